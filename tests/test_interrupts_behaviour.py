"""What the operator is told at each Ctrl-C, and what the run's cancel file and count say (issue #31: the behaviours
behind the mutants the unit suite let survive in driver/interrupts.py).

A command that restarts something: the first Ctrl-C waits for what is in flight, the second abandons, and no more is
said after; one that restarts nothing names itself and abandons at once; nothing is said without a Ctrl-C. The cancel
file is the run's (0600, whatever the umask). A KeyboardInterrupt that came through counts as the second Ctrl-C: the
rollout's put-back (driver/cli.py) still runs until a third. The messages go to stderr, each on its own line.
"""

from __future__ import annotations

import signal
import stat

import pytest

from driver import interrupts
from driver.interrupts import AT_ONCE, FIRST, SECOND, Interrupts

pytestmark = pytest.mark.usefixtures("usual_umask")


def ctrl_c(i: Interrupts, times: int = 1) -> None:
    for _ in range(times):
        i.handler(signal.SIGINT, None)


def test_nothing_is_said_and_nothing_abandoned_without_a_ctrl_c():
    said = []
    i = Interrupts("restart", say=said.append)
    assert i.poll() is False and said == [] and not i.interrupted


def test_a_restart_says_it_waits_then_that_it_abandons_and_nothing_more_at_a_third():
    said = []
    i = Interrupts("restart", say=said.append)
    ctrl_c(i)
    assert i.poll() is False and said == [FIRST]
    ctrl_c(i, 2)
    assert i.poll() is True and said == [FIRST, SECOND]
    assert i.poll() is True and said == [FIRST, SECOND]


@pytest.mark.parametrize("command", ["status", "deploy"])
def test_a_command_that_restarts_nothing_names_itself_and_abandons_at_once(command):
    said = []
    i = Interrupts(command, say=said.append)
    ctrl_c(i, 3)
    assert i.poll() is True
    assert said == [AT_ONCE.format(command=command)]
    assert f"({command} restarts nothing" in said[0]


def test_the_first_ctrl_c_makes_the_runs_cancel_file_private(tmp_path):
    cancel = tmp_path / "cancel"
    i = Interrupts("restart", say=lambda m: None)
    i.arm(cancel)
    ctrl_c(i)
    assert stat.S_IMODE(cancel.stat().st_mode) == 0o600


def test_a_keyboard_interrupt_that_came_through_is_the_second_ctrl_c_not_the_third(tmp_path):
    """cli.py stops the rollout's put-back at interrupts.count >= 3: only a Ctrl-C after this one stops it."""
    i = Interrupts("rollout", say=lambda m: None)
    i.arm(tmp_path / "cancel")
    i.abandon()
    assert i.abandoned and i.count == 2 and (tmp_path / "cancel").exists()
    ctrl_c(i)
    assert i.count == 3


def test_the_default_message_goes_to_stderr_on_its_own_line(capsys):
    said = Interrupts("restart")  # the default say
    ctrl_c(said)
    said.poll()
    interrupts._stderr("second line")
    out, err = capsys.readouterr()
    assert out == "" and err == f"\n{FIRST}\n\nsecond line\n"
