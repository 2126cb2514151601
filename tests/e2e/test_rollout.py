"""python -m driver rollout on the lab, under load through the real sglang-router (docs/rollout.md).

The lab's two nodes are the replicas, each serving one instance `ro` (the stand-in, 4 simulated GPUs, port 30010);
sglang-router 0.3.2 runs on lab-node1 (roles/sglang_router through playbooks/router.yml, port 30100, an API key)
in front of both. bench/loadgen.py runs on lab-node1 (the router's port is not published), sending a steady mixed
load through the router during each rollout and counting every failed or truncated response.

The inventory is the lab's own plus the groups sglang_replicas and sglang_routers and the instance as host variables
(an inventory file next to the lab's: lab/lab.py is untouched). At the end the instance and the router are stopped
and removed: the nodes are left deployed, never verified, as found.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from driver import interrupts
from support import rollout, wait_for
from support.e2e import driver_runner, labmod, podman_exec, remove_instances, wait_ssh
from support.rollout import KEY, ROUTER, ROUTER_PORT, Load, Watched, in_node, router_workers

pytestmark = pytest.mark.lab

NODES = ("lab-node1", "lab-node2")
RO = {"name": "ro", "port": 30010, "gpus": [0, 1, 2, 3]}
# The canary gate, loose: tok/s measured on a loaded 2-core machine jitters; a slow canary is not tested here.
GATE = json.dumps({"sglang_rollout_canary_threshold": 0.5})
REPLICAS = {"sglang_replicas": list(NODES)}


def write_inventory(the_lab, name: str, instances: dict[str, list[dict]]) -> str:
    return rollout.write_inventory(the_lab, name, instances, REPLICAS)


def main_pid(container: str) -> int:
    return rollout.main_pid(container, "sglang-ro.service")


@pytest.fixture(scope="module")
def fleet(deployed, tmp_path_factory):
    """ro serving on both nodes (started through the safe restart: a known-good generation each), the router in
    front of them listing both healthy, the load generator copied to the router's node."""
    the_lab, hosts = deployed
    containers = {h["name"]: h["container"] for h in hosts}
    inventory = write_inventory(the_lab, "rollout-hosts.yml", {h: [RO] for h in NODES})
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, None)
    try:
        rollout.serve_behind_router(run, inventory, containers[ROUTER])
        yield the_lab, containers, inventory, run
    finally:
        rollout.remove_router(containers[ROUTER])
        for n in NODES:
            remove_instances(containers[n], "ro")


TEXTFILES = "/var/lib/prometheus/node-exporter"  # node_exporter's textfile collector (sglang_service_metrics_dir)


def rows_by_host(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for r in doc["rows"] if r["instance"] == "ro"}


def test_a_clean_rollout_under_load_loses_no_request(fleet):
    _, containers, inventory, run = fleet
    router = containers[ROUTER]
    pids = {n: main_pid(containers[n]) for n in NODES}
    new = json.dumps({"sglang_instances": [{**RO, "env": {"LAB_ROLLOUT": str(time.time_ns())}}]})
    for n in NODES:
        podman_exec(containers[n], "mkdir", "-p", TEXTFILES)  # as Debian's prometheus-node-exporter leaves it
    load = Load(router)
    t0 = time.monotonic()
    try:
        code, doc, proc = run("rollout", "-e", new, "-e", GATE, inventory=inventory)
        prom = {n: podman_exec(containers[n], "cat", f"{TEXTFILES}/sglang_deploy_ro.prom") for n in NODES}
    finally:
        stats = load.stop()
        for n in NODES:
            podman_exec(containers[n], "rm", "-rf", TEXTFILES)
    took = time.monotonic() - t0
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 0, out
    rows = rows_by_host(doc)
    assert {n: rows[n]["result"] for n in NODES} == {n: "restarted" for n in NODES}, out
    assert all(main_pid(containers[n]) != pids[n] for n in NODES)  # every replica restarted
    assert router_workers(router) == {f"http://{n}:{RO['port']}": True for n in NODES}
    # Each replica's metrics: its restart, and where the rollout left it, behind the one gateway (docs/monitoring.md).
    for n in NODES:
        assert (
            'sglang_deploy_operation_outcome{operation="rollout",outcome="restarted",sglang_instance="ro"} 1' in prom[n]
        )
        assert (
            'sglang_deploy_operation_outcome{operation="restart",outcome="restarted",sglang_instance="ro"} 1' in prom[n]
        )
        assert 'sglang_deploy_rollout_gateways_healthy{sglang_instance="ro"} 1' in prom[n], prom[n]
    assert stats["lost"] == 0, stats["failures"]
    assert stats["sent"] >= 20, stats
    # Streamed answers were streamed, through the router, whole ([DONE]); not a whole JSON passed off as one.
    assert stats["not_streamed"] == 0, stats
    assert stats["by_kind"]["generate-stream"]["ok"] and stats["by_kind"]["completions-stream"]["ok"], stats
    print(f"clean rollout of {len(NODES)} replicas in {took:.0f} s under load: {json.dumps(stats)}")


