"""A restart or rollback run in a worker detached from the module call (and its SSH session), so that the
controller can learn its progress while it runs (sglang_deploy.progress) and a dropped connection never cuts
it short: the worker always runs to the state machine's defined end and writes its result.

A job is a root-only directory under JOBS_DIR: pid (the worker's), unit (the worker's own scope unit, when
systemd made it), progress.json (progress.Reporter) and result.json (the module's result, secrets already
stripped), each written atomically.

The worker is moved out of the SSH session's cgroup into a transient scope unit of its own (own_scope): logind
with KillUserProcesses=yes ends a session by killing every process in its scope, setsid or not, and a restart
killed mid-way rolls back for nothing, or is killed mid-rollback. Its stdout and stderr are a journal stream,
so `journalctl -u sglang-deploy-job-...scope` shows what it did. plugins/modules/sglang_job.py
reads it, and hands the result over as often as it is asked for it (an answer lost with a dropped connection is
asked for again): the directory is removed only when the controller acknowledges the result (ack).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from . import procinfo, progress
from .durable import write_atomic

JOBS_DIR = "/run/sglang-deploy/jobs"
SCOPE_PREFIX = "sglang-deploy-job-"
JOURNAL_STREAM = "/run/systemd/journal/stdout"


def boot_id() -> str | None:
    """This boot of the host: the kernel's boot id and PID 1's start. A job's answers carry it, so that a job gone
    with a reboot is told from one acknowledged; PID 1's part tells a container booted again (same kernel)."""
    kernel = procinfo.boot_id()
    return f"{kernel}/{procinfo.start_time(1)}" if kernel else None


