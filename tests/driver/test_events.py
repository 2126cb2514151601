"""driver/events.py from structured fields alone: the module a task runs, its role, and the module's
outcome, phases, failure, rollback and lock. The events here carry no task file at all, so nothing
can be read from one; tests/driver/test_replay.py covers the recorded streams of real runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from driver import commands, exitcodes, putback
from driver.events import Tracker

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "driver"
HOLDER = {
    "pid": 4242,
    "command": "python -m driver restart",
    "controller": "ops-laptop",
    "since": "2026-12-01T09:30:00Z",
}


def start(action: str, role: str | None = "sglang_service", host: str = "n1", resolved: bool = True) -> dict:
    """A task starting, as ansible-runner reports it, less the task's file."""
    data = {"host": host, "task": f"run {action}", "task_action": action.rsplit(".", 1)[-1], "role": role}
    if resolved:
        data["resolved_action"] = action
    return {"event": "runner_on_start", "event_data": data}


def item_failed(action: str, res: dict, host: str = "n1") -> dict:
    """One loop item of a task failing, with the module's result."""
    data = {"host": host, "task": f"run {action}", "task_action": action, "resolved_action": action, "res": res}
    return {"event": "runner_item_on_failed", "event_data": data}


def task_failed(action: str, res: dict, host: str = "n1") -> dict:
    data = {"host": host, "task": f"run {action}", "task_action": action, "resolved_action": action, "res": res}
    return {"event": "runner_on_failed", "event_data": data}


def feed(command: str, *events: dict) -> Tracker:
    tracker = Tracker(command)
    for event in events:
        assert "task_path" not in event["event_data"]
        tracker.handle(event)
    return tracker


def phases_seen(command: str, *events: dict) -> list[str]:
    tracker, seen = Tracker(command), []
    for event in events:
        tracker.handle(event)
        phase = tracker.hosts["n1"].phase
        if not seen or seen[-1] != phase:
            seen.append(phase)
    return seen


# ------------------------------------------------------------------ phases


def test_restart_phases_from_modules_and_roles():
    events = [
        start("ansible.builtin.include_role", role=None),
        start("ansible.builtin.validate_argument_spec"),
        start("ansible.builtin.set_fact"),
        start("ansible.builtin.assert"),
        start("sglang_validate"),
        start("ansible.builtin.include_tasks"),
        start("sglang_stage"),
        start("ansible.builtin.systemd_service"),
        start("ansible.builtin.include_role", role=None),
        start("sglang_server"),
        start("ansible.builtin.debug"),
    ]
    assert phases_seen("restart", *events) == ["play", "validate", "configure", "restart"]


def entry(role: str, point: str = "main") -> dict:
    """A role's argument check, as ansible-core names it: a play's role begins with its main entry point's."""
    event = start("ansible.builtin.validate_argument_spec", role=role)
    event["event_data"]["task"] = f"Validating arguments against arg spec '{point}' - the {role} role"
    return event


def ok(action: str, role: str | None, changed: bool = False, host: str = "n1") -> dict:
    data = {"host": host, "task": f"run {action}", "task_action": action, "resolved_action": action, "role": role,
            "res": {"changed": changed}}  # fmt: skip
    return {"event": "runner_on_ok", "event_data": data}


