"""The NCCL preflight (plugins/module_utils/sglang_deploy/nccl.py and nccl_worker.py) on real GPUs.

Run on a GPU host (the `device` machine, kind nvidia-h200-x2), with py-spy carried as a wheel:
    python3 bench/nccl_preflight_on_device.py OUT_DIR
1. captures: nvidia-smi topo -m, topo -p2p n/r, nvlink --status, -q; torch's view of peer access;
2. the floor derived from that topology (nccl.derive_floor);
3. the preflight (nccl.preflight: the worker under this python, one process per GPU) with
   (a) the default environment, (b) the seed's NCCL variables (group_vars/all.yml's
   eagle3_5tok_cuda_graph profile), (c) NCCL_PROTO=bogus and (d) NCCL_ALGO=Nope (refused, NCCL's
   message), and, to look for the earlier 12.9 GB/s: (e) NCCL_P2P_DISABLE=1 (host memory), each
   with sizes from 1 MiB to 1 GiB and the 30 s budget; (f) the default run's raw NCCL lines;
4. a py-spy dump of a process holding CUDA memory, plain and --nonblocking;
5. the hunt for the earlier 12.9 GB/s ("PCIe-like on NV18"): the default and the seed's
   environment from 64 KiB to 1 MiB (latency-bound sizes), and two ways of measuring that
   others use: NCCL timed per operation on the host (synchronize after each), and gloo on CUDA
   tensors (every byte through host memory).

Every environment keeps this host's multicast switches (NCCL_NVLS_ENABLE=0 and the two others
the device README names): a program that uses NVLink multicast there can take the host's GPUs
out of service. The results go to OUT_DIR/nccl-preflight.json; the captures beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "collections"))
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import nccl  # noqa: E402

# The device host's rule: never NVLink multicast (NVLS), whatever environment a program gets.
HOST_SAFETY = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SEED = {
    "NCCL_PROTO": "LL",
    "NCCL_ALGO": "Ring",
    "NCCL_P2P_LEVEL": "SYS",
    "NCCL_MIN_NCHANNELS": "16",
    "NCCL_BUFFSIZE": "16777216",
    "NCCL_NTHREADS": "512",
}
CASES = {
    "default": {},
    "seed": SEED,
    "bad_proto": {"NCCL_PROTO": "bogus"},
    "bad_algo": {"NCCL_ALGO": "Nope"},
    "p2p_disabled": {"NCCL_P2P_DISABLE": "1"},
}

# Two other ways of timing an all-reduce (one process per GPU, env rendezvous): argv rank world mode.
PROBE = """
import json, sys, time, torch, torch.distributed as dist
rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.set_device(rank)
if mode == "gloo_cuda":
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = [1 << k for k in range(20, 29, 2)]
else:
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    sizes = [1 << k for k in range(16, 31, 2)]
rows = []
for nbytes in sizes:
    t = torch.zeros(nbytes // 4, device="cuda")
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    n = 20 if nbytes <= 1 << 24 else 3
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
        torch.cuda.synchronize()
    rows.append([nbytes, (time.perf_counter() - t0) / n])
if rank == 0:
    print(json.dumps(rows))
dist.destroy_process_group()
"""

HOLD = (
    "import time, torch\n"
    "def hold_cuda_memory(gib):\n"
    "    x = torch.empty(gib << 30, dtype=torch.uint8, device='cuda:0')\n"
    "    torch.cuda.synchronize(); print('held', flush=True)\n"
    "    while True:\n"
    "        time.sleep(0.1)\n"
    "hold_cuda_memory(4)\n"
)


def sh(*cmd: str) -> dict:
    t = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    return {"cmd": " ".join(cmd), "rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr, "s": time.monotonic() - t}


def base_env() -> dict:
    """This host's environment less any NCCL_/GLOO_ variable, plus the multicast switches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "GLOO_"))}
    return {**env, **HOST_SAFETY}


def py_spy(out: Path) -> dict:
    p = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    res = {"holder_pid": p.pid, "whoami": sh("id")["stdout"].strip()}
    status = Path("/proc/self/status").read_text()
    res["cap_eff"] = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("CapEff")), None)
    res["ptrace_scope"] = sh("cat", "/proc/sys/kernel/yama/ptrace_scope")["stdout"].strip() or None
    res["apps"] = sh("nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader")["stdout"]
    res["dump"] = sh("py-spy", "dump", "--pid", str(p.pid))
    res["dump_nonblocking"] = sh("py-spy", "dump", "--nonblocking", "--pid", str(p.pid))
    res["dump_locals"] = sh("py-spy", "dump", "--locals", "--pid", str(p.pid))
    p.kill()
    p.wait()
    text = "\n\n".join(
        f"$ {res[k]['cmd']}  (rc {res[k]['rc']})\n{res[k]['stdout']}{res[k]['stderr']}"
        for k in ("dump", "dump_nonblocking", "dump_locals")
    )
    (out / "py-spy-dump.txt").write_text(text)
    return res


