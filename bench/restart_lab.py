"""Benchmark the safe restart on the local lab: medians of several runs.

    make lab-up && ansible-playbook playbooks/deploy.yml     # or: make demo
    .venv/bin/python bench/restart_lab.py [--runs 5] [--node lab-node1] [--out docs/bench/restart-lab.json]

Measures, through playbooks/restart.yml against the lab's SGLang stand-in (lab/standin):
- restart overhead: the server's downtime (stop -> verified and serving, from the module)
  minus the stand-in's configured time to ready (30 s), and the whole playbook's wall
  time minus the same (it also validates and writes the configuration, while the old
  server still serves);
- failure detection: the server's process exit (systemd's ExecMainExitTimestamp) to the
  failure being reported with its journal (fault crash-startup, rollback off);
- release detection: GPU memory freed to the start (fault slow-release: the simulated
  memory falls linearly over R s once the processes are gone, so it is under the
  1024 MiB threshold R * (1 - 1024/used) s after the stop; the wait's extra time is
  the detection latency).
Leaves the node's instance on its group_vars configuration, restarted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_S = 30.0
RELEASE_S = 3.0
THRESHOLD_MIB = 1024
USED_MIB = int(143771 * 0.88)  # what the stand-in holds per GPU at mem_fraction_static 0.88


def playbook(
    node: str, env: dict[str, str], *extra: str, controller_env: dict | None = None
) -> tuple[float, int, dict]:
    """Run restart.yml on node with the instance's env (and ansible-playbook's controller_env); (wall s, rc, the
    module's result)."""
    inst = {"name": "main", "port": 30000, "gpus": list(range(8)), "env": env}
    cmd = [
        str(REPO / ".venv" / "bin" / "ansible-playbook"),
        "playbooks/restart.yml",
        "--limit",
        node,
        "-e",
        json.dumps({"sglang_instances": [inst]}),
        *extra,
    ]
    t0 = time.monotonic()
    playbook.began = time.time()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json", **(controller_env or {})},
    )
    wall = time.monotonic() - t0
    start = proc.stdout.find("\n{\n")
    if start < 0:
        raise SystemExit(f"no JSON from restart.yml:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    doc, _ = json.JSONDecoder().raw_decode(proc.stdout, start + 1)
    found = None
    for play in doc["plays"]:
        for task in play["tasks"]:
            for item in (task["hosts"].get(node) or {}).get("results") or []:
                if item.get("outcome") and item.get("instance") == "main" and "phases" in item:
                    found = item  # the restart's (staging reports an outcome too, without phases)
    if found is None:
        raise SystemExit(f"restart.yml reported no result for main:\n{proc.stdout[-3000:]}")
    return wall, proc.returncode, found


def stop_to_end(res: dict) -> float:
    """The server's downtime: from the stop's start to verified and serving. The lock and the preflight come
    before it; recording the known-good generation (and enabling the unit) after, while the new server serves."""
    phases = res["phases"]
    i = next(n for n, p in enumerate(phases) if p["phase"] == "stop")
    return sum(p["seconds"] for p in phases[i:] if p["phase"] != "record")


def med(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> int:
    a = parse_args()
    if not (REPO / "inventory" / "lab" / "hosts.yml").exists():
        print("no lab: run `make demo` (or make lab-up and deploy.yml) first", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    results["restart_overhead"], results["pre_stop"] = measure_restart_overhead(a.node, a.runs)
    results["failure_detection"] = measure_failure_detection(a.node, a.runs)
    results["release_detection"] = measure_release_detection(a.node, a.runs)
    playbook(a.node, {})  # back to the group_vars configuration
    results["runs"] = a.runs
    results["command"] = " ".join(["bench/restart_lab.py", *sys.argv[1:]])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print_table(results, a.runs)
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--node", default="lab-node1")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "restart-lab.json")
    return ap.parse_args()


def measure_restart_overhead(node: str, runs: int) -> tuple[dict, dict]:
    """Restart overhead at 30 s to ready: the downtime and the playbook's wall time less READY_S; and the time from
    the playbook's start to the stop."""
    slow = {"LAB_STANDIN_READY_S": str(READY_S)}
    playbook(node, slow)  # the configuration in place; the timed runs restart it as it is
    downtime, wall, pre_stop = [], [], []
    for _ in range(runs):
        w, rc, res = playbook(node, slow)
        assert rc == 0 and res["outcome"] == "restarted", res
        stop = next(p for p in res["phases"] if p["phase"] == "stop")
        downtime.append(round(stop_to_end(res) - READY_S, 3))
        wall.append(w - READY_S)
        pre_stop.append(round(stop["at"] - playbook.began, 3))  # the lab node shares this machine's clock
    overhead = {
        "downtime_minus_ready_s": downtime,
        "playbook_wall_minus_ready_s": wall,
        "median_downtime_minus_ready_s": med(downtime),
        "median_playbook_minus_ready_s": med(wall),
        "goal_s": 3.0,
    }
    # Before the stop: ansible-playbook's start, rendering, validation (SGLang's parser, cached once a
    # configuration and software were validated on the host), staging, the lock and the preflight.
    return overhead, {"playbook_start_to_stop_s": pre_stop, "median_s": med(pre_stop), "goal_s": 3.0}


def measure_failure_detection(node: str, runs: int) -> dict:
    """Failure detection: the server's process exit to the failure detected, and reported with its journal."""
    crash = {"LAB_STANDIN_FAULT": "crash-startup"}
    detect, report = [], []
    for _ in range(runs):
        _, rc, res = playbook(node, crash, "-e", "sglang_service_rollback=false")
        assert rc != 0 and res["failure"]["phase"] == "start", res
        detect.append(res["failure"]["exit_to_detect_s"])
        report.append(res["failure"]["exit_to_report_s"])
    return {
        "exit_to_detect_s": detect,
        "exit_to_report_s": report,
        "median_exit_to_report_s": med(report),
        "goal_s": 2.0,
    }


def measure_release_detection(node: str, runs: int) -> dict:
    """Release detection: the GPU memory under the threshold to the start (the wait's time past when the stand-in's
    falling memory crosses it)."""
    slow_release = {"LAB_STANDIN_FAULT": "slow-release", "LAB_STANDIN_RELEASE_S": str(RELEASE_S)}
    playbook(node, slow_release)
    freed_after = RELEASE_S * (1 - THRESHOLD_MIB / USED_MIB)
    latency = []
    for _ in range(runs):
        _, rc, res = playbook(node, slow_release)
        assert rc == 0, res
        gpus = next(p for p in res["phases"] if p["phase"] == "gpus")
        latency.append(round(gpus["detail"]["waited_s"] - freed_after, 3))
    return {
        "freed_to_start_s": latency,
        "median_freed_to_start_s": med(latency),
        "memory_under_threshold_after_s": round(freed_after, 3),
        "goal_s": 0.5,
    }


def print_table(results: dict, runs: int) -> None:
    """The medians against their goals, as docs quote them."""
    print(
        f"| measure | median | goal | runs |\n|---|---|---|---|\n"
        f"| restart overhead (downtime - {READY_S:g} s to ready) | {results['restart_overhead']['median_downtime_minus_ready_s']} s | 3 s | {runs} |\n"
        f"| restart.yml wall - {READY_S:g} s (incl. validation while the old server serves) | {results['restart_overhead']['median_playbook_minus_ready_s']} s | - | {runs} |\n"
        f"| restart.yml start -> the stop (the old server still serves) | {results['pre_stop']['median_s']} s | 3 s | {runs} |\n"
        f"| failure detection (process exit -> reported with journal) | {results['failure_detection']['median_exit_to_report_s']} s | 2 s | {runs} |\n"
        f"| release detection (memory freed -> start) | {results['release_detection']['median_freed_to_start_s']} s | 0.5 s | {runs} |"
    )


if __name__ == "__main__":
    sys.exit(main())
