"""LAB TEST DOUBLE: a simulated nvidia-smi for lab nodes without GPUs.

Never installed by the roles; the lab image build (lab/image/build.sh) puts it
at /usr/local/bin/nvidia-smi on lab nodes only. It answers the query forms the
project uses, in exactly the format of the real nvidia-smi 580 (see
../shared/reference/nvidia-smi-h200.md), from a state file that lab processes
update with the companion command ``lab-gpu``:

    lab-gpu init --gpus 8              # 8 idle simulated H200s
    lab-gpu hold --pid 123 --gpu 0,1 --mib 8148 --name python3
    lab-gpu release --pid 123          # start releasing its memory now
    lab-gpu fail driver-mismatch       # nvidia-smi itself fails (or: none)
    lab-gpu driver 570.86.15           # the driver version it reports

Memory model (what the wait-for-clean-GPUs logic has to cope with):
- a held allocation is listed as a compute app while its pid is alive (or
  while it is "pinned": a stray that nothing here may kill);
- once the pid is gone (or ``release`` was called) the app is no longer
  listed, but the GPU's memory.used falls linearly to zero over the
  allocation's ``release_seconds`` (0: at once, as the real H200 did);
- a GPU with any app listed shows ``context_overhead_mib`` more used memory
  than its apps hold (15 MiB on the reference hosts).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

STATE_FILE = os.environ.get("LAB_GPU_STATE", "/var/lib/lab-gpu-sim/state.json")

# nvidia-smi's own messages and exit codes for a broken driver.
FAILURES = {
    "no-driver": (
        9,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        "Make sure that the latest NVIDIA driver is installed and running.\n",
    ),
    "driver-mismatch": (
        18,
        "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.159\n",
    ),
}

GPU_FIELDS: dict[str, tuple[str, str | None]] = {
    # field: (header, unit)
    "count": ("count", None),
    "index": ("index", None),
    "uuid": ("uuid", None),
    "name": ("name", None),
    "pci.bus_id": ("pci.bus_id", None),
    "memory.used": ("memory.used [MiB]", "MiB"),
    "memory.total": ("memory.total [MiB]", "MiB"),
    "memory.free": ("memory.free [MiB]", "MiB"),
    "driver_version": ("driver_version", None),
    "persistence_mode": ("persistence_mode", None),
    "compute_mode": ("compute_mode", None),
    "temperature.gpu": ("temperature.gpu", None),
    "power.draw": ("power.draw [W]", "W"),
    "utilization.gpu": ("utilization.gpu [%]", "%"),
}
APP_FIELDS: dict[str, tuple[str, str | None]] = {
    "pid": ("pid", None),
    "process_name": ("process_name", None),
    "name": ("process_name", None),
    "gpu_uuid": ("gpu_uuid", None),
    "gpu_bus_id": ("gpu_bus_id", None),
    "used_memory": ("used_gpu_memory [MiB]", "MiB"),
    "used_gpu_memory": ("used_gpu_memory [MiB]", "MiB"),
}


# --------------------------------------------------------------------------- state


def default_state(gpus: int, seed: str | None = None) -> dict[str, Any]:
    seed = seed or socket.gethostname()
    return {
        "version": 1,
        "driver_version": "580.159.04",
        "cuda_version": "13.0",
        "context_overhead_mib": 15,
        "fail": None,
        "gpus": [
            {
                "index": i,
                "uuid": _uuid(seed, i),
                "name": "NVIDIA H200",
                "pci_bus_id": f"00000000:00:{6 + i:02X}.0",
                "memory_total_mib": 143771,
                "temperature_c": 36 - (i % 4),
                "power_w": 78 + (i % 3),
                "power_cap_w": 700,
                "persistence_mode": "Enabled",
                "compute_mode": "Default",
            }
            for i in range(gpus)
        ],
        "apps": [],
    }


def _uuid(seed: str, index: int) -> str:
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@contextlib.contextmanager
def locked_state(path: str = STATE_FILE, write: bool = False) -> Iterator[dict[str, Any]]:
    """Read (and with write=True, rewrite) the state under a lock."""
    mode = "r+" if write else "r"
    with open(path, mode, encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        state = json.load(fh)
        yield state
        if write:
            fh.seek(0)
            fh.truncate()
            json.dump(state, fh, indent=1)
            fh.flush()


def write_state(state: dict[str, Any], path: str = STATE_FILE) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=1)
    os.chmod(tmp, 0o666)
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    """Alive even where /proc hides it (a unit with ProtectProc=invisible runs nvidia-smi too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no GPU memory
    except (OSError, IndexError):
        return True


def settle(state: dict[str, Any], now: float) -> bool:
    """Mark apps whose process has gone; drop fully released ones. True if changed."""
    changed = False
    kept = []
    for app in state["apps"]:
        if app.get("released_at") is None and not app.get("pinned") and not _pid_alive(app["pid"]):
            app["released_at"] = now
            changed = True
        rel = app.get("released_at")
        if rel is not None and now >= rel + float(app.get("release_seconds", 0)):
            changed = True
            continue
        kept.append(app)
    state["apps"] = kept
    return changed


def app_memory(app: dict[str, Any], now: float) -> int:
    rel = app.get("released_at")
    if rel is None:
        return int(app["used_mib"])
    span = float(app.get("release_seconds", 0))
    if span <= 0:
        return 0
    left = max(0.0, 1.0 - (now - rel) / span)
    return int(app["used_mib"] * left)


def snapshot(path: str = STATE_FILE, now: float | None = None) -> dict[str, Any]:
    """The state as nvidia-smi sees it right now (dead pids accounted for)."""
    now = time.time() if now is None else now
    with locked_state(path) as state:
        needs_write = any(
            a.get("released_at") is None and not a.get("pinned") and not _pid_alive(a["pid"]) for a in state["apps"]
        )
    if needs_write:
        with contextlib.suppress(OSError), locked_state(path, write=True) as state:
            settle(state, now)
    with locked_state(path) as state:
        settle(state, now)  # view only: fully released apps vanish
        return state


def gpu_view(state: dict[str, Any], now: float) -> list[dict[str, Any]]:
    gpus = []
    for gpu in state["gpus"]:
        apps = [a for a in state["apps"] if a["gpu"] == gpu["index"]]
        listed = [a for a in apps if a.get("released_at") is None]
        used = sum(app_memory(a, now) for a in apps)
        if listed:
            used += int(state.get("context_overhead_mib", 0))
        used = min(used, gpu["memory_total_mib"])
        gpus.append({**gpu, "memory_used_mib": used, "apps": listed})
    return gpus


# --------------------------------------------------------------------------- nvidia-smi


def _fmt(value: Any, unit: str | None, units: bool) -> str:
    if unit and units:
        return f"{value} {unit}"
    return str(value)


def query_gpu(gpus: list[dict[str, Any]], fields: list[str], header: bool, units: bool) -> str:
    out = []
    if header:
        out.append(", ".join(GPU_FIELDS[f][0] for f in fields))
    for g in gpus:
        values = {
            "count": len(gpus),
            "index": g["index"],
            "uuid": g["uuid"],
            "name": g["name"],
            "pci.bus_id": g["pci_bus_id"],
            "memory.used": g["memory_used_mib"],
            "memory.total": g["memory_total_mib"],
            "memory.free": g["memory_total_mib"] - g["memory_used_mib"],
            "driver_version": g["driver_version"],
            "persistence_mode": g["persistence_mode"],
            "compute_mode": g["compute_mode"],
            "temperature.gpu": g["temperature_c"],
            "power.draw": f"{g['power_w']:.2f}",
            "utilization.gpu": 0,
        }
        out.append(", ".join(_fmt(values[f], GPU_FIELDS[f][1], units) for f in fields))
    return "".join(line + "\n" for line in out)


def query_apps(gpus: list[dict[str, Any]], fields: list[str], header: bool, units: bool) -> str:
    out = []
    if header:
        out.append(", ".join(APP_FIELDS[f][0] for f in fields))
    # nvidia-smi lists apps GPU by GPU, in the order the processes appeared.
    for g in gpus:
        for a in g["apps"]:
            values = {
                "pid": a["pid"],
                "process_name": a.get("name", "python3"),
                "name": a.get("name", "python3"),
                "gpu_uuid": g["uuid"],
                "gpu_bus_id": g["pci_bus_id"],
                "used_memory": a["used_mib"],
                "used_gpu_memory": a["used_mib"],
            }
            out.append(", ".join(_fmt(values[f], APP_FIELDS[f][1], units) for f in fields))
    return "".join(line + "\n" for line in out)


WIDE = "+" + "-" * 89 + "+"
SPLIT = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"


def table(state: dict[str, Any], gpus: list[dict[str, Any]], now: float) -> str:
    stamp = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now))
    drv, cuda = state["driver_version"], state["cuda_version"]
    lines = [
        f"{stamp}       ",
        WIDE,
        "| " + f"NVIDIA-SMI {drv:<23}Driver Version: {drv:<15}CUDA Version: {cuda:<9}" + "|",
        SPLIT,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
    ]
    for g in gpus:
        pm = "On" if g["persistence_mode"] == "Enabled" else "Off"
        power = f"{g['power_w']}W /  {g['power_cap_w']}W"
        mem = f"{g['memory_used_mib']}MiB / {g['memory_total_mib']}MiB"
        lines += [
            f"|{g['index']:>4}  {g['name']:<29}{pm:>4}  |   {g['pci_bus_id']} Off |{'0':>21} |",
            f"| N/A   {g['temperature_c']}C    P0 {power:>23} | {mem:>22} |{'0%':>8}{g['compute_mode']:>13} |",
            f"|{'':41}|{'':24}|{'Disabled':>21} |",
            SPLIT,
        ]
    lines += [
        "",
        WIDE,
        f"| {'Processes:':<88}|",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * 89 + "|",
    ]
    apps = [(g, a) for g in gpus for a in g["apps"]]
    if not apps:
        lines.append(f"|  {'No running processes found':<87}|")
    for g, a in apps:
        name = a.get("name", "python3")[:35]
        lines.append(
            f"|  {g['index']:>3}   N/A  N/A  {a['pid']:>15}      C   {name:<35} {str(a['used_mib']) + 'MiB':>9} |"
        )
    lines.append(WIDE)
    return "".join(line + "\n" for line in lines)


