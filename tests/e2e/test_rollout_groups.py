"""python -m driver rollout of a multi-node group behind the real sglang-router, under load (docs/rollout.md).

Both lab nodes serve a replica `ro` (GPUs 0-3, port 30010) and one rank each of a model over the two nodes, `mn`
(GPUs 4-7, port 30002, rank 0 on lab-node1). sglang-router 0.3.2 on lab-node1 routes to ro on each node and to mn
once, through its rank 0. The group is one worker of the rollout: out of the router and drained, restarted on both
nodes in step, back in; a rank whose new configuration fails rolls the group back on both nodes, serving, and it
rejoins the router. bench/loadgen.py sends a steady mixed load through the router meanwhile.
At the end ro, mn and the router are stopped and removed: the nodes are left deployed, never verified, as found.
"""

from __future__ import annotations

import json
import threading

import pytest

from support import rollout
from support.e2e import driver_runner, podman_exec
from support.rollout import ROUTER, Load, router_workers

pytestmark = pytest.mark.lab

NODES = ("lab-node1", "lab-node2")
RO = {"name": "ro", "port": 30010, "gpus": [0, 1, 2, 3]}
MN = {"name": "mn", "port": 30002, "gpus": [4, 5, 6, 7], "nnodes": 2, "dist_init_addr": "lab-node1:5757"}
MN_WORKER = f"http://lab-node1:{MN['port']}"
GATE = json.dumps({"sglang_rollout_canary_threshold": 0.5})  # loose: tok/s on a loaded 2-core machine jitters
GROUPS = {"sglang_replicas": list(NODES), "sglang_multinode": list(NODES)}


# Every rank of mn frees its GPU memory over 2 s once stopped (the stand-in's slow-release): rank 0 is down for
# at least that long, so that the watcher's samples (a podman exec each, slow on a busy machine) see it down.
SLOW_RELEASE = {"LAB_STANDIN_FAULT": "slow-release", "LAB_STANDIN_RELEASE_S": "2"}


def rank_env_of(extra: dict) -> dict:
    faults = ",".join(f for f in (SLOW_RELEASE["LAB_STANDIN_FAULT"], extra.get("LAB_STANDIN_FAULT")) if f)
    return {**SLOW_RELEASE, **extra, "LAB_STANDIN_FAULT": faults}


def fleet_inventory(the_lab, name: str, rank_env: dict[int, dict] | None = None) -> str:
    instances = {
        host: [RO, {**MN, "node_rank": rank, "env": rank_env_of((rank_env or {}).get(rank, {}))}]
        for rank, host in enumerate(NODES)
    }
    return rollout.write_inventory(the_lab, name, instances, GROUPS)


def mn_pid(container: str) -> int:
    return rollout.main_pid(container, "sglang-mn.service")


class Watch:
    """Polls, until stopped, whether rank 0 of mn runs and whether the router lists mn: (runs, listed) samples."""

    def __init__(self, rank0: str, router: str):
        self.samples: list[tuple[bool, bool]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.poll, args=(rank0, router), daemon=True)
        self.thread.start()

    def poll(self, rank0: str, router: str) -> None:
        while not self.done.is_set():
            state = podman_exec(rank0, "systemctl", "show", "-p", "SubState", "--value", "sglang-mn.service").strip()
            listed = MN_WORKER in router_workers(router)  # read after the unit: listed then means listed while so
            self.samples.append((state == "running", listed))
            self.done.wait(0.2)

    def stop(self) -> list[tuple[bool, bool]]:
        self.done.set()
        self.thread.join(timeout=30)
        return self.samples


def latest_events(ledger) -> str:
    """The newest run's recorded event stream (events.jsonl in its directory under the ledger's runs/)."""
    runs = sorted((ledger.parent / "runs").iterdir(), key=lambda d: int(d.name))
    return (runs[-1] / "events.jsonl").read_text(encoding="utf-8")


def rows_of(doc: dict, instance: str) -> dict[str, dict]:
    return {r["host"]: r for r in doc["rows"] if r["instance"] == instance}


@pytest.fixture(scope="module")
def fleet(deployed, tmp_path_factory):
    """ro on both nodes and the group mn over both (started through the safe restart: a known-good generation on
    each node), the router in front listing all three healthy, the load generator on the router's node."""
    the_lab, hosts = deployed
    containers = {h["name"]: h["container"] for h in hosts}
    inventory = fleet_inventory(the_lab, "rollout-groups-hosts.yml")
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, None)
    try:
        rollout.serve_behind_router(run, inventory, containers[ROUTER])
        assert router_workers(containers[ROUTER]) == {
            "http://lab-node1:30010": True,
            "http://lab-node2:30010": True,
            MN_WORKER: True,
        }
        yield the_lab, containers, ledger, run
    finally:
        rollout.remove_router(containers[ROUTER])
        for node in NODES:
            c = containers[node]
            for name in ("ro", "mn"):
                podman_exec(c, "sh", "-c", f"systemctl disable --now sglang-{name}.service || true")
                podman_exec(
                    c,
                    "sh",
                    "-c",
                    f"rm -rf /etc/systemd/system/sglang-{name}.service /etc/sglang/{name}.env /etc/sglang/pending/*{name}* "
                    f"/etc/sglang/secrets/{name}.env /var/lib/sglang/known-good/{name}",
                )
            podman_exec(c, "systemctl", "daemon-reload")


