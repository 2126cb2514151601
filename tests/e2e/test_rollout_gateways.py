"""python -m driver rollout behind two gateways at once, the real binaries of both (issue #32, docs/router.md "Two
gateways"): smg 1.13.0 on lab-node2, its workers declared in a discovery file (sglang_router_discovery: file, which
the rollout and the sentinel edit), and sglang-router 0.3.2 on lab-node1, its workers on its command line (the API
mode); roles/sglang_router, each host's own sglang_router_impl, the same port and key, both in front of the two
replicas `ro`. bench/loadgen.py runs on each gateway's node, through that gateway: the load is split between them.

Every rollout step acts on both gateways; a gateway killed mid-rollout is said and, by default (every gateway must
carry each step out), fails the replica's turn and stops the rollout; with --gateway-quorum 1 the rollout goes on
through the other. Nothing is lost through the gateway that stays up.
"""

from __future__ import annotations

import base64
import json
import signal
import subprocess

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import discovery
from support import rollout, wait_for
from support.e2e import driver_runner, podman_exec, remove_instances
from support.rollout import MODEL, Load, router_workers

pytestmark = pytest.mark.lab

NODES = ("lab-node1", "lab-node2")
RO = {"name": "ro", "port": 30010, "gpus": [0, 1, 2, 3]}
GATE = json.dumps({"sglang_rollout_canary_threshold": 0.5})  # loose: tok/s jitters on a loaded 2-core machine
WORKER1, WORKER2 = (f"http://{n}:{RO['port']}" for n in NODES)
BOTH = {WORKER1: True, WORKER2: True}
SMG = "lab-node2"
# Each gateway's hung-worker sentinel, quicker than the role's (a probe every 10 s, 30 s to a stall): a worker that
# hangs is out in about 2 x (2 + 5) s.
SENTINEL = {"sglang_router_sentinel_interval_secs": 2, "sglang_router_sentinel_stall_secs": 5}


def new_configuration(n: int) -> str:
    return json.dumps({"sglang_instances": [{**RO, "env": {"LAB_ROLLOUT": f"gateways-{n}"}}]})


@pytest.fixture(scope="module")
def pair(deployed, tmp_path_factory):
    """ro serving on both nodes, a gateway on each (0.3.2 on lab-node1, smg on lab-node2) listing both healthy, the
    load generator on both."""
    the_lab, hosts = deployed
    containers = {h["name"]: h["container"] for h in hosts}
    inventory = rollout.write_inventory(
        the_lab,
        "gateways-hosts.yml",
        {h: [RO] for h in NODES},
        {"sglang_replicas": list(NODES)},
        # smg first: the rollout's gateway steps run on its host, where they edit its discovery file.
        routers={
            SMG: {"sglang_router_impl": "smg", "sglang_router_discovery": "file", **SENTINEL},
            "lab-node1": SENTINEL,
        },
    )
    run = driver_runner(the_lab, tmp_path_factory.mktemp("ledger") / "ledger.sqlite3", None)
    try:
        rollout.serve_behind_router(run, inventory, *(containers[n] for n in NODES))
        for n in NODES:
            wait_for(f"{n}'s gateway to list both", lambda n=n: router_workers(containers[n]) == BOTH, 120)
        yield containers, inventory, run
    finally:
        for n in NODES:
            rollout.remove_router(containers[n])
            remove_instances(containers[n], "ro")


def pids(containers) -> dict[str, int]:
    return {n: rollout.main_pid(containers[n], "sglang-ro.service") for n in NODES}


def rows(doc: dict) -> dict[str, str]:
    return {r["host"]: r["result"] for r in doc["rows"] if r["instance"] == "ro"}


def test_a_rollout_behind_two_gateways_with_the_load_split_between_them_loses_no_request(pair):
    containers, inventory, run = pair
    before = pids(containers)
    loads = {n: Load(containers[n], MODEL) for n in NODES}
    try:
        code, doc, proc = run("rollout", "-e", new_configuration(1), "-e", GATE, inventory=inventory)
    finally:
        stats = {n: load.stop() for n, load in loads.items()}
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 0, out
    assert rows(doc) == {n: "restarted" for n in NODES}, out
    assert all(p != before[n] for n, p in pids(containers).items())
    for n in NODES:  # each gateway took each worker out and put it back
        assert router_workers(containers[n]) == BOTH, n
        assert stats[n]["lost"] == 0, (n, stats[n]["failures"])
        assert stats[n]["sent"] >= 10, (n, stats[n])
        # streamed answers streamed through each gateway, whole ([DONE]), the completions naming the served model
        assert stats[n]["not_streamed"] == 0, (n, stats[n])
        assert stats[n]["by_kind"]["completions-stream"]["ok"] and stats[n]["by_kind"]["generate-stream"]["ok"], stats
    assert f"router {SMG}, lab-node1 lists: " + ", ".join(BOTH) in doc["report"], doc["report"]
    assert manifest(containers[SMG]) == sorted(BOTH)  # each worker out of smg's file in turn, and back
    print(f"two gateways, load split: {json.dumps(stats)}")
    # python -m driver status: what each gateway thinks of each replica, both having routed to both
    code, doc, proc = run("status", inventory=inventory)
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    view = {(r["host"], r["gateway"]): r for r in doc["gateways"]}
    assert set(view) == {(h, g) for h in NODES for g in NODES}, doc["gateways"]
    for (_, gateway), r in view.items():
        assert (r["listed"], r["healthy"], r["circuit"], r["why"]) == (True, True, "closed", ""), r
        if gateway == SMG:  # smg keeps a state and an in-flight count per worker; 0.3.2 neither
            assert r["status"] == "ready" and r["in_flight"] == 0.0, r
        else:
            assert r["status"] is None and r["in_flight"] is None, r


