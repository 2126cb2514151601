"""The unit's boot guard (roles/sglang_service/files/sglang-boot-guard over sglang_deploy.boot), installed as
tasks/gate.yml lays it out, run as systemd runs it: its exit status and what it says, with a systemctl on PATH
that records the reload. The restart's side of the mark is in test_restart_machine.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import boot, known_good
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import kg_dir
from support import REPO
from support.gpus import install_gate

GUARD = REPO / "roles" / "sglang_service" / "files" / "sglang-boot-guard"
GOOD = {"unit": "[Service]\nExecStart=/venv-good/bin/python -m sglang.launch_server\n", "env": 'P="good"\n'}
NEW = {"unit": "[Service]\nExecStart=/venv-new/bin/python -m sglang.launch_server\n", "env": 'P="new"\n'}


@pytest.fixture
def host(tmp_path):
    """The guard installed beside its package, a systemctl that logs its arguments, one instance's files."""
    libexec = tmp_path / "libexec"
    install_gate(libexec)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # As installed, but the systemctl it calls by path is the test's.
    (libexec / GUARD.name).write_text(GUARD.read_text().replace('"/usr/bin/systemctl"', f'"{bin_dir}/systemctl"'))
    (libexec / GUARD.name).chmod(0o755)
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "systemctl.log"}\n')
    (bin_dir / "systemctl").chmod(0o755)
    files = {"unit": tmp_path / "systemd" / "sglang-m.service", "env": tmp_path / "etc" / "m.env"}
    for p in files.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    return tmp_path, libexec, bin_dir, files


def write(files, contents) -> dict[str, str]:
    for k, p in files.items():
        p.write_text(contents[k])
    return {str(files[k]): contents[k] for k in files}


def record(state: Path, files, contents) -> dict:
    gens = Path(kg_dir(str(state), "m"), "generations")
    gens.mkdir(parents=True, exist_ok=True)
    as_files = {str(files[k]): contents[k] for k in files}
    rec = {"argv": [], "files": as_files, "profile": "p", "config_hash": known_good.content_hash(as_files)}
    n = len(list(gens.iterdir())) + 1
    rec["generation"] = f"{n:06d}-x-{rec['config_hash']}"
    (gens / f"{rec['generation']}.json").write_text(json.dumps(rec))
    return rec


