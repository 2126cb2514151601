"""The checks of the host an instance runs on: its port free (or held by its own unit), the host's instances
with distinct names, ports and GPUs, /dev/shm large enough, and the GPUs nvidia-smi lists.

Each answers problems naming the variable to change (problems.problem); validate runs them.
"""

from __future__ import annotations

import math
import os
import subprocess

from .problems import ValidateError, problem
from .procinfo import listening_inodes, socket_holders
from .secret_rule import clip

DISTINCT = "each instance needs its own name, port and GPUs"


def check_port(port, unit, origin):
    """The port is free, or held by the instance's own unit."""
    inodes = listening_inodes(port)
    if not inodes:
        return []
    holders = socket_holders(inodes)
    others = {pid: h for pid, h in holders.items() if h[0] != unit}
    if holders and not others:
        return []
    who = "; ".join(f"pid {pid} ({u}: {clip(cmd, 120)})" for pid, (u, cmd) in sorted(others.items()))
    message = f"port {port} is already in use by {who or 'a process not visible here'}: "
    return [problem("port", origin, message + f"choose another port ({origin}) or stop that process")]


def where(inst, i, field):
    """The variable an instance's field came from (sglang_instances[i].port), for messages."""
    if field == "port":
        return (inst.get("origins") or {}).get("--port") or f"sglang_instances[{i}].port"
    if field == "gpus":
        return (inst.get("env_origins") or {}).get("CUDA_VISIBLE_DEVICES") or f"sglang_instances[{i}].gpus"
    return f"sglang_instances[{i}].{field}"


def check_distinct(instances):
    """The host's instances have distinct names, ports and GPUs."""
    problems = []
    names, ports, gpus = {}, {}, {}
    for i, inst in enumerate(instances):
        name, port = inst["name"], inst["port"]
        if name in names:
            j = names[name]
            message = f"{where(inst, i, 'name')} is {name!r}, as is {where(instances[j], j, 'name')}: {DISTINCT}"
            problems.append(problem("host", where(inst, i, "name"), message))
        names.setdefault(name, i)
        if port in ports:
            j = ports[port]
            message = f"{where(inst, i, 'port')} is {port}, as is {where(instances[j], j, 'port')}: {DISTINCT}"
            problems.append(problem("host", where(inst, i, "port"), message))
        ports.setdefault(port, i)
        shared = {}
        for g in inst["gpus"]:
            if g in gpus and gpus[g] != i:
                shared.setdefault(gpus[g], []).append(g)
            gpus.setdefault(g, i)
        for j, gs in sorted(shared.items()):
            message = (
                f"{where(inst, i, 'gpus')}: GPU(s) {gs} are also given to {instances[j]['name']} "
                f"({where(instances[j], j, 'gpus')}): {DISTINCT}"
            )
            problems.append(problem("host", where(inst, i, "gpus"), message))
    return problems


def check_shm(min_mib, path="/dev/shm"):
    """([problem], size in MiB or None): /dev/shm holds NCCL's buffers between a host's GPUs."""
    advice = (
        "NCCL shares buffers through it: enlarge it (for example `size=` in the /dev/shm line of /etc/fstab) "
        "or lower sglang_service_min_shm_mib"
    )
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return [problem("host", "sglang_service_min_shm_mib", f"{path}: {exc.strerror}; {advice}")], None
    size = math.ceil(st.f_blocks * st.f_frsize / (1 << 20))  # as `df --block-size=1M` rounds
    if size >= min_mib:
        return [], size
    message = f"{path} is {size} MiB, less than sglang_service_min_shm_mib ({min_mib}); {advice}"
    return [problem("host", "sglang_service_min_shm_mib", message)], size


def count_gpus(run=subprocess.run):
    """The number of GPUs nvidia-smi lists; FileNotFoundError when there is no nvidia-smi."""
    try:
        proc = run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise ValidateError("nvidia-smi did not answer within 60 s: the host's GPUs could not be counted") from exc
    if proc.returncode != 0:
        why = clip((proc.stderr or proc.stdout).strip(), 500, last=True)
        raise ValidateError(f"nvidia-smi failed (exit {proc.returncode}): {why}: the host's GPUs could not be counted")
    return sum(1 for line in proc.stdout.splitlines() if line.strip())