def test_a_gateway_killed_mid_rollout_stops_it_and_nothing_is_lost_through_the_other(pair):
    """smg on lab-node2 killed (SIGKILL, then kept down) once the canary is out of both gateways: the canary's
    restart succeeds, but its return into the dead gateway fails, so its turn fails (quorum: every gateway) and the
    rollout stops before lab-node2; the canary serves in lab-node1's gateway; the report names the dead gateway."""
    containers, inventory, run = pair
    try:
        killed_mid_rollout(containers, inventory, run)
    finally:
        revive_gateway(containers[SMG])  # as found, whatever failed: the tests run in any order


def killed_mid_rollout(containers: dict, inventory: str, run) -> None:
    gw1, gw2 = containers["lab-node1"], containers[SMG]
    before = pids(containers)
    load = Load(gw1, MODEL)
    try:
        driver = rollout.Watched(
            run("rollout", "-e", new_configuration(2), "-e", GATE, inventory=inventory, popen=True)
        )
        try:
            # out of both: smg acts on its file a moment after 0.3.2 on its DELETE; killed before, its part fails
            wait_for("the canary out of lab-node1's gateway", lambda: WORKER1 not in router_workers(gw1), 120, 0.1)
            wait_for("the canary out of smg's rotation", lambda: router_workers(gw2).get(WORKER1) is not True, 30, 0.1)
            kill_gateway(gw2)
        finally:
            code, out, err = driver.wait(400)
    finally:
        stats = load.stop()
    assert code == 1, out[-3000:] + err[-3000:]
    doc = json.loads(out)
    assert rows(doc)["lab-node1"] == "restarted", out[-3000:]  # its restart succeeded; the gateway failed its turn
    assert pids(containers)["lab-node2"] == before["lab-node2"], "the rollout stopped after the canary"
    canary = next(line for line in doc["report"] if line.startswith("lab-node1/ro: "))
    assert canary.startswith(
        f"lab-node1/ro: failed (add {WORKER1}: 1 of 2 gateways carried it out, 2 wanted (--gateway-quorum): {SMG}: "
    ), canary
    assert canary.endswith("router: lab-node1 healthy"), canary  # back in the gateway left
    assert any(line.startswith(f"gateway {SMG} did not answer: ") for line in doc["report"]), doc["report"]
    assert router_workers(gw1) == BOTH
    assert stats["lost"] == 0, stats["failures"]
    # smg's file is the truth: its removal of the canary was written, its return was not (smg was down).
    assert manifest(gw2) == [WORKER2]
    code, doc, _ = run("status", inventory=inventory)
    down = [r for r in doc["gateways"] if r["gateway"] == SMG]
    assert len(down) == 2 and all(r["why"].startswith("the gateway did not answer: ") for r in down), down
    assert all(r["listed"] for r in doc["gateways"] if r["gateway"] == "lab-node1"), doc["gateways"]


def revive_gateway(container: str) -> None:
    """smg started again, its discovery file as the role writes it (both workers): it lists both, healthy."""
    if manifest(container) != sorted(BOTH):  # what an operator does: playbooks/router.yml declares every worker
        text = base64.b64encode(discovery.render([{"url": u} for u in BOTH]).encode()).decode()
        podman_exec(container, "sh", "-c", f"echo {text} | base64 -d > {FILE}.new && mv {FILE}.new {FILE}")
    podman_exec(container, "systemctl", "start", "sglang-router.service")
    # started is not listening yet (the unit's Type=simple): refused connections are part of the wait
    wait_for("smg back, listing both", lambda: answering(container) == BOTH, 120)


def answering(container: str) -> dict[str, bool] | None:
    """What the gateway lists, None while it does not answer."""
    try:
        return router_workers(container)
    except subprocess.CalledProcessError:
        return None


FILE = "/var/lib/sglang-router-discovery/workers.json"


def manifest(container: str) -> list[str]:
    """The workers smg's discovery file declares."""
    return sorted(w["url"] for w in json.loads(podman_exec(container, "cat", FILE))["workers"])


