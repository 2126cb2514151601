"""module_utils/sglang_gpu (the GPU state and the wait for clean GPUs) and library/gpu_state.

Parsers run on the real H200 captures (tests/vectors); the wait and the stop policy on
the lab's simulated nvidia-smi (a PATH shim) with real processes holding its GPUs.
"""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "module_utils"))
import sglang_gpu  # noqa: E402
import test_gpu_gate  # noqa: E402
from test_gpu_gate import holding, nvsim  # noqa: E402

gpus = test_gpu_gate.gpus  # the fixture: 4 simulated GPUs and an nvidia-smi that reads them
from test_nvsim import UUIDS_2GPU, VEC  # noqa: E402

TWO_GPUS_BUSY = "2 GPUs: process 564 holds 8 GB on each GPU; process 565 holds 3 GB on GPU 1 and a 518 MiB context on GPU 0"


def vector(title: str, startswith: str, endswith: str = "") -> str:
    return next(out for cmd, out in VEC[title] if cmd.startswith(startswith) and cmd.endswith(endswith))


def test_real_capture_gpus_and_processes():
    gpus_out = vector(TWO_GPUS_BUSY, "nvidia-smi --query-gpu=index,uuid,name,pci.bus_id")
    # The module queries index,uuid,name,memory.used,memory.total: same fields, fewer columns.
    rows = [r.split(", ") for r in gpus_out.splitlines()]
    text = "\n".join(", ".join([r[0], r[1], r[2], r[4], r[5]]) for r in rows)
    parsed = sglang_gpu.parse_gpus(text)
    assert [(g["index"], g["uuid"], g["memory_used_mib"], g["memory_total_mib"]) for g in parsed] == [
        (0, UUIDS_2GPU[0], 8681, 143771), (1, UUIDS_2GPU[1], 11543, 143771)]  # fmt: skip
    apps = sglang_gpu.parse_apps(vector(TWO_GPUS_BUSY, "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader"), parsed)
    assert [(a["pid"], a["gpu"], a["used_mib"], a["process_name"]) for a in apps] == [
        (564, 0, 8148, "python3"), (565, 0, 518, "python3"), (564, 1, 8148, "python3"), (565, 1, 3380, "python3")]  # fmt: skip


def test_header_and_units_are_understood():
    with_units = vector(TWO_GPUS_BUSY, "nvidia-smi --query-compute-apps=", "--format=csv")
    gpus = [{"index": 0, "uuid": UUIDS_2GPU[0]}, {"index": 1, "uuid": UUIDS_2GPU[1]}]
    apps = sglang_gpu.parse_apps(with_units, gpus)
    assert [(a["pid"], a["gpu"], a["used_mib"]) for a in apps] == [(564, 0, 8148), (565, 0, 518), (564, 1, 8148), (565, 1, 3380)]


def test_not_available_memory_is_none_not_a_crash():
    apps = sglang_gpu.parse_apps(f"77, {UUIDS_2GPU[0]}, [N/A], python3", [{"index": 0, "uuid": UUIDS_2GPU[0]}])
    assert apps[0]["used_mib"] is None and apps[0]["gpu"] == 0


@pytest.fixture
def sim(gpus, monkeypatch):
    state, env = gpus
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("LAB_GPU_STATE", state)
    return state


def test_snapshot_names_pid_user_unit_and_command_line(sim):
    with holding(sim, ["sleep", "30"], gpu=2, mib=4096) as holder:
        snap = sglang_gpu.snapshot()
    assert len(snap["gpus"]) == 4
    (proc,) = snap["processes"]
    assert (proc["pid"], proc["gpu"], proc["used_mib"]) == (holder.pid, 2, 4096)
    assert proc["user"] == getpass.getuser() and proc["cmdline"] == "sleep 30"


@pytest.mark.parametrize("mode,words", [("driver-mismatch", "reload the nvidia modules"), ("no-driver", "not loaded")])
def test_nvidia_smi_failures_are_explained(sim, mode, words):
    nvsim.lab_gpu(["fail", mode], path=sim)
    with pytest.raises(sglang_gpu.NvidiaSmiError) as exc:
        sglang_gpu.snapshot()
    assert "nvidia-smi failed" in str(exc.value) and words in str(exc.value)


