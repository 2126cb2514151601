"""One model over two lab nodes (nnodes 2): restart.yml stops every rank before any starts,
rank 0 waits until ready, generates and verifies, rank 1 is confirmed, then both record; a
rank failing its start rolls the group back on both nodes, in step, to its known-good generation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from support.e2e import REPO, VENV_BIN, ansible, controller_env, driver_runner, podman_exec

pytestmark = pytest.mark.lab

PORT = 30002


def inventory_with_multinode(the_lab, tmp_path, rank1_env: dict | None = None, env: dict | None = None):
    """The lab's inventory, each node given its rank of the instance `mn` (host variables); `env` on both ranks."""
    text = the_lab.inventory.read_text()
    for rank, host in enumerate(("lab-node1", "lab-node2")):
        inst = {
            "name": "mn",
            "port": PORT,
            "gpus": [0, 1, 2, 3],
            "nnodes": 2,
            "node_rank": rank,
            "dist_init_addr": "lab-node1:5757",
            "env": {**(env or {}), **((rank1_env or {}) if rank == 1 else {})},
        }
        text = text.replace(
            f"        {host}:\n", f"        {host}:\n          sglang_instances: {json.dumps([inst])}\n", 1
        )
    inv = tmp_path / "hosts.yml"
    inv.write_text(text)
    return inv


def results(proc_stdout: str) -> dict:
    start = proc_stdout.find("\n{\n")
    doc, _ = json.JSONDecoder().raw_decode(proc_stdout, start + 1)
    out: dict = {}
    for play in doc["plays"]:
        for task in play["tasks"]:
            for host, r in task["hosts"].items():
                for item in r.get("results") or []:
                    if item.get("instance") == "mn" and item.get("outcome") and "phases" in item:  # sglang_server's
                        out.setdefault(host, []).append(item)
    return out


@pytest.fixture(scope="module")
def nodes(deployed):
    the_lab, hosts = deployed
    yield the_lab, {h["name"]: h["container"] for h in hosts}
    for h in hosts:
        podman_exec(
            h["container"],
            "sh",
            "-c",
            "systemctl disable --now sglang-mn.service; rm -rf /etc/systemd/system/sglang-mn.service "
            "/etc/sglang/mn.env /var/lib/sglang/known-good/mn /etc/sglang/pending/*mn*; systemctl daemon-reload",
        )


def restart(the_lab, inv, *extra: str):
    return ansible(
        "ansible-playbook",
        "playbooks/restart.yml",
        *extra,
        inventory=inv,
        check=False,
        env={"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"},
    )


def phase_times(items: list[dict], name: str) -> list[tuple[float, float]]:
    """(began, ended) of each run of the phase `name` in these results (wall-clock epoch seconds, as the host saw)."""
    return [(p["at"], p["at"] + p["seconds"]) for r in items for p in r["phases"] if p["phase"] == name]


def test_every_rank_stops_before_any_starts_and_both_are_recorded(nodes, tmp_path):
    the_lab, containers = nodes
    proc = restart(the_lab, inventory_with_multinode(the_lab, tmp_path))
    res = results(proc.stdout)
    assert proc.returncode == 0, {h: [(r["outcome"], r.get("msg")) for r in rs] for h, rs in res.items()}
    for host in ("lab-node1", "lab-node2"):
        assert [r["outcome"] for r in res[host]] == ["stopped", "started", "verified", "restarted"], host
    rank0 = res["lab-node1"][1]
    assert rank0["verify"]["ok"] and rank0["verify"]["accept_length"] > 1.5
    assert rank0["verify"]["running_profile"] == "eagle3_topk1"
    rank1 = res["lab-node2"][2]
    assert {c["name"] for c in rank1["verify"]["checks"]} == {"unit", "drift", "gpu_processes", "patches"}
    # From the times the hosts recorded: every rank's stop ended before any rank's start began, and every rank was
    # confirmed before any rank recorded (the lab's nodes share this machine's clock).
    everything = res["lab-node1"] + res["lab-node2"]
    assert max(end for _, end in phase_times(everything, "stop")) <= min(b for b, _ in phase_times(everything, "start"))
    confirmed = max(end for _, end in phase_times(res["lab-node2"], "verify"))
    recorded = [b for b, _ in phase_times(everything, "record")]
    assert len(recorded) == 4 and confirmed <= min(recorded)  # each rank: load what started, then record it
    for host, container in containers.items():
        argv = podman_exec(
            container, "sh", "-c", "tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value sglang-mn.service)/cmdline"
        )
        assert f"--node-rank {0 if host == 'lab-node1' else 1}" in argv and "--nnodes 2" in argv
        newest = "cat $(ls -1 /var/lib/sglang/known-good/mn/generations/*.json | tail -n 1)"
        assert json.loads(podman_exec(container, "sh", "-c", newest))["profile"] == "eagle3_topk1"