def test_a_canary_that_crashes_on_first_decode_stops_the_rollout_rolled_back_and_back_in(fleet):
    the_lab, containers, _, run = fleet
    router = containers[ROUTER]
    faulty = write_inventory(
        the_lab,
        "rollout-crash-hosts.yml",
        {"lab-node1": [{**RO, "env": {"LAB_STANDIN_FAULT": "crash-first-decode"}}], "lab-node2": [RO]},
    )
    untouched = main_pid(containers["lab-node2"])
    load = Load(router)
    try:
        code, doc, proc = run("rollout", "-e", GATE, inventory=faulty)
    finally:
        stats = load.stop()
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 5, out  # rolled back: the known-good configuration serves
    rows = rows_by_host(doc)
    assert rows["lab-node1"]["result"] == "rolled_back", out
    assert "rollback" in rows["lab-node1"]["detail"], rows
    assert main_pid(containers["lab-node2"]) == untouched  # the rollout stopped before it
    assert rows.get("lab-node2", {}).get("result") != "restarted"
    assert "LAB_STANDIN_FAULT" not in podman_exec(containers["lab-node1"], "cat", "/etc/sglang/ro.env")
    assert router_workers(router) == {f"http://{n}:{RO['port']}": True for n in NODES}  # rejoined
    assert stats["lost"] == 0, stats["failures"]
    print(f"crashing canary under load: {json.dumps(stats)}")


def test_a_canary_slower_than_the_fleet_is_rolled_back_and_stops_the_rollout(fleet):
    the_lab, containers, _, run = fleet
    router = containers[ROUTER]
    slow = write_inventory(
        the_lab,
        "rollout-slow-hosts.yml",
        {"lab-node1": [{**RO, "env": {"LAB_STANDIN_TOKENS_PER_S": "150"}}], "lab-node2": [RO]},
    )
    untouched = main_pid(containers["lab-node2"])
    code, doc, proc = run("rollout", inventory=slow)  # the default gate: more than 20 % slower than the fleet
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 5, out
    row = rows_by_host(doc)["lab-node1"]
    assert row["result"] == "rolled_back" and "throughput_vs_profile_baseline" in row["detail"], row
    assert main_pid(containers["lab-node2"]) == untouched
    assert "LAB_STANDIN_TOKENS_PER_S" not in podman_exec(containers["lab-node1"], "cat", "/etc/sglang/ro.env")
    assert router_workers(router) == {f"http://{n}:{RO['port']}": True for n in NODES}


def test_a_replica_whose_configuration_is_refused_stops_the_rollout_before_anything_leaves_the_router(fleet):
    """Every replica is validated at once before the canary: lab-node2's configuration refused by SGLang's parser
    stops the rollout with nothing touched (the canary lab-node1 not restarted either, both in the router). Within
    a failure budget of 1 the refused replica is skipped, untouched, and the others roll."""
    the_lab, containers, _, run = fleet
    router = containers[ROUTER]
    new_env = {"LAB_ROLLOUT": str(time.time_ns())}
    refused = write_inventory(
        the_lab,
        "rollout-refused-hosts.yml",
        {
            "lab-node1": [{**RO, "env": new_env}],
            "lab-node2": [{**RO, "env": new_env, "flags": {"mem_fraction_static": "most"}}],
        },
    )
    pids = {n: main_pid(containers[n]) for n in NODES}
    code, _, proc = run("rollout", "-e", GATE, inventory=refused)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 3, out  # exitcodes.INVALID_CONFIG: nothing running was touched
    assert "mem_fraction_static" in out, out
    assert {n: main_pid(containers[n]) for n in NODES} == pids  # not even the canary
    assert router_workers(router) == {f"http://{n}:{RO['port']}": True for n in NODES}

    code, doc, proc = run("rollout", "-e", GATE, "--max-fail", "1", inventory=refused)
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 3, out
    assert rows_by_host(doc)["lab-node1"]["result"] == "restarted", out
    assert main_pid(containers["lab-node1"]) != pids["lab-node1"]
    assert main_pid(containers["lab-node2"]) == pids["lab-node2"]  # refused: skipped, untouched
    assert "mem_fraction_static" not in podman_exec(containers["lab-node2"], "cat", "/etc/sglang/ro.env")
    assert router_workers(router) == {f"http://{n}:{RO['port']}": True for n in NODES}


