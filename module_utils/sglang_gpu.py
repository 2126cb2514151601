"""GPU state from nvidia-smi, who holds each GPU, and the wait for clean GPUs.

Shared by the gpu_state and sglang_server modules. Runs on the GPU host; polls
there (one nvidia-smi query is about 20 ms on H200 hosts), never through Ansible
task retries (about 0.2 s of round trip each).
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time

GPU_QUERY = "index,uuid,name,memory.used,memory.total"
APP_QUERY = "pid,gpu_uuid,used_memory,process_name"


class NvidiaSmiError(RuntimeError):
    """nvidia-smi itself failed: no driver, driver/library mismatch, not installed."""


def _number(text: str) -> int | None:
    text = text.strip()
    if text.endswith(" MiB"):
        text = text[:-4]
    try:
        return int(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_csv(text: str) -> list[list[str]]:
    """Rows of `--format=csv,noheader,nounits` (a header line, if any, is dropped)."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("index,", "pid,")):
            continue
        rows.append([f.strip() for f in line.split(",")])
    return rows


def parse_gpus(text: str) -> list[dict]:
    gpus = []
    for row in parse_csv(text):
        index, uuid, name, used, total = row[:5]
        gpus.append({"index": int(index), "uuid": uuid, "name": name,
                     "memory_used_mib": _number(used), "memory_total_mib": _number(total)})  # fmt: skip
    return gpus


def parse_apps(text: str, gpus: list[dict]) -> list[dict]:
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    apps = []
    for row in parse_csv(text):
        pid, uuid, used = row[:3]
        name = ",".join(row[3:]) if len(row) > 3 else ""
        apps.append({"pid": int(pid), "gpu": by_uuid.get(uuid), "gpu_uuid": uuid, "used_mib": _number(used),
                     "process_name": name})  # fmt: skip
    return apps


def run_nvidia_smi(*args: str, timeout: float = 30.0) -> str:
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=False, timeout=timeout)
    except FileNotFoundError as exc:
        raise NvidiaSmiError("nvidia-smi is not installed (no NVIDIA driver on this host?)") from exc
    except subprocess.TimeoutExpired as exc:
        raise NvidiaSmiError(f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?)") from exc
    if out.returncode != 0:
        text = " ".join((out.stdout + out.stderr).split())
        hint = ""
        if "mismatch" in text:
            hint = " The kernel driver and the NVML library differ: reboot, or reload the nvidia modules."
        elif out.returncode == 9 or "couldn't communicate" in text:
            hint = " The NVIDIA kernel driver is not loaded."
        raise NvidiaSmiError(f"nvidia-smi failed (exit {out.returncode}): {text}{hint}")
    return out.stdout