TEXTFILES = "/var/lib/prometheus/node-exporter"  # node_exporter's textfile collector (sglang_service_metrics_dir)


def unit_state(container: str) -> tuple[str, str]:
    out = podman_exec(container, "systemctl", "show", "-p", "ActiveState,MainPID", "sglang-mn.service")
    props = dict(line.split("=", 1) for line in out.split())
    return props["ActiveState"], props["MainPID"]


def test_a_rank_failing_its_start_rolls_the_group_back_on_both_nodes_in_step(nodes, tmp_path):
    """The new configuration dies at start on rank 1: rank 1 is contained, rank 0 (which started it) is stopped too,
    then both start their known-good generation, rank 0 verifies, rank 1 is confirmed: rolled back, serving."""
    the_lab, containers = nodes
    good = restart(the_lab, inventory_with_multinode(the_lab, tmp_path))  # a known-good generation on both nodes
    assert good.returncode == 0, good.stdout[-3000:]
    for container in containers.values():
        podman_exec(container, "mkdir", "-p", TEXTFILES)  # as Debian's prometheus-node-exporter leaves it
    try:
        proc = restart(the_lab, inventory_with_multinode(the_lab, tmp_path, {"LAB_STANDIN_FAULT": "crash-startup"}))
        prom = {h: podman_exec(c, "cat", f"{TEXTFILES}/sglang_deploy_mn.prom") for h, c in containers.items()}
    finally:
        for container in containers.values():
            podman_exec(container, "rm", "-rf", TEXTFILES)
    assert proc.returncode != 0
    res = results(proc.stdout)
    said = {h: [(r["outcome"], (r.get("failure") or {}).get("phase")) for r in rs] for h, rs in res.items()}
    # Rank 1 dies half a second after its start: its start phase sees it, or (when systemd had already
    # restarted it, Restart=on-failure) its confirmation does (the unit restarted behind our back).
    failed = next((r for r in res["lab-node2"] if r.get("failure")), None)
    assert failed and failed["outcome"] == "not_recovered", said
    assert failed["failure"]["phase"] in ("start", "verify"), said
    assert "rolls every node of it back in step" in failed["rollback"]["why"]
    for host in ("lab-node1", "lab-node2"):
        last = res[host][-1]
        assert last["outcome"] == "rolled_back" and last["rollback"]["outcome"] == "serving", said
        assert [r["outcome"] for r in res[host]][-3:] == ["stopped", "started", "rolled_back"], said
    assert res["lab-node1"][-1]["verify"]["ok"]
    # In step: every rank's rollback stop ended before any rank's rollback start began.
    everything = res["lab-node1"] + res["lab-node2"]
    stops, starts = phase_times(everything, "rollback-stop"), phase_times(everything, "rollback-start")
    assert len(stops) == 2 and len(starts) == 2 and max(e for _, e in stops) <= min(b for b, _ in starts)
    for container in containers.values():
        assert unit_state(container)[0] == "active"
        assert "LAB_STANDIN_FAULT" not in podman_exec(container, "cat", "/etc/sglang/mn.env")
    # Each node's metrics: the group's end there (its rollback's confirmation), counted as a rollback; no duration or
    # downtime, which no single phase saw (docs/monitoring.md).
    for host, text in prom.items():
        assert (
            'sglang_deploy_operation_outcome{operation="restart",outcome="rolled_back",sglang_instance="mn"} 1' in text
        )
        assert 'sglang_deploy_rollbacks_total{sglang_instance="mn"} 1' in text, host
        assert "sglang_deploy_operation_duration_seconds" not in text and "downtime" not in text, host


def test_a_limit_that_leaves_out_a_rank_is_refused_before_any_rank_stops(nodes, tmp_path):
    """The one-batch rule: a model's ranks restart together or not at all. `--limit lab-node1` leaves rank 1 out:
    rank 0 is refused before its stop, naming the node that is missing, and neither unit is touched."""
    the_lab, containers = nodes
    inv = inventory_with_multinode(the_lab, tmp_path)
    before = {host: unit_state(c) for host, c in containers.items()}
    proc = restart(the_lab, inv, "--limit", "lab-node1")
    assert proc.returncode != 0, proc.stdout[-3000:]
    res = results(proc.stdout)
    assert set(res) == {"lab-node1"}, res
    said = [(r["outcome"], r.get("failure")) for r in res["lab-node1"]]
    assert [o for o, _ in said] == ["refused"], said
    cause = said[0][1]["cause"]
    assert cause.startswith("mn spans 2 nodes, but only lab-node1 of them are in this run"), cause
    assert cause.endswith("Nothing was stopped on any node."), cause
    assert res["lab-node1"][0]["phases"] == [], "no phase ran: not even the lock"
    assert {host: unit_state(c) for host, c in containers.items()} == before, "no unit stopped or restarted"


LEASE = "/run/sglang-deploy/locks/mn.lease"