def router_add(container: str, worker: str) -> None:
    code = (
        "import json, urllib.request as u; u.urlopen(u.Request("
        f"'http://127.0.0.1:{ROUTER_PORT}/workers', data=json.dumps({{'url': '{worker}'}}).encode(), "
        f"headers={{'Authorization': 'Bearer {KEY}', 'Content-Type': 'application/json'}}), timeout=10)"
    )
    in_node(container, code)


def test_a_replica_node_down_is_reported_unreachable_taken_out_of_the_router_and_stops_the_rollout(fleet):
    """lab-node2's container killed under load: the canary (lab-node1) rolls, then lab-node2 is reported
    unreachable, out of the router (before the router's own health check would drop it), the rollout stops. Then
    the node comes back and the safe restart and the router take it back."""
    the_lab, containers, inventory, run = fleet
    router, down = containers[ROUTER], containers["lab-node2"]
    worker2 = f"http://lab-node2:{RO['port']}"
    new = json.dumps({"sglang_instances": [{**RO, "env": {"LAB_ROLLOUT": str(time.time_ns())}}]})
    load = Load(router)
    t_load = time.monotonic()
    try:
        subprocess.run(["podman", "kill", down], check=True, capture_output=True)
        t_kill = time.monotonic() - t_load
        code, doc, proc = run("rollout", "-e", new, "-e", GATE, inventory=inventory)
        t_end = time.monotonic() - t_load
        listed = router_workers(router)
    finally:
        stats = load.stop()
        subprocess.run(["podman", "start", down], check=True, capture_output=True)
        labmod.up(the_lab, nodes=len(NODES), gpus=8, timeout=120)  # the node's SSH port is published anew
        write_inventory(the_lab, "rollout-hosts.yml", {h: [RO] for h in NODES})
        wait_ssh(inventory, "lab-node2")
    out = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert code == 8, out  # exitcodes.UNREACHABLE
    rows = rows_by_host(doc)
    assert rows["lab-node1"]["result"] == "restarted", out
    assert doc["hosts"]["lab-node2"]["status"] == "unreachable", doc["hosts"]["lab-node2"]
    assert listed == {f"http://lab-node1:{RO['port']}": True}  # the router routes to the canary only
    # Lost requests: only those in flight to lab-node2 or sent to it before the rollout took it out, when the
    # router's retry could not save them (the count, reported); none after the rollout ended.
    late = [f for f in stats["failures"] if f["at_s"] > t_end + 2]  # loadgen's clock starts a little earlier
    assert not late, late
    print(
        f"node down at {t_kill:.1f} s, rollout ended at {t_end:.1f} s; lost {stats['lost']} of {stats['sent']}: "
        f"{json.dumps(stats['failures'][:10])}"
    )

    # Back: the safe restart on the returned node, then into the router, healthy.
    code, _, proc = run("restart", limit="lab-node2", inventory=inventory)
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    router_add(router, worker2)
    deadline = time.monotonic() + 60
    while router_workers(router) != {f"http://{n}:{RO['port']}": True for n in NODES}:
        assert time.monotonic() < deadline, router_workers(router)
        time.sleep(0.5)


# ---------------------------------------------------------------------- an operator's ordinary day (issue #29)

WORKER1, WORKER2 = (f"http://{n}:{RO['port']}" for n in NODES)
BOTH = {WORKER1: True, WORKER2: True}


def a_new_configuration() -> str:
    return json.dumps({"sglang_instances": [{**RO, "env": {"LAB_ROLLOUT": str(time.time_ns())}}]})


def out_of_the_router(router: str, worker: str):
    return lambda: worker not in router_workers(router)


