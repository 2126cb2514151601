"""The safe restart, the rollback, verify and status of one instance: a state machine.

The phases are data: the sequences REFUSALS, RESTART, ROLLBACK and MULTINODE below, each a
tuple of Steps. Each phase is one method of Machine; every exception raised in it (a refused
systemctl, a timeout, a dropped HTTP connection, malformed JSON, an OSError, SIGTERM of the
module, a bug) becomes a failure of that phase. What a failure leads to is the sequence's rule:

    REFUSALS  nothing running was touched: the step's refusal outcome (lock held, GPUs not
              clean), or `refused` for an exception its own check did not raise
    RESTART   put the last known-good generation back, start and verify it (ROLLBACK); when
              that is impossible or fails too, contain: the unit stopped, never crash-looping,
              and the files on disk the known-good ones (or, with none, the unit disabled)
    MULTINODE contain on the failing node; restart.yml, which sees every node, then rolls the whole
              group back in step (MULTINODE_ROLLBACK: every rank stopped, then every rank started on
              its known-good generation, rank 0 verified, the others confirmed)
    RECORD    the server runs and verified: report what could not be done

So a restart ends in exactly one of: restarted (and verified), rolled back (and serving),
not recovered (stopped, with the cause); or a refusal that touched nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from . import bench as benchmark
from . import boot, evidence, gpu, job, outcomes, procinfo, unit
from . import progress as load_progress
from . import stage as staging
from .checks import Thresholds
from .checks import verify as run_checks
from .durable import write_atomic
from .gpu import format_offender, may_stop
from .http import HttpError, generate, healthy
from .instance import Instance, masked
from .known_good import Store, content_hash
from .lock import LEASE_BEGIN, LEASE_CHECK, LEASE_CONTINUE, LEASE_RECOVER, InstanceLock, Lease, Locked, peek
from .rendezvous import parse_dist_init_addr
from .secret_rule import clip
from .stage import promote, read_text, stage_complete
from .validate import ValidateError, validate_host


class Failure(Exception):
    def __init__(self, phase: str, cause: str, **details):
        super().__init__(cause)
        self.phase, self.cause, self.details = phase, cause, details

    def as_dict(self) -> dict:
        return {"phase": self.phase, "cause": self.cause, **self.details}


class Terminated(Exception):
    """The module got SIGTERM: the phase in progress fails, and the machine ends in a defined state."""


@dataclass(frozen=True)
class Step:
    phase: str
    run: Callable[[Machine], dict | None]
    refusal: str = ""  # in REFUSALS: the outcome when the step's own check says no


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


def sigterm(signum, frame):
    raise Terminated("the module was sent SIGTERM (the controller gave up or was stopped)")


def install_signal_handlers() -> None:
    """SIGTERM fails the phase in progress (then the defined ending); SIGHUP (a dropped SSH session) is ignored."""
    signal.signal(signal.SIGTERM, sigterm)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


class Machine:
    def __init__(self, inst: Instance, settings: Settings, ports: Ports | None = None):
        self.inst, self.s, self.ports = inst, settings, ports or Ports()
        self.store = Store(inst, settings.known_good_keep)
        self.lock: InstanceLock | None = None
        self.started: dict | None = None  # the live configuration as it was started
        self.invocation: str | None = None  # the unit's invocation the start phase saw running
        self.argv: list[str] = []  # the main process's argv once ready
        self.verified: dict | None = None
        self.target: dict | None = None  # the known-good generation a rollback puts back
        self.touched_at: float | None = None  # when the first phase past the refusals began: the downtime's start
        self.served_at: float | None = None  # when a benchmark after the record began: the downtime's end
        self.gpu_model: str | None = None  # the instance's GPUs' model, from the preflight's nvidia-smi snapshot
        # Where a detached restart reports its phase and model-load step as it goes (sglang_deploy.progress).
        self.progress: load_progress.Reporter | None = None

    # ------------------------------------------------------------------ the phases

    def take_lock(self) -> dict:
        self.lock = InstanceLock(
            self.inst.name,
            self.operation,
            self.s.controller,
            self.s.command,
            self.ports.lock_dir,
            lease=self.group_lease(),
            clock=self.ports.wall,
        )
        try:
            holder = self.lock.acquire()
        except Locked as exc:
            self.lock = None
            raise Failure(outcomes.LOCK, str(exc), lock={"holder": exc.holder}, checked=True) from None
        return {"holder": holder}

    def group_lease(self) -> Lease | None:
        """A multi-node restart's phase holds the lock between the phases as its run's lease (lock.py): the stop takes
        it, the start, confirm and record go on only under it, the group rollback's phases take it back if need be;
        the group's last phase on the node ends it (end()). In check mode it is only read."""
        if not self.s.group_token or self.s.phase == "all":
            return None
        phase = self.s.phase
        mode = (
            LEASE_CHECK
            if self.s.check_mode
            else LEASE_BEGIN
            if phase == "stop"
            else LEASE_RECOVER
            if phase in MULTINODE_ROLLBACK
            else LEASE_CONTINUE
        )
        return Lease(self.s.group_token, self.s.group_lease_s, mode, phase)

    def validate(self) -> dict:
        """Every instance of the host checked as `sglang_validate` checks them (sglang_deploy.validate), under the
        lock: a refusal names the variable and touches nothing."""
        if self.s.validate_instances is None:
            return {"skipped": "validated by an earlier task"}
        try:
            out = self.ports.validate(
                self.s.validate_instances,
                self.inst.service_user,
                min_shm_mib=self.s.min_shm_mib,
                state_dir=self.inst.state_dir,
                patch_manifest=self.s.patch_manifest,
                check_mode=self.s.check_mode,
            )
        except ValidateError as exc:  # the checks could not run (nvidia-smi, SGLang's parser): no verdict
            raise Failure(outcomes.VALIDATE, f"{exc}. Nothing was stopped.") from None
        if out.get("failed"):
            raise Failure(
                outcomes.VALIDATE, f"{out['msg']}. Nothing was stopped.", checked=True, problems=out["problems"]
            )
        return {"msg": out["msg"], "seconds": out["seconds"]}

    def stage(self) -> dict:
        """Write this run's configuration as pending (sglang_deploy.stage) under the lock this restart holds, so no
        other controller can stage between here and the start; the preflight then finds exactly it."""
        if self.s.rendered is None:
            return {"skipped": "staged by an earlier task"}
        try:
            out = self.ports.stage(self.inst, self.s.rendered, self.s.secrets, self.s.check_mode)
        except ValueError as exc:  # systemd-analyze refused the unit: before anything was written
            raise Failure(outcomes.STAGE, f"{exc}. Nothing was stopped.", checked=True) from None
        if not self.s.check_mode:  # in check mode nothing was written: the files on disk are not this run's
            self.s.expected_config_hash = out["config_hash"]
        return {k: out[k] for k in ("outcome", "pending", "wrote", "config_hash") if k in out}

    def preflight(self) -> dict:
        """Refuse before touching anything: another configuration than this run's staged, or GPUs held by others."""
        self.check_staged()
        try:
            snap = self.ports.snapshot()
        except gpu.NvidiaSmiError as exc:
            raise Failure(outcomes.PREFLIGHT, f"{exc}. Nothing was stopped.", checked=True) from None
        i = self.inst
        self.gpu_model = gpu.model_of(snap, i.gpus)
        wanted = [p for p in snap["processes"] if p["gpu"] in i.gpus]
        # Judged from the host's own processes, whatever the inventory declares: another instance's unit on these
        # GPUs is refused here, before this unit is stopped (issue #29), unless the operator said 'force'.
        held = gpu.units_held(gpu.other_units(wanted, i.unit), i.unit, i.name)
        foreign = [
            p for p in wanted if p.get("unit") != i.unit and not may_stop(p, self.s.stop_policy, i.unit, i.service_user)
        ]
        if foreign:
            raise Failure(
                outcomes.PREFLIGHT,
                (f"GPUs {sorted(i.gpus)} are held by another unit: {held}. " if held else "")
                + "GPUs held by processes outside this service: "
                + "; ".join(format_offender(x) for x in foreign)
                + ". Nothing was stopped. Stop them, or rerun with stop policy 'force'.",
                offenders=foreign,
                checked=True,
            )
        out = {"processes": len(wanted), "pending": self.pending}
        if held:  # only 'force' gets here with another unit's processes on the GPUs: the wait stops them
            out["note"] = f"GPUs {sorted(i.gpus)} are held by another unit: {held}; stop policy 'force' stops them"
        return out

    def check_staged(self) -> None:
        """The configuration this run would start (pending, else the unit's) is complete and the one it staged.
        Its failures are not `checked`: refused, not the preflight's GPUs-not-clean."""
        i = self.inst
        try:
            target = {live: read_text(i.pending_files.get(live, live)) for live in i.config_files}
        except OSError as exc:
            raise Failure(
                outcomes.PREFLIGHT,
                f"the configuration to start cannot be read ({exc}): run deploy again. Nothing was stopped.",
            ) from None
        if i.pending_files and not stage_complete(i):
            raise Failure(
                outcomes.PREFLIGHT,
                f"the pending configuration of {i.name} is incomplete (a deploy was "
                "interrupted?): run deploy again. Nothing was stopped.",
            )
        expected = self.s.expected_config_hash
        if expected and content_hash(target) != expected:
            raise Failure(
                outcomes.PREFLIGHT,
                f"the configuration staged for {i.name} is not the one this run rendered "
                f"(hash {content_hash(target)}, this run {expected}): another controller staged it. "
                "Nothing was stopped.",
            )

    def stop(self) -> dict:
        out = self.ports.systemctl("stop", self.inst.unit)
        if out.returncode != 0:
            raise Failure(outcomes.STOP, f"systemctl stop {self.inst.unit} failed: {out.stderr.strip()}")
        props = self.ports.show(self.inst.unit)
        if props["MainPID"]:
            raise Failure(outcomes.STOP, f"{self.inst.unit} still has main pid {props['MainPID']} after stop")
        return {"state": unit.state(props)}

    def wait_gpus(self) -> dict:
        i, s = self.inst, self.s
        res = self.ports.wait_clean(
            i.gpus, s.gpu_timeout, s.gpu_interval, s.max_used_mib, s.stop_policy, i.unit, i.service_user
        )
        if not res["clean"]:
            raise Failure(outcomes.GPUS, res["message"], offenders=res.get("offenders"), busy=res.get("busy"))
        return {
            "waited_s": round(res["waited_s"], 3),
            "polls": res["polls"],
            "stopped": res["stopped"],  # {pid: how it ended}
            "stopped_processes": res["stopped_processes"],  # whose each was: Machine.stopped_in gathers them
        }

    @staticmethod
    def stopped_in(res: dict) -> list[dict]:
        """Every process a result's GPU waits stopped (its own phases', its rollback's), each with its phase."""
        phases = [*res["phases"], *(res.get("rollback") or {}).get("phases", [])]
        details = [(p["phase"], p["detail"]) for p in phases if isinstance(p.get("detail"), dict)]
        return [{**x, "phase": phase} for phase, d in details for x in d.get("stopped_processes", [])]

    def promote(self) -> dict:
        # From here to the record, what is on disk has not verified: a boot meanwhile starts the known-good one.
        boot.mark(self.inst.name, self.unverified_dir)
        out = promote(self.inst, reload=lambda: self.systemctl_ok("daemon-reload"))
        if not out["promoted"] and self.ports.show(self.inst.unit).get("NeedDaemonReload") == "yes":
            self.systemctl_ok("daemon-reload")  # the unit's file changed on disk: start what it says
            out["reloaded"] = True
        return out

    def restore(self) -> dict:
        # A generation older than the newest goes on disk: the boot guard would put the newest back at this very
        # start (and at a boot before the record). The run's own window, as promote's.
        boot.mark(self.inst.name, self.unverified_dir)
        out = self.store.restore(self.target)
        self.systemctl_ok("daemon-reload")
        return out

    def start(self) -> dict:
        """systemctl start, then wait until ready; fail fast when the new invocation fails or exits."""
        i, p = self.inst, self.ports
        self.started = self.store.snapshot()
        boot.forget_put_backs(i.name, boot.beside(p.lock_dir, boot.PUT_BACK_DIR))
        p.systemctl("reset-failed", i.unit)
        before = p.show(i.unit).get("InvocationID")
        self.systemctl_ok("start", "--no-block", i.unit)
        t0 = p.clock()
        running_since = None
        watch = LoadFollower(self) if self.progress is not None else None
        while True:
            props = p.show(i.unit)
            if watch is not None and props.get("InvocationID") != before:
                watch.poll(props.get("InvocationID"))
            # Until the start job runs, the unit is still the stopped one (same invocation).
            if props.get("InvocationID") != before and unit.has_failed(props):
                raise self.failure_from_journal(outcomes.START, props, f"{i.unit} exited while starting")
            if props["ActiveState"] == "active" and not i.serves_http:
                # A rank above 0 (no HTTP to ask): its process runs its own code, a line of its own in the journal,
                # and still runs 2 s on. Counted from the unit's start instead, a process slow to get going (Python
                # on a busy host) outlasts the 2 s before it even reaches what kills it. Its own: the main
                # process's, not the ExecStartPre gate's ("GPUs [..] clean after"), written under the same invocation.
                # The 2 s are the one process's: a new one (died, started again between two polls) starts them over.
                process = (props.get("InvocationID"), props.get("MainPID"))
                if running_since is not None and running_since[1] != process:
                    running_since = None
                if running_since is None and self.logged(*process):
                    running_since = (p.clock(), process)
                if running_since is not None and p.clock() - running_since[0] >= 2.0:
                    if watch is not None:
                        watch.poll(props.get("InvocationID"), last=True)
                    self.argv, self.invocation = p.cmdline(props["MainPID"]), props.get("InvocationID")
                    if self.s.phase in SAVES_STARTED:
                        self.save_started()  # this node's next call confirms and records it
                    return {"main_pid": props["MainPID"], "running_after_s": round(p.clock() - t0, 3)}
            elif props["ActiveState"] == "active" and healthy(i.base, api_key=i.api_key()):
                if watch is not None:
                    watch.poll(props.get("InvocationID"), last=True)
                self.argv, self.invocation = p.cmdline(props["MainPID"]), props.get("InvocationID")
                if self.s.phase in SAVES_STARTED:
                    self.save_started()  # rank 0 records in the record phase, once every rank is confirmed
                return {"main_pid": props["MainPID"], "ready_after_s": round(p.clock() - t0, 3)}
            if p.clock() - t0 >= self.s.ready_timeout:
                lines = p.journal(i.unit, props.get("InvocationID") or None)
                # The server's own last line, not systemd's about the unit ("sglang-a.service: ...").
                said = [line for line in lines if not line.startswith(f"{i.unit}: ")]
                raise Failure(
                    outcomes.START,
                    f"{i.unit} not ready after {self.s.ready_timeout:g}s (unit "
                    f"{unit.state(props)}; /health never answered 200). "
                    f"Last log line: {said[-1] if said else 'none'}",
                    invocation=props.get("InvocationID") or None,
                    journal_tail=lines[-40:],
                    traceback=unit.traceback_of(lines),
                )
            # Woken at once if the main process exits (systemd then says failed within milliseconds), else the
            # next poll of the unit and /health in 0.1 s.
            if props.get("MainPID") and p.wait_exit(props["MainPID"], 0.1):
                p.sleep(0.01)
            elif not props.get("MainPID"):
                p.sleep(0.1)

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

    def generation(self) -> dict:
        i, t, p = self.inst, self.s.thresholds, self.ports
        if not i.serves_http:
            return {"skipped": "rank above 0: rank 0 serves"}
        try:
            out = generate(i.base, t.prompt, t.max_new_tokens, api_key=i.api_key())
            return {k: v for k, v in out.items() if k != "text"}
        except HttpError as exc:
            # The seed's failure: the server loaded, then died on its first decode.
            t0 = p.clock()
            props = p.show(i.unit)
            while p.clock() - t0 < 2.0 and not unit.has_failed(props):
                p.sleep(0.05)
                props = p.show(i.unit)
            if unit.has_failed(props):
                raise self.failure_from_journal(
                    outcomes.GENERATE, props, f"the server died on its first generation ({exc})"
                ) from exc
            raise Failure(outcomes.GENERATE, f"generation failed: {exc}") from None

    def verify(self) -> dict:
        v = run_checks(self.inst, self.s.thresholds, self.ports, self.s.patch_manifest)
        self.verified = v
        if not v["ok"]:
            raise Failure(outcomes.VERIFY, "verification failed: " + "; ".join(v["failed_checks"]), verify=v)
        return {"checks": len(v["checks"]), "warnings": v["warnings"]}

    def record(self) -> dict:
        """What started and verified becomes a known-good generation, if it is still what runs."""
        now = self.store.snapshot()
        props = self.ports.show(self.inst.unit)
        argv = self.ports.cmdline(props["MainPID"]) if props["MainPID"] else []
        if (
            self.started is None
            or now["config_hash"] != self.started["config_hash"]
            or masked(argv) != masked(self.argv)
        ):
            put_back = ""
            if self.started is not None and now["config_hash"] != self.started["config_hash"]:
                # What is on disk is not what verified: a crash or a boot must start what did.
                for path, content in self.started["files"].items():
                    write_atomic(path, content, 0o600 if path.endswith(".env") else 0o644)
                self.systemctl_ok("daemon-reload")
                put_back = "; the files that started and verified were put back"
            raise Failure(
                outcomes.RECORD,
                "the unit's configuration or command line changed during the restart "
                f"(another tool wrote it?): not recorded as known-good{put_back}",
            )
        summary = self.store.record(self.started, argv, self.verified or {})
        self.quietly(lambda: os.unlink(self.contained_path) if os.path.exists(self.contained_path) else None)
        try:
            self.systemctl_ok("enable", self.inst.unit)  # verified: now it may start at boot
            summary["enabled"] = True
        except (Exception, KeyboardInterrupt) as exc:
            summary.update(enabled=False, enable_error=as_failure(outcomes.RECORD, exc).cause)
        return summary

    def rank0_serving(self) -> dict:
        """A rank above 0 confirms only once rank 0 serves the instance (it may have failed its start)."""
        i = self.inst
        try:
            host, _ = parse_dist_init_addr(i.dist_init_addr)  # the rendezvous's own reading of it
        except ValueError as exc:
            raise Failure(outcomes.VERIFY, f"{i.name}: dist_init_addr {exc}: rank 0 cannot be reached") from None
        where = f"[{host}]:{i.port}" if ":" in host else f"{host}:{i.port}"  # an IPv6 address in a URL: bracketed
        if not healthy(f"http://{where}", timeout=10, api_key=i.api_key()):
            raise Failure(
                outcomes.VERIFY, f"rank 0 of {i.name} ({where}) does not serve: this rank's start is not confirmed"
            )
        return {"rank0": where}

    def load_started(self) -> dict:
        """The start phase's snapshot (written by this node's previous call), for the confirm phase's record."""
        with open(self.started_path, encoding="utf-8") as fh:
            saved = json.load(fh)
        self.started, self.argv = saved["started"], saved["argv"]
        self.invocation = saved.get("invocation")
        return {"started_hash": self.started["config_hash"]}

    def confirm(self) -> dict:
        """A rank above 0, after every node's start phase: rank 0 serves, then this node's own checks, on the very
        process the start phase saw (one that died and was started again by Restart=on-failure is not confirmed)."""
        out = {**self.rank0_serving(), **self.load_started()}
        now = self.ports.show(self.inst.unit).get("InvocationID")
        if self.invocation and now != self.invocation:
            raise Failure(
                outcomes.VERIFY,
                f"{self.inst.unit} is not the process its start phase saw (invocation {self.invocation}, now "
                f"{now or 'none'}): it exited and systemd started it again",
            )
        return {**out, **self.verify()}

    def save_started(self) -> None:
        os.makedirs(os.path.dirname(self.started_path), mode=0o700, exist_ok=True)
        saved = {"started": self.started, "argv": masked(self.argv), "invocation": self.invocation}
        write_atomic(self.started_path, json.dumps(saved), 0o600)

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

    # ------------------------------------------------------------------ helpers

    @property
    def operation(self) -> str:
        # A rollback's target is chosen under the lock, after this is written: the configured profile is not it.
        profile = f" (profile {self.inst.profile})" if self.action == "restart" else ""
        return f"{self.action} {self.inst.name}{profile}"

    action = "restart"

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

    def run_steps(self, steps: tuple[Step, ...], log: list[dict], label: str = "") -> tuple[Step, Failure] | None:
        """Run the steps in order; the first failure stops them and is returned with its step."""
        for step in steps:
            t0 = None
            at = None
            try:
                at = round(self.ports.wall(), 3)
                t0 = self.ports.clock()
                if self.touched_at is None and step not in REFUSALS:
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

    def contain(self, res: dict) -> None:
        """Stopped and not recovered: the unit stopped (no crash loop), the files on disk ones that may start at boot."""
        previous = signal.getsignal(signal.SIGTERM)
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish containing: a second SIGTERM must not cut it short
        except ValueError:  # not the main thread (tests): nothing to mask
            previous = None
        end: dict = {}
        try:
            end["stop"] = self.quietly(lambda: self.systemctl_ok("stop", self.inst.unit))
            record = self.target or self.quietly_value(self.store.latest)
            live = live_hash_of(self)
            failed = None
            if record and live != record.get("config_hash"):
                self.target = record
                failed = self.quietly(self.restore)
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