def probe(mode: str, env: dict) -> dict:
    """PROBE on both GPUs: [[bytes, seconds per operation], ...] from rank 0, with busbw (n = 2: busbw = algbw)."""
    penv = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + len(mode))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, str(r), "2", mode],
            env=penv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    try:
        rows = json.loads(outs[0][0].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": outs[0][1][-2000:]}
    return {
        "rows": [
            {
                "bytes": b,
                "time_us": round(s * 1e6, 1),
                "busbw_gbps": round(nccl.busbw_gbps(nccl.algbw_gbps(b, s), 2), 2),
            }
            for b, s in rows
        ]
    }


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "host_env_nccl": {
            k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "GLOO_", "CUDA_", "TORCH_", "NVSHMEM_"))
        }
    }
    cap = captures(out)
    peer = sh(
        sys.executable,
        "-c",
        "import torch; print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count(), torch.cuda.can_device_access_peer(0, 1))",
    )
    report["torch_peer"] = peer["stdout"].strip() or peer["stderr"][-500:]
    topo = nccl.parse_topo(cap["topo_m"]["stdout"])
    status = nccl.parse_nvlink_status(cap["nvlink_status"]["stdout"])
    report["topology"] = topo
    report["nvlink"] = status
    report["floor"] = nccl.derive_floor(topo, None, status)
    env = base_env()
    report["cases"] = preflights(topo["gpus"], env)
    (out / "nccl-raw-log.txt").write_text(raw_logs(topo["gpus"], env))
    report["py_spy"] = py_spy(out)
    report["small_sizes"] = small_sizes(topo["gpus"], env)
    report["probes"] = {mode: probe(mode, env) for mode in ("nccl_host_timed", "gloo_cuda")}
    (out / "nccl-preflight.json").write_text(json.dumps(report, indent=1, default=str))
    print_report(report)
    return 0


def captures(out: Path) -> dict[str, dict]:
    """1. The topology as nvidia-smi shows it, written beside the results (captures.txt, nvidia-smi-q.txt)."""
    cap = {
        "topo_m": sh("nvidia-smi", "topo", "-m"),
        "topo_p2p_n": sh("nvidia-smi", "topo", "-p2p", "n"),
        "topo_p2p_r": sh("nvidia-smi", "topo", "-p2p", "r"),
        "nvlink_status": sh("nvidia-smi", "nvlink", "--status"),
        "nvlink_caps": sh("nvidia-smi", "nvlink", "-c"),
        "gpus": sh("nvidia-smi", "--query-gpu=index,name,pci.bus_id,driver_version", "--format=csv"),
    }
    (out / "nvidia-smi-q.txt").write_text(sh("nvidia-smi", "-q")["stdout"])
    (out / "captures.txt").write_text(
        "\n".join(f"$ {c['cmd']}  (rc {c['rc']})\n{c['stdout']}{c['stderr']}" for c in cap.values())
    )
    return cap


def preflights(gpus: list, env: dict) -> dict[str, dict]:
    """3. The preflight in each of CASES' environments, timed, each said as it ends."""
    cases = {}
    for name, case in CASES.items():
        t = time.monotonic()
        res = nccl.preflight(sys.executable, case, gpus=gpus, base_env=env, budget_s=30.0)
        res["wall_s"] = round(time.monotonic() - t, 2)
        res["case_env"] = case
        cases[name] = res
        print(f"{name}: {res['status']} in {res['wall_s']} s: {res['message']}", flush=True)
    return cases


def raw_logs(gpus: list, env: dict) -> str:
    """The raw NCCL lines of a default run (sizes to 16 MiB) and of a refused value: what the parser reads."""
    logs = []
    for name, case in (("default", {}), ("bad_proto", {"NCCL_PROTO": "bogus"})):
        wenv = {**env, **case, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        worker = REPO / "plugins" / "module_utils" / "sglang_deploy" / "nccl_worker.py"
        r = subprocess.run(
            [sys.executable, str(worker), "--max-bytes", str(16 << 20), "--keep-log", "60000"],
            capture_output=True,
            text=True,
            env=wenv,
        )
        try:
            logs.append(f"##### {name} (rc {r.returncode})\n{json.loads(r.stdout).get('log', '')}")
        except ValueError:
            logs.append(f"##### {name} (rc {r.returncode}) no JSON\n{r.stdout[-5000:]}\n{r.stderr[-5000:]}")
    return "\n".join(logs)


def small_sizes(gpus: list, env: dict) -> dict[str, list]:
    """5. The default and the seed's environment from 64 KiB to 1 MiB (latency-bound sizes), no floor."""
    sizes = {}
    for name in ("default", "seed"):
        res = nccl.preflight(
            sys.executable,
            CASES[name],
            gpus=gpus,
            base_env=env,
            min_bytes=64 << 10,
            max_bytes=1 << 20,
            floor_gbps=0,
        )
        sizes[name] = res["result"]["sizes"]
    return sizes


def print_report(report: dict) -> None:
    """The floor, each case's sizes, the small sizes, the probes and py-spy's dump, for the device run's log."""
    print(f"floor: {report['floor']['floor_gbps']} GB/s ({report['floor']['basis']}, {report['floor']['link']})")
    for name, res in report["cases"].items():
        rows = (res.get("result") or {}).get("sizes") or []
        print(f"== {name}: {res['status']}: {res['message']}")
        for row in rows:
            print(
                f"  {row['bytes']:>11} {row['time_us']:>10} us algbw {row['algbw_gbps']:>8} busbw {row['busbw_gbps']:>8} {row.get('algorithm')}/{row.get('protocol')} x{row['iters']}"
            )
    for name, rows in report["small_sizes"].items():
        print(f"== small sizes, {name}: " + ", ".join(f"{r['bytes'] >> 10} KiB {r['busbw_gbps']}" for r in rows))
    for mode, res in report["probes"].items():
        print(
            f"== probe {mode}: "
            + (
                ", ".join(f"{r['bytes'] >> 10} KiB {r['busbw_gbps']}" for r in res["rows"])
                if "rows" in res
                else res["error"]
            )
        )
    ps = report["py_spy"]
    print("py-spy:", {k: ps[k]["rc"] for k in ("dump", "dump_nonblocking", "dump_locals")}, "CapEff", ps["cap_eff"])
    print(ps["dump"]["stdout"][-1500:], ps["dump"]["stderr"][-800:])


if __name__ == "__main__":
    sys.exit(main())