def test_a_group_rolls_as_one_worker_out_of_the_router_and_back_with_no_request_lost(fleet):
    the_lab, containers, _, run = fleet
    router = containers[ROUTER]
    new = fleet_inventory(the_lab, "rollout-groups-new.yml", {0: {"LAB_ROLLOUT": "1"}, 1: {"LAB_ROLLOUT": "1"}})
    pids = {n: mn_pid(containers[n]) for n in NODES}
    load = Load(router)
    watch = Watch(containers["lab-node1"], router)
    try:
        code, doc, proc = run("rollout", "-e", GATE, inventory=new)
    finally:
        samples = watch.stop()
        stats = load.stop()
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 0, out
    assert {n: r["result"] for n, r in rows_of(doc, "mn").items()} == {n: "restarted" for n in NODES}, out
    assert {n: r["result"] for n, r in rows_of(doc, "ro").items()} == {n: "restarted" for n in NODES}, out
    assert all(mn_pid(containers[n]) not in (0, pids[n]) for n in NODES)  # both ranks restarted
    assert all("LAB_ROLLOUT" in podman_exec(containers[n], "cat", "/etc/sglang/mn.env") for n in NODES)
    assert router_workers(router) == {"http://lab-node1:30010": True, "http://lab-node2:30010": True, MN_WORKER: True}
    # Out of the router while its rank 0 did not run, and for a while around it; listed again at the end.
    assert (False, False) in samples, samples
    assert (False, True) not in samples, samples
    assert stats["lost"] == 0, stats["failures"]
    assert stats["sent"] >= 20, stats
    print(f"group rollout under load: {json.dumps(stats)}; {len(samples)} samples")


def test_a_group_whose_rank_fails_is_rolled_back_on_both_nodes_and_rejoins_the_router(fleet):
    """The new configuration dies at start on rank 1 only: the group is rolled back on both nodes to its
    known-good generation, serves, and is back in the router; ro is not touched (--instance mn)."""
    the_lab, containers, ledger, run = fleet
    router = containers[ROUTER]
    faulty = fleet_inventory(the_lab, "rollout-groups-crash.yml", {1: {"LAB_STANDIN_FAULT": "crash-startup"}})
    ro_pids = {n: rollout.main_pid(containers[n], "sglang-ro.service") for n in NODES}
    load = Load(router)
    try:
        code, doc, proc = run("rollout", "--instance", "mn", "-e", GATE, inventory=faulty)
    finally:
        stats = load.stop()
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 5, out  # rolled back: the known-good generation serves
    assert {n: r["result"] for n, r in rows_of(doc, "mn").items()} == {n: "rolled_back" for n in NODES}, out
    assert {n: rollout.main_pid(containers[n], "sglang-ro.service") for n in NODES} == ro_pids
    for n in NODES:
        c = containers[n]
        assert (
            podman_exec(c, "systemctl", "show", "-p", "SubState", "--value", "sglang-mn.service").strip() == "running"
        )
        assert "crash-startup" not in podman_exec(c, "cat", "/etc/sglang/mn.env")
    assert router_workers(router) == {"http://lab-node1:30010": True, "http://lab-node2:30010": True, MN_WORKER: True}
    assert stats["lost"] == 0, stats["failures"]
    said = latest_events(ledger)  # the last play's list of where every replica and group stands
    assert "lab-node1/mn rank 0: rolled_back, router: in, healthy" in said
    assert "lab-node2/mn rank 1: rolled_back, router: through rank 0" in said
    print(f"failing group rolled back under load: {json.dumps(stats)}")


def test_a_group_with_a_rank_left_out_is_not_rolled_stays_in_the_router_and_fails_the_run(fleet):
    """--limit lab-node1: mn's rank 1 is not in the run. The group is not taken out of the router, no rank stops,
    and the run says so (exit 1, the group named)."""
    the_lab, containers, ledger, run = fleet
    router = containers[ROUTER]
    pids = {n: mn_pid(containers[n]) for n in NODES}
    new = fleet_inventory(the_lab, "rollout-groups-limit.yml", {0: {"LAB_ROLLOUT": "2"}, 1: {"LAB_ROLLOUT": "2"}})
    code, _, proc = run("rollout", "--instance", "mn", "-e", GATE, limit="lab-node1", inventory=new)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 1, out
    assert {n: mn_pid(containers[n]) for n in NODES} == pids  # nothing stopped on either node
    assert router_workers(router)[MN_WORKER] is True
    said = latest_events(ledger)
    assert "lab-node1/mn rank 0: not_rolled, router: in, healthy" in said
    assert "Not rolled, unrestarted and in the router: lab-node1/mn" in said