def test_with_a_quorum_of_one_the_rollout_goes_on_through_the_gateway_left_and_says_the_other(pair):
    """smg down from the start: --gateway-quorum 1 rolls both replicas through lab-node1's gateway, each turn naming
    the dead one; then smg started again lists both (its unit's workers) healthy."""
    containers, inventory, run = pair
    gw1, gw2 = containers["lab-node1"], containers[SMG]
    kill_gateway(gw2)
    before = pids(containers)
    load = Load(gw1, MODEL)
    try:
        code, doc, proc = run(
            "rollout", "-e", new_configuration(3), "-e", GATE, "--gateway-quorum", "1", inventory=inventory
        )
    finally:
        stats = load.stop()
        revive_gateway(gw2)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 0, out
    assert rows(doc) == {n: "restarted" for n in NODES}, out
    assert all(p != before[n] for n, p in pids(containers).items())
    assert any(line.startswith(f"gateway {SMG} did not answer: ") for line in doc["report"]), doc["report"]
    assert router_workers(gw1) == BOTH
    assert stats["lost"] == 0, stats["failures"]


def kill_gateway(container: str) -> None:
    """The gateway's process killed and its unit kept from coming back (a dead host's gateway, for this run)."""
    podman_exec(container, "systemctl", "kill", "-s", str(int(signal.SIGKILL)), "sglang-router.service")
    podman_exec(container, "systemctl", "stop", "sglang-router.service")


BURST = """
import json, sys, threading, urllib.request as u
n, key, port, model = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
out = []
def one():
    body = json.dumps({"text": "burst", "model": model, "sampling_params": {"max_new_tokens": 8}}).encode()
    req = u.Request(f"http://127.0.0.1:{port}/generate", data=body, headers={"Content-Type": "application/json",
                    "Authorization": "Bearer " + key})
    try:
        with u.urlopen(req, timeout=8) as r:
            out.append(r.status == 200 and bool(json.load(r).get("text")))
    except Exception:
        out.append(False)
ts = [threading.Thread(target=one) for _ in range(n)]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps({"ok": out.count(True), "failed": out.count(False)}))
"""


def burst(container: str, n: int) -> dict:
    """n generations at once through the node's gateway, 8 s each at most: how many were answered, how many not."""
    return json.loads(
        podman_exec(container, "python3", "-c", BURST, str(n), rollout.KEY, str(rollout.ROUTER_PORT), MODEL)
    )


def sentinel_said(container: str) -> str:
    return podman_exec(container, "journalctl", "-u", "sglang-router-sentinel.service", "-o", "cat", "--no-pager")


def test_a_replica_whose_generations_hang_is_taken_out_by_each_gateways_sentinel_and_put_back_after_a_restart(pair):
    """sglang#22779's failure on lab-node2's replica (LAB_STANDIN_HANG_AFTER: /health stays 200, generations hang
    once it has served 60): neither gateway's health check sees it, each gateway's sentinel takes it out, saying
    how many requests it held (the ones it failed); the clients are then all served by lab-node1's replica; restarted
    without the fault, it is put back into both."""
    containers, inventory, run = pair
    try:
        hang = {"sglang_instances": [{**RO, "env": {"LAB_ROLLOUT": "gateways-hang", "LAB_STANDIN_HANG_AFTER": "60"}}]}
        code, _, proc = run("restart", "-e", json.dumps(hang), "--limit", SMG, inventory=inventory)
        assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        wait_for("both gateways list both", lambda: all(router_workers(c) == BOTH for c in containers.values()), 120)
        failed = 0
        for _ in range(20):  # until its 60 are spent and generations hang there
            failed += sum(burst(c, 12)["failed"] for c in containers.values())
            if failed:
                break
        assert failed, "the replica never hung"
        for n, c in containers.items():
            wait_for(
                f"{n}'s sentinel to take {WORKER2} out", lambda c=c: router_workers(c).get(WORKER2) is not True, 90
            )
        for n, c in containers.items():  # every client served, by the replica left
            assert burst(c, 12) == {"ok": 12, "failed": 0}, n
            said = sentinel_said(c)
            line = next(x for x in said.splitlines() if x.startswith(f"sentinel: {WORKER2} taken out of "))
            held = int(line.split(" it held ", 1)[1].split()[0])
            assert held >= 1, line  # the requests it failed, counted on its own gauges
            print(f"{n}: {line}")
        assert router_workers(containers["lab-node1"]).get(WORKER1) is True
    finally:
        code, _, proc = run("restart", "-e", new_configuration(4), "--limit", SMG, inventory=inventory)
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for n, c in containers.items():
        try:
            wait_for(f"{n}'s sentinel to put {WORKER2} back", lambda c=c: router_workers(c) == BOTH, 120)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {router_workers(c)}; its sentinel said:\n{sentinel_said(c)[-3000:]}"
            ) from None
        assert f"sentinel: {WORKER2} put back into " in sentinel_said(c), n