def _split_fields(spec: str, known: dict[str, Any]) -> list[str]:
    fields = [f.strip() for f in spec.split(",") if f.strip()]
    for f in fields:
        if f not in known:
            raise _Invalid(f'Field "{f}" is not a valid field to query.\n')
    return fields


class _Invalid(Exception):
    pass


def nvidia_smi(argv: list[str], path: str = STATE_FILE, now: float | None = None) -> tuple[int, str, str]:
    """Run the simulated nvidia-smi: (exit status, stdout, stderr)."""
    now = time.time() if now is None else now
    parser = argparse.ArgumentParser(prog="nvidia-smi", add_help=False)
    parser.add_argument("--query-gpu")
    parser.add_argument("--query-compute-apps")
    parser.add_argument("--format")
    parser.add_argument("-i", "--id")
    parser.add_argument("-L", "--list-gpus", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if rest:
        return 2, "", "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
    try:
        state = snapshot(path, now)
    except FileNotFoundError:
        return 9, "", FAILURES["no-driver"][1]
    if state.get("fail"):
        code, msg = FAILURES[state["fail"]]
        return code, msg, ""
    gpus = gpu_view(state, now)
    for g in gpus:
        g["driver_version"] = state["driver_version"]
    if args.id is not None:
        wanted = {int(x) for x in args.id.split(",")}
        gpus = [g for g in gpus if g["index"] in wanted]
    if args.list_gpus:
        return 0, "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in gpus), ""
    if args.query_gpu or args.query_compute_apps:
        fmt = [f.strip() for f in (args.format or "").split(",")]
        if not args.format or "csv" not in fmt:
            return 2, "", "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
        header, units = "noheader" not in fmt, "nounits" not in fmt
        try:
            if args.query_gpu:
                return 0, query_gpu(gpus, _split_fields(args.query_gpu, GPU_FIELDS), header, units), ""
            return 0, query_apps(gpus, _split_fields(args.query_compute_apps, APP_FIELDS), header, units), ""
        except _Invalid as exc:
            return 2, str(exc), ""
    return 0, table(state, gpus, now), ""


# --------------------------------------------------------------------------- lab-gpu


def lab_gpu(argv: list[str], path: str = STATE_FILE) -> int:
    parser = argparse.ArgumentParser(
        prog="lab-gpu", description="Drive the simulated GPUs of a lab node (test double)."
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("init", help="write a fresh state with N idle GPUs")
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--seed", help="seed for the GPU UUIDs (default: hostname)")
    p.add_argument("--force", action="store_true", help="overwrite an existing state")
    p = sub.add_parser("hold", help="a process holds memory on GPUs")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--gpu", required=True, help="comma-separated indices")
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--name", default="python3")
    p.add_argument(
        "--release-seconds", type=float, default=0.0, help="time the memory takes to free once the pid is gone"
    )
    p.add_argument(
        "--pinned", action="store_true", help="listed even without a live pid (a stray nobody here can kill)"
    )
    p = sub.add_parser("release", help="start releasing a pid's memory now")
    p.add_argument("--pid", type=int, required=True)
    p = sub.add_parser("fail", help="make nvidia-smi itself fail")
    p.add_argument("mode", choices=["none", *FAILURES])
    p = sub.add_parser("driver", help="set the driver version nvidia-smi reports")
    p.add_argument("version")
    sub.add_parser("show", help="print the state as JSON")
    args = parser.parse_args(argv)

    if args.cmd == "init":
        if os.path.exists(path) and not args.force:
            return 0
        write_state(default_state(args.gpus, args.seed), path)
        return 0
    if args.cmd == "show":
        print(json.dumps(snapshot(path), indent=1))
        return 0
    with locked_state(path, write=True) as state:
        if args.cmd == "hold":
            indices = [int(x) for x in args.gpu.split(",")]
            known = {g["index"] for g in state["gpus"]}
            bad = [i for i in indices if i not in known]
            if bad:
                parser.error(f"--gpu: no simulated GPU {bad} (this node has {sorted(known)})")
            for i in indices:
                state["apps"].append(
                    {
                        "pid": args.pid,
                        "gpu": i,
                        "used_mib": args.mib,
                        "name": args.name,
                        "release_seconds": args.release_seconds,
                        "pinned": args.pinned,
                        "released_at": None,
                    }
                )
        elif args.cmd == "release":
            now = time.time()
            for app in state["apps"]:
                if app["pid"] == args.pid and app.get("released_at") is None:
                    app["released_at"] = now
                    app["pinned"] = False
        elif args.cmd == "fail":
            state["fail"] = None if args.mode == "none" else args.mode
        elif args.cmd == "driver":
            state["driver_version"] = args.version
    return 0


def main_nvidia_smi() -> None:
    code, out, err = nvidia_smi(sys.argv[1:])
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.exit(code)


def main_lab_gpu() -> None:
    sys.exit(lab_gpu(sys.argv[1:]))