def test_deploy_goes_from_role_to_role_and_names_each_with_its_result():
    """A role's phase begins with its main argument check; inside it the modules' phases (patch, validate,
    configure). cuda's pip install runs ml_env's requirements (their own check included), sglang runs ml_env's
    generation, a cuda handler runs at the play's end: none moves the host back or ahead. The summary names every
    role once, in the order they ran, with what each changed."""
    events = [
        start("ansible.builtin.gather_facts", role=None),
        entry("gpu_node"),
        start("ansible.builtin.apt", role="gpu_node"),
        ok("ansible.builtin.apt", "gpu_node"),
        entry("cuda"),
        start("ansible.builtin.command", role="cuda"),
        ok("ansible.builtin.command", "cuda", changed=True),
        entry("ml_env", "requirements"),  # cuda's include of ml_env's requirements
        start("ansible.builtin.pip", role="ml_env"),
        ok("ansible.builtin.pip", "ml_env", changed=True),
        start("ansible.builtin.file", role="cuda"),
        entry("sglang.deploy.ml_env"),
        start("ansible.builtin.pip", role="sglang.deploy.ml_env"),
        entry("sglang"),
        start("ansible.builtin.pip", role="ml_env"),  # sglang's include of ml_env's generation
        start("sglang_patch", role="sglang"),
        ok("sglang_patch", "sglang", changed=True),
        entry("sglang_service"),
        start("ansible.builtin.template", role="sglang_service"),
        start("sglang_validate", role="sglang_service"),
        start("sglang_stage", role="sglang_service"),
        ok("sglang_stage", "sglang_service", changed=True),
        start("ansible.builtin.systemd_service", role="cuda"),  # a handler, at the end
    ]
    seen = phases_seen("deploy", *events)
    assert seen == [
        "play",
        "node",
        "cuda",
        "ml-env",
        "sglang",
        "patch",
        "service",
        "configure",
        "validate",
        "configure",
    ]
    tracker = feed("deploy", *events)
    assert (
        tracker.rows()[0]["roles"] == "node ok, cuda 1 changed, ml-env 1 changed, sglang 1 changed, service 1 changed"
    )
    assert tracker.result(0)["hosts"]["n1"]["role_results"]["cuda"] == {"changed": 1, "failed": False}
    broke = task_failed("ansible.builtin.command", {"msg": "no"})
    broke["event_data"]["role"] = "cuda"
    failed = feed("deploy", entry("gpu_node"), entry("cuda"), start("ansible.builtin.command", role="cuda"), broke)
    assert failed.rows()[0]["roles"] == "node ok, cuda failed" and failed.hosts["n1"].phase == "cuda"
    restart = feed("restart", start("ansible.builtin.pip", role="cuda"))
    assert restart.rows()[0]["roles"] == "" and "role_results" not in restart.result(0)["hosts"]["n1"]  # deploy's


@pytest.mark.parametrize("command", ["restart", "rollback", "verify", "status"])
def test_the_server_module_runs_the_commands_own_phase(command):
    assert phases_seen(command, start("ansible.builtin.set_fact"), start("sglang_server")) == ["play", command]


def test_phase_from_task_action_alone_or_a_collections_name():
    assert phases_seen("restart", start("validate_argument_spec", resolved=False)) == ["validate"]
    assert phases_seen("restart", start("local.sglang.gpu_state")) == [outcomes.GPUS]


def test_task_names_and_other_fields_do_not_move_the_phase():
    event = start("ansible.builtin.debug")
    event["event_data"]["task"] = "Validating arguments against arg spec 'main'"
    assert phases_seen("restart", start("sglang_server"), event) == ["restart"]


# ------------------------------------------------------------------ exit codes


def test_invalid_config_outcome_exits_3_and_says_why():
    msg = "--tp-size 8 but 4 GPUs (set by sglang_instances[0].gpus)"
    res = {"instance": "main", "outcome": outcomes.INVALID_CONFIG, "msg": msg}
    t = feed("restart", start("sglang_stage"), item_failed("sglang_stage", res))
    assert t.exit_code("failed", 2) == exitcodes.INVALID_CONFIG == 3
    (row,) = t.rows()
    assert row["result"] == outcomes.INVALID_CONFIG and row["detail"].startswith("--tp-size 8 but 4 GPUs")


def test_a_failed_argument_spec_check_exits_3():
    res = {"failed": True, "msg": "Validation of arguments failed", "argument_errors": ["sglang_instances: bad"]}
    check = "ansible.builtin.validate_argument_spec"
    t = feed("restart", start(check), task_failed(check, res))
    assert t.exit_code("failed", 2) == exitcodes.INVALID_CONFIG
    assert t.rows()[0]["phase"] == "validate"


def test_sglang_validate_problems_exit_3_but_a_parser_that_cannot_run_is_no_verdict():
    problem = {"check": "flags", "key": "sglang_server_flags.x", "message": "--x is not a flag of SGLang"}
    refused = feed("validate", item_failed("sglang_validate", {"failed": True, "msg": "--x", "problems": [problem]}))
    assert refused.exit_code("failed", 2) == exitcodes.INVALID_CONFIG
    broken = feed("validate", item_failed("sglang_validate", {"failed": True, "msg": "no python", "problems": []}))
    assert broken.exit_code("failed", 2) == exitcodes.FAILED


def test_a_failure_in_the_validate_phase_is_not_invalid_config_by_itself():
    t = feed("restart", start("sglang_validate"), task_failed("ansible.builtin.assert", {"failed": True, "msg": "no"}))
    assert t.hosts["n1"].phase == "validate" and t.exit_code("failed", 2) == exitcodes.FAILED


