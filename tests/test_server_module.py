"""plugins/modules/sglang_server.py as Ansible runs it: its arguments, each action's result, and which outcomes fail the task.

The state machine itself (plugins/module_utils/sglang_deploy/restart.py) is tested in test_restart_machine.py against
in-process fakes; here the module runs in its own process against stand-ins on this machine: systemctl on
PATH (its `show` naming a real process whose command line is the instance's argv), the lab's simulated
nvidia-smi (nvsim), and SGLang's HTTP API served on the instance's loopback port. The instance lock lies under
tmp_path (the runner's prelude moves it there).
"""

from __future__ import annotations

import json
import os
import sys
from base64 import b64encode
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import InstanceLock
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import MASK
from support import started
from support.gpus import simulated
from support.modules import http_server, instance_record, run_module, systemctl_shim

KEY = "server-key-never-shown"
GENERATED = {"text": " Paris, the capital of France."}  # what /generate answers (a test may change it)


def sglang_api(method, path, body, headers):
    """SGLang's HTTP API, as far as status and verify read it (no speculative decoding)."""
    if headers.get("Authorization") != f"Bearer {KEY}":
        return 401, {"error": "Unauthorized"}
    if path in ("/health", "/health_generate"):
        return 200, ""
    if path == "/server_info":
        return 200, {"speculative_algorithm": None}
    if path == "/generate":
        n = body["sampling_params"]["max_new_tokens"]
        return 200, {"text": GENERATED["text"], "meta_info": {"completion_tokens": n}}
    return 404, {}


@pytest.fixture
def node(tmp_path):
    """A host with the instance `m` running: (record, environment, lock dir, systemctl log, SGLang's requests)."""
    _, env = simulated(tmp_path)  # tmp_path/bin/nvidia-smi over 4 simulated GPUs
    with http_server(sglang_api) as (base, seen):
        port = int(base.rsplit(":", 1)[1])
        argv = [sys.executable, "-c", "import time; time.sleep(120)", "--port", str(port)]
        proc = started(argv)  # the unit's main process: its /proc cmdline is the instance's argv
        try:
            record = instance_record(tmp_path, port=port, argv=argv)
            secrets = Path(record["secrets_path"])
            secrets.parent.mkdir(parents=True)
            secrets.write_text(f'SGLANG_API_KEY="{KEY}"\n')
            log = tmp_path / "systemctl.log"
            props = {"ActiveState": "active", "SubState": "running", "MainPID": proc.pid, "NRestarts": 0}
            systemctl_shim(tmp_path / "bin", {**props, "UnitFileState": "enabled"}, log)
            yield record, env, tmp_path / "locks", log, seen
        finally:
            proc.kill()
            proc.wait()


def prelude(lock_dir: Path) -> str:
    """The state machine's ports as on a host, but for the lock directory."""
    return (
        "import ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine as r; _ports = r.Ports; "
        f"r.Ports = lambda: _ports(lock_dir={str(lock_dir)!r})"
    )


def server_module(tmp_path, node, check_mode=False, **args) -> tuple[int, dict]:
    record, env, locks, _, _ = node
    args = {"instance": record, "state_dir": str(tmp_path / "state"), "evidence": False, **args}
    return run_module("sglang_server", args, tmp_path, env=env, check_mode=check_mode, prelude=prelude(locks))


def test_status_reports_the_running_instance_and_never_its_key(tmp_path, node):
    rc, out = server_module(tmp_path, node, action="status")
    assert rc == 0 and out["outcome"] == outcomes.STATUS and out["changed"] is False, out
    assert out["errors"] == [] and out["msg"] == "m: active/running, profile default"
    assert out["state"] == "active/running" and out["running_profile"] == "default" and out["drift"] is False
    assert out["enabled"] == "enabled" and out["health"] is True and out["accept_length"] is None
    assert set(out["gpu_memory_mib"]) == {"0", "1"}  # the instance's GPUs (JSON keys are strings)
    assert out["known_good"] is None and out["pending"] is False and out["lock"] is None
    assert KEY not in str(out)


def test_verify_of_a_healthy_instance_succeeds(tmp_path, node):
    *_, seen = node
    rc, out = server_module(tmp_path, node, action="verify", load_requests=2, load_max_new_tokens=8)
    assert rc == 0 and out["outcome"] == outcomes.VERIFIED and out["msg"] == "m: verified", out
    v = out["verify"]
    assert v["ok"] is True and v["failed_checks"] == [] and v["tokens_per_s"] > 0
    assert [c["name"] for c in v["checks"]] == [
        "unit",
        "drift",
        "gpu_processes",
        "health_generate",
        "generate",
        "patches",
    ]
    assert seen.count(("POST", "/generate")) == 3  # the generation, then the load of 2


