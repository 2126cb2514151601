"""Fixtures shared by the unit test modules (helpers that are not fixtures: tests/support)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from support.gpus import install_gate, simulated


@pytest.fixture(scope="session")
def installed_gate(tmp_path_factory) -> Path:
    """The GPU gate installed as on a host (beside its sglang_deploy package), in a temporary directory."""
    return install_gate(tmp_path_factory.mktemp("libexec") / "sglang-deploy")


@pytest.fixture
def gpus(tmp_path) -> tuple[str, dict]:
    """4 simulated GPUs, and an nvidia-smi on PATH that reads them: (state file, environment)."""
    return simulated(tmp_path)


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_dispositions_restored():
    """Each test leaves the signal dispositions as it found them.

    sglang_deploy.restart ignores SIGTERM and SIGINT once its last phase has ended (the module
    process exits after); run in the test process, that would leak into every later test: their
    children inherit an ignored SIGTERM (`sleep` no longer stops on it), and Ctrl-C stops working.
    """
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    yield
    for s, handler in saved.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


@pytest.fixture
def usual_umask():
    """The usual umask, 022: a directory made without its own mode would be 0755, a file 0644 (the tests of modes
    show what the code sets itself)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.fixture(scope="module")
def standins():
    """Three lab stand-ins on loopback for a test module that runs a real gateway in front of them
    (tests/support/smg.py's Standins), stopped at its end."""
    from support.smg import Standins

    s = Standins()
    try:
        yield s
    finally:
        s.stop()
