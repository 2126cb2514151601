"""roles/sglang_service/files/sglang-gpu-gate, installed as on the host, against the lab's simulated nvidia-smi.

The gate runs from a temporary directory laid out as tasks/gate.yml lays it out on the
host (the gate beside its sglang_deploy package), never from the repository, so these
tests prove that the layout works, not only the code.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import nvsim
from support import REPO, wait_for
from support.gpus import GATE, GATE_PACKAGE, holding, imports_beyond, nvidia_smi_calls

GATE_YML = REPO / "roles" / "sglang_service" / "tasks" / "gate.yml"
HOST_GATE = "/usr/local/libexec/sglang-deploy/sglang-gpu-gate"


def run_gate(gate_path: Path, env: dict, *args: str, **kw) -> subprocess.Popen:
    """The gate at gate_path, started as a unit's ExecStartPre would be, from an unrelated working directory."""
    argv = [sys.executable, str(gate_path), *args]
    return subprocess.Popen(argv, env=env, text=True, cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.fixture
def gate(installed_gate):
    """Start the installed gate: gate(env, *args) -> Popen."""
    return lambda env, *args, **kw: run_gate(installed_gate, env, *args, **kw)


# ---------------------------------------------------------------- the host layout


def test_gate_yml_installs_the_layout_these_tests_run():
    tasks = {t["name"]: t for t in yaml.safe_load(GATE_YML.read_text())}
    package = tasks["Install the GPU logic the gate runs"]
    assert tuple(package["loop"]) == GATE_PACKAGE
    copy = package["ansible.builtin.copy"]
    assert copy["src"] == "{{ role_path }}/../../plugins/module_utils/sglang_deploy/{{ item }}"
    assert copy["dest"] == "{{ sglang_service_gate_path | dirname }}/sglang_deploy/{{ item }}"
    entries = {e["src"]: e["dest"] for e in tasks["Install the GPU gate and the launcher"]["loop"]}
    guard = "{{ sglang_service_gate_path | dirname }}/sglang-boot-guard"  # beside the package it imports
    assert entries == {
        "sglang-gpu-gate": "{{ sglang_service_gate_path }}",
        "sglang-launch": "{{ sglang_service_launcher_path }}",
        "sglang-boot-guard": guard,
    }
    unit = (REPO / "roles" / "sglang_service" / "templates" / "sglang.service.j2").read_text()
    assert "ExecStartPre=+{{ [sglang_service_gate_path | dirname ~ '/sglang-boot-guard', " in unit  # the same path
    defaults = yaml.safe_load((REPO / "roles" / "sglang_service" / "defaults" / "main.yml").read_text())
    assert defaults["sglang_service_gate_path"] == HOST_GATE


def test_what_the_gate_imports_is_only_the_standard_library_and_the_files_installed_beside_it():
    assert imports_beyond(GATE_PACKAGE) == []


def test_the_gate_uses_the_package_beside_it_not_one_on_pythonpath(gpus, gate, tmp_path):
    _, env = gpus
    decoy = tmp_path / "decoy" / "sglang_deploy"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the decoy on PYTHONPATH was imported')\n")
    proc = gate({**env, "PYTHONPATH": str(decoy.parent)}, "--gpus", "0")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "clean after" in out


def test_the_gate_run_through_a_link_finds_its_package(gpus, installed_gate, tmp_path):
    """gate.yml points the old path (/usr/local/libexec/sglang-gpu-gate) at the new gate with a link."""
    _, env = gpus
    link = tmp_path / "old-libexec" / "sglang-gpu-gate"
    link.parent.mkdir()
    link.symlink_to(installed_gate)
    proc = run_gate(link, env, "--gpus", "0,1")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.startswith("sglang-gpu-gate: GPUs [0, 1] clean after ")


def test_the_gate_without_its_package_exits_2_and_says_where_it_looked(gpus, tmp_path):
    _, env = gpus
    lone = tmp_path / "lone" / "sglang-gpu-gate"
    lone.parent.mkdir()
    shutil.copy2(GATE, lone)
    proc = run_gate(lone, env, "--gpus", "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert f"sglang-gpu-gate: cannot load sglang_deploy.gpu beside {lone}" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------- the verdict, as the unit sees it


def test_clean_gpus_pass_at_once(gpus, gate):
    _, env = gpus
    proc = gate(env, "--gpus", "0,1")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.startswith("sglang-gpu-gate: GPUs [0, 1] clean after ")


def test_a_process_on_the_instances_gpus_is_refused_and_named(gpus, gate):
    state, env = gpus
    with holding(state, ["sleep", "30"], gpu=1, mib=8148) as holder:
        proc = gate(env, "--gpus", "0,1", "--timeout", "0.5")
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "GPUs [0, 1] not clean after 0.5s; refusing to start." in err
    assert f"GPU 1: pid {holder.pid} holds 8148 MiB (user root, unit " in err
    assert "command sleep 30" in err


def test_other_gpus_being_busy_does_not_matter(gpus, gate):
    state, env = gpus
    nvsim.lab_gpu(["hold", "--pid", "4242", "--gpu", "3", "--mib", "9000", "--pinned"], path=state)
    proc = gate(env, "--gpus", "0,1,2", "--timeout", "0.5")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_waits_for_a_process_to_go_then_passes(gpus, gate):
    state, env = gpus
    with holding(state, ["sleep", "30"], gpu=0, mib=20000):
        proc = gate(env, "--gpus", "0", "--timeout", "20")
        wait_for("the gate to poll nvidia-smi 3 times", lambda: nvidia_smi_calls(state) >= 6, timeout=15)  # 2 a poll
        assert proc.poll() is None, "the gate must wait while the GPU is held"
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "clean after" in out


def test_memory_still_being_released_is_waited_for(gpus, gate):
    state, env = gpus
    hold = ["hold", "--pid", "999999", "--gpu", "2", "--mib", "30000", "--release-seconds", "1.0", "--pinned"]
    nvsim.lab_gpu(hold, path=state)
    nvsim.lab_gpu(["release", "--pid", "999999"], path=state)
    proc = gate(env, "--gpus", "2", "--timeout", "0.3", "--max-used-mib", "100")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "GPU 2: " in err and "MiB used with no process listed (memory still being released?)" in err
    proc = gate(env, "--gpus", "2", "--timeout", "20", "--max-used-mib", "100")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "clean after" in out


def test_nvidia_smi_failure_and_missing_gpus_are_errors(gpus, gate):
    state, env = gpus
    proc = gate(env, "--gpus", "7")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "GPUs [7] are not on this host (it has [0, 1, 2, 3])" in err
    nvsim.lab_gpu(["fail", "driver-mismatch"], path=state)
    proc = gate(env, "--gpus", "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "nvidia-smi failed (exit 18): Failed to initialize NVML: Driver/library version mismatch" in err
    assert "reload the nvidia modules" in err and "Traceback" not in err


def test_an_offenders_multi_line_command_is_shown_on_one_line(gpus, gate):
    """Seen on a real H200: `python3 -c '<script>'` holders have newlines in their command line."""
    state, env = gpus
    with holding(state, [sys.executable, "-c", "import time\ntime.sleep(30)"], gpu=0, mib=100) as holder:
        proc = gate(env, "--gpus", "0", "--timeout", "0.2")
        _, err = proc.communicate(timeout=30)
    (line,) = [x for x in err.splitlines() if f"pid {holder.pid}" in x]
    assert line.endswith("-c import time time.sleep(30))")


def test_a_malformed_gpu_list_is_a_usage_error(gpus, gate):
    _, env = gpus
    proc = gate(env, "--gpus", "0,x")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "--gpus: '0,x' is not a comma-separated list of GPU indices" in err
