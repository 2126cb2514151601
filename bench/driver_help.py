"""How long `python -m driver --help` takes, start to exit: median of several runs.

    .venv/bin/python bench/driver_help.py [RUNS]

The goal is under 0.5 s: the CLI imports argparse alone; ansible-runner and rich are
imported only when a command runs (tests/driver/test_ledger_cli.py checks the imports).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "driver", "--help"], cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    print(
        f"python -m driver --help: median {statistics.median(times) * 1000:.0f} ms, "
        f"min {min(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms over {runs} runs (goal: < 500 ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
