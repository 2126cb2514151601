"""Ctrl-C (driver/interrupts.py, driver/cli.py): the first stops every restart not yet begun and lets the
playbook finish; the second abandons the run; never a traceback; the ledger row always says 130."""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import secret_rule
from driver import cli, commands, exitcodes, interrupts, putback, runner
from driver.events import NOT_BEGUN, Tracker
from support import wait_for


@pytest.fixture
def one_host(tmp_path, monkeypatch):
    """An inventory the check accepts (the playbook itself is faked by each test)."""
    path = tmp_path / "hosts.yml"
    path.write_text("all:\n  children:\n    sglang_nodes:\n      hosts:\n        n1: {ansible_connection: local}\n")
    return path


@pytest.fixture
def one_replica(tmp_path):
    """One replica host (the group the rollout's plays run on)."""
    path = tmp_path / "replicas.yml"
    path.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n        n1: {ansible_connection: local}\n"
        "    sglang_replicas:\n      hosts:\n        n1:\n"
    )
    return path


def server_start() -> dict:
    data = {"host": "n1", "task": "Run the action on each instance", "resolved_action": "sglang_server"}
    return {"event": "runner_on_start", "event_data": {**data, "task_action": "sglang_server"}}


def server_item(kind: str, res: dict) -> dict:
    data = {"host": "n1", "task": "Run the action on each instance", "resolved_action": "sglang_server", "res": res}
    return {"event": kind, "event_data": {**data, "task_action": "sglang_server"}}


A_RESTARTED = server_item("runner_item_on_ok", {"instance": "a", "outcome": "restarted", "downtime_s": 4.2})
B_SKIPPED = server_item(
    "runner_item_on_skipped",
    {
        "skipped": True,
        "skip_reason": "Conditional result was False",
        "false_condition": "sglang_service_cancel_file is not exists",
        "ansible_loop_var": "__sglang_service_i",
        "__sglang_service_i": {"name": "b", "profile": "eagle3_topk1", "port": 30001},
    },
)
STATS = {"event": "playbook_on_stats", "event_data": {"ok": {"n1": 3}}}


class FakePlaybook:
    """Stands in for runner.run: feeds events and sends this process SIGINTs where a test says, noting what
    the driver answered at each point (the cancel file, cancelled())."""

    def __init__(self, script):
        self.script = script
        self.seen: dict = {}

    def __call__(self, job, on_event, cancelled, record=None):
        cancel = Path(job.env["SGLANG_DEPLOY_CANCEL_FILE"])
        self.seen["cancel_file"] = cancel
        self.seen["env"] = job.env
        for step in self.script:
            if step in ("SIGINT", "SIGTERM"):
                os.kill(os.getpid(), getattr(signal, step))
                self.seen.setdefault("after", []).append((cancel.exists(), cancelled()))
            elif step == "KeyboardInterrupt":
                raise KeyboardInterrupt
            else:
                on_event(step)
        return runner.Outcome("canceled" if cancelled() else "successful", 254 if cancelled() else 0)


def drive(
    monkeypatch, capsys, inv: Path, script, *args: str, command: str = "restart"
) -> tuple[int, FakePlaybook, str, str]:
    fake = FakePlaybook(script)
    monkeypatch.setattr("driver.runner.run", fake)
    code = cli.main([command, "-i", str(inv), *args])
    out, err = capsys.readouterr()
    return code, fake, out, err


def test_first_ctrl_c_creates_the_cancel_file_and_lets_the_playbook_finish(
    one_host, ledger_path, ledger_rows, monkeypatch, capsys
):
    script = [server_start(), "SIGINT", A_RESTARTED, B_SKIPPED, STATS]
    code, fake, out, err = drive(monkeypatch, capsys, one_host, script, "--json")
    assert fake.seen["after"] == [(True, False)], "the file exists at once; the runner is not cancelled"
    assert fake.seen["cancel_file"].parent == ledger_path.parent / "runs" / "1", "in the run's private directory"
    assert code == exitcodes.INTERRUPTED == 130
    assert interrupts.FIRST in err and "Traceback" not in err
    doc = json.loads(out)
    assert {r["instance"]: r["result"] for r in doc["rows"]} == {"a": "restarted", "b": NOT_BEGUN}
    assert doc["left"] == ["n1: ok (phase restart)", "  n1/a: restarted", f"  n1/b: {NOT_BEGUN}"]
    (row,) = ledger_rows(ledger_path)
    assert row["exit_code"] == 130 and row["outcome"] == "interrupted (Ctrl-C or SIGTERM)"