def locked_result(**holder) -> dict:
    return {
        "instance": "main",
        "outcome": outcomes.LOCKED,
        "changed": False,
        "phases": [{"phase": outcomes.LOCK, "seconds": 0.001, "ok": False, "detail": "held"}],
        "failure": {"phase": outcomes.LOCK, "cause": "another operation holds the lock"},
        "lock": {"holder": {**HOLDER, **holder}},
        "msg": "main: locked",
    }


def test_locked_exits_with_its_own_code_and_names_the_holder():
    t = feed("restart", start("sglang_server"), item_failed("sglang_server", locked_result()))
    assert t.exit_code("failed", 2) == exitcodes.LOCKED == 9
    (row,) = t.rows()
    assert (row["phase"], row["result"]) == (outcomes.LOCK, outcomes.LOCKED)
    holder = "held by pid 4242 (python -m driver restart) from controller ops-laptop since 2026-12-01T09:30:00Z"
    assert row["detail"] == holder


def test_a_lock_held_since_epoch_seconds_reads_as_utc():
    t = feed("restart", item_failed("sglang_server", locked_result(since=1764581400)))
    assert t.rows()[0]["detail"].endswith("since 2025-12-01T09:30:00Z")


@pytest.mark.parametrize("codes,worst", [([9, 7], 9), ([4, 9], 4), ([9, 3], 9), ([5, 9], 5)])
def test_locked_ranks_between_gpus_not_clean_and_verify_failed(codes, worst):
    assert exitcodes.worst(codes) == worst


def test_every_outcome_a_module_fails_with_has_a_code():
    assert set(exitcodes.OUTCOME_CODES) == outcomes.ALL - outcomes.SUCCESS
    assert len(set(exitcodes.OUTCOME_CODES.values())) == len(exitcodes.OUTCOME_CODES)
    assert exitcodes.OUTCOME_CODES[outcomes.INVALID_CONFIG] == exitcodes.INVALID_CONFIG


