"""The safe restart's machine: what it is given (Settings, Ports), what it holds while it runs (the lock, the
target, what started and verified), and how it runs a sequence of steps (run_steps). The phases themselves are
functions of the machine in phases.py; what a failure leads to is recover.py's (the containment, Machine.contain,
the machine's own); a restart's entry and ending restart.py's; the operator's rollback, verify and status operate.py's.

The target is one value the machine owns (Target): what this run starts and verifies, what drift and the record
are judged against, and the configuration hash the preflight expects. A restart starts with the rendered
configuration as its target; a rollback or a containment replaces it by a known-good generation (retarget). The
Instance (the rendered record) and the Settings are never changed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import bench as benchmark
from . import boot, evidence, gpu, outcomes, procinfo, unit
from . import progress as load_progress
from . import stage as staging
from .checks import Thresholds
from .durable import write_atomic
from .failure import Failure, Terminated, as_failure
from .instance import Instance, masked
from .known_good import Store
from .lock import InstanceLock
from .validate import validate_host


@dataclass(frozen=True)
class Step:
    phase: str
    run: Callable[[Machine], dict | None]
    refusal: str = (
        ""  # a refusal's (phases.REFUSALS): the outcome when the step's own check says no; it touches nothing
    )


@dataclass
class Settings:
    ready_timeout: float = 900.0
    gpu_timeout: float = 120.0
    gpu_interval: float = 0.1
    max_used_mib: int = 1024
    stop_policy: str = "own"
    rollback: bool = True
    patch_manifest: str | None = None
    known_good_keep: int = 5
    controller: str = ""
    command: str = ""
    phase: str = "all"
    # A multi-node instance's other ranks, as restart.yml saw them across nodes after the last phase: in step, or
    # not (a rank failed, or its node left the run), and why. Out of step, the stop refuses (nothing stopped) and
    # the group rollback's last phase contains this rank.
    group_ok: bool = True
    group_why: str = ""
    # A multi-node restart's run, the same on every node (restart_multinode.yml): its phases hold the instance's lock
    # between them as a lease on each node (lock.py), valid group_lease_s after each phase. None: no lease.
    group_token: str | None = None
    group_lease_s: float = 1470.0
    # The hash of the configuration an earlier task staged for this run (sglang_stage); the machine's target starts
    # with it, and this run's own staging replaces it there.
    expected_config_hash: str | None = None
    # This run's rendered configuration ({live path: content} of the unit and environment file) and the
    # secrets file's content: staged by the restart itself, under the lock it holds to the end.
    rendered: dict | None = None
    secrets: str | None = None
    # The host's rendered instance records, checked in this call before anything is touched (SGLang's parser, its
    # verdict cached while configuration and software stay the same; the host's checks): one module call less than
    # a validation task of its own. None: an earlier task validated them.
    validate_instances: list | None = None
    min_shm_mib: int = 0
    # The crash evidence bundle (sglang_deploy.evidence), taken when a start, generation or verification fails,
    # before the rollback restarts the unit; at most evidence_budget_s.
    evidence: bool = True
    evidence_budget_s: float = 10.0
    # Autotune's benchmark (sglang_deploy.bench.run's concurrency, requests, max_new_tokens, warmup, timeout): run
    # after a verified restart's record, in this call and under its lock, so that no other operation restarts the
    # instance between the restart and its measurement (and no second module call per combination). None: none.
    bench: dict | None = None
    check_mode: bool = False
    thresholds: Thresholds = field(default_factory=Thresholds)


@dataclass
class Ports:
    """The machine's side effects; the unit tests replace them with fakes."""

    systemctl: Callable = unit.systemctl
    show: Callable = unit.show
    journal: Callable = unit.journal
    journal_since: Callable = unit.journal_since
    snapshot: Callable = gpu.snapshot
    wait_clean: Callable = gpu.wait_clean
    cmdline: Callable = procinfo.cmdline
    wait_exit: Callable = procinfo.wait_exit
    clock: Callable = time.monotonic
    wall: Callable = time.time  # the epoch time each phase began: comparable across hosts and with the controller
    sleep: Callable = time.sleep
    lock_dir: str = "/run/sglang-deploy/locks"
    stage: Callable = staging.stage
    validate: Callable = validate_host
    evidence: Callable = evidence.for_failure
    bench: Callable = benchmark.run


@dataclass(frozen=True)
class Target:
    """What the run starts: a command line and its profile, the configuration hash the preflight expects (None: not
    checked), and for a known-good generation its record (None: this run's own configuration)."""

    argv: list[str]
    profile: str
    config_hash: str | None = None
    record: dict | None = None

    @classmethod
    def generation(cls, record: dict) -> Target:
        return cls(record["argv"], record["profile"], record.get("config_hash"), record)

    def summary(self) -> dict:
        """A rollback's summary in a result: the generation it puts back."""
        r = self.record or {}
        return {
            "attempted": True,
            "to_generation": r.get("generation"),
            "to_profile": r.get("profile"),
            "config_hash": r.get("config_hash"),
        }