def test_one_interrupt_mid_replica_finishes_it_puts_it_back_and_begins_no_other(fleet):
    """The driver's first Ctrl-C while the canary is out of the router: the canary's turn finishes (restarted,
    back in the router, healthy), lab-node2 never begins, exit 130; both serve in the router. (SIGTERM is the
    first interrupt of the next case: one handler, tests/driver/test_ctrl_c.py.)"""
    _, containers, inventory, run = fleet
    router = containers[ROUTER]
    pids = {n: main_pid(containers[n]) for n in NODES}
    driver = Watched(run("rollout", "-e", a_new_configuration(), "-e", GATE, inventory=inventory, popen=True))
    try:
        wait_for("the canary out of the router", out_of_the_router(router, WORKER1), 120, interval=0.1)
        driver.proc.send_signal(signal.SIGINT)
    finally:
        code, out, err = driver.wait(300)
    assert code == 130, out[-3000:] + err[-3000:]
    assert interrupts.FIRST in err, err[-3000:]
    assert rows_by_host(json.loads(out))["lab-node1"]["result"] == "restarted", out[-3000:]
    assert main_pid(containers["lab-node1"]) != pids["lab-node1"], "the replica in flight finished its restart"
    assert main_pid(containers["lab-node2"]) == pids["lab-node2"], "no further replica began"
    assert router_workers(router) == BOTH


