"""plugins/modules/gpu_state and the wait for clean GPUs (plugins/module_utils/sglang_deploy/gpu.py) on real GPUs.

Run on a GPU host (the `device` machine), with ansible-core installed:
    python3 bench/gpu_state_on_device.py OUT_DIR [RUNS]
1. the module through Ansible (ansible localhost -m sglang.deploy.gpu_state) on idle GPUs;
2. a real process holds ~20 GB on GPU 0 (torch.empty on cuda): the module lists it with
   pid, user, command line, memory; wait=true with a short timeout fails naming it;
3. the module waits (wait=true) while a holder is SIGKILLed 2 s later: it succeeds;
4. release detection, repeated: SIGKILL of a 30 GB holder to the wait's return, through
   the same code the module runs (median reported);
5. stop policy 'own' stops the service user's holder (here root's: service_user=root).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "collections"))
from gpu_gate_on_device import holder  # noqa: E402  (bench/ is on sys.path: a real process holding GPU memory)

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import gpu as sglang_gpu  # noqa: E402


def module(args: dict) -> tuple[int, dict]:
    """gpu_state run by Ansible itself on this host."""
    # ansible-core and this checkout as the collection sglang.deploy alone, and no project ansible.cfg (it names
    # collection callbacks).
    cfg = Path("/tmp/gpu-state-bench-ansible.cfg")
    cfg.write_text("[defaults]\n")
    tree = Path("/tmp/gpu-state-bench-tree")
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(cfg),
        "ANSIBLE_COLLECTIONS_PATH": str(REPO / "collections"),
        "ANSIBLE_LOCALHOST_WARNING": "0",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
    }
    cmd = [
        "ansible",
        "localhost",
        "-c",
        "local",
        "-e",
        f"ansible_python_interpreter={sys.executable}",
        "-t",
        str(tree),
        "-m",
        "sglang.deploy.gpu_state",
        "-a",
        " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in args.items()),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        res = json.loads((tree / "localhost").read_text())
    except (OSError, ValueError):
        res = {"stdout": proc.stdout[-3000:], "stderr": proc.stderr[-3000:]}
        print("ansible failed:", res, flush=True)
    return proc.returncode, res


def main() -> int:
    out = Path(sys.argv[1])
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "nvidia_smi": subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout
    }
    report["idle"] = idle()
    report.update(held())
    latencies = release_detection(runs)
    report["release_detection_s"] = latencies
    report["release_detection_median_s"] = statistics.median(latencies)
    print("kill -> wait returns (s):", latencies, "median", statistics.median(latencies), flush=True)
    report["policy_own"] = policy_own()
    (out / "gpu-state-on-device.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


def idle() -> dict:
    """1. The module on idle GPUs (its raw result kept when Ansible failed)."""
    rc, res = module({})
    print("idle:", rc, json.dumps(res.get("gpus")), res.get("processes"), flush=True)
    return {"rc": rc, "gpus": res.get("gpus"), "processes": res.get("processes"), "raw": None if rc == 0 else res}


def held() -> dict:
    """2 and 3. A holder of ~20 GB on GPU 0: the module lists it; wait=true with a 1 s timeout fails naming it; a
    wait of 60 s succeeds once the holder is killed 2 s in. The holder is killed whatever happens."""
    report = {}
    h = holder(20480)
    try:
        rc, res = module({})
        report["held"] = {"rc": rc, "holder_pid": h.pid, "processes": res.get("processes"), "gpus": res.get("gpus")}
        print("held:", rc, json.dumps(res.get("processes")), flush=True)
        t0 = time.monotonic()
        rc, res = module({"wait": True, "gpus": [0], "timeout": 1})
        report["held_wait_timeout"] = {"rc": rc, "msg": res.get("msg"), "seconds": round(time.monotonic() - t0, 3)}
        print("held, wait 1 s:", rc, res.get("msg"), flush=True)
        # The module waits while the holder is killed 2 s later.
        killer = threading.Timer(2.0, h.kill)
        killer.start()
        t0 = time.monotonic()
        rc, res = module({"wait": True, "gpus": [0], "timeout": 60})
        report["module_wait_through_kill"] = {
            "rc": rc,
            "wait": res.get("wait"),
            "wall_s": round(time.monotonic() - t0, 3),
        }
        print("module wait through a kill at 2 s:", rc, res.get("wait"), flush=True)
    finally:
        h.kill()
        h.wait()
    return report


def release_detection(runs: int) -> list[float]:
    """4. Seconds from a 30 GB holder's kill to the return of the wait the module runs (gpu.wait_clean), `runs`
    times."""
    latencies = []
    for _ in range(runs):
        h = holder(30720)
        result: dict = {}

        def wait(result: dict = result) -> None:
            result.update(sglang_gpu.wait_clean([0], timeout=60, interval=0.1, max_used_mib=1024))
            result["returned_at"] = time.monotonic()

        t = threading.Thread(target=wait)
        t.start()
        time.sleep(1.0)
        killed_at = time.monotonic()
        h.kill()
        h.wait()
        t.join()
        latencies.append(round(result["returned_at"] - killed_at, 3))
        assert result["clean"], result
    return latencies


def policy_own() -> dict:
    """5. Stop policy 'own' with this user as the service user: the module stops this user's holder and waits."""
    h = holder(1024)
    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    t0 = time.monotonic()
    rc, res = module(
        {"wait": True, "gpus": [0], "timeout": 30, "stop_policy": "own", "service_user": me, "kill_grace": 5}
    )
    report = {
        "rc": rc,
        "wait": res.get("wait"),
        "changed": res.get("changed"),
        "holder_exit": h.poll(),
        "wall_s": round(time.monotonic() - t0, 3),
    }
    print("policy own:", rc, res.get("changed"), res.get("wait"), flush=True)
    h.kill()
    h.wait()
    return report


if __name__ == "__main__":
    sys.exit(main())
