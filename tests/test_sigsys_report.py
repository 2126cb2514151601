"""A server killed by the unit's system-call filter is reported as such (issue #17).

docs/unit-security.md: with `SystemCallErrorNumber=kill` (the drop-in it describes for finding a denied call) "the
death is `status=31/SYS`, which the restart reports as 'a system call the unit's SystemCallFilter denies'".
systemd (PID 1) writes that status in its own journal line about the unit's invocation, "sglang-NAME.service:
Main process exited, code=killed, status=31/SYS", tagged INVOCATION_ID= (the server's own lines carry
_SYSTEMD_INVOCATION_ID=; journalctl's --invocation matches both). The mapping is sglang_deploy.unit.cause_of;
the start phase reads the failing invocation's journal with unit.journal and reports cause_of's line.

The journal here is a fake journalctl on PATH that applies journalctl's match rules (FIELD=value terms: the
same field OR'd, different fields AND'd, "+" between alternatives) to entries with the fields systemd gives them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, phases, unit
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.failure import Failure
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine import Machine, Ports, Settings

UNIT = "sglang-m.service"
OLD, NEW = "0" * 31 + "1", "f" * 31 + "2"  # the invocation before the start, and the one killed by SIGSYS
SIGSYS_CAUSE = "Main process exited, code=killed, status=31/SYS (a system call the unit's SystemCallFilter denies)"


def server(invocation: str, message: str) -> dict:
    """A line the server wrote (stdout to the journal): journald adds its unit's fields."""
    return {"_SYSTEMD_UNIT": UNIT, "_SYSTEMD_INVOCATION_ID": invocation, "_PID": "4242", "MESSAGE": message}


def manager(invocation: str, message: str) -> dict:
    """A line PID 1 wrote about the unit (log_unit_*): UNIT= and INVOCATION_ID=, from init.scope."""
    return {
        "_SYSTEMD_UNIT": "init.scope",
        "_PID": "1",
        "UNIT": UNIT,
        "INVOCATION_ID": invocation,
        "MESSAGE": f"{UNIT}: {message}",
    }


JOURNAL = [
    manager(OLD, "Deactivated successfully."),
    server(OLD, "[2026-12-01 09:00:00] The server is fired up and ready to roll!"),
    manager(OLD, "Main process exited, code=exited, status=0/SUCCESS"),
    manager(NEW, "Started SGLang server m (eagle3_topk1)."),
    server(NEW, "[2026-12-01 10:00:01] server_args=ServerArgs(model_path='/models/m', tp_size=2, ...)"),
    server(NEW, "[2026-12-01 10:00:02] Init torch distributed begin."),
    manager(NEW, "Main process exited, code=killed, status=31/SYS"),
    manager(NEW, "Failed with result 'signal'."),
]

FAKE_JOURNALCTL = textwrap.dedent(
    """\
    import json, os, sys

    entries = json.load(open(os.environ["FAKE_JOURNAL"]))
    args, n, groups = sys.argv[1:], None, [{}]
    while args:
        a = args.pop(0)
        if a == "--no-pager":
            continue
        if a == "-o":
            assert args.pop(0) == "cat"
        elif a == "-n":
            n = int(args.pop(0))
        elif a == "-u":
            u = args.pop(0)
            groups = [{"_SYSTEMD_UNIT": {u}}, {"_PID": {"1"}, "UNIT": {u}}]
        elif a == "+":
            groups.append({})
        else:
            name, _, value = a.partition("=")
            groups[-1].setdefault(name, set()).add(value)

    def matches(e):
        return any(g and all(e.get(k) in vs for k, vs in g.items()) for g in groups)

    out = [e["MESSAGE"] for e in entries if matches(e)]
    print("\\n".join(out[-n:] if n else out))
    """
)


