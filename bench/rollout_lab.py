"""Benchmark the rollout behind sglang-router on the local lab: medians of several runs (docs/rollout.md).

    make lab-up LAB_NODES=3 && ansible-playbook playbooks/deploy.yml   # deployed; GPUs 4-7 free on every node
    .venv/bin/python bench/rollout_lab.py [--runs 3] [--out docs/bench/rollout-lab.json]

Every lab node is a replica serving one instance `bench` (the stand-in, 4 simulated GPUs, port 30020); the real
sglang-router (roles/sglang_router, playbooks/router.yml) runs on the first node in front of all of them, and
bench/loadgen.py runs there too (the router's port is not published), a steady mixed load (streamed and not)
through the router. Measured:

- steady: the load alone for --steady seconds: its p99 latency;
- one restart: `python -m driver restart` of one replica to a new configuration, as the rollout restarts each
  (validated, then started), no load (wall seconds); one to the configuration it already runs (its
  validation cached on the host), for comparison; and one to a new configuration under the rollout's load, sent
  straight to the other replica (the lab shares this machine's cores: does the load alone slow a restart?);
- each run: `python -m driver rollout` of every replica with a new configuration under the load: failed or
  truncated requests (goal 0), p99 latency during the rollout / p99 steady (goal at most 1.5), and the
  rollout's wall time / (replicas x one restart), unloaded and under the same load (goal at most 1.2).

The bench's own inventory is written into the lab's state directory (.lab/bench-rollout.yml, ignored by git), its
driver runs go to a ledger in a temporary directory (or --ledger DIR, kept: each run's events.jsonl under
DIR/runs/ times every task, for a profile); at the end the instance and the router are stopped and
removed from every node (the nodes stay deployed).
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

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "lab"))
import lab as labmod  # noqa: E402  (lab/lab.py: the router's variables on a lab node)

LAB_INVENTORY = REPO / "inventory" / "lab" / "hosts.yml"
ROUTER_PORT = 30110
KEY = "lab-bench-router-key"
INSTANCE = {"name": "bench", "port": 30020, "gpus": [4, 5, 6, 7]}


def podman_exec(container: str, *cmd: str, check: bool = True) -> str:
    return subprocess.run(["podman", "exec", container, *cmd], check=check, capture_output=True, text=True).stdout


GATEWAY = {"impl": "sglang-router"}  # --gateway: the router's impl for every inventory this run writes


def write_inventory(env: dict | None = None) -> tuple[Path, list[str], dict[str, str]]:
    doc = yaml.safe_load(LAB_INVENTORY.read_text(encoding="utf-8"))
    hosts = doc["all"]["children"]["sglang_nodes"]["hosts"]
    names = sorted(hosts)
    for h in names:
        hosts[h]["sglang_instances"] = [{**INSTANCE, "env": env or {}}]
    hosts[names[0]].update({**labmod.router_vars(ROUTER_PORT, 29110, KEY), "sglang_router_impl": GATEWAY["impl"]})
    doc["all"]["children"]["sglang_replicas"] = {"hosts": {h: None for h in names}}
    doc["all"]["children"]["sglang_routers"] = {"hosts": {names[0]: None}}
    path = REPO / ".lab" / "bench-rollout.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    containers = {h: hosts[h]["lab_container"] for h in names}
    return path, names, containers


def driver(ledger: Path, *args: str) -> tuple[int, float, str]:
    env = {**os.environ, "SGLANG_DEPLOY_LEDGER": str(ledger), "COLUMNS": "200"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "driver", *args], cwd=REPO, env=env, capture_output=True, text=True, check=False
    )
    return proc.returncode, time.monotonic() - t0, proc.stdout[-3000:] + proc.stderr[-3000:]


class Load:
    """bench/loadgen.py on the router's node, through the router (or to `url`), until stopped."""

    def __init__(self, container: str, seconds: float = 900, url: str = f"http://127.0.0.1:{ROUTER_PORT}"):
        self.container = container
        podman_exec(container, "rm", "-f", "/tmp/bench-load.stop", "/tmp/bench-load.ready")
        self.proc = subprocess.Popen(
            [
                *("podman", "exec", container, "python3", "/tmp/loadgen.py"),
                *("--url", url, "--api-key", KEY, "--concurrency", "3"),
                *("--stop-file", "/tmp/bench-load.stop", "--ready-file", "/tmp/bench-load.ready"),
                *("--duration", str(seconds)),
                # the served model: smg routes by it (404 for loadgen's default name; sglang-router ignores it)
                *("--model", labmod.LAB_HOST_VARS["sglang_model_path"]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while podman_exec(container, "sh", "-c", "test -f /tmp/bench-load.ready && echo y || true").strip() != "y":
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit("the load generator did not start")
            time.sleep(0.2)

    def stop(self) -> dict:
        podman_exec(self.container, "touch", "/tmp/bench-load.stop")
        out, err = self.proc.communicate(timeout=120)
        if self.proc.returncode != 0:
            raise SystemExit(f"loadgen failed: {err[-2000:]}")
        return json.loads(out)


def med(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def cleanup(containers: dict[str, str], router: str) -> None:
    podman_exec(containers[router], "sh", "-c", "systemctl disable --now sglang-router.service || true", check=False)
    podman_exec(containers[router], "rm", "-f", "/etc/systemd/system/sglang-router.service", check=False)
    for c in containers.values():
        podman_exec(c, "sh", "-c", "systemctl disable --now sglang-bench.service || true", check=False)
        podman_exec(
            c,
            *("rm", "-rf", "/etc/systemd/system/sglang-bench.service", "/etc/sglang/bench.env"),
            *("/etc/sglang/pending/sglang-bench.service", "/etc/sglang/pending/bench.env"),
            *("/etc/sglang/secrets/bench.env", "/var/lib/sglang/known-good/bench"),
            check=False,
        )
        podman_exec(c, "systemctl", "daemon-reload", check=False)


def main() -> int:
    a = parse_args()
    GATEWAY["impl"] = a.gateway
    if not LAB_INVENTORY.exists():
        print("no lab: run `make demo` (or make lab-up and deploy.yml) first", file=sys.stderr)
        return 2
    inventory, names, containers = write_inventory()
    router = names[0]
    scratch = tempfile.TemporaryDirectory(prefix="sgd-bench-rollout-")
    if a.ledger:
        a.ledger.mkdir(parents=True, exist_ok=True)
    ledger = (a.ledger or Path(scratch.name)) / "ledger.sqlite3"
    try:
        start_fleet(ledger, inventory, containers[router])
        steady = measure_steady(containers[router], a.steady)
        one, unchanged, loaded = measure_restarts(ledger, names, containers[router], a.runs)
        runs = measure_rollouts(ledger, containers[router], a.runs)
    finally:
        cleanup(containers, router)
        scratch.cleanup()
    results = summarize(a, len(names), runs, steady, one, unchanged, loaded)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print_table(results, a.runs)
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steady", type=float, default=30.0, help="seconds of load alone, for its p99")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "rollout-lab.json")
    ap.add_argument(
        "--gateway",
        choices=["sglang-router", "smg"],
        default="sglang-router",
        help="the router in front (default 0.3.2)",
    )
    ap.add_argument("--ledger", type=Path, help="keep the driver runs' ledger (and their events) in this directory")
    return ap.parse_args()


def start_fleet(ledger: Path, inventory: Path, container: str) -> None:
    """Every replica serving (known-good), the router in front of them, loadgen.py copied onto the router's node."""
    code, _, out = driver(ledger, "restart", "-i", str(inventory))  # every replica serving, known-good
    if code:
        raise SystemExit(f"the replicas did not start (exit {code}):\n{out}")
    subprocess.run(
        [REPO / ".venv" / "bin" / "ansible-playbook", "-i", inventory, "playbooks/router.yml"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    subprocess.run(["podman", "cp", str(REPO / "bench" / "loadgen.py"), f"{container}:/tmp/loadgen.py"], check=True)


def measure_steady(container: str, seconds: float) -> dict:
    """The load alone through the router for `seconds`: loadgen's statistics (its p99 is the rollout's yardstick)."""
    load = Load(container, seconds)
    load.proc.wait(timeout=seconds + 60)
    return load.stop()


def measure_restarts(ledger: Path, names: list[str], container: str, runs: int) -> tuple[list, list, list]:
    """One restart of the last replica per run, in seconds: to a new configuration, to the same again, and to a new
    one under load. The first as the rollout restarts each (validated, then started); the second for comparison
    (its validation cached on the host). The third under the rollout's load, sent straight to the other replica (as
    during a rollout, the replica restarted gets none): the lab's nodes, router and load share this machine's cores
    with the controller, so this tells whether the load alone slows a restart."""
    one, unchanged, loaded = [], [], []
    for _ in range(runs):
        inventory, _, _ = write_inventory({"LAB_BENCH": str(time.time_ns())})
        for runs_of in (one, unchanged):
            code, seconds, out = driver(ledger, "restart", "-i", str(inventory), "--limit", names[-1])
            if code:
                raise SystemExit(f"one restart failed (exit {code}):\n{out}")
            runs_of.append(round(seconds, 2))
        inventory, _, _ = write_inventory({"LAB_BENCH": str(time.time_ns())})
        load = Load(container, url=f"http://{names[0]}:{INSTANCE['port']}")
        try:
            code, seconds, out = driver(ledger, "restart", "-i", str(inventory), "--limit", names[-1])
        finally:
            load.stop()
        if code:
            raise SystemExit(f"one restart under load failed (exit {code}):\n{out}")
        loaded.append(round(seconds, 2))
    return one, unchanged, loaded


def measure_rollouts(ledger: Path, container: str, runs: int) -> list[dict]:
    """`python -m driver rollout` of every replica to a new configuration under the load through the router, per
    run: its seconds and what the load saw."""
    out_runs = []
    for _ in range(runs):
        inventory, _, _ = write_inventory({"LAB_BENCH": str(time.time_ns())})
        load = Load(container)
        try:
            code, seconds, out = driver(ledger, "rollout", "-i", str(inventory))
        finally:
            stats = load.stop()
        if code:
            raise SystemExit(f"the rollout failed (exit {code}):\n{out}")
        out_runs.append(
            {
                "rollout_s": round(seconds, 2),
                "sent": stats["sent"],
                "lost": stats["lost"],
                "not_streamed": stats["not_streamed"],
                "p99_s": stats["p99_s"],
                "failures": stats["failures"][:5],
            }
        )
    return out_runs


def summarize(
    a: argparse.Namespace, n: int, runs: list[dict], steady: dict, one: list, unchanged: list, loaded: list
) -> dict:
    """--out's document: the measures, their medians and ratios against the goals."""
    return {
        "gateway": a.gateway,
        "replicas": n,
        "runs": runs,
        "steady": {k: steady[k] for k in ("sent", "lost", "p50_s", "p99_s", "requests_per_s")},
        "one_restart_s": one,
        "one_restart_unchanged_s": unchanged,
        "one_restart_loaded_s": loaded,
        "median_lost": med([r["lost"] for r in runs]),
        "median_p99_ratio": med([r["p99_s"] / steady["p99_s"] for r in runs]),
        "median_time_ratio": med([r["rollout_s"] / (n * med(one)) for r in runs]),
        "median_time_ratio_unchanged": med([r["rollout_s"] / (n * med(unchanged)) for r in runs]),
        "median_time_ratio_loaded": med([r["rollout_s"] / (n * med(loaded)) for r in runs]),
        "goals": {"lost": 0, "p99_ratio": 1.5, "time_ratio": 1.2},
        "command": " ".join(["bench/rollout_lab.py", *sys.argv[1:]]),
    }


def print_table(results: dict, runs: int) -> None:
    """The medians against their goals, as docs/rollout.md's table."""
    n, p99 = results["replicas"], results["steady"]["p99_s"]
    one, unchanged, loaded = (
        med(results[k]) for k in ("one_restart_s", "one_restart_unchanged_s", "one_restart_loaded_s")
    )
    print(
        f"| measure ({n} replicas, medians of {runs}) | median | goal |\n|---|---|---|\n"
        f"| failed or truncated requests during the rollout | {results['median_lost']} | 0 |\n"
        f"| p99 latency during the rollout / p99 steady ({p99} s) | {results['median_p99_ratio']} | 1.5 |\n"
        f"| rollout time / ({n} x one restart of a new configuration, {one} s) | {results['median_time_ratio']} | 1.2 |\n"
        f"| rollout time / ({n} x one restart of the same configuration, {unchanged} s) "
        f"| {results['median_time_ratio_unchanged']} | - |\n"
        f"| rollout time / ({n} x one restart of a new configuration under the same load, {loaded} s) "
        f"| {results['median_time_ratio_loaded']} | 1.2 |"
    )


if __name__ == "__main__":
    sys.exit(main())
