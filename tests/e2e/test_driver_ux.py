"""The driver's Ctrl-C on a lab node with two instances: after "interrupted", no restart begins (not the next
loop item either); the restart in flight finishes and is reported; the run exits 130 and its ledger row says so.

lab-node1 runs `a` (GPUs 0-3) and `b` (GPUs 4-7); `main` (all 8 GPUs) is stopped for the module and the node
is left as it was found: deployed, never verified (a and b removed).
"""

from __future__ import annotations

import json
import signal
import sqlite3

import pytest

from support import wait_for
from support.e2e import driver_runner, podman_exec, remove_instances

pytestmark = pytest.mark.lab

NODE = "lab-node1"
A = {"name": "a", "port": 30000, "gpus": [0, 1, 2, 3]}
B = {"name": "b", "port": 30001, "gpus": [4, 5, 6, 7]}
NOT_BEGUN = "not begun (interrupted)"  # driver/events.py


def instances(**a_env: str) -> str:
    a = {**A, "env": a_env} if a_env else A
    return json.dumps({"sglang_instances": [a, B]})


def main_pid(node: str, name: str) -> int:
    return int(podman_exec(node, "systemctl", "show", "-p", "MainPID", "--value", f"sglang-{name}.service"))


def lock_holder(node: str, name: str) -> dict:
    """The operation holding the instance's lock on the node ({} when none)."""
    text = podman_exec(node, "sh", "-c", f"cat /run/sglang-deploy/locks/{name}.lock 2>/dev/null || true").strip()
    try:
        return json.loads(text) if text else {}
    except ValueError:  # caught mid-write
        return {}


@pytest.fixture(scope="module")
def two_serving(deployed, tmp_path_factory):
    """a and b verified and running on NODE, through the driver."""
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    podman_exec(node, "systemctl", "disable", "--now", "sglang-main.service")  # it holds all 8 GPUs
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, NODE)
    code, doc, proc = run("restart", "-e", instances())
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    assert {r["instance"]: r["result"] for r in doc["rows"]} == {"a": "restarted", "b": "restarted"}
    yield run, node, ledger
    remove_instances(node, "a", "b")


def test_ctrl_c_during_the_first_restart_never_restarts_the_second(two_serving):
    run, node, ledger = two_serving
    b_before = main_pid(node, "b")
    assert b_before > 0
    # a starts slowly (ready after 8 s): the interrupt lands while its restart is in flight.
    proc = run("restart", "-e", instances(LAB_STANDIN_READY_S="8"), popen=True)
    try:
        wait_for(
            "a's restart to be in flight (holding a's lock)",
            lambda: lock_holder(node, "a").get("operation", "").startswith("restart"),
            120,
            interval=0.2,
        )
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted: no further restart will begin" in err and "Traceback" not in err
    doc = json.loads(out)
    results = {r["instance"]: r["result"] for r in doc["rows"] if r["host"] == NODE}
    assert results == {"a": "restarted", "b": NOT_BEGUN}, "a finished its restart; b's never began"
    assert f"  {NODE}/b: {NOT_BEGUN}" in doc["left"]
    assert main_pid(node, "b") == b_before, "b was restarted after the interrupt"
    assert "LAB_STANDIN_READY_S" in podman_exec(node, "cat", "/etc/sglang/a.env"), "a's new configuration serves"
    db = sqlite3.connect(ledger)
    (exit_code,) = db.execute("SELECT exit_code FROM runs WHERE id = ?", (doc["run_id"],)).fetchone()
    db.close()
    assert exit_code == 130


def test_an_instance_no_host_defines_exits_2_and_nothing_runs(lab, tmp_path):
    """Issue #29: `--instance mian` (a typo) was a success that restarted nothing; now it is refused before
    anything runs: exit 2 naming it and the instances the hosts define, no run recorded, no node touched."""
    the_lab, hosts = lab
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    ledger = tmp_path / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, None)
    logins = podman_exec(node, "sh", "-c", "journalctl -q --no-pager -t sshd | wc -l")
    code, doc, proc = run("restart", "--instance", "mian")
    assert code == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "--instance mian: no selected host defines it (defined: main)" in proc.stderr
    assert doc["exit_code"] == 2 and doc["run_id"] is None
    assert not ledger.exists(), "nothing ran: no run is recorded"
    assert podman_exec(node, "sh", "-c", "journalctl -q --no-pager -t sshd | wc -l") == logins, "no SSH to the node"