def test_second_ctrl_c_cancels_the_runner_without_a_traceback_and_records_130(
    one_host, ledger_path, ledger_rows, monkeypatch, capsys
):
    script = [server_start(), "SIGINT", "SIGINT"]
    code, fake, out, err = drive(monkeypatch, capsys, one_host, script)
    assert fake.seen["after"] == [(True, False), (True, True)], "the second Ctrl-C cancels"
    assert code == 130 and "Traceback" not in err
    assert interrupts.FIRST in err and interrupts.SECOND in err
    assert "interrupted during 'Run the action on each instance' (restart)" in err, "what each host was left doing"
    assert "interrupted (Ctrl-C or SIGTERM) (exit 130)" in out
    (row,) = ledger_rows(ledger_path)
    assert row["exit_code"] == 130


def test_a_keyboard_interrupt_raised_inside_the_run_is_no_traceback_and_records_130(
    one_host, ledger_path, ledger_rows, monkeypatch, capsys
):
    code, _, _, err = drive(monkeypatch, capsys, one_host, [server_start(), "KeyboardInterrupt"])
    assert code == 130 and "Traceback" not in err
    (row,) = ledger_rows(ledger_path)
    assert row["exit_code"] == 130 and row["finished_at"]


@pytest.mark.parametrize("command", ["deploy", "verify", "validate", "status"])
def test_a_command_that_restarts_nothing_stops_at_the_first_ctrl_c(command):
    i = interrupts.Interrupts(command)
    assert not i.poll()
    i.handler(signal.SIGINT, None)
    assert i.poll(), "nothing to wait for: cancelled at once"


def test_the_runner_gets_the_cancel_file_its_callback_and_a_short_poll(tmp_path, monkeypatch):
    """runner.run hands ansible-runner the cancel file's path in the environment, the cancel callback, and a
    settings file that makes it ask the callback twice a second; the recorded stream is 0600 and scrubbed."""
    calls = {}

    def fake_run(**kwargs):
        calls.update(kwargs)
        private = Path(kwargs["private_data_dir"])
        calls["settings"] = json.loads((private / "env" / "settings").read_text())
        kwargs["event_handler"]({"event": "verbose", "stdout": "token hf_abcdef123 in output"})
        return SimpleNamespace(status="successful", rc=0)

    monkeypatch.setitem(sys.modules, "ansible_runner", SimpleNamespace(run=fake_run))
    cancel, record = tmp_path / "cancel", tmp_path / "events.jsonl"
    seen = []
    job = runner.Job(
        playbook="playbooks/restart.yml",
        inventory=str(tmp_path / "hosts.yml"),
        env={"SGLANG_DEPLOY_CANCEL_FILE": str(cancel)},
        scrub=lambda ev: json.loads(json.dumps(ev).replace("hf_abcdef123", secret_rule.MASK)),
    )
    outcome = runner.run(job, seen.append, lambda: False, record=record)
    assert outcome == runner.Outcome("successful", 0)
    assert calls["envvars"]["SGLANG_DEPLOY_CANCEL_FILE"] == str(cancel)
    assert calls["cancel_callback"]() is False
    assert calls["settings"] == {"pexpect_timeout": runner.POLL_S}
    assert seen[0]["stdout"] == f"token {secret_rule.MASK} in output"
    assert "hf_abcdef123" not in record.read_text()
    assert record.stat().st_mode & 0o777 == 0o600