def test_missing_nvidia_smi_is_explained(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(sglang_gpu.NvidiaSmiError, match="not installed"):
        sglang_gpu.snapshot()


def test_wait_returns_when_memory_is_released(sim):
    holder = subprocess.Popen(["sleep", "30"])
    nvsim.lab_gpu(["hold", "--pid", str(holder.pid), "--gpu", "0", "--mib", "60000", "--release-seconds", "0.6"], path=sim)
    killed_at = time.monotonic()
    holder.kill()
    holder.wait()
    res = sglang_gpu.wait_clean([0], timeout=10, interval=0.05, max_used_mib=1024)
    assert res["clean"], res["message"]
    # Listed no more at once, but clean only once memory fell under 1024 MiB (about 0.59 s).
    assert 0.4 < time.monotonic() - killed_at < 3 and res["polls"] > 2


def test_timeout_names_every_offender_and_stops_nothing_by_default(sim):
    with holding(sim, ["sleep", "30"], gpu=1, mib=8148) as holder:
        res = sglang_gpu.wait_clean([0, 1], timeout=0.3, interval=0.05)
        assert holder.poll() is None  # still running: policy none
    assert not res["clean"] and res["stopped"] == {}
    assert f"GPU 1: pid {holder.pid} holds 8148 MiB (user {getpass.getuser()}" in res["message"]
    assert "command sleep 30" in res["message"] and "never stopped" in res["message"]


def test_other_gpus_do_not_matter(sim):
    with holding(sim, ["sleep", "30"], gpu=3, mib=8148):
        assert sglang_gpu.wait_clean([0, 1], timeout=0.2, interval=0.05)["clean"]


def test_policy_own_stops_the_service_users_process_but_not_others(sim):
    me = getpass.getuser()
    with holding(sim, ["sleep", "30"], gpu=0, mib=8148) as holder:
        res = sglang_gpu.wait_clean([0], timeout=5, interval=0.05, policy="own", service_user="someone-else")
        assert not res["clean"] and holder.poll() is None and res["refused"]
        res = sglang_gpu.wait_clean([0], timeout=5, interval=0.05, policy="own", service_user=me, kill_grace=2)
        assert res["clean"], res["message"]
        assert res["stopped"] == {holder.pid: "SIGTERM"} and holder.wait(timeout=5) == -15


def test_policy_own_escalates_to_sigkill(sim):
    with holding(sim, [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"],
                 gpu=0, mib=100) as holder:  # fmt: skip
        time.sleep(0.3)  # let it ignore SIGTERM first
        res = sglang_gpu.wait_clean([0], timeout=5, interval=0.05, policy="own", service_user=getpass.getuser(), kill_grace=0.5)
        assert res["clean"] and res["stopped"] == {holder.pid: "SIGKILL"}


def test_force_stops_anyone(sim):
    with holding(sim, ["sleep", "30"], gpu=0, mib=100) as holder:
        res = sglang_gpu.wait_clean([0], timeout=5, interval=0.05, policy="force", kill_grace=2)
        assert res["clean"] and holder.pid in res["stopped"]


def test_a_missing_gpu_is_named(sim):
    res = sglang_gpu.wait_clean([0, 7], timeout=1, interval=0.05)
    assert not res["clean"] and res["missing"] == [7] and "GPUs [7] are not on this host (it has [0, 1, 2, 3])" in res["message"]


def run_module(env: dict, args: dict) -> tuple[int, dict]:
    """library/gpu_state.py run as Ansible runs it (arguments as JSON), on this machine."""
    argfile = Path(env["LAB_GPU_STATE"]).with_name("args.json")
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    shim = Path(env["LAB_GPU_STATE"]).with_name("ansible_shim")
    shim.mkdir(exist_ok=True)
    mu = shim / "ansible_module_utils_shim.py"
    mu.write_text(
        "import sys, importlib, types\n"
        f"sys.path.insert(0, {str(REPO / 'module_utils')!r})\n"
        "import ansible.module_utils, sglang_gpu\n"
        "sys.modules['ansible.module_utils.sglang_gpu'] = sglang_gpu\n"
        f"sys.argv = ['gpu_state', {str(argfile)!r}]\n"
        f"exec(compile(open({str(REPO / 'library' / 'gpu_state.py')!r}).read(), 'gpu_state', 'exec'), {{'__name__': '__main__'}})\n"
    )
    proc = subprocess.run([sys.executable, str(mu)], env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout)


def test_module_reports_and_fails_with_offenders(gpus):
    state, env = gpus
    rc, out = run_module(env, {})
    assert rc == 0 and len(out["gpus"]) == 4 and out["processes"] == [] and not out["changed"]
    with holding(state, ["sleep", "30"], gpu=1, mib=8148) as holder:
        rc, out = run_module(env, {"wait": True, "gpus": [1], "timeout": 0.3})
    assert rc == 1 and out["failed"] and f"pid {holder.pid} holds 8148 MiB" in out["msg"]
    assert out["wait"]["offenders"][0]["pid"] == holder.pid


def test_module_refuses_slow_polling(gpus):
    _, env = gpus
    rc, out = run_module(env, {"wait": True, "interval": 1.0})
    assert rc == 1 and "interval is 1.0: poll at least every 0.25 s" in out["msg"]
