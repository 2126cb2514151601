"""Benchmark what a sweep spends per combination beyond the server's own start and the benchmark (issue 15):
python -m driver tune on a lab node, the stand-in's throughput model on; the median of the measured combinations'
overhead (the measure step's wall time less the restart's start phase, process start to ready, and less the
benchmark itself: plan, ansible-playbook, stop, GPU wait, generation, verify, record are the sweep's own).

    make lab-up && ansible-playbook playbooks/deploy.yml     # or: make demo
    .venv/bin/python bench/tune_lab.py [--node lab-node1] [--out docs/bench/tune-lab.json]

A fresh ledger (a temporary directory) each run, so that nothing is resumed. Leaves the node's instance on its
own profile (the sweep puts it back).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GRID = ["--grid", "speculative_num_steps=1,3", "--grid", "speculative_eagle_topk=1,4"]
# main (8 GPUs) with the stand-in's throughput model, in the instance's env (the lab's sglang_server_env carries the
# stand-in's PYTHONPATH).
MODEL = {
    "sglang_instances": [
        {
            "name": "main",
            "port": 30000,
            "gpus": list(range(8)),
            "env": {"LAB_STANDIN_SPEC_MODEL": "1", "LAB_STANDIN_TOKENS_PER_S": "300"},
        }
    ]
}


def main() -> int:
    a = parse_args()
    if not (REPO / "inventory" / "lab" / "hosts.yml").exists():
        print("no lab: run `make demo` (or make lab-up and deploy.yml) first", file=sys.stderr)
        return 2
    proc, wall = run_tune(a)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        return 1
    out = summarize(json.loads(proc.stdout), a.repeat, wall)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=1))
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--node", default="lab-node1")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "tune-lab.json")
    ap.add_argument("--repeat", type=int, default=3, help="measurements per combination (tune's --repeat)")
    ap.add_argument("--concurrency", default="1,8", help="the levels (tune's --concurrency), the first ranked")
    return ap.parse_args()


def run_tune(a: argparse.Namespace) -> tuple[subprocess.CompletedProcess[str], float]:
    """`python -m driver tune --json` over GRID on the node, with a fresh ledger and profile directory (nothing
    resumed): the finished process and its wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "driver",
            "tune",
            "--limit",
            a.node,
            "--instance",
            "main",
            "--profile",
            "eagle3_topk1",
            *GRID,
            "--requests",
            "8",
            "--max-new-tokens",
            "32",
            "--warmup",
            "1",
            "--concurrency",
            a.concurrency,
            "--repeat",
            str(a.repeat),
            "-e",
            json.dumps(MODEL),
            "--profile-dir",
            tmp,
            "--json",
        ]
        env = {**os.environ, "SGLANG_DEPLOY_LEDGER": str(Path(tmp) / "ledger.sqlite3")}
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.monotonic() - t0
    return proc, wall


def summarize(doc: dict, repeat: int, wall: float) -> dict:
    """--out's document from tune's: the sweep's own overhead, the medians of its steps, each combination ranked."""
    timings = [r["bench"]["timing"] for r in doc["ranked"] if (r.get("bench") or {}).get("timing")]
    return {
        "combinations": len(timings),
        "overheads_s": doc["overheads_s"],
        "median_overhead_s": doc["overhead_median_s"],
        # Each combination gives `repeat` measurements for its one restart: the sweep's own time per measurement.
        "repeat": repeat,
        "median_overhead_per_measurement_s": round(doc["overhead_median_s"] / repeat, 2),
        "median_step_s": round(statistics.median(t["seconds"] for t in timings), 2),
        "median_start_s": round(statistics.median(t["start_s"] for t in timings), 2),
        "median_bench_s": round(statistics.median(t["bench_s"] for t in timings), 2),
        "sweep_wall_s": round(wall, 1),
        "verdict": doc["verdict"],
        "why": doc["why"],
        # Each combination as ranked at the first level: every figure's median and 95 % interval, every level's tok/s.
        "ranked": [ranked(r) for r in doc["ranked"]],
        "goal_overhead_per_measurement_s": 5.0,
        "command": " ".join(["bench/tune_lab.py", *sys.argv[1:]]),
    }


def ranked(r: dict) -> dict:
    """One combination of tune's ranking, as --out keeps it."""
    return {
        "label": r["label"],
        "rank": r["rank"],
        "vs_baseline": r["vs_baseline"],
        **{k: r.get(k) for k in ("output_tokens_per_s", "interval", "samples", "accept_length")},
        "intervals": r.get("intervals"),
        "ttft_median_s": r.get("ttft_median_s"),
        "itl_median_s": r.get("itl_median_s"),
        "tokens_per_s_by_concurrency": {
            lv["concurrency"]: lv.get("output_tokens_per_s") for lv in (r.get("bench") or {}).get("levels") or []
        },
        "timing": (r.get("bench") or {}).get("timing"),
    }


if __name__ == "__main__":
    sys.exit(main())
