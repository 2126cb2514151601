"""The operations core on a lab node, through the driver: the instance lock (two drivers at once),
staged configuration (a crash between deploy and restart starts the verified one), secrets outside
rollback, and a server with an API key. Uses lab-node1's `main` instance; at the end stops it and
writes back the group_vars configuration (named test_operate_* to run after test_lab)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from support import wait_for
from support.e2e import REPO, back_to_deployed, driver_runner, main_with, podman_exec

pytestmark = pytest.mark.lab

NODE = "lab-node1"
LOCK = "/run/sglang-deploy/locks/main.lock"


@pytest.fixture(scope="module")
def core(deployed, tmp_path_factory):
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, NODE)
    run.ledger = ledger
    code, _, proc = run("restart")
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    yield run, node
    back_to_deployed(the_lab, node, NODE)


def row(doc: dict) -> dict:
    return next(r for r in doc["rows"] if r["instance"] == "main")


def main_pid(node: str) -> int:
    return int(podman_exec(node, "systemctl", "show", "-p", "MainPID", "--value", "sglang-main.service"))


def running_argv(node: str) -> str:
    return podman_exec(node, "sh", "-c", f"tr '\\0' ' ' < /proc/{main_pid(node)}/cmdline")


def http_status(node: str, path: str) -> int | None:
    """The status of GET http://127.0.0.1:30000{path} on the node (no curl in the lab image); None if refused."""
    code = (
        "import sys, urllib.request as u, urllib.error as e\n"
        f"try:\n    print(u.urlopen('http://127.0.0.1:30000{path}', timeout=5).status)\n"
        "except e.HTTPError as x:\n    print(x.code)\nexcept Exception:\n    print(0)\n"
    )
    out = subprocess.run(["podman", "exec", node, "python3", "-c", code], capture_output=True, text=True).stdout.strip()
    return int(out) if out.isdigit() and out != "0" else None


def test_two_drivers_at_once_one_restarts_the_other_is_refused_naming_the_holder(core):
    run, node = core
    first = run("restart", "-e", main_with(env={"LAB_STANDIN_READY_S": "20"}), popen=True)

    def restart_holds_the_lock() -> str:
        text = subprocess.run(["podman", "exec", node, "cat", LOCK], capture_output=True, text=True).stdout.strip()
        return text if text and json.loads(text)["operation"].startswith("restart") else ""

    try:
        holder = wait_for("the first driver's restart to hold the lock", restart_holds_the_lock, 120, interval=0.2)
        t0 = time.monotonic()
        code, doc, proc = run("restart")
        refused_in = time.monotonic() - t0
    finally:
        out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert json.loads(out)["rows"][0]["result"] == "restarted"
    assert code == 9, (proc.stdout + proc.stderr)[-3000:]
    held = json.loads(holder)
    assert held["operation"].startswith("restart main") and held["pid"] > 0 and held["controller"]
    detail = row(doc)["detail"]
    assert f"held by pid {held['pid']}" in detail and held["controller"] in detail, detail
    assert refused_in < 60, "refused at once, not after waiting for the first restart"
    assert "LAB_STANDIN_READY_S" in running_argv(node) or "LAB_STANDIN_READY_S" in podman_exec(
        node, "cat", "/etc/sglang/main.env"
    )


def test_a_server_killed_between_deploy_and_restart_comes_back_on_its_known_good_profile(core):
    run, node = core
    code, _, proc = run("restart")
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "--speculative-num-steps 2 " in running_argv(node)
    code, _, proc = run("deploy", "-e", "sglang_profile=eagle3_5tok_cuda_graph")
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "--speculative-num-steps 3 " in podman_exec(node, "cat", "/etc/sglang/pending/sglang-main.service")
    assert "--speculative-num-steps 2 " in podman_exec(node, "cat", "/etc/systemd/system/sglang-main.service")
    before = main_pid(node)
    podman_exec(node, "kill", "-9", str(before))  # a crash: Restart=on-failure starts the unit's files again
    wait_for("systemd to start the server again", lambda: main_pid(node) not in (0, before), 60, interval=0.2)
    wait_for("the restarted server to answer", lambda: http_status(node, "/health") == 200, 90, interval=0.2)
    assert "--speculative-num-steps 2 " in running_argv(node), "a crash must start the verified configuration"
    code, _, proc = run("restart", "-e", "sglang_profile=eagle3_5tok_cuda_graph")
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "--speculative-num-steps 3 " in running_argv(node), "the safe restart promotes the pending one"
    assert podman_exec(node, "sh", "-c", "ls /etc/sglang/pending | wc -l").strip() == "0"
    code, _, proc = run("restart")  # back to the group_vars profile
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]


