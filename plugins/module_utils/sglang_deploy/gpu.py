"""nvidia-smi: the GPUs of a host, who holds them, and the wait for clean GPUs.

Used by the modules (gpu_state, sglang_server) and, installed on the host beside
the unit's ``ExecStartPre`` gate (sglang-gpu-gate), by the gate itself: both judge
a snapshot with the one function ``verdict``, so they cannot disagree. Polls on the
host (one nvidia-smi query is about 20 ms on H200 hosts), never through Ansible
task retries (about 0.2 s of round trip each).

Values nvidia-smi cannot give (``[N/A]``, ``[Not Supported]``, any other bracketed
word) parse as None, in every numeric field. What that means for the verdict:

- a process listed on a wanted GPU is an offender whatever its memory says: the
  process list, not the memory figure, is what says a GPU is held;
- a wanted GPU whose memory.used is unknown is not "busy": the threshold cannot be
  applied, so such a GPU is judged by its process list alone, and the verdict names
  it (``unknown_memory``, and a note in its message). Counting it busy would make
  the gate refuse forever on a host whose driver never reports the figure; the
  threshold only catches memory still being released after its process has left
  the list, and starting then fails at start (and is rolled back) instead of
  sharing a GPU with another process;
- a process with no pid still counts, but is never stopped; a GPU with no index
  cannot be matched, so a wanted GPU only such a row could be is "missing".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from . import procinfo

GPU_QUERY = "index,uuid,name,memory.used,memory.total"
APP_QUERY = "pid,gpu_uuid,used_memory,process_name"
_INTEGER = re.compile(r"(\d+)(?: MiB)?")

# The names plugins/module_utils/sglang_gpu.py had, for callers that only change their import line.
read_proc = procinfo.read_proc
unit_of = procinfo.unit_of
describe = procinfo.describe
alive = procinfo.alive


class NvidiaSmiError(RuntimeError):
    """nvidia-smi itself failed: no driver, driver/library mismatch, not installed, output it cannot read."""


def _number(text: str) -> int | None:
    """An integer field (units allowed), None for "[N/A]", "[Not Supported]" and anything else not a number."""
    match = _INTEGER.fullmatch(text.strip())
    return int(match.group(1)) if match else None


def parse_csv(text: str) -> list[list[str]]:
    """Rows of `--format=csv[,noheader][,nounits]` (a header line, if any, is dropped)."""
    rows = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("index,", "pid,")):
            continue
        rows.append([f.strip() for f in line.split(",")])
    return rows


def _columns(row: list[str], count: int, what: str) -> list[str]:
    """The first `count` fields of a row; NvidiaSmiError (not an IndexError traceback) when it has fewer."""
    if len(row) < count:
        raise NvidiaSmiError(
            f"nvidia-smi printed a {what} row with {len(row)} fields, expected {count}: {', '.join(row)}"
        )
    return row[:count]


def parse_gpus(text: str) -> list[dict]:
    """GPUs from `--query-gpu=GPU_QUERY`; index is None where nvidia-smi could not give it."""
    gpus = []
    for row in parse_csv(text):
        index, uuid, name, used, total = _columns(row, 5, "GPU")
        gpus.append(
            {
                "index": _number(index),
                "uuid": uuid,
                "name": name,
                "memory_used_mib": _number(used),
                "memory_total_mib": _number(total),
            }
        )
    return gpus


def parse_apps(text: str, gpus: list[dict]) -> list[dict]:
    """Compute processes from `--query-compute-apps=APP_QUERY`; gpu is the index of the GPU with that uuid.

    A process name may hold commas: everything after the third field is the name.
    """
    by_uuid = {g["uuid"]: g["index"] for g in gpus}
    apps = []
    for row in parse_csv(text):
        pid, uuid, used = _columns(row, 3, "compute process")
        apps.append(
            {
                "pid": _number(pid),
                "gpu": by_uuid.get(uuid),
                "gpu_uuid": uuid,
                "used_mib": _number(used),
                "process_name": ",".join(row[3:]),
            }
        )
    return apps


def run_nvidia_smi(*args: str, timeout: float = 30.0) -> str:
    """nvidia-smi's stdout; NvidiaSmiError with its own message and a hint at the cause when it fails."""
    return run_nvidia_smi_together([list(args)], timeout)[0]


