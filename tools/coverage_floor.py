"""The per-file coverage floor (issue #17): every production Python file measured at FLOOR % of its lines or more.

coverage.py's --fail-under judges the total only; this reads its JSON report and judges each file:

    python -m coverage json -q -o - | python tools/coverage_floor.py --floor 80 -
    python tools/coverage_floor.py --floor 80 coverage.json

Prints one line per file below the floor (its percentage and the lines it misses) and exits 1 when there is
one, or when the report holds no file at all (no data: nothing was measured); exits 0 otherwise.
The files judged are the report's: .coveragerc's `source` (plugins/module_utils/sglang_deploy, plugins/modules,
driver, plugins/filter, plugins/action), a file never imported included at 0 %.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

FLOOR = 80.0


@dataclass(frozen=True)
class Shortfall:
    path: str
    percent: float
    missing: list[int]

    def line(self, floor: float) -> str:
        lines = ", ".join(map(str, self.missing[:20])) + (" ..." if len(self.missing) > 20 else "")
        return f"{self.path}: {self.percent:.1f} % of its lines, below {floor:g} % (missing: {lines})"


def below(report: dict, floor: float = FLOOR) -> list[Shortfall]:
    """The files of a `coverage json` report under `floor` percent, lowest first (then by path)."""
    out = []
    for path, data in report.get("files", {}).items():
        percent = float(data["summary"]["percent_covered"])
        if percent < floor:
            out.append(Shortfall(path, percent, sorted(data.get("missing_lines", []))))
    return sorted(out, key=lambda s: (s.percent, s.path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", default="coverage.json", help="coverage json's output ('-': stdin)")
    parser.add_argument("--floor", type=float, default=FLOOR, help="the least percentage of each file (default 80)")
    args = parser.parse_args(argv)
    if args.report == "-":
        report = json.load(sys.stdin)
    else:
        with open(args.report) as fh:
            report = json.load(fh)
    files = report.get("files", {})
    if not files:
        print("coverage floor: the report holds no file (was anything measured?)", file=sys.stderr)
        return 1
    short = below(report, args.floor)
    for s in short:
        print(s.line(args.floor), file=sys.stderr)
    if short:
        print(f"coverage floor: {len(short)} of {len(files)} files below {args.floor:g} %", file=sys.stderr)
        return 1
    lowest = min(files.items(), key=lambda kv: kv[1]["summary"]["percent_covered"])
    print(
        f"coverage floor: all {len(files)} files at {args.floor:g} % or more "
        f"(lowest {lowest[0]}, {lowest[1]['summary']['percent_covered']:.1f} %)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
