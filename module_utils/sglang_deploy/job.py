"""A restart or rollback run in a worker detached from the module call (and its SSH session), so that the
controller can learn its progress while it runs (sglang_deploy.progress) and a dropped connection never cuts
it short: the worker always runs to the state machine's defined end and writes its result.

A job is a root-only directory under JOBS_DIR: pid (the worker's), progress.json (progress.Reporter) and
result.json (the module's result, secrets already stripped), each written atomically. library/sglang_job.py
reads it, and hands the result over as often as it is asked for it (an answer lost with a dropped connection is
asked for again): the directory is removed only when the controller acknowledges the result (ack).
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import progress
from .durable import write_atomic

JOBS_DIR = "/run/sglang-deploy/jobs"


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
            return {"done": False, "job": job.dir, "progress": prog, "seq": seq}
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


def detach(job: Job, work: Callable[[], dict], on_error: Callable[[BaseException], dict]) -> int:
    """work() in a grandchild in its own session, stdio on /dev/null; its return (or on_error's, if it raised)
    written to job.result. Returns the worker's pid once its pid file is written."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the intermediate child; the tests see its effects
        try:
            os.close(r)
            os.setsid()
            worker = os.fork()
            if worker:
                os.write(w, str(worker).encode("ascii"))
                os._exit(0)
            os.close(w)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            try:
                res = work()
            except BaseException as exc:  # the state machine contains its own; anything else still ends here
                res = on_error(exc)
            write_json(job.result, res)
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as f:
        raw = f.read()
    if not raw:
        raise OSError("the restart's worker could not be started (its fork failed)")
    worker = int(raw)
    with open(job.pid_file, "w", encoding="ascii") as f:
        f.write(str(worker))
    return worker


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
        on_start()
        res = action()
        res["steps"] = machine.progress.finish()
        res["trail"] = machine.progress.doc["trail"]
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
    module.exit_json(changed=True, sglang_job=said["job"], progress=said["progress"], seq=said["seq"])
