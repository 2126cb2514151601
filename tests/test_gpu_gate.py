"""roles/sglang_service/files/sglang-gpu-gate against the lab's simulated nvidia-smi (a PATH shim)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GATE = REPO / "roles" / "sglang_service" / "files" / "sglang-gpu-gate"
sys.path.insert(0, str(REPO / "lab" / "gpu_sim"))
import nvsim  # noqa: E402


@pytest.fixture
def gpus(tmp_path):
    """4 simulated GPUs, and an nvidia-smi on PATH that reads them."""
    state = tmp_path / "state.json"
    nvsim.write_state(nvsim.default_state(4, seed="gate"), str(state))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "nvidia-smi"
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO / 'lab' / 'gpu_sim')!r})\nimport nvsim\nnvsim.main_nvidia_smi()\n")
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LAB_GPU_STATE": str(state)}
    return str(state), env


@contextlib.contextmanager
def holding(state, argv, gpu, mib):
    """A real process (argv) registered as holding `mib` on simulated GPU `gpu`; killed on exit."""
    holder = subprocess.Popen(argv)
    try:
        nvsim.lab_gpu(["hold", "--pid", str(holder.pid), "--gpu", str(gpu), "--mib", str(mib)], path=state)
        yield holder
    finally:
        holder.kill()
        holder.wait()


def gate(env, *args, **kw):
    return subprocess.Popen([sys.executable, str(GATE), *args], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_clean_gpus_pass_at_once(gpus):
    _, env = gpus
    proc = gate(env, "--gpus", "0,1")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.startswith("sglang-gpu-gate: GPUs [0, 1] clean after ")


def test_a_process_on_the_instances_gpus_is_refused_and_named(gpus):
    state, env = gpus
    with holding(state, ["sleep", "30"], gpu=1, mib=8148) as holder:
        proc = gate(env, "--gpus", "0,1", "--timeout", "0.5")
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "GPUs [0, 1] not clean after 0.5s; refusing to start." in err
    assert f"GPU 1: pid {holder.pid} holds 8148 MiB (user root, unit " in err
    assert "command sleep 30" in err


def test_other_gpus_being_busy_does_not_matter(gpus):
    state, env = gpus
    nvsim.lab_gpu(["hold", "--pid", "4242", "--gpu", "3", "--mib", "9000", "--pinned"], path=state)
    proc = gate(env, "--gpus", "0,1,2", "--timeout", "0.5")
    proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_waits_for_a_process_to_go_then_passes(gpus):
    state, env = gpus
    with holding(state, ["sleep", "30"], gpu=0, mib=20000):
        proc = gate(env, "--gpus", "0", "--timeout", "20")
        time.sleep(0.5)
        assert proc.poll() is None, "the gate must wait while the GPU is held"
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "clean after" in out


def test_memory_still_being_released_is_waited_for(gpus):
    state, env = gpus
    nvsim.lab_gpu(["hold", "--pid", "999999", "--gpu", "2", "--mib", "30000", "--release-seconds", "1.0", "--pinned"], path=state)
    nvsim.lab_gpu(["release", "--pid", "999999"], path=state)
    proc = gate(env, "--gpus", "2", "--timeout", "0.3", "--max-used-mib", "100")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "GPU 2: " in err and "MiB used with no process listed (memory still being released?)" in err
    proc = gate(env, "--gpus", "2", "--timeout", "20", "--max-used-mib", "100")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "clean after" in out


def test_nvidia_smi_failure_and_missing_gpus_are_errors(gpus):
    state, env = gpus
    proc = gate(env, "--gpus", "7")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "GPUs [7] are not on this host (it has [0, 1, 2, 3])" in err
    nvsim.lab_gpu(["fail", "driver-mismatch"], path=state)
    proc = gate(env, "--gpus", "0")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "nvidia-smi failed (rc=18): Failed to initialize NVML: Driver/library version mismatch" in err


def test_an_offenders_multi_line_command_is_shown_on_one_line(gpus):
    """Seen on a real H200: `python3 -c '<script>'` holders have newlines in their command line."""
    state, env = gpus
    with holding(state, [sys.executable, "-c", "import time\ntime.sleep(30)"], gpu=0, mib=100) as holder:
        proc = gate(env, "--gpus", "0", "--timeout", "0.2")
        _, err = proc.communicate(timeout=30)
    (line,) = [x for x in err.splitlines() if f"pid {holder.pid}" in x]
    assert line.endswith("-c import time time.sleep(30))")