class LoadFollower:
    """While a detached restart's start waits: the unit's new journal lines (at most every READ_S) to its
    progress reporter as the model-load step SGLang logs (sglang_deploy.progress.LoadWatch)."""

    READ_S = 0.5

    def __init__(self, m: Machine):
        self.m = m
        self.watch = load_progress.LoadWatch(m.inst.redactor().text)  # the secrets file's values known too
        self.cursor: str | None = None
        self.next_read = 0.0

    def poll(self, invocation: str | None, last: bool = False) -> None:
        """last: the server is ready; what it logged since the previous read is read now, whatever the time."""
        p = self.m.ports
        if not invocation or (p.clock() < self.next_read and not last):
            return
        self.next_read = p.clock() + self.READ_S
        try:
            lines, self.cursor = p.journal_since(invocation, self.cursor)
        except Exception:  # progress is shown, never needed: a journal that cannot be read shows none
            return
        for step, detail in self.watch.feed(lines) or [(self.watch.step, self.watch.detail)]:
            self.m.progress.step(step or load_progress.READY_WAIT, detail, self.watch.last_line)


class Machine:
    def __init__(self, inst: Instance, settings: Settings, ports: Ports | None = None, action: str = "restart"):
        self.inst, self.s, self.ports, self.action = inst, settings, ports or Ports(), action
        self.target = Target(inst.argv, inst.profile, settings.expected_config_hash)
        self.lock: InstanceLock | None = None
        self.started: dict | None = None  # the live configuration as it was started
        self.invocation: str | None = None  # the unit's invocation the start phase saw running
        self.argv: list[str] = []  # the main process's argv once ready
        self.verified: dict | None = None
        self.touched_at: float | None = None  # when the first phase past the refusals began: the downtime's start
        self.served_at: float | None = None  # when a benchmark after the record began: the downtime's end
        self.gpu_model: str | None = None  # the instance's GPUs' model, from the preflight's nvidia-smi snapshot
        # Where a detached restart reports its phase and model-load step as it goes (sglang_deploy.progress).
        self.progress: load_progress.Reporter | None = None

    def retarget(self, record: dict) -> dict:
        """A known-good generation becomes what the run starts (a rollback, a containment); its summary."""
        self.target = Target.generation(record)
        return self.target.summary()

    @property
    def running(self) -> Instance:
        """The instance as this run starts it: the target's command line and profile (verified, recorded)."""
        if (self.target.argv, self.target.profile) == (self.inst.argv, self.inst.profile):
            return self.inst
        return replace(self.inst, argv=self.target.argv, profile=self.target.profile)

    @property
    def store(self) -> Store:
        # A rollback records the generation it started under that generation's profile and software.
        return Store(self.running, self.s.known_good_keep)

    @property
    def started_path(self) -> str:
        return os.path.join(os.path.dirname(self.ports.lock_dir), "starts", f"{self.inst.name}.json")

    @property
    def contained_path(self) -> str:
        """A containment's note: which generation it left on disk, stopped (removed by the next record)."""
        return os.path.join(self.inst.kg_dir, "contained.json")

    @property
    def unverified_dir(self) -> str:
        return boot.beside(self.ports.lock_dir, boot.UNVERIFIED_DIR)

    @property
    def operation(self) -> str:
        # A rollback's target is chosen under the lock, after this is written: the configured profile is not it.
        profile = f" (profile {self.inst.profile})" if self.action == "restart" else ""
        return f"{self.action} {self.inst.name}{profile}"

    @property
    def pending(self) -> bool:
        return bool(self.inst.pending_files)

    def systemctl_ok(self, *args: str) -> None:
        out = self.ports.systemctl(*args)
        if out.returncode != 0:
            raise unit.UnitError(f"systemctl {' '.join(args)} failed: {(out.stderr or '').strip()}")

    def failure_from_journal(self, phase: str, props: dict, fallback: str) -> Failure:
        p = self.ports
        lines: list[str] = []
        t0 = p.clock()
        while p.clock() - t0 < 1.0:  # journald may lag the exit by a few ms
            lines = p.journal(self.inst.unit, props.get("InvocationID") or None)
            if lines:
                break
            p.sleep(0.05)
        timing = {}
        exited = props.get("ExecMainExitTimestampMonotonic") or 0
        if exited:  # CLOCK_MONOTONIC in microseconds, the clock of time.monotonic()
            timing = {
                "exit_to_detect_s": round(t0 - exited / 1e6, 3),
                "exit_to_report_s": round(p.clock() - exited / 1e6, 3),
            }
        return Failure(
            phase,
            unit.cause_of(lines) or fallback,
            invocation=props.get("InvocationID") or None,
            journal_tail=lines[-40:],
            traceback=unit.traceback_of(lines),
            unit_state=unit.state(props),
            exit=f"{props.get('ExecMainCode', '?')}/{props.get('ExecMainStatus', '?')}",
            **timing,
        )

    def logged(self, invocation: str | None, pid: int | None) -> bool:
        """The invocation's main process has written a line of its own to the journal: not the ExecStartPre gate's
        (another _PID), not systemd's from the process before its exec ("sglang-a.service: ProtectHostname=yes is
        configured, but ...", the main process's _PID)."""
        if not invocation or not pid:
            return False
        try:
            lines, _ = self.ports.journal_since(invocation, None, 3, pid=pid)
        except (OSError, subprocess.SubprocessError):  # journalctl slow or missing: not yet; the next poll asks again
            return False
        return any(not line.startswith(f"{self.inst.unit}: ") for line in lines)

    def save_started(self) -> None:
        os.makedirs(os.path.dirname(self.started_path), mode=0o700, exist_ok=True)
        saved = {"started": self.started, "argv": masked(self.argv), "invocation": self.invocation}
        write_atomic(self.started_path, json.dumps(saved), 0o600)

    def run_steps(self, steps: tuple[Step, ...], log: list[dict], label: str = "") -> tuple[Step, Failure] | None:
        """Run the steps in order; the first failure stops them and is returned with its step."""
        for step in steps:
            t0 = None
            at = None
            try:
                at = round(self.ports.wall(), 3)
                t0 = self.ports.clock()
                if self.touched_at is None and not step.refusal:
                    self.touched_at = t0
                if self.progress is not None:
                    self.progress.phase(label + step.phase)
                detail = step.run(self) or {}
                log.append(
                    {
                        "phase": label + step.phase,
                        "at": at,
                        "seconds": round(self.ports.clock() - t0, 3),
                        "ok": True,
                        "detail": detail,
                    }
                )
            except (Exception, KeyboardInterrupt) as exc:
                failure = as_failure(step.phase, exc)
                now = self.ports.clock()
                log.append(
                    {
                        "phase": label + step.phase,
                        "at": at,
                        "seconds": round(now - (t0 if t0 is not None else now), 3),
                        "ok": False,
                        "detail": failure.cause,
                    }
                )
                return step, failure
        return None

    @property
    def live_hash(self) -> str | None:
        """The hash of the configuration on disk now; None when it cannot be read."""
        return self.quietly_value(lambda: self.store.snapshot()["config_hash"])

    def contain(self, res: dict) -> None:
        """Stopped and not recovered: the unit stopped (no crash loop), the files on disk ones that may start at boot."""
        from .phases import restore  # phases.py imports this module: its phase, imported when a containment runs

        previous = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish containing: a second SIGTERM must not cut it short
        except ValueError:  # not the main thread (tests): nothing to mask
            previous = None
        end: dict = {}
        try:
            end["stop"] = self.quietly(lambda: self.systemctl_ok("stop", self.inst.unit))
            record = self.target.record or self.quietly_value(self.store.latest)
            failed = None
            if record and self.live_hash != record.get("config_hash"):
                self.retarget(record)
                failed = self.quietly(lambda: restore(self))
                end["files"] = failed or f"known-good generation {record.get('generation')} put back, not started"
                if failed:  # the failed files stay on disk: a boot must not start them
                    end["disable"] = (
                        self.quietly(lambda: self.systemctl_ok("disable", self.inst.unit)) or "unit disabled"
                    )
            if record and not failed:  # the operator's rollback starts this one, not the one before it
                note = {"generation": record.get("generation"), "at": self.ports.wall()}
                self.quietly(lambda: write_atomic(self.contained_path, json.dumps(note), 0o600))
            elif not record:
                end["files"] = self.quietly(lambda: self.systemctl_ok("disable", self.inst.unit)) or (
                    "no known-good generation: the unit is disabled so that a boot does not start it"
                )
            props = self.quietly_value(lambda: self.ports.show(self.inst.unit)) or {}
            end["unit_state"] = unit.state(props) if props else "unknown"
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        res["outcome"] = outcomes.NOT_RECOVERED
        res["contained"] = end

    @staticmethod
    def stopped_in(res: dict) -> list[dict]:
        """Every process a result's GPU waits stopped (its own phases', its rollback's), each with its phase."""
        phases = [*res["phases"], *(res.get("rollback") or {}).get("phases", [])]
        details = [(p["phase"], p["detail"]) for p in phases if isinstance(p.get("detail"), dict)]
        return [{**x, "phase": phase} for phase, d in details for x in d.get("stopped_processes", [])]

    @staticmethod
    def quietly(fn: Callable[[], object]) -> str | None:
        """Run a containment step; its failure is reported, never raised."""
        try:
            fn()
            return None
        except Exception as exc:
            return f"failed: {type(exc).__name__}: {exc}"

    @staticmethod
    def quietly_value(fn: Callable[[], object]):
        try:
            return fn()
        except Terminated:
            raise  # not "no value": the caller's defined ending handles it
        except Exception:
            return None