def as_failure(phase: str, exc: BaseException) -> Failure:
    if isinstance(exc, Failure):
        if exc.phase != phase:
            exc.details.setdefault("raised_in", exc.phase)
            exc.phase = phase
        return exc
    if isinstance(exc, (Terminated, KeyboardInterrupt)):
        return Failure(phase, str(exc) or "interrupted (SIGINT)", interrupted=True)
    kind = type(exc).__name__
    known = (unit.UnitError, HttpError, gpu.NvidiaSmiError, OSError, TimeoutError, ValueError, LookupError)
    if isinstance(exc, known) or kind == "TimeoutExpired":
        return Failure(phase, f"{kind}: {exc}")
    return Failure(phase, f"unexpected {kind}: {exc}", traceback=traceback.format_exc().splitlines()[-12:])


# ---------------------------------------------------------------------- the machines as data

LOCK = Step(outcomes.LOCK, Machine.take_lock, outcomes.LOCKED)
VALIDATE = Step(outcomes.VALIDATE, Machine.validate, outcomes.INVALID_CONFIG)
STAGE = Step(outcomes.STAGE, Machine.stage, outcomes.INVALID_CONFIG)
PREFLIGHT = Step(outcomes.PREFLIGHT, Machine.preflight, outcomes.GPUS_NOT_CLEAN)
STOP = Step(outcomes.STOP, Machine.stop)
GPUS = Step(outcomes.GPUS, Machine.wait_gpus)
PROMOTE = Step(outcomes.PROMOTE, Machine.promote)
RESTORE = Step(outcomes.RESTORE, Machine.restore)
START = Step(outcomes.START, Machine.start)
GENERATE = Step(outcomes.GENERATE, Machine.generation)
VERIFY = Step(outcomes.VERIFY, Machine.verify)
RECORD = Step(outcomes.RECORD, Machine.record)
CONFIRM = Step(outcomes.VERIFY, Machine.confirm)
LOAD_STARTED = Step(outcomes.RECORD, Machine.load_started)

