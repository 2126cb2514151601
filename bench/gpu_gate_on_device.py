"""The ExecStartPre GPU gate (roles/sglang_service/files/sglang-gpu-gate over plugins/module_utils/sglang_deploy/gpu.py,
laid out as on a host) on real GPUs.

Run on a GPU host (the `device` machine): python3 bench/gpu_gate_on_device.py OUT_DIR
1. clean GPUs: the gate passes;
2. a real process holds ~20 GB on GPU 0 (torch.empty on cuda): the gate refuses within its
   timeout and names the process;
3. the gate waits while it is held; the holder is SIGKILLed; time from the kill to the
   gate's exit (release detection), repeated, median reported;
4. the nvidia-smi query forms the project uses, with their output, for the parser vectors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def host_layout() -> Path:
    """The gate as roles/sglang_service/tasks/gate.yml installs it: the entry point beside its package."""
    lib = Path(tempfile.mkdtemp()) / "sglang-deploy"
    (lib / "sglang_deploy").mkdir(parents=True)
    for name in ("__init__.py", "gpu.py", "procinfo.py"):
        shutil.copy(REPO / "plugins" / "module_utils" / "sglang_deploy" / name, lib / "sglang_deploy" / name)
    shutil.copy(REPO / "roles" / "sglang_service" / "files" / "sglang-gpu-gate", lib / "sglang-gpu-gate")
    return lib / "sglang-gpu-gate"


GATE = [sys.executable, str(host_layout())]
sys.path.insert(0, str(REPO / "collections"))
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import gpu  # noqa: E402  - the modules' verdict, beside the gate's


def module_verdict() -> dict:
    """What the modules (sglang_server's wait, gpu_state) conclude on the same state, without waiting."""
    res = gpu.wait_clean([0], timeout=0.3, interval=0.1, max_used_mib=1024)
    return {"clean": res["clean"], "message": res["message"]}


HOLD = (
    "import sys, time, torch\n"
    "x = torch.empty(int(sys.argv[1]) * 2**20, dtype=torch.uint8, device='cuda:0')\n"
    "torch.cuda.synchronize(); print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def holder(mib: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(mib)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    # Wait until nvidia-smi lists it (polled).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout
        if str(p.pid) in apps.split():
            return p
        time.sleep(0.05)
    raise RuntimeError("nvidia-smi never listed the holder")


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    report: dict = nvidia_smi_queries()
    report["clean"] = gate(timeout="10")
    report["busy"], busy_apps = gate_on_held_gpu()
    report["same_verdict"] = (report["clean"]["rc"] == 0) == report["clean"]["module"]["clean"] and (
        report["busy"]["rc"] == 1
    ) == (not report["busy"]["module"]["clean"])
    report["busy_apps"] = busy_apps
    detections = release_detections(5)
    report["release_to_gate_exit_s"] = detections
    report["release_to_gate_exit_median_s"] = statistics.median(detections)
    (out / "gate.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if not k.startswith("query_")}, indent=1))
    return 0


def nvidia_smi_queries() -> dict:
    """The nvidia-smi query forms the project uses, each with its output (the parser's test vectors)."""
    report = {}
    queries = {
        "gpus": [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,pci.bus_id,memory.used,memory.total,driver_version,persistence_mode,compute_mode",
            "--format=csv",
        ],
        "gpu_probe": [
            "nvidia-smi",
            "--query-gpu=index,uuid,name,memory.total,driver_version",
            "--format=csv,noheader,nounits",
        ],
        "driver": ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        "count": ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
    }
    for name, cmd in queries.items():
        r = subprocess.run(cmd, capture_output=True, text=True)
        report[f"query_{name}"] = {"cmd": " ".join(cmd), "rc": r.returncode, "stdout": r.stdout}
    return report


def gate(timeout: str, **extra) -> dict:
    """The gate on GPU 0 with `timeout`, timed, beside the modules' verdict on the same state (and `extra`)."""
    t = time.monotonic()
    r = subprocess.run([*GATE, "--gpus", "0", "--timeout", timeout], capture_output=True, text=True)
    return {
        "rc": r.returncode,
        "stdout": r.stdout,
        "stderr": r.stderr,
        "seconds": time.monotonic() - t,
        **extra,
        "module": module_verdict(),
    }


def gate_on_held_gpu() -> tuple[dict, str]:
    """The gate while ~20 GB of GPU 0 is held (it refuses, naming the holder), and nvidia-smi's list of the GPU's
    processes then; the holder killed after."""
    p = holder(20000)
    busy = gate(timeout="2", holder_pid=p.pid)
    apps = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory,process_name", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
    )
    p.kill()
    p.wait()
    return busy, apps.stdout


def release_detections(runs: int) -> list[float]:
    """Seconds from a holder's SIGKILL to the waiting gate's exit, `runs` times."""
    detections = []
    for _ in range(runs):
        p = holder(20000)
        g = subprocess.Popen(
            [*GATE, "--gpus", "0", "--timeout", "60", "--interval", "0.05"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)
        assert g.poll() is None, "gate passed while the GPU was held"
        t = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        g.wait(timeout=60)
        detections.append(time.monotonic() - t)
        p.wait()
        assert g.returncode == 0, g.stderr.read()
    return detections


if __name__ == "__main__":
    sys.exit(main())