def run_nvidia_smi_together(queries: list[list[str]], timeout: float = 30.0) -> list[str]:
    """Each query's stdout, the queries run side by side: a snapshot costs one nvidia-smi's latency, not the sum
    of two (the GPU wait and the gate poll a snapshot; its latency is their detection latency). The first failure
    raises NvidiaSmiError, once every process has ended (none is left running)."""
    procs: list[subprocess.Popen] = []
    try:
        for args in queries:
            procs.append(
                subprocess.Popen(["nvidia-smi", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
    except FileNotFoundError as exc:
        _reap(procs)
        raise NvidiaSmiError("nvidia-smi is not installed (no NVIDIA driver on this host?)") from exc
    except OSError as exc:
        _reap(procs)
        raise NvidiaSmiError(f"nvidia-smi could not be run: {exc}") from exc
    deadline = time.monotonic() + timeout
    outs: list[str] = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:  # the others are ended in `finally`: nothing waits on them
                raise NvidiaSmiError(_failed(proc.returncode, stdout + stderr))
            outs.append(stdout)
    except subprocess.TimeoutExpired as exc:
        raise NvidiaSmiError(f"nvidia-smi did not answer within {timeout:g}s (a hung GPU or driver?)") from exc
    finally:
        _reap(procs)
    return outs


def _failed(returncode: int, output: str) -> str:
    text = " ".join(output.split())
    hint = ""
    if "mismatch" in text:
        hint = " The kernel driver and the NVML library differ: reboot, or reload the nvidia modules."
    elif returncode == 9 or "couldn't communicate" in text:
        hint = " The NVIDIA kernel driver is not loaded."
    return f"nvidia-smi failed (exit {returncode}): {text}{hint}"


def _reap(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def snapshot(describe_processes: bool = True, timeout: float = 30.0) -> dict:
    """{gpus, processes}: every GPU of the host and every compute process on them (with user, unit, cmdline);
    both queries within `timeout`."""
    fmt = "--format=csv,noheader,nounits"
    gpu_rows, app_rows = run_nvidia_smi_together(
        [[f"--query-gpu={GPU_QUERY}", fmt], [f"--query-compute-apps={APP_QUERY}", fmt]], timeout
    )
    gpus = parse_gpus(gpu_rows)
    apps = parse_apps(app_rows, gpus)
    if describe_processes:
        seen: dict[int, dict] = {}  # a process on several GPUs (a row each) is read from /proc once
        for app in apps:
            if app["pid"] is not None:
                if app["pid"] not in seen:
                    seen[app["pid"]] = procinfo.describe(app["pid"])
                app.update(seen[app["pid"]])
    return {"gpus": gpus, "processes": apps}


def model_of(snap: dict, gpus: list[int]) -> str | None:
    """The model of these GPUs as nvidia-smi names them ("NVIDIA H200"; several joined by ", "), from a snapshot;
    None when it names none of them."""
    names = sorted({g["name"] for g in snap.get("gpus") or [] if g.get("index") in gpus and g.get("name")})
    return ", ".join(names) or None


def offenders(snap: dict, wanted: set[int], max_used_mib: int) -> tuple[list[dict], list[dict]]:
    """(processes on the wanted GPUs, wanted GPUs over the memory threshold).

    A GPU whose memory.used is unknown is never over the threshold (the module docstring says why).
    """
    procs = [p for p in snap["processes"] if p["gpu"] in wanted]
    busy = [
        g
        for g in snap["gpus"]
        if g["index"] in wanted and g["memory_used_mib"] is not None and g["memory_used_mib"] > max_used_mib
    ]
    return procs, busy


def _indices(gpus: list[dict]) -> str:
    """The host's GPU indices for messages ("[0, 1, ?]"), ? where nvidia-smi gave none."""
    known = sorted(g["index"] for g in gpus if g["index"] is not None)
    return "[" + ", ".join([str(i) for i in known] + ["?"] * (len(gpus) - len(known))) + "]"


def _mib(value: int | None) -> str:
    """A number for a message, ? where nvidia-smi did not give it."""
    return "?" if value is None else str(value)


def format_offender(proc: dict) -> str:
    """One line naming a process on a GPU: where, how much, whose, what (? for what cannot be seen)."""
    return (
        f"GPU {_mib(proc['gpu'])}: pid {_mib(proc['pid'])} holds {_mib(proc['used_mib'])} MiB "
        f"(user {proc.get('user') or '?'}, unit {proc.get('unit') or '?'}, "
        f"command {proc.get('cmdline') or proc.get('process_name') or '?'})"
    )


def _busy_line(gpu: dict) -> str:
    """A GPU over the threshold with no process listed: most often memory the kernel is still releasing."""
    used = gpu["memory_used_mib"]
    return f"GPU {gpu['index']}: {used} MiB used with no process listed (memory still being released?)"


def verdict(snap: dict, gpus: list[int], max_used_mib: int) -> dict:
    """The verdict on one snapshot for the GPUs `gpus`: what the gate and the modules both act on.

    Returns {clean, missing, offenders, busy, unknown_memory, lines, note, message}:
    missing are wanted GPUs the host does not have (then nothing else is judged);
    offenders the processes on wanted GPUs; busy the wanted GPUs over max_used_mib;
    unknown_memory the wanted GPUs whose memory.used nvidia-smi did not give (note
    says so in words, "" when none); lines one line per offender, then one per busy
    GPU with no process listed. Clean means no lines.
    """
    wanted = set(gpus)
    missing = sorted(wanted - {g["index"] for g in snap["gpus"]})
    out = dict(clean=False, missing=missing, offenders=[], busy=[], unknown_memory=[], lines=[], note="")
    if missing:
        out["message"] = f"GPUs {missing} are not on this host (it has {_indices(snap['gpus'])})"
        return out
    procs, busy = offenders(snap, wanted, max_used_mib)
    listed = {p["gpu"] for p in procs}
    unknown = sorted(g["index"] for g in snap["gpus"] if g["index"] in wanted and g["memory_used_mib"] is None)
    lines = [format_offender(p) for p in procs] + [_busy_line(g) for g in busy if g["index"] not in listed]
    note = f" (memory.used not reported for GPUs {unknown}: judged by their process lists alone)" if unknown else ""
    out.update(clean=not lines, offenders=procs, busy=busy, unknown_memory=unknown, lines=lines, note=note)
    out["message"] = f"GPUs {sorted(wanted)} " + ("clean" if not lines else "not clean: " + "; ".join(lines)) + note
    return out


# A login session's scope (session-<id>.scope: a shell, ssh, `su -l`) runs what a person started by hand, no unit's
# own work: for the stop policy its processes are owned by no unit.
LOGIN_SESSION = re.compile(r"session-[^/]+\.scope")


def owned_by_no_unit(proc: dict) -> bool:
    """Its cgroup names no systemd unit (procinfo.unit_of: None), or only a login session's scope."""
    unit = proc.get("unit")
    return unit is None or bool(LOGIN_SESSION.fullmatch(unit))


def may_stop(proc: dict, policy: str, service_unit: str | None, service_user: str | None) -> bool:
    """Whether the stop policy allows stopping this offender.

    none: never. force: any process (the operator said so explicitly). own: this unit's processes, and the
    service user's that no unit owns (`owned_by_no_unit`), never another unit's: every instance runs as that user.
    A process without a pid cannot be stopped, nor under own one /proc hides (procinfo gives it no user).
    """
    if proc.get("pid") is None:
        return False
    if policy == "force":
        return True
    if policy == "own":
        if service_unit and proc.get("unit") == service_unit:
            return True
        return bool(service_user) and proc.get("user") == service_user and owned_by_no_unit(proc)
    return False


def other_units(procs: list[dict], service_unit: str | None) -> dict[str, list[dict]]:
    """{unit: its processes} of the processes another systemd unit owns, in the order listed."""
    held: dict[str, list[dict]] = {}
    for p in procs:
        if p.get("unit") != service_unit and not owned_by_no_unit(p):
            held.setdefault(p["unit"], []).append(p)
    return held


def units_held(held: dict[str, list[dict]], service_unit: str, name: str) -> str:
    """The units of `other_units` for a message: "sglang-main.service (sglang instance main): pids 101, 102 on GPUs
    [4, 5]"; a unit named as this instance's is (<prefix><instance>.service) is said to be another instance's."""
    prefix = service_unit.removesuffix(f"{name}.service") if service_unit.endswith(f"{name}.service") else None
    out = []
    for unit, procs in held.items():
        ours = bool(prefix) and unit.startswith(prefix) and unit.endswith(".service")
        whose = f" (sglang instance {unit[len(prefix) : -len('.service')]})" if ours else ""
        pids = ", ".join(str(p) for p in sorted({p["pid"] for p in procs if p["pid"] is not None})) or "?"
        gpus = sorted({p["gpu"] for p in procs if p["gpu"] is not None})
        out.append(f"{unit}{whose}: pids {pids} on GPUs {gpus}")
    return "; ".join(out)


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
    while time.monotonic() < deadline and any(procinfo.alive(p) for p in pids):
        time.sleep(interval)
    for pid in pids:
        if procinfo.alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                outcome[pid] = "SIGKILL"
            except ProcessLookupError:
                pass
    return outcome


def _stopped(pid: int, rows: list[dict], how: str) -> dict:
    """One stopped process for the result: whose it was and where (its rows, one per GPU it held), how it ended."""
    first = rows[0]
    return {
        "pid": pid,
        "user": first.get("user"),
        "unit": first.get("unit"),
        "gpus": sorted({r["gpu"] for r in rows}),
        "command": first.get("cmdline") or first.get("process_name"),
        "how": how,
    }


def _timeout_message(judged: dict, gpus: list[int], timeout: float) -> str:
    """What the modules fail with: every offender, and why nothing was stopped where nothing was."""
    hint = ""
    if judged["refused"]:
        hint = (
            " Processes of other users or units are never stopped: stop them yourself, or rerun with the "
            "stop policy 'force' to have them killed."
        )
    listed = "; ".join(judged["lines"])
    return f"GPUs {sorted(set(gpus))} not clean after {timeout:g}s: {listed}.{judged['note']}{hint}"


def _result(judged: dict, snap: dict, start: float, now: float, polls: int, stopped: list[dict], message: str) -> dict:
    """wait_clean's answer: the last verdict, how long and how often it polled, and the state it last saw."""
    return {
        **judged,
        "waited_s": now - start,
        "polls": polls,
        "stopped": {p["pid"]: p["how"] for p in stopped},
        "stopped_processes": stopped,
        "gpus": snap["gpus"],
        "processes": snap["processes"],
        "message": message,
    }


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
    """Poll until `verdict` says `gpus` are clean, or until timeout; the gate's loop as well as the modules'.

    Offenders the policy allows are stopped (once each); the others are waited
    for. Returns verdict's keys plus {waited_s, polls, stopped, stopped_processes,
    refused, gpus, processes}: stopped {pid: how it ended}, stopped_processes each
    stopped one as it was seen then {pid, user, unit, gpus, command, how}; on
    timeout `offenders`/`busy`/`lines` say what was still there. Missing GPUs end
    the wait at once. NvidiaSmiError propagates.
    """
    start = clock()
    deadline = start + timeout
    stopped: list[dict] = []
    polls = 0
    while True:
        began = clock()
        snap = take_snapshot()
        polls += 1
        judged = verdict(snap, gpus, max_used_mib)
        judged["refused"] = [p for p in judged["offenders"] if not may_stop(p, policy, service_unit, service_user)]
        if judged["clean"] or judged["missing"]:
            return _result(judged, snap, start, clock(), polls, stopped, judged["message"])
        allowed = [p for p in judged["offenders"] if may_stop(p, policy, service_unit, service_user)]
        done = {p["pid"] for p in stopped}
        to_stop = sorted({p["pid"] for p in allowed} - done)
        if to_stop:
            how = terminate(to_stop, kill_grace, interval)
            stopped += [_stopped(pid, [p for p in allowed if p["pid"] == pid], how[pid]) for pid in to_stop]
            continue
        if clock() >= deadline:
            return _result(judged, snap, start, clock(), polls, stopped, _timeout_message(judged, gpus, timeout))
        # One poll every `interval` from its start: the snapshot's own time is not added to the detection latency.
        sleep(max(0.0, interval - (clock() - began)))
