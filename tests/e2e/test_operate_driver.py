"""python -m driver against lab nodes: every command, the failure paths and their exit codes,
the JSON result and the ledger (Ctrl-C: test_driver_ux.py). Uses lab-node1's `main` instance; at the end stops it
and writes back the group_vars configuration (named test_operate_* to run after test_lab, which
needs fresh nodes)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.e2e import (
    REPO,
    back_to_deployed,
    controller_env,
    driver_runner,
    lab_gpu_state,
    main_with,
    podman_exec,
)

pytestmark = pytest.mark.lab

NODE = "lab-node1"


@pytest.fixture(scope="module")
def drive(deployed, tmp_path_factory):
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, NODE)

    def history(*args: str):
        env = {**controller_env(), "SGLANG_DEPLOY_LEDGER": str(ledger)}
        out = subprocess.run(
            [sys.executable, "-m", "driver", "history", "--json", *args],
            cwd=REPO,
            env=env,
            text=True,
            capture_output=True,
            check=True,
        ).stdout
        return json.loads(out)

    run.history = history
    run.the_lab = the_lab
    # Each test may run first (random order): main verified once, so a known-good generation exists.
    code, _, proc = run("restart")
    assert code == 0, proc.stdout[-3000:]
    yield run, node
    back_to_deployed(the_lab, node, NODE)


def main_pid(container: str) -> int:
    return int(podman_exec(container, "systemctl", "show", "-p", "MainPID", "--value", "sglang-main.service"))


def row(doc: dict) -> dict:
    (r,) = [r for r in doc["rows"] if r["host"] == NODE]
    return r


def test_validate_and_deploy_check(drive):
    run, _ = drive
    code, doc, proc = run("validate")
    assert code == 0, proc.stderr[-2000:]
    code, doc, _ = run("validate", "-e", main_with(flags={"speculative_algorithm": "EAGLE"}))
    assert code == 3 and doc["meaning"].startswith("invalid configuration")
    assert "use EAGLE3" in row(doc)["detail"]
    code, doc, proc = run("deploy", "--check")
    assert code == 0, proc.stdout[-3000:]


def test_restart_status_verify(drive):
    run, _ = drive
    code, doc, proc = run("restart")
    assert code == 0, proc.stdout[-3000:]
    r = row(doc)
    assert r["result"] == "restarted" and r["tokens_per_s"] > 100 and r["accept_length"] > 1.5
    code, doc, _ = run("status")
    inst = doc["hosts"][NODE]["instances"]["main"]
    assert (
        code == 0
        and inst["state"] == "active/running"
        and inst["running_profile"] == "eagle3_topk1"
        and not inst["drift"]
    )
    code, doc, _ = run("verify")
    assert code == 0 and row(doc)["result"] == "verified"
    code, doc, _ = run("verify", "-e", "sglang_service_verify_accept_length_min=5")
    # the failed check, after the phase it failed in (the running server's evidence bundle is taken too)
    assert code == 7 and row(doc)["detail"].startswith("verify: accept_length: average accept length")


def test_restart_failure_paths(drive):
    run, node = drive
    with lab_gpu_state(node, ["hold", "--pid", "1", "--gpu", "5", "--mib", "8148"], ["release", "--pid", "1"]):
        code, doc, _ = run("restart")
    assert code == 4 and "GPU 5: pid 1 holds 8148 MiB" in row(doc)["detail"]
    code, doc, _ = run("restart", "-e", main_with(env={"LAB_STANDIN_FAULT": "crash-first-decode"}))
    assert code == 5 and row(doc)["result"] == "rolled_back"
    assert "AttributeError" in doc["hosts"][NODE]["instances"]["main"]["failure"]["cause"]
    code, doc, _ = run("restart", "--no-rollback", "-e", main_with(env={"LAB_STANDIN_FAULT": "crash-startup"}))
    assert code == 6 and row(doc)["result"] == "not_recovered"
    code, doc, _ = run("rollback")
    assert code == 0 and row(doc)["result"] == "rolled_back", "the operator's rollback brings the known-good back"
    code, doc, _ = run("status")
    assert doc["hosts"][NODE]["instances"]["main"]["health"] is True


def test_unreachable_host(drive, tmp_path):
    run, _ = drive
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        run.the_lab.inventory.read_text().replace(
            "      hosts:\n",
            "      hosts:\n        lab-node9:\n          ansible_host: 127.0.0.1\n          ansible_port: 1\n",
            1,
        )
    )
    code, doc, _ = run("status", inventory=inv, limit=f"{NODE},lab-node9")
    assert code == 8
    assert doc["hosts"]["lab-node9"]["status"] == "unreachable" and doc["hosts"][NODE]["status"] == "ok"


def test_history_and_compare(drive):
    run, node = drive
    for args in (("validate",), ("deploy", "--check"), ("restart",), ("status",), ("verify",)):
        code, _, proc = run(*args)
        assert code == 0, (args, proc.stdout[-2000:])
    # A second, different generation serves: the operator's rollback puts back the one before it (issue #31),
    # never the newest, which is what runs (a rollback that would change nothing).
    code, doc, proc = run("restart", "-e", main_with(env={"LAB_STANDIN_LOAD_S": "1"}))
    assert code == 0, proc.stdout[-2000:]
    newer = doc["hosts"][NODE]["instances"]["main"]["known_good"]["generation"]
    assert "LAB_STANDIN_LOAD_S=1" in podman_exec(node, "cat", f"/proc/{main_pid(node)}/environ")
    code, doc, proc = run("rollback")
    main = doc["hosts"][NODE]["instances"]["main"]
    assert code == 0 and row(doc)["result"] == "rolled_back", json.dumps([main.get("failure"), main.get("phases")])
    back = main["rollback"]
    assert back["to_generation"] != newer, "the generation before the one serving, not the newest"
    assert "LAB_STANDIN_LOAD_S" not in podman_exec(node, "cat", f"/proc/{main_pid(node)}/environ")
    runs = run.history("-n", "50")
    commands = [r["command"] for r in runs]
    assert {"validate", "deploy", "restart", "status", "verify", "rollback"} <= set(commands)
    restart_ok = next(r for r in reversed(runs) if r["command"] == "restart" and r["exit_code"] == 0)
    assert restart_ok["config_hash"] and restart_ok["measurements"][0]["tokens_per_s"] > 100
    compare = {c["profile"]: c for c in run.history("--compare")}
    assert compare["eagle3_topk1"]["measurements"] >= 2 and compare["eagle3_topk1"]["median_tokens_per_s"] > 100