REFUSALS = (LOCK, VALIDATE, STAGE, PREFLIGHT)
RESTART = (STOP, GPUS, PROMOTE, START, GENERATE, VERIFY)
ROLLBACK = (RESTORE, STOP, GPUS, START, GENERATE, VERIFY)
# One model over several nodes: one task per phase, each over every node (all ranks down before any starts;
# nothing recorded before every rank is confirmed). A failure contains the instance on the failing node; restart.yml
# then runs MULTINODE_ROLLBACK on every node of the group. Rank 0 serves; the ranks above it have no HTTP server.
MULTINODE = {
    "stop": (STOP, GPUS),
    "start": (PROMOTE, START, GENERATE, VERIFY),  # ranks above 0: PROMOTE, START
    "confirm": (CONFIRM,),  # ranks above 0 (rank 0 serves, then their own checks); rank 0 verified at its start
    "record": (LOAD_STARTED, RECORD),  # every rank, once every rank is confirmed
}
MULTINODE_ROLLBACK = {
    "rollback_stop": (STOP, GPUS),
    "rollback_start": (RESTORE, START, GENERATE, VERIFY),  # ranks above 0: RESTORE, START
    "rollback_confirm": (CONFIRM,),  # ranks above 0; rank 0: VERIFY (again, now that every rank runs)
}
MULTINODE_PHASES = (*MULTINODE, *MULTINODE_ROLLBACK)
# Where a multi-node group's restart ends on each node, success or failure: the record (every rank confirmed), or
# the last phase of its rollback (rolled back, or contained); there its lease is removed. restart.yml runs one of
# them on every node of a group that took a lease (a group refused before its stop never took one).
GROUP_ENDS = ("record", "rollback_confirm")
SAVES_STARTED = ("start", "rollback_start")
assert tuple(s.phase for s in (*REFUSALS, *RESTART, RECORD)) == outcomes.RESTART_PHASES
assert tuple(s.phase for s in ROLLBACK) == outcomes.ROLLBACK_PHASES