def test_help_from_the_repo_root_lists_the_locked_code():
    """`python -m driver` imports the collection's outcomes (ansible_collections.sglang.deploy...) from the repository root, as is."""
    cmd = [sys.executable, "-m", "driver", "--help"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert f"  9  {exitcodes.MEANING[exitcodes.LOCKED]}" in out


def test_readme_lists_every_exit_code():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for code in exitcodes.MEANING:
        assert f"\n| {code} | " in readme, code
    order = ", ".join(str(c) for c in exitcodes.SEVERITY if c != exitcodes.OK)
    assert f"the most serious decides: {order}." in readme


# ------------------------------------------------------------------ the new result fields


def test_rollback_phases_show_as_the_last_phase_reached_and_the_generation_rolled_back_to():
    phases = [{"phase": p, "seconds": 0.1, "ok": p != outcomes.START} for p in outcomes.RESTART_PHASES[:6]]
    phases += [{"phase": outcomes.ROLLBACK_PREFIX + p, "seconds": 0.1, "ok": True} for p in outcomes.ROLLBACK_PHASES]
    verify = {"tokens_per_s": 101.0}
    rollback = {"attempted": True, "outcome": outcomes.ROLLED_BACK, "to_generation": 3, "verify": verify}
    res = {
        "instance": "main",
        "outcome": outcomes.ROLLED_BACK,
        "phases": phases,
        "downtime_s": 7.5,
        "failure": {"phase": outcomes.START, "cause": "RuntimeError: CUDA error"},
        "rollback": rollback,
        "known_good": {"generation": 3, "config_hash": "abc", "software": {"sglang": "0.5.23"}},
    }
    t = feed("restart", start("sglang_server"), item_failed("sglang_server", res))
    assert t.exit_code("failed", 2) == exitcodes.ROLLED_BACK
    (row,) = t.rows()
    assert row["phase"] == "rollback-verify" and row["tokens_per_s"] == 101.0
    assert row["detail"] == "start: RuntimeError: CUDA error -> rollback to generation 3: rolled_back"
    assert t.measurements()[0]["config_hash"] == "abc"


def test_not_recovered_says_why_there_was_no_rollback():
    res = {
        "instance": "main",
        "outcome": outcomes.NOT_RECOVERED,
        "failure": {"phase": outcomes.START, "cause": "OOM"},
        "rollback": {"attempted": False, "why": "no known-good generation"},
    }
    t = feed("restart", item_failed("sglang_server", res))
    assert t.exit_code() == exitcodes.NOT_RECOVERED
    assert t.rows()[0]["detail"] == "start: OOM -> not rolled back: no known-good generation"


def test_a_multinode_phase_whose_errors_are_ignored_is_no_failure_its_last_phase_decides():
    """restart_multinode.yml: rank 1 fails its start (contained there: not_recovered), a soft phase
    (ignore_errors, said only by the task's own end event); the group's rollback then ends rolled_back."""
    contained = {"instance": "mn", "outcome": outcomes.NOT_RECOVERED, "failure": {"phase": "start", "cause": "x"}}
    rolled = {"instance": "mn", "outcome": outcomes.ROLLED_BACK, "rollback": {"to_profile": "p"}}

    def ev(kind: str, res: dict, uuid: str, ignore: bool | None) -> dict:
        data = {"host": "n2", "task": "run", "task_action": "sglang_server", "res": res, "task_uuid": uuid}
        if ignore is not None:
            data["ignore_errors"] = ignore
        return {"event": kind, "event_data": data}

    t = feed(
        "rollout",
        ev("runner_item_on_failed", contained, "start-task", None),
        ev("runner_on_failed", {"results": [contained]}, "start-task", True),
    )
    assert t.exit_code() == exitcodes.OK and t.hosts["n2"].status == "running"  # the soft phase alone: no verdict
    t.handle(ev("runner_item_on_failed", rolled, "confirm-task", None))
    t.handle(ev("runner_on_failed", {"results": [rolled]}, "confirm-task", False))
    assert t.exit_code() == exitcodes.ROLLED_BACK
    assert [r["result"] for r in t.rows()] == [outcomes.ROLLED_BACK]
    # Without the task's end saying so, an item's failure stands (a replica's restart, not soft).
    t2 = feed("restart", ev("runner_item_on_failed", contained, "t", None), ev("runner_on_failed", {}, "t", False))
    assert t2.exit_code() == exitcodes.NOT_RECOVERED


def test_a_result_without_a_loop_is_kept_too():
    res = {"instance": "main", "outcome": outcomes.STAGED}
    ok = {"event": "runner_on_ok", "event_data": {"host": "n1", "task_action": "sglang_stage", "res": res}}
    t = feed("deploy", start("sglang_stage"), ok)
    assert t.rows()[0]["result"] == outcomes.STAGED and t.exit_code("successful", 0) == exitcodes.OK


def test_a_host_failure_after_its_instances_reported_is_not_hidden():
    res = {"instance": "main", "outcome": outcomes.STAGED}
    staged = {"event": "runner_item_on_ok", "event_data": {"host": "n1", "res": res}}
    failed = task_failed("ansible.builtin.systemd_service", {"msg": "no unit"})
    t = feed("deploy", start("sglang_stage"), staged, failed)
    assert t.exit_code("failed", 2) == exitcodes.FAILED
    rows = [(r["instance"], r["result"], r["detail"]) for r in t.rows()]
    assert rows == [("main", outcomes.STAGED, ""), ("", "failed", "no unit")]


# ------------------------------------------------------------------ nothing read from task files


def string_literals(path: Path) -> list[str]:
    """Every string constant in a file, docstrings included."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_the_driver_reads_no_task_file():
    for path in sorted(DRIVER.glob("*.py")):
        assert "task_path" not in path.read_text(encoding="utf-8"), path.name


def test_the_only_yml_literals_are_what_the_driver_hands_to_ansible():
    handed = {playbook for playbook, _ in commands.PLAYBOOKS.values()} | {
        commands.TUNE_PLAYBOOK,
        commands.DRIFT_PLAYBOOK,
        putback.PLAYBOOK,
        "hosts.yml",
    }  # hosts.yml: runner.py's default inventory
    # Read, never tasks: the roles' declared arguments, for the variables declared no_log (driver/redact.py).
    declared = "roles/*/meta/argument_specs.yml"
    for path in sorted(DRIVER.glob("*.py")):
        named = [
            s for s in string_literals(path) if ".yml" in s.replace(declared, "").replace("argument_specs.yml", "")
        ]
        stray = [s for s in named if s not in handed and "inventory/lab/hosts.yml" not in s]  # that one: --help
        assert not stray, f"{path.name}: {stray}"
