"""How a phase of the safe restart fails: Failure (its phase, cause and details), every exception turned into one
(as_failure), and the signals that end a restart in a defined state (SIGTERM fails the phase in progress; from the
last phase's end on, SIGTERM and SIGINT are ignored so that the ending is not cut short)."""

from __future__ import annotations

import signal
import traceback

from . import gpu, unit
from .http import HttpError


class Failure(Exception):
    def __init__(self, phase: str, cause: str, **details):
        super().__init__(cause)
        self.phase, self.cause, self.details = phase, cause, details

    def as_dict(self) -> dict:
        return {"phase": self.phase, "cause": self.cause, **self.details}


class Terminated(Exception):
    """The module got SIGTERM: the phase in progress fails, and the machine ends in a defined state."""


def sigterm(signum, frame):
    raise Terminated("the module was sent SIGTERM (the controller gave up or was stopped)")


def install_signal_handlers() -> None:
    """SIGTERM fails the phase in progress (then the defined ending); SIGHUP (a dropped SSH session) is ignored."""
    signal.signal(signal.SIGTERM, sigterm)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def ignore_sigterm() -> None:
    """From the end of the last phase on, a SIGTERM must not cut the ending short."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (tests)
        pass


def as_failure(phase: str, exc: BaseException) -> Failure:
    if isinstance(exc, Failure):
        if exc.phase != phase:
            exc.details.setdefault("raised_in", exc.phase)
            exc.phase = phase
        return exc
    if isinstance(exc, (Terminated, KeyboardInterrupt)):
        return Failure(phase, str(exc) or "interrupted (SIGINT)", interrupted=True)
    kind = type(exc).__name__
    known = (unit.UnitError, HttpError, gpu.NvidiaSmiError, OSError, TimeoutError, ValueError, LookupError)
    if isinstance(exc, known) or kind == "TimeoutExpired":
        return Failure(phase, f"{kind}: {exc}")
    return Failure(phase, f"unexpected {kind}: {exc}", traceback=traceback.format_exc().splitlines()[-12:])