def run(host, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The guard run as systemd runs it: through its shebang (the host's python3), the unit's environment."""
    _, libexec, _, _ = host
    env = env or {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "PYTHONUNBUFFERED": "1"}
    run_dir = str(host[0] / "run")  # never this machine's /run/sglang-deploy
    argv = [str(libexec / GUARD.name), *args, "--run-dir", run_dir]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


def test_the_known_good_configuration_starts_and_nothing_is_reloaded(host):
    tmp, _, _, files = host
    write(files, GOOD)
    rec = record(tmp / "state", files, GOOD)
    out = run(host, "--instance", "m", "--state-dir", str(tmp / "state"))
    assert out.returncode == boot.GO, out.stderr
    assert f"is known-good generation {rec['generation']}" in out.stdout
    assert not (tmp / "systemctl.log").exists()


def test_an_unverified_configuration_at_boot_is_replaced_by_the_newest_known_good_one(host):
    tmp, _, _, files = host
    write(files, GOOD)
    record(tmp / "state", files, {**GOOD, "env": 'P="older"\n'})
    rec = record(tmp / "state", files, GOOD)  # the newest generation is the one put back
    write(files, NEW)
    out = run(host, "--instance", "m", "--state-dir", str(tmp / "state"))
    assert out.returncode == boot.PUT_BACK == 75
    assert {k: p.read_text() for k, p in files.items()} == GOOD
    assert (tmp / "systemctl.log").read_text() == "daemon-reload\n"
    assert f"known-good generation {rec['generation']} put back" in out.stderr
    kept = Path(kg_dir(str(tmp / "state"), "m"), known_good.FAILED_DIR)
    assert sorted(p.read_text() for p in kept.iterdir()) == sorted(NEW.values())
    assert oct(files["env"].stat().st_mode & 0o777) == "0o600"  # an env file keeps its mode
    # verify counts the start the guard refused as no crash (checks.verify reads boot.put_backs)
    assert boot.put_backs("m", str(tmp / "run" / "put-back")) == {"count": 1, "generation": rec["generation"]}
    again = run(host, "--instance", "m", "--state-dir", str(tmp / "state"))  # Restart=on-failure's start
    assert again.returncode == boot.GO and (tmp / "systemctl.log").read_text() == "daemon-reload\n"
    assert boot.put_backs("m", str(tmp / "run" / "put-back"))["count"] == 1


def test_a_missing_file_counts_as_unverified(host):
    tmp, _, _, files = host
    write(files, GOOD)
    record(tmp / "state", files, GOOD)
    files["env"].unlink()
    assert run(host, "--instance", "m", "--state-dir", str(tmp / "state")).returncode == boot.PUT_BACK
    assert files["env"].read_text() == GOOD["env"]


def test_without_a_known_good_generation_the_unit_starts_what_it_has(host):
    tmp, _, _, files = host
    write(files, NEW)
    out = run(host, "--instance", "m", "--state-dir", str(tmp / "state"))
    assert out.returncode == boot.GO and "no known-good generation" in out.stdout
    assert {k: p.read_text() for k, p in files.items()} == NEW


def test_a_guard_that_cannot_put_the_files_back_refuses_the_start_with_its_cause(host):
    tmp, _, _, files = host
    write(files, GOOD)
    record(tmp / "state", files, GOOD)
    write(files, NEW)
    (tmp / "bin" / "systemctl").write_text("#!/bin/sh\necho 'Failed to reload daemon' >&2\nexit 1\n")
    out = run(host, "--instance", "m", "--state-dir", str(tmp / "state"))
    assert out.returncode == boot.FAILED
    assert "cannot hold the unit to its known-good configuration" in out.stderr and "daemon-reload" in out.stderr


def test_a_bad_instance_name_is_refused_not_joined_into_a_path(host):
    out = run(host, "--instance", "../etc", "--state-dir", "/nonexistent")
    assert out.returncode == boot.FAILED and "instance name '../etc'" in out.stderr


def test_the_machine_marks_where_the_guard_looks():
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine import Machine, Ports

    class Bare:
        ports = Ports()

    assert Machine.unverified_dir.fget(Bare) == boot.UNVERIFIED_DIR


def test_the_unit_environment_steers_nothing_the_guard_runs_as_root(host):
    """The guard runs as root (+) with the unit's environment: HOME is the service user's StateDirectory, which
    the server may write. Python's user site there, or PYTHON* variables, must not run code in it."""
    tmp, _, bin_dir, files = host
    write(files, GOOD)
    record(tmp / "state", files, GOOD)
    version = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    ).stdout.strip()
    home = tmp / "home"
    site = home / ".local" / "lib" / f"python{version}" / "site-packages"
    site.mkdir(parents=True)
    owned = tmp / "owned"
    (site / "usercustomize.py").write_text(f"open({str(owned)!r}, 'w').write('ran')\n")
    (tmp / "pp").mkdir()
    (tmp / "pp" / "sitecustomize.py").write_text(f"open({str(owned)!r}, 'w').write('ran')\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(tmp / "pp"), "PYTHONNOUSERSITE": ""}
    out = run(host, "--instance", "m", "--state-dir", str(tmp / "state"), env=env)
    assert out.returncode == boot.GO, out.stderr
    assert not owned.exists()


DAMAGED = [
    "{not json",
    '{"argv": [], "files": {"/etc/m.env": 7}, "profile": "p", "config_hash": "0"}',  # files not path -> text
]


@pytest.mark.parametrize("body", DAMAGED, ids=["cut-short", "files-not-text"])
def test_a_damaged_newest_generation_is_not_replaced_by_an_older_one(host, body):
    tmp, _, _, files = host
    write(files, GOOD)
    record(tmp / "state", files, {**GOOD, "env": 'P="older"\n'})
    gens = Path(kg_dir(str(tmp / "state"), "m"), "generations")
    (gens / "000002-x-damaged.json").write_text(body)
    out = run(host, "--instance", "m", "--state-dir", str(tmp / "state"))
    assert out.returncode == boot.GO and "000002-x-damaged.json) is unreadable" in out.stdout
    assert {k: p.read_text() for k, p in files.items()} == GOOD  # what runs is not touched