def long_request(router: str, worker: str, tokens: int) -> subprocess.Popen:
    """One generation straight to the worker (not through the router), running for tokens / 400 s. Streamed, so
    that killing it ends it on the server too (its next piece cannot be written), as SGLang aborts a request whose
    client went away: the next test's drain does not wait on it."""
    code = (
        "import json, urllib.request as u; u.urlopen(u.Request("
        f"'{worker}/generate', data=json.dumps({{'text': 'long', 'stream': True, 'sampling_params': "
        f"{{'max_new_tokens': {tokens}}}}}).encode(), headers={{'Content-Type': 'application/json'}}), timeout=300).read()"
        "  # sgd-held-request"
    )
    return subprocess.Popen(
        ["podman", "exec", router, "python3", "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def test_two_interrupts_abandon_the_run_and_put_back_what_serves(fleet):
    """SIGTERM (a closed terminal, a CI runner's stop), then Ctrl-C, while the canary drains a long request: the
    first is an interrupt as a Ctrl-C is, the second abandons the run: ansible-playbook is stopped, the driver puts
    the canary (still serving its old configuration) back into the router and says so; exit 130."""
    _, containers, inventory, run = fleet
    router = containers[ROUTER]
    pids = {n: main_pid(containers[n]) for n in NODES}
    # About 60 s at the stand-in's 400 tok/s: the drain waits on it while the plan (every replica validated, the
    # fleet measured), the canary's removal and both interrupts happen; 20 s once ran out on a loaded machine.
    held = long_request(router, WORKER1, 24000)
    driver = Watched(run("rollout", "-e", a_new_configuration(), "-e", GATE, inventory=inventory, popen=True))
    try:
        wait_for("the canary out of the router", out_of_the_router(router, WORKER1), 120, interval=0.1)
        driver.proc.send_signal(signal.SIGTERM)
        wait_for("the first interrupt said", driver.said(interrupts.FIRST), 30, interval=0.05)
        driver.proc.send_signal(signal.SIGINT)
    finally:
        code, out, err = driver.wait(300)
        held.kill()  # podman exec's client: the request's own process runs on in the container, so it too
        subprocess.run(["podman", "exec", router, "pkill", "-f", "sgd-held-request"], check=False, capture_output=True)
    assert code == 130, out[-3000:] + err[-3000:]
    assert f"put back into the router: {WORKER1}" in err, err[-3000:]
    assert main_pid(containers["lab-node1"]) == pids["lab-node1"], "abandoned while draining: never stopped"
    assert main_pid(containers["lab-node2"]) == pids["lab-node2"]
    assert router_workers(router) == BOTH


def router_remove(container: str, worker: str) -> None:
    """The worker out of the router by its UUID, as an operator would with curl."""
    base = f"http://127.0.0.1:{ROUTER_PORT}/workers"
    code = (
        f"import json, urllib.request as u; h = {{'Authorization': 'Bearer {KEY}'}}; "
        f"ws = json.load(u.urlopen(u.Request('{base}', headers=h), timeout=10))['workers']; "
        f"[u.urlopen(u.Request('{base}/' + w['id'], headers=h, method='DELETE'), timeout=10) "
        f"for w in ws if w['url'] == '{worker}']"
    )
    in_node(container, code)


def listed_as(router: str, want: dict[str, bool], timeout: float = 60) -> None:
    wait_for(f"the router to list {want}", lambda: router_workers(router) == want, timeout, interval=0.3)


def test_a_worker_the_router_lists_under_its_address_is_rolled_once_and_not_duplicated(fleet):
    """lab-node2 registered under its IP address (an operator's curl): the rollout finds it by what it resolves
    to, takes it out, drains and restarts it, and puts it back once, under the inventory's name; 0 lost."""
    _, containers, inventory, run = fleet
    router = containers[ROUTER]
    ip = podman_exec(router, "getent", "hosts", "lab-node2").split()[0]
    alias = f"http://{ip}:{RO['port']}"
    router_remove(router, WORKER2)
    router_add(router, alias)
    listed_as(router, {WORKER1: True, alias: True})
    before = main_pid(containers["lab-node2"])
    load = Load(router)
    try:
        code, doc, proc = run("rollout", "-e", a_new_configuration(), "-e", GATE, inventory=inventory)
    finally:
        stats = load.stop()
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert code == 0, out
    assert rows_by_host(doc)["lab-node2"]["result"] == "restarted", out
    assert main_pid(containers["lab-node2"]) != before
    assert router_workers(router) == BOTH, "the alias is gone, no duplicate"
    assert stats["lost"] == 0, stats["failures"]


def test_a_replica_unreachable_over_ssh_that_serves_stays_in_the_router(fleet):
    """lab-node2's sshd stopped (a bastion outage, a rotated host key): the canary rolls; lab-node2 is reported
    unreachable (exit 8) but left in the router, since it serves over HTTP; nothing is lost."""
    _, containers, inventory, run = fleet
    router, cut = containers[ROUTER], containers["lab-node2"]
    before = main_pid(cut)
    load = Load(router)
    try:
        podman_exec(cut, "sh", "-c", "systemctl stop ssh.service; pkill -KILL -x sshd || true")
        code, doc, proc = run("rollout", "-e", a_new_configuration(), "-e", GATE, inventory=inventory)
        listed = router_workers(router)
    finally:
        stats = load.stop()
        podman_exec(cut, "systemctl", "start", "ssh.service")
        wait_ssh(inventory, "lab-node2")
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert code == 8, out  # exitcodes.UNREACHABLE
    assert rows_by_host(doc)["lab-node1"]["result"] == "restarted", out
    assert doc["hosts"]["lab-node2"]["status"] == "unreachable", doc["hosts"]["lab-node2"]
    assert listed == BOTH, "served over HTTP: left in"
    assert main_pid(cut) == before
    assert stats["lost"] == 0, stats["failures"]


def test_a_replica_without_metrics_is_refused_before_anything_leaves_the_router(fleet):
    """lab-node2 serving without --enable-metrics (SGLang then has no /metrics: nothing can show its drain is
    done): the rollout is refused naming it, before the canary leaves the router; exit 3. Then put back."""
    the_lab, containers, inventory, run = fleet
    router = containers[ROUTER]
    bare = write_inventory(
        the_lab,
        "rollout-nometrics-hosts.yml",
        {"lab-node1": [RO], "lab-node2": [{**RO, "flags": {"enable_metrics": False}}]},
    )
    try:
        code, _, proc = run("restart", limit="lab-node2", inventory=bare)
        assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        pids = {n: main_pid(containers[n]) for n in NODES}
        code, _, proc = run("rollout", "-e", a_new_configuration(), "-e", GATE, inventory=inventory)
        out = proc.stdout[-4000:] + proc.stderr[-4000:]
        assert code == 3, out  # exitcodes.INVALID_CONFIG: nothing running was touched
        assert "enable-metrics" in out and WORKER2 in out, out
        assert {n: main_pid(containers[n]) for n in NODES} == pids, "not even the canary"
        assert router_workers(router) == BOTH
    finally:
        code, _, proc = run("restart", limit="lab-node2", inventory=inventory)
        assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_an_ssh_blip_during_a_replicas_restart_ends_defined_and_back_in_the_router(fleet):
    """lab-node2's sshd stopped and its sessions cut while its restart runs (the restart goes on on the host,
    detached), then back. Either the controller's poll outlasts the blip and gets the restart's real outcome
    (exit 0, restarted), or the blip hit a call the poll cannot ask again (its first: the job not yet known to the
    controller): the turn fails unreachable (exit 8) and its rescue, judging over HTTP, puts the serving replica
    back. Both end with the new server serving and listed; never out and unreported."""
    _, containers, inventory, run = fleet
    router, node = containers[ROUTER], containers["lab-node2"]
    before = main_pid(node)
    driver = Watched(run("rollout", "-e", a_new_configuration(), "-e", GATE, inventory=inventory, popen=True))
    try:
        # Cut once the restart runs on the host (its detached worker has stopped the old server), not before its
        # first module call: a host lost before that is a replica unreachable at its turn (tested above).
        wait_for("lab-node2's restart under way on the host", lambda: main_pid(node) != before, 240, interval=0.1)
        podman_exec(node, "sh", "-c", "systemctl stop ssh.service; pkill -KILL -x sshd || true")
        try:  # the blip lasts until the restart has moved on on the host without the controller
            wait_for("lab-node2 restarted on its own", lambda: main_pid(node) not in (0, before), 120, interval=0.5)
        finally:
            podman_exec(node, "systemctl", "start", "ssh.service")
    finally:
        code, out, err = driver.wait(400)
        wait_ssh(inventory, "lab-node2")
    assert code in (0, 8), out[-3000:] + err[-3000:]
    doc = json.loads(out)
    if code == 0:
        assert rows_by_host(doc)["lab-node2"]["result"] == "restarted", out[-3000:]
    else:
        assert any("lab-node2/ro: unreachable" in line and "router: in" in line for line in doc["report"]), doc[
            "report"
        ]
    assert main_pid(node) not in (0, before), "the restart went on on the host"
    listed_as(router, BOTH)


def test_max_unavailable_counts_a_replica_a_tolerated_failure_left_out(fleet):
    """Three replicas (lab-node2 holds two: `ro`, and `ro2` as a second inventory host on the same node), --max-fail 1,
    --max-unavailable 1: lab-node2's restart ends not recovered (its start crashes, no rollback) and it stays out;
    the third replica then does not begin (one out already is the most allowed), untouched and in the router."""
    the_lab, containers, _, run = fleet
    router, node2 = containers[ROUTER], containers["lab-node2"]
    ro2 = {"name": "ro2", "port": 30011, "gpus": [4, 5, 6, 7]}
    worker3 = f"http://lab-node2:{ro2['port']}"
    doc = yaml.safe_load(Path(write_inventory(the_lab, "rollout-three.yml", {h: [RO] for h in NODES})).read_text())
    hosts = doc["all"]["children"]["sglang_nodes"]["hosts"]
    hosts["lab-node2-b"] = {**hosts["lab-node2"], "sglang_instances": [ro2], "sglang_router_worker_host": "lab-node2"}
    doc["all"]["children"]["sglang_replicas"]["hosts"]["lab-node2-b"] = None
    three = the_lab.inventory.parent / "rollout-three.yml"
    three.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    faulty = json.loads(json.dumps(doc))
    faulty["all"]["children"]["sglang_nodes"]["hosts"]["lab-node2"]["sglang_instances"] = [
        {**RO, "env": {"LAB_STANDIN_FAULT": "crash-startup"}}
    ]
    crash = the_lab.inventory.parent / "rollout-three-crash.yml"
    crash.write_text(yaml.safe_dump(faulty, sort_keys=False), encoding="utf-8")
    try:
        code, _, proc = run("restart", limit="lab-node2-b", inventory=str(three))
        assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        router_add(router, worker3)
        listed_as(router, {**BOTH, worker3: True})
        third = rollout.main_pid(node2, "sglang-ro2.service")
        no_rollback = json.dumps({"sglang_service_rollback": False})
        code, doc, proc = run(
            "rollout", "-e", GATE, "-e", no_rollback, "--max-fail", "1", "--max-unavailable", "1", inventory=str(crash)
        )
        out = proc.stdout[-4000:] + proc.stderr[-4000:]
        assert code == 6, out  # not recovered: lab-node2's ro stays down, out of the router
        assert rollout.main_pid(node2, "sglang-ro2.service") == third, "the third replica never began"
        assert router_workers(router) == {WORKER1: True, worker3: True}, "never two of three out"
        assert "max-unavailable 1: 1 replica host(s) already out of the router" in proc.stdout + proc.stderr, out
    finally:
        podman_exec(node2, "sh", "-c", "systemctl disable --now sglang-ro2.service || true")
        podman_exec(node2, "rm", "-rf", "/etc/systemd/system/sglang-ro2.service", "/var/lib/sglang/known-good/ro2")
        code, _, proc = run("restart", limit="lab-node2", inventory=inventory_of(the_lab))
        assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        router_remove(router, worker3)
        router_add(router, WORKER2)
        listed_as(router, BOTH)


def inventory_of(the_lab) -> str:
    """The fleet's own inventory (the fixture's), written again as it was."""
    return write_inventory(the_lab, "rollout-hosts.yml", {h: [RO] for h in NODES})
