"""plugins/modules/sglang_server.py's `stopped_processes`: every process a restart's GPU waits stopped (its own and its
rollback's), gathered from the phases that stopped them, so the driver can name whose processes a restart killed.

The state machine is replaced by a fake (the module's prelude) that returns a result as restart.restart does: what
is tested is the module's result field, not the wait (test_gpu_state.py, test_restart_machine.py)."""

from __future__ import annotations

import json

from support.modules import instance_record, run_module

STRAY = {"pid": 71, "user": "sglang", "unit": None, "gpus": [1], "command": "python stray.py", "how": "SIGTERM"}
OTHER = {"pid": 72, "user": "sglang", "unit": "sglang-main.service", "gpus": [0], "command": "python", "how": "SIGKILL"}
RESULT = {
    "changed": True,
    "instance": "m",
    "outcome": "rolled_back",
    "msg": "m: verify failed",
    "phases": [
        {"phase": "preflight", "ok": True, "detail": {"processes": 0}},
        {"phase": "gpus", "ok": True, "detail": {"stopped": {"71": "SIGTERM"}, "stopped_processes": [STRAY]}},
        {"phase": "verify", "ok": False, "detail": "accept_length: 1.0"},
    ],
    "rollback": {
        "phases": [{"phase": "rollback-gpus", "ok": True, "detail": {"stopped_processes": [OTHER]}}],
    },
}


def fake_action(name: str, result: dict) -> str:
    """run_module's prelude: the state machine's `name` returns `result` (before the module imports it): restart is
    restart.py's, rollback and verify operate.py's."""
    where = "restart" if name == "restart" else "operate"
    return f"import ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.{where} as r, json; r.{name} = lambda m: json.loads({json.dumps(result)!r})"


def test_a_restart_lists_every_process_its_gpu_waits_stopped_with_the_phase_that_stopped_it(tmp_path):
    args = {"action": "restart", "instance": instance_record(tmp_path), "state_dir": str(tmp_path / "state")}
    rc, out = run_module("sglang_server", args, tmp_path, prelude=fake_action("restart", RESULT))
    assert rc == 1 and out["outcome"] == "rolled_back"  # a rollback fails the task; its result is whole
    assert out["stopped_processes"] == [{**STRAY, "phase": "gpus"}, {**OTHER, "phase": "rollback-gpus"}]


def test_a_restart_that_stopped_nothing_says_so_and_verify_has_no_such_field(tmp_path):
    refused = {"changed": False, "instance": "m", "outcome": "gpus_not_clean", "msg": "m: refused", "phases": []}
    args = {"action": "restart", "instance": instance_record(tmp_path), "state_dir": str(tmp_path / "state")}
    rc, out = run_module("sglang_server", args, tmp_path, prelude=fake_action("restart", refused))
    assert rc == 1 and out["stopped_processes"] == []
    verified = {"changed": False, "instance": "m", "outcome": "verified", "msg": "m: verified"}
    rc, out = run_module(
        "sglang_server", {**args, "action": "verify"}, tmp_path, prelude=fake_action("verify", verified)
    )
    assert rc == 0 and "stopped_processes" not in out