def test_twice_sigint_to_a_real_run_ends_130_without_a_traceback(
    held_inventory, ledger_path, ledger_rows, driver, tmp_path
):
    """python -m driver restart against a host whose module call never returns: SIGINT once (it says so and
    waits), SIGINT again (abandoned): exit 130, no traceback, the ledger row says 130."""
    proc = driver("restart", "-i", str(held_inventory.inventory), popen=True)
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
    reader.start()
    got: list[str] = []

    def said(text: str):
        def check():
            while not lines.empty():
                got.append(lines.get())
            return any(text in line for line in got)

        return check

    try:
        wait_for("a module call in flight on the host", held_inventory.entered.exists, 120, interval=0.05)
        proc.send_signal(signal.SIGINT)
        wait_for("the driver to say it was interrupted", said(interrupts.FIRST), 60, interval=0.05)
        assert proc.poll() is None, "after the first Ctrl-C the driver waits for what is in flight"
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=60)  # stderr to its end
    said("")()
    err = "".join(got)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err + out
    assert interrupts.SECOND in err and "hosts were left so:" in err and "here: interrupted" in err
    (row,) = ledger_rows(ledger_path)
    assert row["exit_code"] == 130 and row["outcome"] == "interrupted (Ctrl-C or SIGTERM)"


def test_only_a_skip_by_the_condition_is_not_begun():
    """The server task's one condition is the cancel file; a skip for another reason says nothing of the instance."""
    other = json.loads(json.dumps(B_SKIPPED))
    other["event_data"]["res"]["skip_reason"] = "Task skipped: check mode not supported"
    tracker = Tracker("restart")
    for event in (server_start(), other):
        tracker.handle(event)
    assert tracker.hosts["n1"].instances == {}
    tracker.handle(B_SKIPPED)
    assert tracker.hosts["n1"].instances["b"]["outcome"] == NOT_BEGUN
    (row,) = tracker.rows()
    assert (row["instance"], row["result"], row["phase"], row["seconds"]) == ("b", NOT_BEGUN, "restart", None)


# ---------------------------------------------------------------------- SIGTERM, precedence, the rollout (issue #29)


def test_sigterm_is_a_first_ctrl_c_and_the_ledger_row_is_completed(
    one_host, ledger_path, ledger_rows, monkeypatch, capsys
):
    """SIGTERM to the driver (a closed terminal, a CI runner's stop) had no handler: rc 143, the row left open."""
    previous = signal.getsignal(signal.SIGTERM)
    code, fake, _, err = drive(monkeypatch, capsys, one_host, [server_start(), "SIGTERM", A_RESTARTED, STATS])
    assert fake.seen["after"] == [(True, False)], "the cancel file at once; in-flight work lets finish"
    assert code == 130 and interrupts.FIRST in err and "Traceback" not in err
    (row,) = ledger_rows(ledger_path)
    assert row["exit_code"] == 130 and row["finished_at"]
    assert signal.getsignal(signal.SIGTERM) is previous, "the driver's handler is removed again"


def server_failed(outcome: str) -> dict:
    data = {"host": "n1", "task": "Run the action on each instance", "resolved_action": "sglang_server"}
    res = {"instance": "a", "outcome": outcome, "failed": True, "msg": f"the restart ended {outcome}"}
    return {"event": "runner_item_on_failed", "event_data": {**data, "task_action": "sglang_server", "res": res}}


@pytest.mark.parametrize("outcome,code", [("not_recovered", 6), ("rolled_back", 130), ("gpus_not_clean", 130)], ids=str)
def test_an_interruption_never_hides_a_server_left_down(outcome, code, one_host, monkeypatch, capsys):
    """Exit 130 said less than what happened when a restart ended not recovered (6): 6 and 8 outrank 130."""
    script = [server_start(), "SIGINT", server_failed(outcome), STATS]
    got, _, out, err = drive(monkeypatch, capsys, one_host, script)
    assert got == code, out + err
    assert "hosts were left so:" in err, "the interruption is said whatever the code"