def test_every_value_of_the_secrets_file_is_stripped_from_whatever_the_module_returns(tmp_path, node, monkeypatch):
    """docs/restart.md: sglang_server strips every value of the secrets file from what it returns (SGLang logs its
    server_args, the API key included, and a failure carries a journal tail). Here the server's own words carry
    the key: the generated text, which verify's generate check quotes."""
    monkeypatch.setitem(GENERATED, "text", f" the key is {KEY}.")
    rc, out = server_module(tmp_path, node, action="verify", load_requests=0)
    assert rc == 0 and out["outcome"] == outcomes.VERIFIED, out
    [generate] = [c for c in out["verify"]["checks"] if c["name"] == "generate"]
    assert generate["detail"] == f"16 tokens: ' the key is {MASK}.'", "the key was there, and is stripped"
    assert KEY not in json.dumps(out)


def test_a_rotated_key_the_call_stages_is_stripped_too(tmp_path, node, monkeypatch):
    """The secrets file on the host still holds the old key; this run's secrets_content the new one, which the
    restart stages and SGLang then logs. Ansible would mask only the whole secrets_content text: the module strips
    each of its values."""
    new = "sk-rotated-key-never-shown-2"
    monkeypatch.setitem(GENERATED, "text", f" the new key is {new}.")
    rc, out = server_module(
        tmp_path, node, action="verify", load_requests=0, secrets_content=f'SGLANG_API_KEY="{new}"\n'
    )
    assert rc == 0 and out["outcome"] == outcomes.VERIFIED, out
    assert new not in json.dumps(out) and f"the new key is {MASK}." in json.dumps(out)


def test_a_secret_is_stripped_in_every_form_the_result_carries_it(tmp_path, node, monkeypatch):
    """#30: Ansible's no_log looks for the literal value only; SGLang logs its server_args as a repr (a backslash
    doubled) and verify quotes the server's words as a repr again: the value is stripped in every form (the one
    secret rule's, sglang_deploy.secret_rule), the one mask in its place."""
    new = 'Zq9\\r"t$d%.*+'
    # verify quotes the first 60 characters: three forms fit (a secret cut short there could not be matched)
    said = f"{new!r} {json.dumps(new)} {b64encode(new.encode()).decode()}"
    monkeypatch.setitem(GENERATED, "text", said)
    line = 'SGLANG_API_KEY="' + new.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"\n'
    rc, out = server_module(tmp_path, node, action="verify", load_requests=0, secrets_content=line)
    assert rc == 0 and out["outcome"] == outcomes.VERIFIED, out
    [generate] = [c for c in out["verify"]["checks"] if c["name"] == "generate"]
    assert generate["detail"].count(MASK) == 3, generate["detail"]
    assert "Zq9" not in json.dumps(out) and b64encode(new.encode()).decode() not in json.dumps(out)


def test_a_failed_verification_fails_the_task_with_the_failed_checks(tmp_path, node):
    log = node[3]
    systemctl_shim(log.parent / "bin", {"ActiveState": "active", "SubState": "running", "MainPID": 0}, log)
    rc, out = server_module(tmp_path, node, action="verify", load_requests=0)
    assert rc == 1 and out["failed"] is True and out["outcome"] == outcomes.VERIFY_FAILED
    assert (
        out["failure"]["phase"] == outcomes.VERIFY and "drift: running command line differs" in out["failure"]["cause"]
    )
    assert out["msg"].startswith("m: verification failed: drift:") and "evidence" not in out


def test_restart_in_check_mode_runs_the_refusals_only(tmp_path, node):
    record, _, locks, log, seen = node
    for path, text in ((record["unit_path"], "[Service]\n"), (record["env_path"], "A=1\n")):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    rc, out = server_module(tmp_path, node, check_mode=True, action="restart")
    assert rc == 0 and out["outcome"] == outcomes.WOULD_RESTART and out["changed"] is False, out
    assert [p["phase"] for p in out["phases"]] == [outcomes.LOCK, outcomes.VALIDATE, outcomes.STAGE, outcomes.PREFLIGHT]
    assert all(p["ok"] for p in out["phases"]) and out["msg"] == "m: would_restart (check mode)"
    assert (locks / "m.lock").read_text() == "", "the lock was taken and released"
    assert not log.exists() and seen == [], "no systemctl call, no request to the server"


def test_restart_while_another_operation_holds_the_lock_is_refused(tmp_path, node):
    locks = node[2]
    with InstanceLock("m", "rollback m (profile default)", "other", "driver rollback", str(locks)):
        rc, out = server_module(tmp_path, node, action="restart")
    assert rc == 1 and out["outcome"] == outcomes.LOCKED and out["changed"] is False
    assert out["lock"]["holder"]["operation"] == "rollback m (profile default)"
    assert out["failure"]["phase"] == outcomes.LOCK


def test_rollback_of_an_instance_spanning_nodes_is_refused(tmp_path, node):
    record = node[0]
    rc, out = server_module(tmp_path, node, action="rollback", instance={**record, "nnodes": 2})
    assert rc == 1 and out["outcome"] == outcomes.REFUSED and out["failure"]["phase"] == outcomes.RESTORE
    assert "m spans 2 nodes" in out["failure"]["cause"] and out["msg"].startswith("m: restore failed: m spans 2 nodes")