@pytest.fixture
def journal(tmp_path, monkeypatch) -> Path:
    """journalctl on PATH reading JOURNAL (write another list to the returned file)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "journalctl"
    fake.write_text(f"#!{sys.executable}\n{FAKE_JOURNALCTL}")
    fake.chmod(0o755)
    entries = tmp_path / "journal.json"
    entries.write_text(json.dumps(JOURNAL))
    monkeypatch.setenv("FAKE_JOURNAL", str(entries))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return entries


def test_the_fake_journalctl_matches_as_journalctl_does(journal):
    def run(*matches: str) -> list[str]:
        return subprocess.run(["journalctl", "-o", "cat", *matches], capture_output=True, text=True).stdout.splitlines()

    assert run(f"_SYSTEMD_INVOCATION_ID={NEW}") == [JOURNAL[4]["MESSAGE"], JOURNAL[5]["MESSAGE"]]
    assert run(f"INVOCATION_ID={NEW}") == [JOURNAL[i]["MESSAGE"] for i in (3, 6, 7)]
    assert run(f"_SYSTEMD_INVOCATION_ID={NEW}", "+", f"INVOCATION_ID={NEW}") == [e["MESSAGE"] for e in JOURNAL[3:]]
    assert len(run("-u", UNIT)) == len(JOURNAL)


def test_cause_of_a_journal_ending_in_a_sigsys_death_names_the_filter():
    lines = [e["MESSAGE"] for e in JOURNAL[3:]]
    assert unit.cause_of(lines) == SIGSYS_CAUSE


def test_a_death_by_another_signal_is_not_blamed_on_the_filter():
    lines = [f"{UNIT}: Main process exited, code=killed, status=9/KILL", f"{UNIT}: Failed with result 'signal'."]
    assert unit.cause_of(lines) == "Main process exited, code=killed, status=9/KILL"


def test_the_journal_of_an_invocation_holds_systemds_lines_about_it(journal):
    """The restart reads the failing invocation's journal: the server's lines and PID 1's about that invocation
    (its exit status), nothing of the invocation before."""
    assert unit.journal(UNIT, NEW) == [e["MESSAGE"] for e in JOURNAL[3:]]
    assert unit.cause_of(unit.journal(UNIT, NEW)) == SIGSYS_CAUSE


@dataclass
class SigsysHost:
    """The unit as the start phase sees it: started, then its main process killed by SIGSYS (auto-restart)."""

    t: float = 100.0
    shows: int = 0
    calls: list[tuple] = field(default_factory=list)

    def systemctl(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        self.calls.append(args)
        return subprocess.CompletedProcess(["systemctl", *args], 0, "", "")

    def show(self, name: str) -> dict:
        self.shows += 1
        if self.shows == 1:  # before the start job: the stopped invocation
            return {"ActiveState": "inactive", "SubState": "dead", "MainPID": 0, "InvocationID": OLD}
        return {  # as `systemctl show` gives them (unit.show): ExecMainCode 2 is CLD_KILLED
            "ActiveState": "activating",
            "SubState": "auto-restart",
            "MainPID": 0,
            "NRestarts": 1,
            "InvocationID": NEW,
            "ExecMainCode": "2",
            "ExecMainStatus": 31,
            "ExecMainExitTimestampMonotonic": 0,
        }

    def clock(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_a_start_killed_by_the_system_call_filter_fails_with_that_cause(journal, tmp_path):
    files = {tmp_path / UNIT: "[Service]\nExecStart=/x\n", tmp_path / "m.env": 'A="1"\n'}
    for path, text in files.items():
        path.write_text(text)
    inst = Instance(
        name="m",
        unit=UNIT,
        unit_path=str(tmp_path / UNIT),
        env_path=str(tmp_path / "m.env"),
        secrets_path=str(tmp_path / "secrets.env"),
        pending_dir=str(tmp_path / "pending"),
        port=1,
        gpus=[0],
        argv=["/venv/bin/python", "-m", "sglang.launch_server"],
        profile="p",
        state_dir=str(tmp_path / "state"),
    )
    host = SigsysHost()
    ports = Ports(
        systemctl=host.systemctl,
        show=host.show,
        journal=unit.journal,  # the real one, reading the fake journalctl
        clock=host.clock,
        sleep=host.sleep,
        lock_dir=str(tmp_path / "locks"),
    )
    with pytest.raises(Failure) as exc:
        phases.start(Machine(inst, Settings(), ports))
    f = exc.value
    assert (f.phase, f.cause) == (outcomes.START, SIGSYS_CAUSE)
    assert f.details["exit"] == "2/31" and f.details["invocation"] == NEW
    assert f.details["journal_tail"][-2:] == [
        f"{UNIT}: Main process exited, code=killed, status=31/SYS",
        f"{UNIT}: Failed with result 'signal'.",
    ]