def on_both(containers: dict, script: str) -> dict[str, str]:
    """What `sh -c script` prints on each node ('' when it fails)."""
    out = {}
    for host, container in containers.items():
        proc = subprocess.run(["podman", "exec", container, "sh", "-c", script], capture_output=True, text=True)
        out[host] = proc.stdout.strip() if proc.returncode == 0 else ""
    return out


def wait_for(containers: dict, script: str, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        out = on_both(containers, script)
        if all(out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


# The lock free (taken and let go at once: nothing else runs on the node now) and the unit stopped.
IDLE = (
    "python3 -c \"import fcntl, os; fcntl.flock(os.open('/run/sglang-deploy/locks/mn.lock', os.O_RDWR), "
    'fcntl.LOCK_EX | fcntl.LOCK_NB)" && ! systemctl is-active --quiet sglang-mn.service && echo idle'
)


def test_a_controller_gone_between_the_groups_phases_leaves_a_lease_that_refuses_every_other_operation(nodes, tmp_path):
    """Issue #29: each phase is a module call of its own, so the group holds each node's lock between its phases as
    a lease. The controller is killed during the stop phase: each node ends its stop (the rank stopped) and keeps
    the run's lease, with no process holding the lock. Another restart of the instance and a deploy (sglang_stage)
    are refused, locked (the driver's exit 9), naming the lease, and touch nothing; once the operator removes the
    lease files (docs/restart.md), a restart brings the group back, and a successful run leaves no lease behind."""
    the_lab, containers = nodes
    # Each stop phase then waits 3 s for its GPUs (the stand-in's memory freed late): the controller is killed within
    # it, not after it, on a busy machine too (the rehearsal of 2026-12-06 killed it once the start phase had begun).
    inv = inventory_with_multinode(the_lab, tmp_path, env={"LAB_STANDIN_RELEASE_S": "3"})
    try:
        good = restart(the_lab, inv)
        assert good.returncode == 0, good.stdout[-3000:]
        assert on_both(containers, f"test -e {LEASE} || echo none") == {h: "none" for h in containers}
        env = {**controller_env(), "ANSIBLE_CONFIG": str(REPO / "ansible.cfg")}
        # A lease that outlasts the refused runs below (the lab's own timeouts make it 60 + 5 + 20 + 300 = 385 s).
        lease_s = ["-e", "sglang_service_group_lease_s=1800"]
        cmd = [str(VENV_BIN / "ansible-playbook"), "-i", str(inv), "playbooks/restart.yml", *lease_s]
        run = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
        try:
            seen = wait_for(containers, f"cat {LEASE}", timeout=180)  # both stop phases under way
        finally:
            os.killpg(run.pid, signal.SIGKILL)  # the controller dies mid-group
            run.wait()
        assert all(seen.values()), seen
        assert wait_for(containers, IDLE, timeout=120) == {h: "idle" for h in containers}, "each stop ran to its end"
        leases = {h: json.loads(text) for h, text in on_both(containers, f"cat {LEASE}").items()}
        tokens = {lease["token"] for lease in leases.values()}
        assert len(tokens) == 1 and all(lease["phase"] == "stop" for lease in leases.values()), leases
        (token,) = tokens
        assert all(time.time() + 1500 < lease["expires"] <= time.time() + 1800 for lease in leases.values()), leases

        ledger = tmp_path / "ledger.sqlite"
        driver = driver_runner(the_lab, ledger, None)
        for command in ("restart", "deploy"):  # another controller's restart of the instance; a deploy's sglang_stage
            code, doc, proc = driver(command, inventory=inv)
            assert code == 9, (command, proc.stdout[-3000:], proc.stderr[-3000:])
            mn = [r for r in doc["rows"] if r["instance"] == "mn"]
            assert {r["host"] for r in mn} == set(containers), (command, doc["rows"])
            assert all(r["result"] == "locked" and "a group lease until" in r["detail"] for r in mn), (command, mn)
            assert f"a multi-node restart's group lease (run {token}" in json.dumps(doc), command
        assert on_both(containers, IDLE) == {h: "idle" for h in containers}, "nothing was started"
        assert on_both(containers, "ls /etc/sglang/pending | grep -c mn || true") == {h: "0" for h in containers}
        assert {h: json.loads(t)["token"] for h, t in on_both(containers, f"cat {LEASE}").items()} == {
            h: token for h in containers
        }

        on_both(containers, f"rm {LEASE} && echo removed")  # the operator: that controller's run is gone
        back = restart(the_lab, inv)
        assert back.returncode == 0, back.stdout[-3000:]
        res = results(back.stdout)
        for host in containers:
            assert [r["outcome"] for r in res[host]] == ["stopped", "started", "verified", "restarted"], host
            assert res[host][-1]["group_lease"]["ended"] is True
            assert unit_state(containers[host])[0] == "active"
        assert on_both(containers, f"test -e {LEASE} || echo none") == {h: "none" for h in containers}
    finally:
        on_both(containers, f"rm -f {LEASE}")