def test_an_unreachable_host_outranks_the_interruption():
    tracker = Tracker("restart")
    tracker.handle(
        {"event": "runner_on_unreachable", "event_data": {"host": "n1", "task": "x", "res": {"msg": "gone"}}}
    )
    assert tracker.exit_code("successful", 0, interrupted=True) == exitcodes.UNREACHABLE == 8
    assert Tracker("restart").exit_code("successful", 0, interrupted=True) == exitcodes.INTERRUPTED


def test_a_rollout_waits_for_the_replica_in_flight_at_the_first_interrupt():
    i = interrupts.Interrupts("rollout")
    i.handler(signal.SIGINT, None)
    assert not i.poll(), "the replica in flight finishes"
    i.handler(signal.SIGTERM, None)
    assert i.poll()


def putback_said(*lines: str) -> dict:
    res = {"ansible_facts": {putback.FACT: list(lines)}}
    return {"event": "runner_on_ok", "event_data": {"host": "n1", "task": "any", "res": res}}


def test_a_second_interrupt_of_a_rollout_puts_back_what_serves(one_replica, monkeypatch, capsys):
    """Abandoned mid-turn, a replica may be out of the router yet serving: the driver runs the put-back playbook
    (only a third interrupt stops it) and says what it put back and what stays out."""
    runs = []
    rollout = FakePlaybook([server_start(), "SIGINT", "SIGINT"])

    def fake_run(job, on_event, cancelled, record=None):
        runs.append(job.playbook)
        if job.playbook != putback.PLAYBOOK:
            return rollout(job, on_event, cancelled, record)
        assert not cancelled(), "two interrupts do not stop the put-back"
        assert record.name == "putback.jsonl"
        on_event(putback_said("put back into the router: http://n1:30010"))
        on_event(putback_said("http://n2:30010 stays out of the router: not serving"))
        return runner.Outcome("successful", 0)

    monkeypatch.setattr("driver.runner.run", fake_run)
    code = cli.main(["rollout", "-i", str(one_replica), "--json"])
    out, err = capsys.readouterr()
    assert code == 130 and runs == [commands.PLAYBOOKS["rollout"][0], putback.PLAYBOOK]
    assert "put back into the router: http://n1:30010" in err
    left = json.loads(out)["left"]
    assert "put back into the router: http://n1:30010" in left
    assert "http://n2:30010 stays out of the router: not serving" in left


def test_a_third_interrupt_stops_the_put_back_and_says_so(one_replica, monkeypatch, capsys):
    rollout = FakePlaybook([server_start(), "SIGINT", "SIGINT"])

    def fake_run(job, on_event, cancelled, record=None):
        if job.playbook != putback.PLAYBOOK:
            return rollout(job, on_event, cancelled, record)
        os.kill(os.getpid(), signal.SIGINT)
        return runner.Outcome("canceled" if cancelled() else "successful", 254)

    monkeypatch.setattr("driver.runner.run", fake_run)
    assert cli.main(["rollout", "-i", str(one_replica)]) == 130
    assert putback.STOPPED in capsys.readouterr().err


def test_a_restart_abandoned_runs_no_put_back(one_host, monkeypatch, capsys):
    runs = []
    fake = FakePlaybook([server_start(), "SIGINT", "SIGINT"])

    def fake_run(job, *a, **k):
        runs.append(job.playbook)
        return fake(job, *a, **k)

    monkeypatch.setattr("driver.runner.run", fake_run)
    assert cli.main(["restart", "-i", str(one_host)]) == 130
    assert runs == [commands.PLAYBOOKS["restart"][0]]


@pytest.mark.parametrize(
    "event,said",
    [
        (putback_said("put back into the router: http://h:1"), ["put back into the router: http://h:1"]),
        ({"event": "runner_on_ok", "event_data": {"host": "h", "res": {"worker_url": "http://h:1"}}}, []),
        (
            {"event": "runner_on_unreachable", "event_data": {"host": "r", "res": {"msg": "no route"}}},
            ["put-back failed on r: no route"],
        ),
    ],
)
def test_what_each_event_of_the_put_back_says(event, said):
    assert putback.lines_of(event) == said