# ---------------------------------------------------------------------- actions


def result(m: Machine) -> dict:
    i = m.inst
    return {"changed": False, "instance": i.name, "unit": i.unit, "profile": i.profile, "phases": []}


def restart(m: Machine) -> dict:
    res = result(m)
    try:
        if m.s.phase == "stop" and not m.s.group_ok:
            res.update(
                outcome=outcomes.REFUSED,
                failure={"phase": outcomes.PREFLIGHT, "cause": f"{m.s.group_why}. Nothing was stopped on any node."},
            )
            return res
        # The group rollback's phases put the known-good generation back: this run's configuration is not staged.
        if refused(m, res, (LOCK,) if m.s.phase in MULTINODE_ROLLBACK else REFUSALS):
            return res
        if m.s.check_mode:
            res.update(outcome=outcomes.WOULD_RESTART, pending=m.pending)
            return res
        res["changed"] = True
        if m.s.phase != "all":
            return multinode(m, res)
        failed = m.run_steps(RESTART, res["phases"])
        if failed is None:
            finish_restarted(m, res)
            if m.s.bench is not None:
                measure(m, res)
        else:
            res["failure"] = failed[1].as_dict()
            res["verify"] = failed[1].details.get("verify")
            take_evidence(m, res, failed[0].phase)
            recover(m, res)
        return res
    except (Exception, KeyboardInterrupt) as exc:
        escaped(m, res, exc)
        return res
    finally:
        end(m, res)


