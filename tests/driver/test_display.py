"""driver/display.py beyond the replayed streams (test_replay.py, test_output.py): the live progress on a terminal,
the instance whose restart was never begun, the journal tail of a failure without a traceback, a failed host
without instances, Ansible's own words when no task says why, and the summary as an SVG picture."""

from __future__ import annotations

import io
import sys

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from driver import display, exitcodes
from driver.events import NOT_BEGUN, WAITS, Tracker


def event(kind: str, host: str | None = None, module: str = "", created: str = "2026-01-01T00:00:00", **data):
    """An ansible-runner event as the driver receives it."""
    event_data = {**({"host": host} if host else {}), "resolved_action": module, **data}
    return {"event": kind, "event_data": event_data, "created": created}


def fed(command: str, *events: dict) -> Tracker:
    tracker = Tracker(command)
    for e in events:
        tracker.handle(e)
    return tracker


def text_of(renderable, width: int = 200) -> str:
    from rich.console import Console

    c = Console(file=io.StringIO(), width=width, color_system=None)
    c.print(renderable)
    return c.file.getvalue()


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")


def test_on_a_terminal_progress_is_live_and_says_messages_above_it(capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    tracker = fed(
        "restart",
        event("runner_on_start", "node-a", "sglang_deploy.sglang_server", task="Run the action on each instance"),
        event("runner_on_start", "node-b", "ansible.builtin.template", role="sglang_service", task="Write the unit"),
    )
    progress = display.Progress(tracker)
    assert progress.live is not None
    with progress:
        progress.update()
        progress.say("Ctrl-C: finishing the restarts in progress")
        rows = text_of(progress.render())
    assert "Ctrl-C: finishing the restarts in progress" in capsys.readouterr().err
    assert f"Run the action on each instance: {WAITS['restart']}" in rows
    assert "node-b" in rows and "configure" in rows and "Write the unit" in rows


def test_elsewhere_progress_prints_one_line_per_phase_change_and_quiet_prints_none(capsys):
    tracker = fed("verify", event("runner_on_start", "node-a", "sglang_server", task="Verify"))
    progress = display.Progress(tracker)
    assert progress.live is None
    with progress:
        progress.update()
        progress.update()  # no change: no second line
        progress.say("a message")
    err = capsys.readouterr().err
    assert err.count("node-a: verify running") == 1 and f"(waiting for: {WAITS['verify']})" in err
    assert err.endswith("\na message\n")
    quiet = display.Progress(tracker, quiet=True)
    quiet.update()
    assert capsys.readouterr().err == ""


def test_status_shows_an_instance_never_begun(capsys, wide):
    skipped = {"skip_reason": "Conditional result was False", "item": {"name": "main", "profile": "p"}}
    tracker = fed(
        "status",
        event("runner_item_on_skipped", "node-a", "sglang_server", res=skipped),
        event("playbook_on_stats"),
    )
    assert tracker.hosts["node-a"].instances["main"]["outcome"] == NOT_BEGUN
    display.summary(tracker, exitcodes.INTERRUPTED, run_id=4)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "main" in line)
    assert NOT_BEGUN in line and "active" not in line
    assert "run 4 recorded in the ledger" in out


def test_a_failure_without_a_traceback_shows_its_journal_tail(capsys, wide):
    res = {
        "instance": "main",
        "outcome": outcomes.NOT_RECOVERED,
        "failure": {"phase": "start", "cause": "exited", "journal_tail": [f"journal line {i}" for i in range(12)]},
        "phases": [{"phase": "start", "ok": False}],
    }
    tracker = fed("restart", event("runner_item_on_failed", "node-a", "sglang_server", task="Run", res=res))
    display.summary(tracker, tracker.exit_code(), run_id=None)
    out = capsys.readouterr().out
    assert "node-a/main: journal tail (start):" in out
    assert "journal line 11" in out and "journal line 4" in out and "journal line 3" not in out  # the last 8


def test_a_failed_host_without_instances_says_its_task_and_message(capsys, wide):
    res = {"msg": "Timeout (12s) waiting for privilege escalation prompt"}
    tracker = fed(
        "deploy", event("runner_on_failed", "node-a", "ansible.builtin.setup", task="Gathering Facts", res=res)
    )
    assert tracker.exit_code() == exitcodes.FAILED
    display.summary(tracker, exitcodes.FAILED, run_id=None)
    out = capsys.readouterr().out
    assert "node-a: Gathering Facts: Timeout (12s) waiting for privilege escalation prompt" in out
    assert "Ansible said:" not in out


