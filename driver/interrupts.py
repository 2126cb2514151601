"""Ctrl-C or SIGTERM during a run: the first stops what has not begun, the second abandons the run; never a
traceback. SIGTERM (a terminal closed, systemd or a CI runner stopping the driver) counts as a Ctrl-C.

The first Ctrl-C creates the run's cancel file (runs/<id>/cancel, passed to ansible-playbook as
$SGLANG_DEPLOY_CANCEL_FILE, the sglang_service role's sglang_service_cancel_file): the role begins no
restart or rollback of an instance once it exists (read per loop item, on the controller), so the playbook
runs to its end with what was in flight finished and reported, and every later restart reported as not
begun. A rollout reads it per replica: the replica in flight finishes (drain, restart or rollback, back into
the router), no further replica begins. Commands that restart nothing (deploy, verify, validate, status) have nothing to wait for: their
first Ctrl-C abandons at once.
The second Ctrl-C abandons: ansible-runner kills ansible-playbook's process group (a rollout then puts back
into the router what serves and is out: driver/cli.py).

The SIGINT handler only counts and creates the file (no buffered I/O, so it cannot break a write it
interrupts, and it never raises KeyboardInterrupt); the messages are printed from the main loop (poll).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

# Commands whose playbooks honour the cancel file (each instance's restart or rollback begins only without it).
GRACEFUL = frozenset({"restart", "rollback", "tune", "rollout"})
# The signals that interrupt a run: the operator's Ctrl-C, and SIGTERM from whatever stops the driver.
SIGNALS = (signal.SIGINT, signal.SIGTERM)

FIRST = "interrupted: no further restart will begin; waiting for those in flight (Ctrl-C again to abandon)"
AT_ONCE = "interrupted: stopping ansible-playbook ({command} restarts nothing, so nothing is left to wait for)"
SECOND = "abandoned: ansible-playbook is stopped; what each host was doing is listed below"


def _stderr(message: str) -> None:
    print(f"\n{message}", file=sys.stderr, flush=True)


class Interrupts:
    def __init__(self, command: str, say: Callable[[str], None] = _stderr):
        self.command = command
        self.graceful = command in GRACEFUL
        self.count = 0
        self.said = 0
        self.say = say
        self.cancel_file: Path | None = None

    def handler(self, signum, frame) -> None:
        """The SIGINT and SIGTERM handler."""
        self.count += 1
        if self.count == 1:
            self._touch()

    def install(self) -> dict:
        """This object handles SIGINT and SIGTERM from now on; the handlers it replaced, for restore()."""
        return {sig: signal.signal(sig, self.handler) for sig in SIGNALS}

    @staticmethod
    def restore(previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def arm(self, cancel_file: Path) -> None:
        """The run has its directory: a Ctrl-C from now on (or one already given) creates this cancel file."""
        self.cancel_file = cancel_file
        if self.count:
            self._touch()

    def _touch(self) -> None:
        if self.cancel_file is not None:
            os.close(os.open(self.cancel_file, os.O_CREAT | os.O_WRONLY, 0o600))

    @property
    def interrupted(self) -> bool:
        return self.count >= 1

    @property
    def abandoned(self) -> bool:
        """ansible-playbook is (to be) stopped: a second Ctrl-C, or the first for a command that restarts nothing."""
        return self.count >= 2 or (self.count >= 1 and not self.graceful)

    def abandon(self) -> None:
        """A KeyboardInterrupt came through after all (from code that raised its own): count it as the second."""
        self.count = max(self.count, 2)
        self._touch()

    def poll(self) -> bool:
        """ansible-runner's cancel_callback (the main thread, every line of output and every POLL_S seconds):
        say what the Ctrl-Cs so far mean; True once the run is abandoned."""
        self.announce()
        return self.abandoned

    def announce(self) -> None:
        while self.said < min(self.count, 2):
            self.said += 1
            if self.said == 1:
                self.say(FIRST if self.graceful else AT_ONCE.format(command=self.command))
            elif self.graceful:
                self.say(SECOND)
