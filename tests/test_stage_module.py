"""plugins/modules/sglang_stage.py as Ansible runs it: the outcome of each staging, under the instance's lock.

systemctl and systemd-analyze are stand-ins on PATH (each call logged); the instance's files, its known-good
generations and its lock all lie under tmp_path (the lock directory is moved there by the runner's prelude).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good import Store
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import InstanceLock
from support.modules import instance_record, lock_dir_prelude, run_module, shim, systemctl_shim

UNIT = "[Unit]\nDescription=m\n[Service]\nExecStart=/opt/ml-env/bin/python -m sglang.launch_server\n"
ENV = 'NCCL_DEBUG="WARN"\n'
SECRET = "stage-secret-never-shown"


@pytest.fixture
def host(tmp_path):
    """(record, environment, lock dir, systemctl log) of one instance on a host made of tmp_path."""
    bin_dir = tmp_path / "bin"
    log = tmp_path / "systemctl.log"
    systemctl_shim(bin_dir, {}, log)
    shim(bin_dir, "systemd-analyze", 'echo "$*" >> ' + str(tmp_path / "analyze.log") + "\nexit 0\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return instance_record(tmp_path), env, tmp_path / "locks", log


def stage_module(tmp_path, host, check_mode=False, **args) -> tuple[int, dict]:
    record, env, locks, _ = host
    args = {
        "instance": record,
        "unit_content": UNIT,
        "env_content": ENV,
        "state_dir": str(tmp_path / "state"),
        "controller": "ctl",
        "command": "driver deploy",
        **args,
    }
    return run_module("sglang_stage", args, tmp_path, env=env, check_mode=check_mode, prelude=lock_dir_prelude(locks))


def test_a_first_configuration_is_written_as_the_units_then_unchanged(tmp_path, host):
    record, _, locks, log = host
    secrets = f'SGLANG_API_KEY="{SECRET}"\n'
    rc, out = stage_module(tmp_path, host, secrets_content=secrets)
    assert rc == 0 and out["outcome"] == outcomes.STAGED and out["changed"] is True, out
    assert out["pending"] is False and out["first"] is True and out["msg"] == "m: staged"
    assert out["wrote"] == sorted([record["unit_path"], record["env_path"]])
    assert Path(record["unit_path"]).read_text() == UNIT and Path(record["env_path"]).read_text() == ENV
    assert Path(record["secrets_path"]).read_text() == secrets and out["secrets_changed"] is True
    assert stat.S_IMODE(os.stat(record["secrets_path"]).st_mode) == 0o600
    assert SECRET not in str(out)
    assert "daemon-reload" in log.read_text()
    # The lock was taken, and released (its holder wiped) before the module exited.
    assert (locks / "m.lock").exists() and (locks / "m.lock").read_text() == ""
    rc, out = stage_module(tmp_path, host, secrets_content=secrets)
    assert rc == 0 and out["outcome"] == outcomes.UNCHANGED and out["changed"] is False and out["wrote"] == []


def test_with_a_known_good_generation_a_change_waits_as_pending(tmp_path, host):
    record, _, _, _ = host
    assert stage_module(tmp_path, host)[0] == 0
    inst = Instance.from_params({**record, "state_dir": str(tmp_path / "state")})
    store = Store(inst)
    store.record(store.snapshot(), record["argv"], {"ok": True, "checks": []})
    rc, out = stage_module(tmp_path, host, env_content='NCCL_DEBUG="INFO"\n')
    assert rc == 0 and out["outcome"] == outcomes.STAGED and out["pending"] is True, out
    assert out["msg"] == "m: staged (pending: the safe restart applies it)"
    assert Path(record["env_path"]).read_text() == ENV, "the live file is the verified one until the restart"
    assert Path(inst.pending_path(record["env_path"])).read_text() == 'NCCL_DEBUG="INFO"\n'


def test_check_mode_writes_nothing_and_takes_no_lock(tmp_path, host):
    record, _, locks, log = host
    rc, out = stage_module(tmp_path, host, check_mode=True, secrets_content="X=1\n")
    assert rc == 0 and out["outcome"] == outcomes.STAGED and out["changed"] is True
    assert out["wrote"] == sorted([record["unit_path"], record["env_path"]])
    assert not Path(record["unit_path"]).exists() and not Path(record["secrets_path"]).exists()
    assert not locks.exists() and not log.exists()


def test_a_held_lock_refuses_naming_its_holder(tmp_path, host):
    record, _, locks, _ = host
    with InstanceLock("m", "restart m (profile default)", "other-controller", "driver restart", str(locks)):
        rc, out = stage_module(tmp_path, host)
    assert rc == 1 and out["outcome"] == outcomes.LOCKED and out["instance"] == "m"
    assert "m is locked by another operation: restart m (profile default)" in out["msg"]
    assert out["lock"]["holder"]["controller"] == "other-controller" and out["lock"]["holder"]["pid"] == os.getpid()
    assert not Path(record["unit_path"]).exists()


def test_a_unit_systemd_analyze_refuses_is_invalid_config_and_nothing_is_written(tmp_path, host):
    record, env, _, _ = host
    shim(Path(env["PATH"].split(":")[0]), "systemd-analyze", "echo 'Unknown key name ExecStrat' >&2\nexit 1\n")
    rc, out = stage_module(tmp_path, host)
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG
    assert out["msg"].startswith("m: systemd-analyze verify refuses the rendered sglang-m.service: Unknown key name")
    assert not Path(record["unit_path"]).exists() and not Path(record["env_path"]).exists()


def test_an_instance_that_is_not_a_record_is_invalid_config(tmp_path, host):
    record, _, _, _ = host
    rc, out = stage_module(tmp_path, host, instance={**record, "name": "../etc"})
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG
    assert out["msg"].startswith("instance: not a rendered instance record (instance name '../etc'")
    rc, out = stage_module(tmp_path, host, instance={"name": "m"})
    assert rc == 1 and out["outcome"] == outcomes.INVALID_CONFIG and "not a rendered instance record" in out["msg"]


def test_a_write_that_fails_is_refused_saying_the_server_was_not_touched(tmp_path, host):
    record, _, locks, _ = host
    (tmp_path / "blocker").write_text("a file where the unit's directory should be")
    unit_path = str(tmp_path / "blocker" / "sglang-m.service")
    rc, out = stage_module(tmp_path, host, instance={**record, "unit_path": unit_path})
    assert rc == 1 and out["outcome"] == outcomes.REFUSED and out["instance"] == "m"
    assert out["msg"].startswith("m: staging failed (NotADirectoryError:")
    assert "the running server was not touched" in out["msg"]
    assert (locks / "m.lock").read_text() == "", "released (its holder wiped) on the failure too"