@dataclass(frozen=True)
class Job:
    dir: str

    @property
    def progress(self) -> str:
        return os.path.join(self.dir, "progress.json")

    @property
    def result(self) -> str:
        return os.path.join(self.dir, "result.json")

    @property
    def pid_file(self) -> str:
        return os.path.join(self.dir, "pid")

    @property
    def unit_file(self) -> str:
        return os.path.join(self.dir, "unit")

    @property
    def scope(self) -> str:
        """The name of the worker's scope unit: the job directory's own name, under SCOPE_PREFIX."""
        return f"{SCOPE_PREFIX}{os.path.basename(self.dir)}.scope"

    def unit(self) -> str | None:
        """The worker's scope unit, if systemd made it (else the worker runs in the caller's session: own_scope)."""
        try:
            with open(self.unit_file, encoding="ascii") as f:
                return f.read().strip() or None
        except OSError:
            return None

    def pid(self) -> int | None:
        try:
            with open(self.pid_file, encoding="ascii") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def alive(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
        except OSError:
            return False

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait(job: Job, seen: int, wait_s: float, min_s: float, interval: float = 0.05) -> dict:
    """What the controller is told: the result once the worker has written it ({"done": True, "ok", "res"}),
    else the progress once its seq has passed `seen` and min_s are out, or when wait_s are out
    ({"done": False, "progress", "seq"}). A worker dead without a result is a failure naming it. Nothing is
    removed: the same result is answered again until the controller acknowledges it (ack)."""
    t0 = time.monotonic()
    while True:
        end = read_json(job.result)
        prog = read_json(job.progress)
        if end is None and not job.alive():
            end = read_json(job.result) or {"ok": False, "res": lost(job, prog)}  # written between the reads?
        if end is not None:
            return {"done": True, **end}
        waited = time.monotonic() - t0
        seq = (prog or {}).get("seq", 0)
        if (seq > seen and waited >= min_s) or waited >= wait_s:
            return {"done": False, "job": job.dir, "progress": prog, "seq": seq, "boot_id": boot_id()}
        time.sleep(interval)


def ack(job: Job) -> bool:
    """The controller has the job's result: the job's files removed, nothing of it left on the host. Only a job
    whose result is written: a running worker's files, or a killed one's (lost), stay. Whether it removed them."""
    if read_json(job.result) is None:
        return False
    job.remove()
    return True


def lost(job: Job, prog: dict | None) -> dict:
    phase = (prog or {}).get("phase") or "its start"
    return {
        "changed": True,
        "msg": (
            f"the restart's worker (pid {job.pid()}) ended without a result during {phase}: it was killed. "
            "The instance may be stopped or half-started: `python -m driver status` says which; the job's "
            f"files are in {job.dir}"
        ),
        "lost_job": job.dir,
    }


def new(instance: str, jobs_dir: str = JOBS_DIR) -> Job:
    os.makedirs(jobs_dir, mode=0o700, exist_ok=True)
    os.chmod(jobs_dir, 0o700)
    path = os.path.join(jobs_dir, f"{instance}-{time.time_ns()}-{os.getpid()}")
    os.mkdir(path, 0o700)
    return Job(path)


def write_json(path: str, doc: dict) -> None:
    write_atomic(path, json.dumps(doc, default=str), 0o600)


def preload(package) -> None:
    """Every module of `package` imported now. Ansible's module wrapper deletes the module's zip when the call
    returns, while the worker still runs: what the worker has not imported by then it could never import."""
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def own_scope(pid: int, name: str, timeout: float = 10.0, proc: str = "/proc") -> str:
    """pid moved into a new transient scope unit `name` (systemd's StartTransientUnit with PIDs, as
    `systemd-run --scope` does for a new command), which systemd removes once its process is gone. '' once
    /proc says the process is in it, else why not (no systemd as PID 1, no busctl, refused)."""
    argv = [
        "busctl", "call", "--quiet", f"--timeout={timeout:g}",
        "org.freedesktop.systemd1", "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
        "StartTransientUnit", "ssa(sv)a(sa(sv))", name, "fail",
        "3", "PIDs", "au", "1", str(pid),
        "Description", "s", "sglang-deploy restart worker (a detached sglang_server call)",
        "CollectMode", "s", "inactive-or-failed",
        "0",
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"busctl: {exc}"
    if done.returncode != 0:
        return f"busctl: {(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}"
    deadline = time.monotonic() + timeout
    while True:  # the scope's start job moves the process: on cgroup v1 too, where its cgroup paths say so
        try:
            with open(f"{proc}/{pid}/cgroup", encoding="utf-8") as f:
                if f"/{name}" in f.read():
                    return ""
        except OSError as exc:
            return f"the worker is gone ({exc.strerror})"
        if time.monotonic() >= deadline:
            return f"{name} made, but the worker is not in it after {timeout:g}s"
        time.sleep(0.02)


def journal_stream(identifier: str) -> int | None:
    """A stream to journald (its stdout protocol, as systemd-cat opens it), its lines under `identifier` and the
    sender's unit; None where there is no journald."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(JOURNAL_STREAM)
            sock.shutdown(socket.SHUT_RD)
            # identifier, unit id, priority (info), level prefix, forward to syslog, kmsg, console
            sock.sendall(f"{identifier}\n\n6\n0\n0\n0\n0\n".encode())
        except OSError:
            sock.close()
            return None
        return sock.detach()
    except OSError:
        return None


def say(line: str) -> None:
    """A line to the worker's stderr, its journal stream: fd 2 itself, whatever sys.stderr was made in the caller."""
    try:
        os.write(2, line.encode("utf-8", "replace") + b"\n")
    except OSError:
        pass


def detach(job: Job, work: Callable[[], dict], on_error: Callable[[BaseException], dict]) -> int:
    """work() in a grandchild in its own session and, where systemd runs, its own scope unit (own_scope), stdout
    and stderr on the journal (else /dev/null); its return (or on_error's, if it raised) written to job.result.
    The worker waits until this call has tried to make the scope. Returns the worker's pid once its pid file
    (and unit file, if the scope was made) is written."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the intermediate child; the tests see its effects
        _intermediate(job, work, on_error, (r, w), (go_r, go_w))
    os.close(w)
    os.close(go_r)
    return _adopt(job, pid, r, go_w)


def _intermediate(  # pragma: no cover - the intermediate child; the tests see its effects
    job: Job, work: Callable[[], dict], on_error: Callable[[BaseException], dict], pid_pipe, go_pipe
) -> NoReturn:
    """The intermediate child: a session of its own, the worker forked in it and its pid sent up pid_pipe, then
    gone at once (a double fork: the worker is left to init, no child of the caller's). The worker exits here too."""
    r, w = pid_pipe
    go_r, go_w = go_pipe
    try:
        os.close(r)
        os.close(go_w)
        os.setsid()
        worker = os.fork()
        if worker:
            os.write(w, str(worker).encode("ascii"))
            os._exit(0)
        os.close(w)
        _work(job, work, on_error, go_r)
    finally:
        os._exit(0)


def _work(  # pragma: no cover - the worker; the tests see its effects
    job: Job, work: Callable[[], dict], on_error: Callable[[BaseException], dict], go_r: int
) -> None:
    """The worker: once the scope is tried, work() with stdin on /dev/null and stdout and stderr on the journal;
    its return (or on_error's) written to job.result."""
    # Nothing runs before the scope is tried. EOF (the module killed meanwhile) goes on all the same:
    # the state machine, begun or not, ends in a defined state only if it runs.
    os.read(go_r, 1)
    os.close(go_r)
    null = os.open(os.devnull, os.O_RDWR)
    out = journal_stream(SCOPE_PREFIX.rstrip("-")) or null
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        res = work()
    except BaseException as exc:  # the state machine contains its own; anything else still ends here
        res = on_error(exc)
    write_json(job.result, res)
    say(f"job {os.path.basename(job.dir)} ended: ok={res.get('ok')}")


def _adopt(job: Job, pid: int, r: int, go_w: int) -> int:
    """The caller's side: the worker's pid read from the intermediate child (reaped), recorded with its scope, and
    the worker let go; the worker's pid."""
    worker = None
    try:
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as f:
            raw = f.read()
        if not raw:
            raise OSError("the restart's worker could not be started (its fork failed)")
        worker = int(raw)
        _record(job, worker)
        os.write(go_w, b"g")
    except BaseException:
        # This call fails, so the controller never learns the job: the worker, which has done nothing yet, must not
        # restart anything. (Only this process killed outright closes the pipe unsent: then the worker goes on.)
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except OSError:
                pass
        raise
    finally:
        os.close(go_w)
    return worker


def _record(job: Job, worker: int) -> None:
    """The worker's pid file, then its own scope tried: the unit file if made, else scope-error.json saying why."""
    with open(job.pid_file, "w", encoding="ascii") as f:
        f.write(str(worker))
    why = own_scope(worker, job.scope)
    if why:
        write_json(os.path.join(job.dir, "scope-error.json"), {"error": why})
    else:
        with open(job.unit_file, "w", encoding="ascii") as f:
            f.write(job.scope)


def worker_unit(job: Job) -> dict:
    """Where the worker ran: its scope unit, or why it ran in the caller's session (then logind ending that
    session kills it)."""
    unit = job.unit()
    if unit:
        return {"unit": unit}
    doc = read_json(os.path.join(job.dir, "scope-error.json")) or {}
    return {"unit": None, "error": doc.get("error", "unknown")}


def of_instance(name: str, jobs_dir: str | None = None, lines: int = 5) -> list[dict]:
    """The restart and rollback workers of instance `name` this host still holds, oldest first: one running
    (another controller's, or one whose controller was cut off), or ended with a result no controller collected,
    or killed without one. Each with where it got to and the last lines of its journal, for `driver status`.
    A job acknowledged while this reads it is left out; an entry that is no job of new()'s is never one."""
    jobs_dir = jobs_dir or JOBS_DIR
    try:
        names = os.listdir(jobs_dir)
    except OSError:
        return []
    mine = re.compile(re.escape(name) + r"-(\d+)-(\d+)")  # new(): <instance>-<ns>-<pid>
    found = []
    for entry in sorted(names, key=lambda e: [int(x) if x.isdigit() else -1 for x in e.rsplit("-", 2)[1:]]):
        match = mine.fullmatch(entry)
        job = Job(os.path.join(jobs_dir, entry))
        if not match or not os.path.isdir(job.dir):
            continue
        end, prog = _doc(read_json(job.result)), _doc(read_json(job.progress)) or {}
        state = "ended" if end is not None else "running" if job.alive() else "lost"
        if state == "lost" and not os.path.isdir(job.dir):
            continue  # acknowledged between the listing and the reads: its controller has it
        doc = {
            "job": job.dir,
            "state": state,
            "pid": job.pid(),
            "unit": job.unit(),
            "started": int(match.group(1)) / 1e9,
            "phase": prog.get("phase"),
            "step": prog.get("step"),
        }
        if end is not None:
            res = _doc(end.get("res")) or {}
            doc.update(ok=end.get("ok"), outcome=res.get("outcome"), msg=res.get("msg"))
        doc["journal"] = journal_tail(doc["unit"], lines) if doc["unit"] else []
        found.append(doc)
    return found


def _doc(value) -> dict | None:
    """A JSON document that is an object, else None (a file written by hand, or by something else)."""
    return value if isinstance(value, dict) else None


def describe(j: dict) -> str:
    """One restart worker the host holds (of_instance), as `driver status` says it."""
    where = f" in {j['unit']}" if j.get("unit") else f" (pid {j.get('pid')})"
    at = f"{j.get('phase') or 'its start'}" + (f", {j['step']}" if j.get("step") else "")
    if j["state"] == "running":
        return f"a restart's worker runs{where}: {at}"
    if j["state"] == "lost":
        return f"a restart's worker{where} was killed during {at}, without a result: {j['job']}"
    return f"a restart's worker ended{where}, its result never collected: {j.get('outcome')}: {j.get('msg')}"


def journal_tail(unit: str, lines: int) -> list[str]:
    """The last lines the worker wrote to its journal stream (its phases, load steps and end, masked as written)."""
    argv = ["journalctl", "--no-pager", "-q", "-o", "cat", "-n", str(lines), "-u", unit]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return done.stdout.splitlines()[-lines:] if done.returncode == 0 else []


def start(
    machine,
    action: Callable[[], dict],
    succeeded: Callable[[dict], bool],
    mask: Callable[[dict], dict],
    every: float,
    on_start: Callable[[], None] = lambda: None,
    jobs_dir: str = JOBS_DIR,
) -> dict:
    """action() (the state machine's restart or rollback of `machine`) in a detached worker whose progress
    reporter is the job's file; what it says within `every` seconds (wait()). mask strips the secrets from
    everything written; the result gets the model-load steps with their times (steps)."""
    job = new(machine.inst.name, jobs_dir)
    machine.progress = progress.Reporter(job.progress, mask=mask)

    def work() -> dict:
        machine.progress.echo = say  # the worker's journal
        on_start()
        res = action()
        res["steps"] = machine.progress.finish()
        res["trail"] = machine.progress.doc["trail"]
        res["worker"] = worker_unit(job)
        return {"ok": succeeded(res), "res": mask(res)}

    def on_error(exc: BaseException) -> dict:
        return {"ok": False, "res": mask({"changed": True, "msg": f"the detached restart raised {exc!r}"})}

    detach(job, work, on_error)
    said = wait(job, seen=0, wait_s=every, min_s=every)
    if said["done"]:
        ack(job)  # the controller never learns this job: nothing could ask for its result again
    return said


def answer(module, said: dict) -> None:
    """An Ansible module's return for what wait() said: the result once done (failed unless ok), else the job
    still running (sglang_job, progress, seq)."""
    if said["done"]:
        if said["ok"]:
            module.exit_json(**said["res"])
        module.fail_json(**said["res"])
    module.exit_json(
        changed=True, sglang_job=said["job"], progress=said["progress"], seq=said["seq"], boot_id=said.get("boot_id")
    )


def gone(job: Job, seen_boot: str | None, now_boot: str | None) -> str:
    """Why a job's directory holds nothing to answer: the host booted since the controller last heard of it
    (/run is empty after a boot: the worker and its files went with it), or its result was acknowledged."""
    if seen_boot and now_boot and seen_boot != now_boot:
        return (
            f"job: {job.dir} is gone: the host booted during the restart (boot {seen_boot[:8]}, now {now_boot[:8]}), "
            "and the worker with it. An enabled unit's boot guard starts its known-good configuration in place of "
            "one that never verified; `python -m driver status` says what runs"
        )
    return f"job: {job.dir} holds no restart (its result already acknowledged, or never started)"