def test_a_failed_run_no_task_explains_shows_what_ansible_said(capsys, wide):
    tracker = fed(
        "deploy",
        {"event": "verbose", "stdout": "ERROR! the role 'sglang_servic' was not found"},
        {"event": "verbose", "stdout": "Sunday 01 March 2026  10:00:00 +0000 (0:00:00.010)"},  # the task timer
    )
    code = tracker.exit_code(runner_status="failed", rc=1)
    assert code == exitcodes.FAILED
    display.summary(tracker, code, run_id=None)
    out = capsys.readouterr().out
    assert "Ansible said:\nERROR! the role 'sglang_servic' was not found" in out and "Sunday" not in out
    display.summary(tracker, exitcodes.OK, run_id=None)
    assert "Ansible said:" not in capsys.readouterr().out


def test_the_summary_is_saved_as_an_svg_picture(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    res = {"instance": "main", "outcome": outcomes.RESTARTED, "downtime_s": 3.5, "verify": {"tokens_per_s": 91.5}}
    tracker = fed("restart", event("runner_on_ok", "node-a", "sglang_server", res=res), event("playbook_on_stats"))
    svg = tmp_path / "summary.svg"
    display.summary(tracker, exitcodes.OK, run_id=2, svg=str(svg))
    picture = svg.read_text().replace("&#160;", " ")  # rich writes each space as a non-breaking one
    assert picture.startswith("<svg") and "python -m driver restart" in picture
    assert "node-a" in picture and "restarted" in picture and "91.5" in picture
    assert "restarted" in capsys.readouterr().out


def test_a_playbooks_own_report_is_shown_under_the_summary_and_kept_in_json(capsys):
    """The rollout's account of every replica (a fact, never a task name) reaches the operator and --json."""
    from driver.events import REPORT_FACT

    tracker = Tracker("rollout")
    lines = ["lab-node1/ro: restarted, router: in, healthy", "lab-node2/ro: not_begun (interrupted), router: in"]
    data = {"host": "r", "task": "t", "res": {"ansible_facts": {REPORT_FACT: lines}}}
    tracker.handle({"event": "runner_on_ok", "event_data": data})
    display.summary(tracker, exitcodes.INTERRUPTED, run_id=3)
    out = capsys.readouterr().out
    assert all(line in out for line in lines)
    assert tracker.result(exitcodes.INTERRUPTED)["report"] == lines


def test_status_prints_each_restart_worker_the_host_holds_with_its_journal(capsys, wide):
    res = {
        "instance": "main",
        "outcome": outcomes.STATUS,
        "state": "active/running",
        "jobs": [
            {"job": "/run/sglang-deploy/jobs/main-1-2", "state": "running", "pid": 2, "phase": "start",
             "step": "loading weights", "unit": "sglang-deploy-job-main-1-2.scope", "journal": ["phase start"]},
            {"job": "/run/sglang-deploy/jobs/main-0-9", "state": "ended", "pid": 9, "unit": None, "phase": "verify",
             "step": None, "outcome": "rolled_back", "msg": "main: rolled back", "journal": []},
        ],
    }  # fmt: skip
    tracker = fed("status", event("runner_item_on_ok", "node-a", "sglang_server", res=res), event("playbook_on_stats"))
    display.summary(tracker, 0, run_id=None)
    out = capsys.readouterr().out
    assert "node-a/main: a restart's worker runs in sglang-deploy-job-main-1-2.scope: start, loading weights" in out
    assert "\n    phase start\n" in out
    assert (
        "node-a/main: a restart's worker ended (pid 9), its result never collected: rolled_back: main: rolled back"
        in out
    )


def test_status_shows_what_every_gateway_thinks_of_each_instance_and_keeps_it_in_json(capsys, wide):
    """playbooks/status.yml's view (a fact): one row per instance and gateway, a gateway down or a worker not
    listed said as such, and --json's "gateways" the rows as read."""
    from driver.events import VIEW_FACT

    rows = [
        {"host": "n1", "instance": "ro", "gateway": "gw-a", "worker": "http://n1:30010", "listed": True,
         "healthy": True, "status": None, "in_flight": None, "circuit": "closed", "why": ""},
        {"host": "n1", "instance": "ro", "gateway": "gw-b", "worker": "http://n1:30010", "listed": True,
         "healthy": False, "status": "draining", "in_flight": 2.0, "circuit": "open", "why": ""},
        {"host": "n2", "instance": "ro", "gateway": "gw-a", "worker": "http://n2:30010", "listed": False,
         "healthy": None, "status": None, "in_flight": None, "circuit": None, "why": ""},
        {"host": "n2", "instance": "ro", "gateway": "gw-c", "worker": "http://n2:30010", "listed": None,
         "healthy": None, "status": None, "in_flight": None, "circuit": None,
         "why": "the gateway did not answer: connection refused"},
    ]  # fmt: skip
    tracker = Tracker("status")
    data = {"host": "n1", "task": "t", "res": {"ansible_facts": {VIEW_FACT: rows}}}
    tracker.handle({"event": "runner_on_ok", "event_data": data})
    display.summary(tracker, exitcodes.OK, run_id=None)
    out = capsys.readouterr().out
    table = out[out.index("what every gateway thinks") :]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if line.count("│") == 9]
    assert cells == [
        ["n1", "ro", "gw-a", "yes", "ok", "-", "closed", ""],
        ["n1", "ro", "gw-b", "yes", "unhealthy (draining)", "2", "open", ""],
        ["n2", "ro", "gw-a", "NOT LISTED", "-", "-", "-", ""],
        ["n2", "ro", "gw-c", "-", "-", "-", "-", "the gateway did not answer: connection refused"],
    ]
    assert tracker.result(exitcodes.OK)["gateways"] == rows


