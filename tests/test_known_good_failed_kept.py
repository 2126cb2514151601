"""A rollback keeps the failed configuration under known-good/<instance>/failed/ (issue #17).

docs/restart.md, Recover: "the newest known-good generation's files are put back (the failed ones kept in
known-good/<instance>/failed/)". That is sglang_deploy.known_good.Store.restore, which the restore phase of
every rollback runs (the automatic one and the operator's); the restart-level cases are in
tests/test_restart_machine.py. Here the store alone, on files in a temporary directory.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, phases
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good import FAILED_DIR, Store
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine import Machine, Ports, Settings

UNIT = "sglang-m.service"
GOOD = {"unit": "[Service]\nExecStart=/venv-good/bin/python -m sglang.launch_server\n", "env": 'PROFILE="good"\n'}
BAD = {"unit": "[Service]\nExecStart=/venv-new/bin/python -m sglang.launch_server\n", "env": 'PROFILE="new"\n'}


@pytest.fixture
def inst(tmp_path) -> Instance:
    return Instance(
        name="m",
        unit=UNIT,
        unit_path=str(tmp_path / "systemd" / UNIT),
        env_path=str(tmp_path / "etc" / "m.env"),
        secrets_path=str(tmp_path / "etc" / "secrets" / "m.env"),
        pending_dir=str(tmp_path / "etc" / "pending"),
        port=30000,
        gpus=[0],
        argv=["/venv-good/bin/python", "-m", "sglang.launch_server"],
        profile="good",
        state_dir=str(tmp_path / "state"),
    )


def live(inst: Instance, files: dict[str, str]) -> None:
    for path, text in ((inst.unit_path, files["unit"]), (inst.env_path, files["env"])):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def recorded(inst: Instance) -> dict:
    """The known-good generation of GOOD, recorded as a verified restart records it."""
    live(inst, GOOD)
    store = Store(inst)
    store.record(store.snapshot(), inst.argv, {"ok": True, "checks": []})
    return store.latest()


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_restore_keeps_the_failed_files_under_failed_and_puts_the_known_good_ones_back(inst):
    record = recorded(inst)
    live(inst, BAD)  # the configuration that failed
    out = Store(inst).restore(record)

    failed = Path(inst.state_dir, "known-good", "m", "failed")
    assert out == {"generation": record["generation"], "failed_kept_in": str(failed)}
    assert sorted(p.name for p in failed.iterdir()) == ["m.env", UNIT]
    assert (failed / UNIT).read_text() == BAD["unit"]
    assert (failed / "m.env").read_text() == BAD["env"]
    assert mode(failed) == 0o700 and mode(failed / UNIT) == 0o600 and mode(failed / "m.env") == 0o600
    # and the known-good files are live again, with the modes systemd and the role give them
    assert Path(inst.unit_path).read_text() == GOOD["unit"] and Path(inst.env_path).read_text() == GOOD["env"]
    assert mode(inst.unit_path) == 0o644 and mode(inst.env_path) == 0o600
    assert Store(inst).snapshot()["config_hash"] == record["config_hash"]


def test_the_next_failure_replaces_what_failed_holds(inst):
    record = recorded(inst)
    live(inst, BAD)
    Store(inst).restore(record)
    newer = {"unit": BAD["unit"].replace("venv-new", "venv-newer"), "env": 'PROFILE="newer"\n'}
    live(inst, newer)
    Store(inst).restore(record)
    failed = Path(inst.kg_dir, FAILED_DIR)
    assert (failed / UNIT).read_text() == newer["unit"] and (failed / "m.env").read_text() == newer["env"]


def test_a_live_file_that_is_missing_is_put_back_and_nothing_is_invented_for_it(inst):
    record = recorded(inst)
    live(inst, BAD)
    os.unlink(inst.env_path)  # the failed configuration lost its env file
    Store(inst).restore(record)
    failed = Path(inst.kg_dir, FAILED_DIR)
    assert sorted(p.name for p in failed.iterdir()) == [UNIT]
    assert Path(inst.env_path).read_text() == GOOD["env"]


def test_the_rollbacks_restore_phase_keeps_the_failed_files_then_reloads_systemd(inst, tmp_path):
    """The automatic rollback and the operator's both begin with the restore phase: Machine.restore."""
    record = recorded(inst)
    live(inst, BAD)
    calls = []

    def systemctl(*args, timeout=None):
        calls.append(args)
        return subprocess.CompletedProcess(["systemctl", *args], 0, "", "")

    m = Machine(inst, Settings(), Ports(systemctl=systemctl, lock_dir=str(tmp_path / "locks")))
    m.retarget(record)
    assert phases.restore(m)["failed_kept_in"] == os.path.join(inst.kg_dir, FAILED_DIR)
    assert Path(inst.kg_dir, FAILED_DIR, UNIT).read_text() == BAD["unit"]
    assert calls == [("daemon-reload",)]
    assert phases.ROLLBACK[0] is phases.RESTORE and phases.RESTORE.phase == outcomes.RESTORE