def end(m: Machine, res: dict) -> None:
    """Every restart and rollback ends here: SIGTERM ignored from now on, the lock released, one line said."""
    ignore_sigterm()
    # The server's downtime: from the first phase that touches it (the stop; promote for a multi-node start) to
    # the end. The lock, the validation, the staging and the preflight run while the old server still serves.
    served = m.served_at if m.served_at is not None else m.ports.clock()
    res["downtime_s"] = round(served - m.touched_at, 3) if m.touched_at is not None else 0.0
    # The unverified window ends with the run that holds the lock (recorded, rolled back, contained, or refused:
    # then a mark a killed run left goes too, and the guard holds the next start to the known-good files); a
    # multi-node group's with its last phase only. A run cut short (SIGKILL, a boot) leaves it: the guard acts then.
    if m.lock and not m.s.check_mode and (m.s.phase == "all" or m.s.phase in GROUP_ENDS):
        res["unmark"] = Machine.quietly(lambda: boot.unmark(m.inst.name, m.unverified_dir))
        if res["unmark"] is None:
            del res["unmark"]
    if m.lock:
        # A multi-node group's lease (lock.py) is renewed for the gap to its next phase; its last phase ends it.
        lease = m.lock.release(end_group=m.s.phase in GROUP_ENDS)
        if lease is not None:
            res["group_lease"] = lease
    res["msg"] = message(m, res)


def escaped(m: Machine, res: dict, exc: BaseException) -> None:
    """An exception outside any phase: nothing touched yet is a refusal; every phase passed is a restart;
    otherwise contain."""
    ignore_sigterm()
    failure = as_failure(res["phases"][-1]["phase"] if res["phases"] else outcomes.LOCK, exc)
    if res.get("outcome") in (outcomes.RESTARTED, outcomes.ROLLED_BACK, outcomes.NOT_RECOVERED):
        res.setdefault("note", f"after the outcome: {failure.cause}")
        return
    passed = {p["phase"] for p in res["phases"] if p["ok"]}
    if res.get("changed") and {outcomes.START, outcomes.VERIFY} <= passed and m.action == "restart":
        res.update(outcome=outcomes.RESTARTED, verify=m.verified, note=f"after verifying: {failure.cause}")
        return
    res.setdefault("failure", failure.as_dict())
    if not res.get("changed"):
        res.setdefault("outcome", outcomes.REFUSED)
        return
    m.contain(res)


