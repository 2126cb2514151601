"""Fixtures for the driver's tests: a private ledger, and tiny real inventories on this machine.

`held_inventory` is a real inventory whose one host, `here`, is this machine over Ansible's local connection,
with an interpreter that never runs a module: it marks that it was entered (a module call is in flight),
then waits until the test releases it and fails. A playbook run against it is real (ansible-runner,
ansible-playbook, events, the ledger) and touches nothing on this machine.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HOLD = """#!/bin/sh
# Stands in for the Python interpreter of the host `here`: holds every module call until released.
touch '{entered}'
while [ ! -e '{release}' ]; do sleep 0.05; done
exit 1
"""


@dataclass
class Held:
    inventory: Path
    entered: Path  # exists once a module call is in flight
    release: Path  # create it to end every held call


@pytest.fixture
def ledger_path(tmp_path, monkeypatch) -> Path:
    """SGLANG_DEPLOY_LEDGER in a directory that does not exist yet (the ledger makes it)."""
    path = tmp_path / "state" / "ledger.sqlite3"
    monkeypatch.setenv("SGLANG_DEPLOY_LEDGER", str(path))
    return path


@pytest.fixture
def held_inventory(tmp_path):
    hold = tmp_path / "hold.sh"
    held = Held(tmp_path / "hosts.yml", tmp_path / "entered", tmp_path / "release")
    hold.write_text(HOLD.format(entered=held.entered, release=held.release))
    hold.chmod(0o755)
    held.inventory.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n        here:\n"
        "          ansible_connection: local\n          ansible_become: false\n"
        f"          ansible_python_interpreter: {hold}\n"
    )
    yield held
    held.release.touch()  # a call the run left behind ends now


def _driver(*args: str, env: dict | None = None, popen: bool = False, **kw):
    full_env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "driver", *args]
    if popen:
        return subprocess.Popen(
            cmd, cwd=REPO, env=full_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw
        )
    return subprocess.run(cmd, cwd=REPO, env=full_env, text=True, capture_output=True, **kw)


@pytest.fixture
def driver():
    """driver(*args, env=None, popen=False): python -m driver in a subprocess, output piped (no terminal), no
    COLUMNS: CompletedProcess, or the Popen with popen=True."""
    return _driver


@pytest.fixture
def ledger_rows():
    """ledger_rows(path): the ledger's runs, oldest first, read with sqlite3 itself."""

    def rows(path: Path) -> list[dict]:
        db = sqlite3.connect(path)
        db.row_factory = sqlite3.Row
        out = [dict(r) for r in db.execute("SELECT * FROM runs ORDER BY id")]
        db.close()
        return out

    return rows


@pytest.fixture
def no_playbook(monkeypatch):
    """Fails the test if a playbook is started."""

    def run(*args, **kwargs):
        raise AssertionError("a playbook was started")

    monkeypatch.setattr("driver.runner.run", run)