def secret_vars(tmp_path, name: str, values: dict) -> str:
    """-e @FILE: secrets come from a vars file (vaulted in production), never from a command line."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(values))
    path.chmod(0o600)
    return f"@{path}"


def test_a_rotated_secret_survives_a_rollback_and_is_recorded_nowhere(core, tmp_path):
    run, node = core
    old = secret_vars(tmp_path, "old", {"sglang_service_secret_env": {"LAB_TOKEN": "old-token-41"}})
    new = secret_vars(tmp_path, "new", {"sglang_service_secret_env": {"LAB_TOKEN": "new-token-42"}})
    code, doc, proc = run("restart", "-e", old)
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    code, doc, proc = run("restart", "-e", new, "-e", main_with(env={"LAB_STANDIN_FAULT": "crash-startup"}))
    assert code == 5 and row(doc)["result"] == "rolled_back", (proc.stdout + proc.stderr)[-3000:]
    environ = podman_exec(node, "sh", "-c", f"tr '\\0' '\\n' < /proc/{main_pid(node)}/environ")
    assert "LAB_TOKEN=new-token-42" in environ, "the rolled-back server runs with the current secret"
    assert "LAB_STANDIN_FAULT" not in environ
    secrets = "/etc/sglang/secrets/main.env"
    assert podman_exec(node, "stat", "-c", "%U %a", secrets).split() == ["root", "600"]
    found = podman_exec(
        node,
        "sh",
        "-c",
        "grep -rl 'token-4' /var/lib/sglang /etc/systemd/system /etc/sglang/main.env "
        "/etc/sglang/pending 2>/dev/null; true",
    ).split()
    assert found == [], f"a secret outside the secrets file: {found}"
    for text in (run.ledger.read_bytes(), proc.stdout.encode(), proc.stderr.encode()):
        assert b"token-42" not in text and b"token-41" not in text


def test_a_server_with_an_api_key_restarts_verifies_and_refuses_the_unauthenticated(core, tmp_path):
    run, node = core
    key = secret_vars(tmp_path, "key", {"sglang_service_api_key": "lab-api-key-77"})
    code, doc, proc = run("restart", "-e", key)
    assert code == 0 and row(doc)["result"] == "restarted", (proc.stdout + proc.stderr)[-3000:]
    outputs = proc.stdout + proc.stderr
    code, doc, proc = run("verify", "-e", key)
    assert code == 0 and row(doc)["result"] == "verified", (proc.stdout + proc.stderr)[-3000:]
    assert "api-key" not in podman_exec(node, "cat", "/etc/systemd/system/sglang-main.service")
    assert "lab-api-key-77" not in running_argv(node), "never on a command line (ps, /proc/PID/cmdline)"
    assert http_status(node, "/server_info") == 401, "the key is enforced"
    # A crash: the failure carries the journal's tail, where the server logged its server_args with the key.
    code, doc, proc = run("restart", "-e", key, "-e", main_with(env={"LAB_STANDIN_FAULT": "crash-startup"}))
    assert code == 5 and row(doc)["result"] == "rolled_back", (proc.stdout + proc.stderr)[-3000:]
    journal = podman_exec(node, "journalctl", "-u", "sglang-main.service", "--no-pager", "-o", "cat")
    assert "lab-api-key-77" in journal, "the server logged it, as SGLang 0.5.23 does"
    assert "server_args=" in proc.stdout, "the journal tail is in the result"
    outputs += proc.stdout + proc.stderr
    found = podman_exec(
        node,
        "sh",
        "-c",
        "grep -rl 'lab-api-key-77' /var/lib/sglang /etc/systemd/system /etc/sglang/main.env "
        "/etc/sglang/pending 2>/dev/null; true",
    ).split()
    assert found == []
    assert b"lab-api-key-77" not in run.ledger.read_bytes() and "lab-api-key-77" not in outputs
    code, doc, proc = run("restart")  # and without a key again
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]


def test_an_upgrade_whose_server_dies_at_start_rolls_back_to_the_previous_software_generation(core, tmp_path):
    """A new software generation (the shipped patch series plus one that breaks a start-only path of SGLang):
    validation passes, the server dies starting, and the rollback puts back the unit that names the previous
    generation's virtualenv, which is still on the host."""
    run, node = core
    code, doc, proc = run("restart")
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    before = running_argv(node).split()[0]
    series = tmp_path / "series"
    series.mkdir()
    for patch in sorted((REPO / "roles" / "sglang" / "files" / "patches" / "0.5.23").glob("*.patch")):
        (series / patch.name).write_text(patch.read_text())
    broken = REPO / "tests" / "e2e" / "fixtures" / "broken-upgrade" / "0003-lab-upgrade-dies-at-start.patch"
    (series / broken.name).write_text(broken.read_text())
    upgrade = json.dumps({"sglang_patch_series_dir": str(series)})
    code, doc, proc = run("deploy", "-e", upgrade)
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    pending = podman_exec(node, "cat", "/etc/sglang/pending/sglang-main.service")
    exec_start = next(line for line in pending.splitlines() if line.startswith("ExecStart="))
    new_python = exec_start.removeprefix("ExecStart=").split()[0]
    assert new_python != before and new_python.startswith("/opt/ml-env.d/"), "a new generation, its own virtualenv"
    code, doc, proc = run("restart", "-e", upgrade)
    assert code == 5 and row(doc)["result"] == "rolled_back", (proc.stdout + proc.stderr)[-3000:]
    assert "lab upgrade: the server dies at start" in row(doc)["detail"]
    assert running_argv(node).split()[0] == before, "the previous software generation serves again"
    for python in (before, new_python):
        podman_exec(node, "test", "-x", python)  # both generations still on the host
    code, doc, proc = run("verify")
    assert code == 0 and row(doc)["result"] == "verified", (proc.stdout + proc.stderr)[-3000:]
    code, doc, proc = run("deploy")  # the shipped series again: the unit already names its generation
    assert code == 0, (proc.stdout + proc.stderr)[-3000:]
    assert podman_exec(node, "sh", "-c", "ls /etc/sglang/pending | wc -l").strip() == "0"
