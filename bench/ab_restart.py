"""A/B of the safe restart between this checkout and another, run by run, on the local lab.

    make lab-up && ansible-playbook playbooks/deploy.yml
    git worktree add /tmp/base <rev> && ln -s "$PWD/.venv" /tmp/base/.venv
    ln -s "$PWD/inventory/lab/hosts.yml" /tmp/base/inventory/lab/hosts.yml
    .venv/bin/python bench/ab_restart.py --base /tmp/base [--runs 8] [--out FILE]

Restarts lab-node1's `main` through each checkout's playbooks/restart.yml (bench/restart_lab.py's `playbook`, the
stand-in 2 s to ready, the configuration unchanged so its validation is cached), alternating the two and reversing
the order every round, so that a machine that drifts during the bench weighs on both alike. Prints, for each, the
medians of the time from ansible-playbook's start to the stop (the old server still serves), the playbook's wall
time and each phase's seconds, and the median of the paired differences.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {"LAB_STANDIN_READY_S": "2"}


def bench_of(repo: Path):
    """That checkout's bench/restart_lab.py, its playbooks run from there."""
    spec = importlib.util.spec_from_file_location(
        f"restart_lab_{abs(hash(str(repo)))}", repo / "bench" / "restart_lab.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.REPO = repo
    return module


def one(bench, node: str) -> tuple[float, float, dict[str, float]]:
    """One restart: (start to stop s, wall s, {phase: s})."""
    wall, rc, res = bench.playbook(node, ENV)
    if rc != 0 or res["outcome"] != "restarted":
        raise SystemExit(f"{bench.REPO}: the restart did not succeed: {res}")
    stop = next(p for p in res["phases"] if p["phase"] == "stop")
    return (
        round(stop["at"] - bench.playbook.began, 3),
        round(wall, 3),
        {p["phase"]: p["seconds"] for p in res["phases"]},
    )


def med(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (its .venv and lab inventory linked)")
    ap.add_argument("--runs", type=int, default=8, help="restarts of each")
    ap.add_argument("--node", default="lab-node1")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    sides = {"base": bench_of(a.base.resolve()), "this": bench_of(REPO)}
    sides["base"].playbook(a.node, ENV)  # the configuration in place, validated once
    got: dict[str, dict] = {k: {"pre_stop_s": [], "wall_s": [], "phases": {}} for k in sides}
    for i in range(a.runs):
        for name in ("base", "this") if i % 2 == 0 else ("this", "base"):
            pre, wall, phases = one(sides[name], a.node)
            got[name]["pre_stop_s"].append(pre)
            got[name]["wall_s"].append(wall)
            for phase, s in phases.items():
                got[name]["phases"].setdefault(phase, []).append(s)
    for name, g in got.items():
        print(f"{name}: start to stop {med(g['pre_stop_s'])} s, wall {med(g['wall_s'])} s,",
              ", ".join(f"{p} {med(v)}" for p, v in g["phases"].items()))  # fmt: skip
    for key in ("pre_stop_s", "wall_s"):
        diffs = [t - b for b, t in zip(got["base"][key], got["this"][key], strict=True)]
        print(f"paired difference this - base, {key}: {med(diffs)}")
    if a.out:
        a.out.write_text(json.dumps({"base": str(a.base), "runs": a.runs, **got}, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
