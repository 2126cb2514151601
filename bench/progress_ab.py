"""Benchmark what the live progress costs a restart (issue 16): restart.yml on a lab node, alternating runs
without and with $SGLANG_DEPLOY_PROGRESS_DIR (with it, plugins/action/sglang_server.py runs the restart
detached and asks sglang_job for its progress, as under python -m driver). Medians of each, and the difference.

    make lab-up && ansible-playbook playbooks/deploy.yml     # or: make demo
    .venv/bin/python bench/progress_ab.py [--runs 5] [--node lab-node1] [--out docs/bench/progress-ab.json]

The stand-in takes READY_S to be ready and logs its model-load steps over LOAD_S, so that several progress
answers come while it loads. Leaves the node's instance on its group_vars configuration, restarted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart_lab import REPO, med, playbook, stop_to_end

READY_S = 8.0
LOAD_S = 6.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--node", default="lab-node1")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "progress-ab.json")
    a = ap.parse_args()
    if not (REPO / "inventory" / "lab" / "hosts.yml").exists():
        print("no lab: run `make demo` (or make lab-up and deploy.yml) first", file=sys.stderr)
        return 2
    env = {"LAB_STANDIN_READY_S": str(READY_S), "LAB_STANDIN_LOAD_S": str(LOAD_S)}
    playbook(a.node, env)  # the configuration in place; the timed runs restart it as it is
    got: dict[str, dict[str, list[float]]] = {m: {"wall_s": [], "downtime_s": []} for m in ("off", "on")}
    with tempfile.TemporaryDirectory() as progress_dir:
        for _ in range(a.runs):
            for mode in ("off", "on"):
                extra = {"SGLANG_DEPLOY_PROGRESS_DIR": progress_dir} if mode == "on" else {}
                wall, rc, res = playbook(a.node, env, controller_env=extra)
                assert rc == 0 and res["outcome"] == "restarted", res
                assert ("steps" in res) == (mode == "on"), res.keys()
                got[mode]["wall_s"].append(round(wall, 3))
                got[mode]["downtime_s"].append(round(stop_to_end(res), 3))
    playbook(a.node, {})  # back to the group_vars configuration
    out = {
        mode: {**v, "median_wall_s": med(v["wall_s"]), "median_downtime_s": med(v["downtime_s"])}
        for mode, v in got.items()
    }
    out["added_wall_s"] = round(out["on"]["median_wall_s"] - out["off"]["median_wall_s"], 3)
    out["added_downtime_s"] = round(out["on"]["median_downtime_s"] - out["off"]["median_downtime_s"], 3)
    out["goal_added_s"] = 0.5
    out["runs"] = a.runs
    out["command"] = " ".join(["bench/progress_ab.py", *sys.argv[1:]])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    print(
        "| restart.yml | median wall | median downtime (stop -> verified) | runs |\n|---|---|---|---|\n"
        f"| progress off | {out['off']['median_wall_s']} s | {out['off']['median_downtime_s']} s | {a.runs} |\n"
        f"| progress on | {out['on']['median_wall_s']} s | {out['on']['median_downtime_s']} s | {a.runs} |\n"
        f"| added | {out['added_wall_s']} s | {out['added_downtime_s']} s | goal <= 0.5 s |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