def test_status_without_gateways_shows_no_gateway_table(capsys, wide):
    tracker = Tracker("status")
    display.summary(tracker, exitcodes.OK, run_id=None)
    assert "what every gateway thinks" not in capsys.readouterr().out
    assert tracker.result(exitcodes.OK)["gateways"] == []


def test_each_column_of_the_summary_has_one_number_format():
    assert [display.number(v, 1) for v in (4.291, 4.4, 12.0, None)] == ["4.3", "4.4", "12.0", "-"]
    assert display.number(2.5, 2) == "2.50"


def test_a_deploys_current_host_says_so_and_a_drifted_one_exits_10_naming_what_moved():
    """Issue #36: deploy's host ended by its state check ran no role; status --drift's drifted host is "drifted"."""
    current = {"changed": False, "current": True, "why": [], "outcome": "current", "msg": "current"}
    deploy = fed(
        "deploy",
        event("runner_on_start", "node-a", "sglang.deploy.sglang_state"),
        event("runner_on_ok", "node-a", "sglang.deploy.sglang_state", res=current),
        event("runner_on_start", "node-b", "sglang.deploy.sglang_state"),
        event("runner_on_ok", "node-b", "sglang.deploy.sglang_state", res={**current, "current": False, "why": ["x"]}),
        event("runner_on_start", "node-b", "validate_argument_spec", role="sglang.deploy.gpu_node",
              task="Validating arguments against arg spec 'main' - Base"),
        event("runner_on_ok", "node-b", "validate_argument_spec", role="sglang.deploy.gpu_node", res={}),
        event("playbook_on_stats"),
    )  # fmt: skip
    rows = {r["host"]: r for r in deploy.rows()}
    assert rows["node-a"]["roles"] == "none: current (as its last complete deploy left it)"
    assert rows["node-b"]["roles"] == "node ok" and rows["node-a"]["result"] == "ok"
    drifted = {**current, "current": False, "why": ["/etc/sglang changed since the deploy"], "outcome": "drifted",
               "msg": "drifted: /etc/sglang changed since the deploy", "failed": True}  # fmt: skip
    drift = fed(
        "drift",
        event("runner_on_start", "node-a", "sglang.deploy.sglang_state"),
        event("runner_on_ok", "node-a", "sglang.deploy.sglang_state", res=current),
        event("runner_on_start", "node-b", "sglang.deploy.sglang_state"),
        event("runner_on_failed", "node-b", "sglang.deploy.sglang_state", res=drifted),
        event("playbook_on_stats"),
    )
    rows = {r["host"]: r for r in drift.rows()}
    assert rows["node-a"]["result"] == "ok" and rows["node-a"]["phase"] == "state"
    assert rows["node-b"]["result"] == "drifted"
    assert rows["node-b"]["detail"] == "drifted: /etc/sglang changed since the deploy"
    assert drift.exit_code("failed", 2, False) == 10