def read_proc(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def unit_of(pid: int) -> str | None:
    """The systemd unit (service or scope) whose cgroup holds pid."""
    for line in read_proc(pid, "cgroup").splitlines():
        path = line.split(":", 2)[-1]
        for part in reversed(path.split("/")):
            if part.endswith((".service", ".scope")):
                return part
    return None


def describe(pid: int) -> dict:
    """User, unit and command line of a process (None where it cannot be seen)."""
    cmdline = read_proc(pid, "cmdline").replace("\0", " ").split()
    try:
        user = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        user = None
    return {"user": user, "unit": unit_of(pid), "cmdline": " ".join(cmdline)[:400] or None,
            "alive": os.path.exists(f"/proc/{pid}")}  # fmt: skip


def snapshot(describe_processes: bool = True) -> dict:
    """{gpus, processes}: every GPU of the host and every compute process on them."""
    gpus = parse_gpus(run_nvidia_smi(f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"))
    apps = parse_apps(run_nvidia_smi(f"--query-compute-apps={APP_QUERY}", "--format=csv,noheader,nounits"), gpus)
    if describe_processes:
        seen: dict[int, dict] = {}
        for app in apps:
            app.update(seen.setdefault(app["pid"], describe(app["pid"])))
    return {"gpus": gpus, "processes": apps}


def offenders(snap: dict, wanted: set[int], max_used_mib: int) -> tuple[list[dict], list[dict]]:
    """(processes on the wanted GPUs, wanted GPUs over the memory threshold)."""
    procs = [p for p in snap["processes"] if p["gpu"] in wanted]
    busy = [g for g in snap["gpus"] if g["index"] in wanted and (g["memory_used_mib"] or 0) > max_used_mib]
    return procs, busy


def may_stop(proc: dict, policy: str, service_unit: str | None, service_user: str | None) -> bool:
    """Whether the stop policy allows stopping this offender.

    none: never. own: processes of the service's own unit or user. force: any
    process (the operator said so explicitly).
    """
    if policy == "force":
        return True
    if policy == "own":
        return bool((service_unit and proc.get("unit") == service_unit) or (service_user and proc.get("user") == service_user))
    return False


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no GPU memory)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def terminate(pids: list[int], grace: float, interval: float) -> dict[int, str]:
    """SIGTERM, then SIGKILL after grace seconds; {pid: how it ended}."""
    outcome = {}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            outcome[pid] = "SIGTERM"
        except ProcessLookupError:
            outcome[pid] = "gone"
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(interval)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                outcome[pid] = "SIGKILL"
            except ProcessLookupError:
                pass
    return outcome


def format_offender(proc: dict) -> str:
    return (f"GPU {proc['gpu']}: pid {proc['pid']} holds {proc['used_mib']} MiB (user {proc.get('user') or '?'}, "
            f"unit {proc.get('unit') or '?'}, command {proc.get('cmdline') or proc.get('process_name') or '?'})")  # fmt: skip


def wait_clean(
    gpus: list[int],
    timeout: float,
    interval: float = 0.1,
    max_used_mib: int = 1024,
    policy: str = "none",
    service_unit: str | None = None,
    service_user: str | None = None,
    kill_grace: float = 10.0,
    clock=time.monotonic,
    sleep=time.sleep,
    take_snapshot=snapshot,
) -> dict:
    """Poll until no compute process is on `gpus` and each one's memory is at most max_used_mib.

    Offenders the policy allows are stopped (once each); the others are waited
    for. Returns {clean, waited_s, polls, offenders, busy, stopped, refused}; on
    timeout `offenders`/`busy` say what was still there.
    """
    wanted = set(gpus)
    start = clock()
    deadline = start + timeout
    stopped: dict[int, str] = {}
    polls = 0
    while True:
        snap = take_snapshot()
        polls += 1
        missing = sorted(wanted - {g["index"] for g in snap["gpus"]})
        if missing:
            return {"clean": False, "waited_s": clock() - start, "polls": polls, "offenders": [], "busy": [],
                    "stopped": stopped, "missing": missing, "gpus": snap["gpus"], "processes": snap["processes"],
                    "message": f"GPUs {missing} are not on this host (it has {sorted(g['index'] for g in snap['gpus'])})"}  # fmt: skip
        procs, busy = offenders(snap, wanted, max_used_mib)
        if not procs and not busy:
            return {"clean": True, "waited_s": clock() - start, "polls": polls, "offenders": [], "busy": [],
                    "stopped": stopped, "gpus": snap["gpus"], "processes": snap["processes"],
                    "message": f"GPUs {sorted(wanted)} clean"}  # fmt: skip
        to_stop = sorted({p["pid"] for p in procs if p["pid"] not in stopped and may_stop(p, policy, service_unit, service_user)})
        if to_stop:
            stopped.update(terminate(to_stop, kill_grace, interval))
            continue
        if clock() >= deadline:
            refused = [p for p in procs if not may_stop(p, policy, service_unit, service_user)]
            lines = [format_offender(p) for p in procs]
            listed = {p["gpu"] for p in procs}
            lines += [f"GPU {g['index']}: {g['memory_used_mib']} MiB used with no process listed (memory still being released?)"
                      for g in busy if g["index"] not in listed]  # fmt: skip
            hint = ""
            if refused:
                hint = (" Processes of other users or units are never stopped: stop them yourself, or rerun with the "
                        "stop policy 'force' to have them killed.")  # fmt: skip
            return {"clean": False, "waited_s": clock() - start, "polls": polls, "offenders": procs, "busy": busy,
                    "stopped": stopped, "refused": refused, "gpus": snap["gpus"], "processes": snap["processes"],
                    "message": f"GPUs {sorted(wanted)} not clean after {timeout:g}s: " + "; ".join(lines) + "." + hint}  # fmt: skip
        sleep(interval)
