"""How long the modules let `systemctl stop` take (plugins/module_utils/sglang_deploy/unit.py): under KillMode=mixed SGLang's
own drain may use most of the unit's TimeoutStopSec, and systemd's final SIGKILL waits as long again; a bound of
its own below that would fail a stop that systemd is still carrying out."""

from __future__ import annotations

import subprocess

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import unit


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("2min 30s", 150.0),
        ("1min", 60.0),
        ("150ms", 0.15),
        ("1h 30min", 5400.0),
        ("45s", 45.0),
        ("infinity", None),
        ("", None),
        ("2 fortnights", None),
        ("1min garbage", None),
    ],
)
def test_systemd_time_spans(text, seconds):
    assert unit.parse_timespan(text) == seconds


@pytest.fixture
def runs(monkeypatch):
    """subprocess.run recorded; `systemctl show` answers with the TimeoutStopUSec in `runs.shown`."""
    calls: list[tuple[list[str], float]] = []

    def fake(cmd, capture_output, text, check, timeout):
        calls.append((cmd, timeout))
        if cmd[1] == "show":
            return subprocess.CompletedProcess(cmd, fake.rc, fake.shown + "\n", "")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    fake.shown, fake.rc = "2min 30s", 0
    monkeypatch.setattr(unit.subprocess, "run", fake)
    fake.calls = calls
    return fake


def test_a_stop_may_take_twice_the_units_stop_timeout_and_more(runs):
    unit.systemctl("stop", "sglang-main.service")
    assert runs.calls[-1] == (["systemctl", "stop", "sglang-main.service"], 330.0)


@pytest.mark.parametrize("shown,rc,bound", [("45s", 0, 300.0), ("infinity", 0, 300.0), ("", 1, 300.0)])
def test_a_short_unreadable_or_infinite_stop_timeout_keeps_the_300_s_floor(runs, shown, rc, bound):
    runs.shown, runs.rc = shown, rc
    unit.checked("stop", "sglang-main.service")
    assert runs.calls[-1][1] == bound


def test_other_verbs_and_an_explicit_bound_are_as_asked(runs):
    unit.systemctl("start", "--no-block", "sglang-main.service")
    unit.systemctl("stop", "sglang-main.service", timeout=7)
    assert [t for _, t in runs.calls] == [300.0, 7]
    assert not any(cmd[1] == "show" for cmd, _ in runs.calls), "no show when the bound is given or not a stop"