def ignore_sigterm() -> None:
    """From the end of the last phase on, a SIGTERM must not cut the ending short."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread (tests)
        pass


def refused(m: Machine, res: dict, steps: tuple[Step, ...]) -> bool:
    failed = m.run_steps(steps, res["phases"])
    if failed is None:
        return False
    step, failure = failed
    # The step's refusal when its own check said no; any other exception there touched nothing either. The flag
    # is taken out: it is this function's, never the result's.
    outcome = step.refusal if failure.details.pop("checked", False) else outcomes.REFUSED
    res.update(outcome=outcome, failure=failure.as_dict())
    if "lock" in failure.details:
        res["lock"] = failure.details["lock"]
    return True


def finish_restarted(m: Machine, res: dict) -> None:
    res.update(outcome=outcomes.RESTARTED, verify=m.verified)
    failed = m.run_steps((RECORD,), res["phases"])
    if failed is None:
        res["known_good"] = res["phases"][-1]["detail"]
    else:
        res["known_good"] = {"recorded": False, "why": failed[1].cause}


def measure(m: Machine, res: dict) -> None:
    """Autotune's benchmark of the restarted, verified, recorded instance, still under the lock: res["bench"]
    (sglang_deploy.bench.run's result) and res["gpu_model"]; a benchmark that cannot run leaves the restart as it
    is (restarted) with bench None and bench_error its cause. SIGTERM and SIGINT go on to escaped(): restarted,
    with a note. The benchmark stops at its first failed request (bench.run), so a failing server holds the lock
    for at most the warm-up and one request's timeout per concurrent request."""
    m.served_at = m.ports.clock()
    b = m.s.bench
    if m.progress:  # the live table says what the instance's time goes to, not the record
        m.progress.phase(outcomes.BENCH)
    try:
        res["bench"] = m.ports.bench(
            m.inst.base,
            b["concurrency"],
            b["requests"],
            b["max_new_tokens"],
            b["warmup"],
            api_key=m.inst.api_key(),
            timeout=b["timeout"],
        )
    except Terminated:
        res["bench"], res["bench_error"] = None, benchmark.INTERRUPTED
        raise
    except Exception as exc:  # contained: the restart stands, the combination has no measurement
        res["bench"], res["bench_error"] = None, clip(f"the benchmark could not run: {exc!r}", 600)
    res["gpu_model"] = m.gpu_model


EVIDENCE_PHASES = (outcomes.START, outcomes.GENERATE, outcomes.VERIFY)


def take_evidence(m: Machine, res: dict, phase: str) -> None:
    """The evidence of a failed start, generation or verification, before a rollback or containment destroys it."""
    if not m.s.evidence or m.s.check_mode or phase not in EVIDENCE_PHASES:
        return
    t = m.s.thresholds
    request = {"prompt": t.prompt, "max_new_tokens": t.max_new_tokens} if phase == outcomes.GENERATE else None
    try:
        res["evidence"] = m.ports.evidence(
            m.inst,
            res["failure"],
            res["failure"].get("invocation"),
            request=request,
            budget_s=m.s.evidence_budget_s,
        )
    except Exception as exc:  # for_failure never raises; a replaced port might
        res["evidence"] = {"error": f"no evidence bundle: {type(exc).__name__}: {exc}"}


def recover(m: Machine, res: dict) -> None:
    """After a failure past the stop: the known-good generation back, started and verified; else contained."""
    record = Machine.quietly_value(m.store.latest)
    live = live_hash_of(m)
    started = any(p["phase"] == outcomes.START for p in res["phases"])  # before it, the files may be the known-good
    why = (
        "rollback is off (sglang_service_rollback)"
        if not m.s.rollback
        else "no known-good generation is recorded"
        if record is None
        else "the failed configuration is the known-good one"
        if started and record.get("config_hash") == live
        else ""
    )
    if why:
        res["rollback"] = {"attempted": False, "why": why}
        m.contain(res)
        return
    m.target = record
    rb = {
        "attempted": True,
        "to_generation": record.get("generation"),
        "to_profile": record.get("profile"),
        "config_hash": record.get("config_hash"),
        "phases": [],
    }
    res["rollback"] = rb
    m.inst.argv, m.inst.profile = record["argv"], record["profile"]
    failed = m.run_steps(ROLLBACK, rb["phases"], outcomes.ROLLBACK_PREFIX)
    if failed is None:
        rb.update(outcome="serving", verify=m.verified)
        res["outcome"] = outcomes.ROLLED_BACK
    else:
        rb.update(outcome="failed", failure=failed[1].as_dict())
        m.contain(res)


def multinode(m: Machine, res: dict) -> dict:
    phase, i = m.s.phase, m.inst
    if phase in MULTINODE_ROLLBACK:
        return multinode_rollback(m, res)
    steps = MULTINODE[phase]
    if phase == "start" and not i.serves_http:
        steps = (PROMOTE, START)  # verified in the confirm phase, once rank 0 serves
    if phase == "confirm" and i.serves_http:
        steps = ()  # rank 0 generated and verified in its start phase
    failed = m.run_steps(steps[:-1] if phase == "record" else steps, res["phases"])
    if failed is not None:
        res["failure"] = failed[1].as_dict()
        take_evidence(m, res, failed[0].phase)
        res["rollback"] = {
            "attempted": False,
            "why": f"{i.name} spans {i.nnodes} nodes: restart.yml rolls every node of it back in step",
        }
        m.contain(res)
        return res
    if phase == "record":
        finish_restarted(m, res)
    else:
        res["outcome"] = {"stop": outcomes.STOPPED, "start": outcomes.STARTED, "confirm": outcomes.VERIFIED}[phase]
        if m.verified is not None:
            res["verify"] = m.verified
    return res


def multinode_rollback(m: Machine, res: dict) -> dict:
    """One phase of a multi-node group's rollback, every node in step: each rank's newest known-good generation."""
    phase, i = m.s.phase, m.inst
    record = Machine.quietly_value(m.store.latest)
    if record is None or (phase == "rollback_confirm" and not m.s.group_ok):
        res["failure"] = {
            "phase": outcomes.ROLLBACK_PREFIX + outcomes.RESTORE,
            "cause": f"no known-good generation of {i.name} is recorded on this node"
            if record is None
            else f"the group's rollback failed: {m.s.group_why}",
        }
        res["rollback"] = {"attempted": record is not None, "outcome": "failed", "why": res["failure"]["cause"]}
        m.contain(res)
        return res
    m.target = record
    i.argv, i.profile = record["argv"], record["profile"]
    res["rollback"] = {
        "attempted": True,
        "to_generation": record.get("generation"),
        "to_profile": record.get("profile"),
        "config_hash": record.get("config_hash"),
    }
    steps = MULTINODE_ROLLBACK[phase]
    if phase == "rollback_start" and not i.serves_http:
        steps = (RESTORE, START)
    if phase == "rollback_confirm" and i.serves_http:
        steps = (VERIFY,)
    failed = m.run_steps(steps, res["phases"], outcomes.ROLLBACK_PREFIX)
    if failed is not None:
        res["failure"] = failed[1].as_dict()
        res["rollback"].update(outcome="failed", failure=res["failure"])
        m.contain(res)
        return res
    if phase == "rollback_confirm":
        res.update(outcome=outcomes.ROLLED_BACK, profile=record["profile"], verify=m.verified)
        res["rollback"]["outcome"] = "serving"
    else:
        res["outcome"] = outcomes.STOPPED if phase == "rollback_stop" else outcomes.STARTED
    return res


def contained_with(m: Machine, newest: dict | None) -> bool:
    """Whether a containment left the unit stopped with `newest`'s files put back, not started since (its note
    names the newest generation and the files on disk are still its)."""
    note = job.read_json(m.contained_path) or {}
    return (
        newest is not None
        and note.get("generation") == newest.get("generation")
        and live_hash_of(m) == newest.get("config_hash")
        and (Machine.quietly_value(lambda: m.ports.show(m.inst.unit)) or {}).get("ActiveState") != "active"
    )


def live_hash_of(m: Machine) -> str | None:
    return Machine.quietly_value(lambda: m.store.snapshot()["config_hash"])


def rollback(m: Machine) -> dict:
    """The operator's rollback: the known-good generation before the one on disk back (the newest, for a unit a
    containment stopped with it put back), restarted and verified."""
    m.action = "rollback"
    res = result(m)
    try:
        if m.inst.nnodes > 1:
            res.update(
                outcome=outcomes.REFUSED,
                failure={
                    "phase": outcomes.RESTORE,
                    "cause": (
                        f"{m.inst.name} spans {m.inst.nnodes} nodes: rolling its ranks back one node at a time would start them "
                        "out of step. Put the known-good settings back in group_vars and run restart (all its nodes at once)."
                    ),
                },
            )
            return res
        if refused(m, res, (LOCK,)):
            return res
        # The configuration on disk is what runs, or what last ran: the one before it is wanted. Only a unit a
        # containment stopped with the newest generation's files put back (and never started) starts the newest.
        newest = m.store.latest()
        record = newest if contained_with(m, newest) else m.store.rollback_target()
        if record is None:
            cause = (
                f"no known-good generation of {m.inst.name} is recorded in {m.store.dir}: a restart records one when "
                "it succeeds. Nothing was touched."
                if newest is None
                else f"every known-good generation of {m.inst.name} kept in {m.store.dir} is the configuration on disk "
                f"now (the newest, {newest.get('generation')}, verified): there is no other to roll back to. "
                "Nothing was touched."
            )
            res.update(outcome=outcomes.REFUSED, failure={"phase": outcomes.RESTORE, "cause": cause})
            return res
        program = (record["argv"] or [""])[0]
        if not os.access(program, os.X_OK):  # its software generation removed: refused before anything is stopped
            cause = (
                f"known-good generation {record.get('generation')} of {m.inst.name} runs {program or 'no program'}, "
                "which is not on this host (its software generation was removed?): deploy it again, or restart "
                "with the configuration you want. Nothing was touched."
            )
            res.update(outcome=outcomes.REFUSED, failure={"phase": outcomes.RESTORE, "cause": cause})
            return res
        res["rollback"] = {
            "attempted": True,
            "to_generation": record.get("generation"),
            "to_profile": record.get("profile"),
            "config_hash": record.get("config_hash"),
        }
        if m.s.check_mode:
            res["outcome"] = outcomes.WOULD_ROLL_BACK
            return res
        res["changed"] = True
        m.target = record
        m.inst.argv, m.inst.profile = record["argv"], record["profile"]
        before = live_hash_of(m)
        failed = m.run_steps(ROLLBACK, res["phases"])
        if failed is not None and failed[0] is RESTORE and before is not None and live_hash_of(m) == before:
            # Nothing written, nothing stopped: the unit serves as it did.
            res.update(changed=False, outcome=outcomes.REFUSED, failure=failed[1].as_dict())
            res["rollback"]["outcome"] = "not attempted: nothing was touched"
            return res
        if failed is None:
            res.update(outcome=outcomes.ROLLED_BACK, profile=record["profile"], verify=m.verified)
            res["rollback"]["outcome"] = "serving"
            done = m.run_steps((RECORD,), res["phases"])
            res["known_good"] = (
                res["phases"][-1]["detail"] if done is None else {"recorded": False, "why": done[1].cause}
            )
        else:
            res["failure"] = failed[1].as_dict()
            res["rollback"]["outcome"] = "failed"
            m.contain(res)
        return res
    except (Exception, KeyboardInterrupt) as exc:
        escaped(m, res, exc)
        return res
    finally:
        end(m, res)


def verify(m: Machine) -> dict:
    res = {"changed": False, "instance": m.inst.name, "profile": m.inst.profile}
    try:
        v = run_checks(m.inst, m.s.thresholds, m.ports, m.s.patch_manifest)
    except (Exception, KeyboardInterrupt) as exc:
        failure = as_failure(outcomes.VERIFY, exc)
        v = {
            "ok": False,
            "checks": [{"name": "verify", "ok": False, "severity": "fail", "detail": failure.cause}],
            "warnings": [],
            "failed_checks": [f"verify: {failure.cause}"],
        }
    res.update(outcome=outcomes.VERIFIED if v["ok"] else outcomes.VERIFY_FAILED, verify=v)
    if not v["ok"]:  # a running server that fails verification: its evidence, while it still runs
        res["failure"] = {"phase": outcomes.VERIFY, "cause": "; ".join(v["failed_checks"])}
        take_evidence(m, res, outcomes.VERIFY)
    res["msg"] = (
        f"{m.inst.name}: verified"
        if v["ok"]
        else f"{m.inst.name}: verification failed: " + "; ".join(v["failed_checks"])
    )
    return res


def status(m: Machine) -> dict:
    i, p = m.inst, m.ports
    out = {
        "changed": False,
        "outcome": outcomes.STATUS,
        "instance": i.name,
        "unit": i.unit,
        "configured_profile": i.profile,
    }
    errors = []

    def part(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except (Exception, KeyboardInterrupt) as exc:
            errors.append(f"{name}: {as_failure(name, exc).cause}")

    def unit_part() -> None:
        props = p.show(i.unit)
        running = p.cmdline(props["MainPID"]) if props["MainPID"] else []
        out.update(
            state=unit.state(props),
            restarts=props["NRestarts"],
            main_pid=props["MainPID"],
            running_profile=i.profile_of(running),
            drift=bool(running) and masked(running) != masked(i.argv),
            enabled=props.get("UnitFileState"),
        )

    def gpu_part() -> None:
        snap = p.snapshot()
        out["gpu_memory_mib"] = {g["index"]: g["memory_used_mib"] for g in snap["gpus"] if g["index"] in i.gpus}

    def http_part() -> None:
        out.update(health=None, accept_length=None)
        if i.serves_http:
            from .http import get_json, server_accept_length

            key = i.api_key()
            out["health"] = healthy(i.base, timeout=5, api_key=key)
            if out["health"]:
                info = get_json(f"{i.base}/server_info", timeout=5, api_key=key)
                accept = server_accept_length(i.base, info, key) if info.get("speculative_algorithm") else None
                out["accept_length"] = round(accept, 3) if accept is not None else None

    def known_good_part() -> None:
        from .known_good import summary

        record = m.store.latest()
        out["known_good"] = summary(record) if record else None
        out["pending"] = m.pending
        out["lock"] = peek(i.name, p.lock_dir)

    def jobs_part() -> None:
        out["jobs"] = job.of_instance(i.name, boot.beside(p.lock_dir, job.JOBS_DIR))

    parts = (("unit", unit_part), ("gpus", gpu_part), ("http", http_part), ("known_good", known_good_part))
    for name, fn in (*parts, ("jobs", jobs_part)):
        part(name, fn)
    out["errors"] = errors
    out["msg"] = (
        f"{i.name}: {out.get('state', '?')}, profile {out.get('running_profile') or '?'}"
        + "".join(f"; {job.describe(j)}" for j in out.get("jobs") or [])
        + (f"; errors: {'; '.join(errors)}" if errors else "")
    )
    return out


def message(m: Machine, res: dict) -> str:
    """One line for the operator: what happened, and where the instance stands."""
    i, outcome = m.inst, res.get("outcome")
    f = res.get("failure") or {}
    if outcome in (outcomes.RESTARTED, outcomes.STOPPED, outcomes.STARTED):
        kg = res.get("known_good") or {}
        extra = f" (not recorded as known-good: {kg['why']})" if kg.get("recorded") is False else ""
        return f"{i.name}: {outcome}{extra}"
    if outcome in (outcomes.WOULD_RESTART, outcomes.WOULD_ROLL_BACK):
        return f"{i.name}: {outcome} (check mode)"
    msg = f"{i.name}: {f.get('phase')} failed: {f.get('cause')}"
    rb = res.get("rollback") or {}
    if outcome == outcomes.ROLLED_BACK and m.action == "restart":
        msg += f". Rolled back to the last-known-good configuration (profile {rb.get('to_profile')}): serving."
    elif outcome == outcomes.ROLLED_BACK:
        msg = (
            f"{i.name}: rolled back to generation {rb.get('to_generation')} (profile {rb.get('to_profile')}): serving."
        )
        kg = res.get("known_good") or {}
        if kg.get("recorded") is False:  # the boot guard holds a start to the newest recorded generation
            msg += (
                f" Not recorded as known-good ({kg.get('why')}): the next start or boot puts the newest recorded "
                "generation back; run rollback again once the cause is fixed."
            )
    elif outcome == outcomes.NOT_RECOVERED:
        if rb.get("attempted") and rb.get("failure"):
            msg += f". Rollback failed too: {rb['failure'].get('phase')}: {rb['failure'].get('cause')}"
        elif rb.get("why"):
            msg += f". Not rolled back: {rb['why']}"
        contained = res.get("contained") or {}
        msg += f"; {i.unit} is stopped ({contained.get('unit_state', '?')})."
        if contained.get("files"):
            msg += f" {contained['files']}."
    return msg