def test_rollback_without_a_known_good_generation_is_refused_having_touched_nothing(tmp_path, node):
    _, _, _, log, _ = node
    rc, out = server_module(tmp_path, node, action="rollback")
    assert rc == 1 and out["outcome"] == outcomes.REFUSED and out["changed"] is False
    assert "no known-good generation of m is recorded" in out["failure"]["cause"]
    assert not log.exists() or "stop" not in log.read_text()


def test_arguments_refused_before_anything_runs(tmp_path, node):
    record = node[0]
    rc, out = server_module(tmp_path, node, action="status", gpu_interval=0.5)
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG
    assert out["msg"] == "gpu_interval is 0.5: poll at least every 0.25 s"
    rc, out = server_module(tmp_path, node, action="status", instance={**record, "name": "M/x"})
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG
    assert out["msg"].startswith("instance: not a rendered instance record")
    rc, out = server_module(tmp_path, node, action="reboot")
    assert rc == 1 and "action" in out["msg"] and "outcome" not in out


def test_a_benchmark_that_cannot_run_is_refused_before_the_restart_and_none_runs_in_check_mode(tmp_path, node):
    """bench (autotune's, run by the restart under its lock): a load that cannot run is refused naming it, before
    the lock or anything else; in check mode the refusals run and nothing is measured."""
    record, _, locks, log, seen = node
    rc, out = server_module(tmp_path, node, action="restart", bench={"requests": 0})
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG, out
    assert out["msg"] == (
        "bench: concurrency levels, requests, max_new_tokens and repeat must be at least 1, warmup at least 0, timeout "
        "above 0 (concurrency [1], requests 0, max_new_tokens 64, warmup 2, timeout 120.0, repeat 1): nothing was "
        "restarted"
    )
    assert not (locks / "m.lock").exists() and not log.exists() and seen == []
    rc, out = server_module(tmp_path, node, action="restart", bench={}, phase="start")
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG, out
    assert out["msg"] == (
        "bench: not in a multi-node restart's phase start (one node's restart only): nothing was restarted"
    )
    assert not log.exists() and seen == []
    for path, text in ((record["unit_path"], "[Service]\n"), (record["env_path"], "A=1\n")):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    rc, out = server_module(tmp_path, node, check_mode=True, action="restart", bench={"requests": 2})
    assert rc == 0 and out["outcome"] == outcomes.WOULD_RESTART and "bench" not in out, out
    assert not log.exists() and seen == []


def test_a_restart_stages_the_rendered_configuration_given_to_it(tmp_path, node):
    """unit_content and env_content: the restart stages them under its lock (here in check mode: nothing written)."""
    record = node[0]
    rc, out = server_module(
        tmp_path,
        node,
        check_mode=True,
        action="restart",
        unit_content="[Service]\n",
        env_content="A=1\n",
        secrets_content=f'SGLANG_API_KEY="{KEY}"\n',
    )
    # Nothing is on disk yet and check mode writes nothing: the preflight cannot read the configuration to start.
    assert rc == 1 and out["outcome"] == outcomes.REFUSED, out
    stage = next(p for p in out["phases"] if p["phase"] == outcomes.STAGE)
    assert stage["ok"] is True and stage["detail"]["outcome"] == outcomes.STAGED
    assert stage["detail"]["wrote"] == sorted([record["unit_path"], record["env_path"]])
    assert not os.path.exists(record["unit_path"]) and KEY not in str(out)


def test_a_multinode_phase_is_refused_while_another_runs_group_lease_is_valid_and_let_in_with_its_token(tmp_path, node):
    """group_token and group_lease_s reach the state machine: another run's lease on the node (a multi-node restart
    between two of its phases) refuses this one, locked, naming it; the same run's token is let in (check mode here:
    the refusals only, the lease read and left as it is)."""
    import time

    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import lock

    record, _, locks, log, _ = node
    for path, text in ((record["unit_path"], "[Service]\n"), (record["env_path"], "A=1\n")):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    locks.mkdir(mode=0o700)
    lease = {"token": "mn-run-1", "operation": "restart m (profile default)", "controller": "ctl-b", "command": "x"}
    lock.write_atomic(
        str(locks / "m.lease"), json.dumps({**lease, "since": "-", "expires": time.time() + 600}).encode()
    )
    mn = {**record, "nnodes": 2}
    rc, out = server_module(tmp_path, node, action="restart", instance=mn, phase="stop", group_token="mn-run-2")
    assert rc == 1 and out["outcome"] == outcomes.LOCKED and out["changed"] is False, out
    assert "a multi-node restart's group lease (run mn-run-1" in out["msg"]
    assert out["lock"]["holder"]["group_lease"]["token"] == "mn-run-1"
    rc, out = server_module(tmp_path, node, action="restart")  # a single restart, no token
    assert rc == 1 and out["outcome"] == outcomes.LOCKED, out
    rc, out = server_module(
        tmp_path, node, check_mode=True, action="restart", instance=mn, phase="start", group_token="mn-run-1"
    )
    assert rc == 0 and out["outcome"] == outcomes.WOULD_RESTART, out
    assert json.loads((locks / "m.lease").read_text())["controller"] == "ctl-b" and not log.exists()
