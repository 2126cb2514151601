"""The safe restart's phases, each one function of the machine (machine.py), and the sequences as data.

Every exception raised in a phase (a refused systemctl, a timeout, a dropped HTTP connection, malformed JSON, an
OSError, SIGTERM of the module, a bug) becomes a failure of that phase (Machine.run_steps); what a failure leads to
is the sequence's rule, in restart.py. The refusals (REFUSALS) touch nothing running; every other phase may."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from . import boot, gpu, outcomes, unit
from .checks import verify as run_checks
from .durable import write_atomic
from .failure import Failure, as_failure
from .gpu import format_offender, may_stop
from .http import HttpError, generate, healthy
from .instance import masked
from .known_good import content_hash
from .lock import LEASE_BEGIN, LEASE_CHECK, LEASE_CONTINUE, LEASE_RECOVER, InstanceLock, Lease, Locked
from .machine import LoadFollower, Machine, Step
from .problems import ValidateError
from .rendezvous import parse_dist_init_addr
from .stage import promote as promote_pending
from .stage import read_text, stage_complete

# ---------------------------------------------------------------------- refusals: nothing running is touched


def take_lock(m: Machine) -> dict:
    m.lock = InstanceLock(
        m.inst.name,
        m.operation,
        m.s.controller,
        m.s.command,
        m.ports.lock_dir,
        lease=group_lease(m),
        clock=m.ports.wall,
    )
    try:
        holder = m.lock.acquire()
    except Locked as exc:
        m.lock = None
        raise Failure(outcomes.LOCK, str(exc), lock={"holder": exc.holder}, checked=True) from None
    return {"holder": holder}


def group_lease(m: Machine) -> Lease | None:
    """A multi-node restart's phase holds the lock between the phases as its run's lease (lock.py): the stop takes
    it, the start, confirm and record go on only under it, the group rollback's phases take it back if need be;
    the group's last phase on the node ends it (restart.end). In check mode it is only read."""
    if not m.s.group_token or m.s.phase == "all":
        return None
    phase = m.s.phase
    mode = (
        LEASE_CHECK
        if m.s.check_mode
        else LEASE_BEGIN
        if phase == "stop"
        else LEASE_RECOVER
        if phase in MULTINODE_ROLLBACK
        else LEASE_CONTINUE
    )
    return Lease(m.s.group_token, m.s.group_lease_s, mode, phase)


def validate(m: Machine) -> dict:
    """Every instance of the host checked as `sglang_validate` checks them (sglang_deploy.validate), under the
    lock: a refusal names the variable and touches nothing."""
    if m.s.validate_instances is None:
        return {"skipped": "validated by an earlier task"}
    try:
        out = m.ports.validate(
            m.s.validate_instances,
            m.inst.service_user,
            min_shm_mib=m.s.min_shm_mib,
            state_dir=m.inst.state_dir,
            patch_manifest=m.s.patch_manifest,
            check_mode=m.s.check_mode,
        )
    except ValidateError as exc:  # the checks could not run (nvidia-smi, SGLang's parser): no verdict
        raise Failure(outcomes.VALIDATE, f"{exc}. Nothing was stopped.") from None
    if out.get("failed"):
        raise Failure(outcomes.VALIDATE, f"{out['msg']}. Nothing was stopped.", checked=True, problems=out["problems"])
    return {"msg": out["msg"], "seconds": out["seconds"]}


def stage(m: Machine) -> dict:
    """Write this run's configuration as pending (sglang_deploy.stage) under the lock this restart holds, so no
    other controller can stage between here and the start; the preflight then finds exactly it."""
    if m.s.rendered is None:
        return {"skipped": "staged by an earlier task"}
    try:
        out = m.ports.stage(m.inst, m.s.rendered, m.s.secrets, m.s.check_mode)
    except ValueError as exc:  # systemd-analyze refused the unit: before anything was written
        raise Failure(outcomes.STAGE, f"{exc}. Nothing was stopped.", checked=True) from None
    if not m.s.check_mode:  # in check mode nothing was written: the files on disk are not this run's
        m.target = replace(m.target, config_hash=out["config_hash"])
    return {k: out[k] for k in ("outcome", "pending", "wrote", "config_hash") if k in out}


def preflight(m: Machine) -> dict:
    """Refuse before touching anything: another configuration than this run's staged, or GPUs held by others."""
    check_staged(m)
    try:
        snap = m.ports.snapshot()
    except gpu.NvidiaSmiError as exc:
        raise Failure(outcomes.PREFLIGHT, f"{exc}. Nothing was stopped.", checked=True) from None
    i = m.inst
    m.gpu_model = gpu.model_of(snap, i.gpus)
    wanted = [p for p in snap["processes"] if p["gpu"] in i.gpus]
    # Judged from the host's own processes, whatever the inventory declares: another instance's unit on these
    # GPUs is refused here, before this unit is stopped (issue #29), unless the operator said 'force'.
    held = gpu.units_held(gpu.other_units(wanted, i.unit), i.unit, i.name)
    foreign = [
        p for p in wanted if p.get("unit") != i.unit and not may_stop(p, m.s.stop_policy, i.unit, i.service_user)
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
    out = {"processes": len(wanted), "pending": m.pending}
    if held:  # only 'force' gets here with another unit's processes on the GPUs: the wait stops them
        out["note"] = f"GPUs {sorted(i.gpus)} are held by another unit: {held}; stop policy 'force' stops them"
    return out


def check_staged(m: Machine) -> None:
    """The configuration this run would start (pending, else the unit's) is complete and the one it staged.
    Its failures are not `checked`: refused, not the preflight's GPUs-not-clean."""
    i = m.inst
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
    expected = m.target.config_hash
    if expected and content_hash(target) != expected:
        raise Failure(
            outcomes.PREFLIGHT,
            f"the configuration staged for {i.name} is not the one this run rendered "
            f"(hash {content_hash(target)}, this run {expected}): another controller staged it. "
            "Nothing was stopped.",
        )


# ---------------------------------------------------------------------- the unit stopped, started, verified


def stop(m: Machine) -> dict:
    out = m.ports.systemctl("stop", m.inst.unit)
    if out.returncode != 0:
        raise Failure(outcomes.STOP, f"systemctl stop {m.inst.unit} failed: {out.stderr.strip()}")
    props = m.ports.show(m.inst.unit)
    if props["MainPID"]:
        raise Failure(outcomes.STOP, f"{m.inst.unit} still has main pid {props['MainPID']} after stop")
    return {"state": unit.state(props)}


def wait_gpus(m: Machine) -> dict:
    i, s = m.inst, m.s
    res = m.ports.wait_clean(
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


def promote(m: Machine) -> dict:
    # From here to the record, what is on disk has not verified: a boot meanwhile starts the known-good one.
    boot.mark(m.inst.name, m.unverified_dir)
    out = promote_pending(m.inst, reload=lambda: m.systemctl_ok("daemon-reload"))
    if not out["promoted"] and m.ports.show(m.inst.unit).get("NeedDaemonReload") == "yes":
        m.systemctl_ok("daemon-reload")  # the unit's file changed on disk: start what it says
        out["reloaded"] = True
    return out


def restore(m: Machine) -> dict:
    # A generation older than the newest goes on disk: the boot guard would put the newest back at this very
    # start (and at a boot before the record). The run's own window, as promote's.
    boot.mark(m.inst.name, m.unverified_dir)
    out = m.store.restore(m.target.record)
    m.systemctl_ok("daemon-reload")
    return out


def start(m: Machine) -> dict:
    """systemctl start, then wait until ready; fail fast when the new invocation fails or exits."""
    i, p = m.inst, m.ports
    m.started = m.store.snapshot()
    boot.forget_put_backs(i.name, boot.beside(p.lock_dir, boot.PUT_BACK_DIR))
    p.systemctl("reset-failed", i.unit)
    before = p.show(i.unit).get("InvocationID")
    m.systemctl_ok("start", "--no-block", i.unit)
    t0 = p.clock()
    running_since = None
    watch = LoadFollower(m) if m.progress is not None else None
    while True:
        props = p.show(i.unit)
        if watch is not None and props.get("InvocationID") != before:
            watch.poll(props.get("InvocationID"))
        # Until the start job runs, the unit is still the stopped one (same invocation).
        if props.get("InvocationID") != before and unit.has_failed(props):
            raise m.failure_from_journal(outcomes.START, props, f"{i.unit} exited while starting")
        if props["ActiveState"] == "active" and not i.serves_http:
            running_since = _still_running(m, props, running_since)
            if running_since is not None and p.clock() - running_since[0] >= 2.0:
                _ready(m, props, watch)  # this node's next call confirms and records it
                return {"main_pid": props["MainPID"], "running_after_s": round(p.clock() - t0, 3)}
        elif props["ActiveState"] == "active" and healthy(i.base, api_key=i.api_key()):
            _ready(m, props, watch)  # a multi-node rank 0 records in the record phase, once every rank is confirmed
            return {"main_pid": props["MainPID"], "ready_after_s": round(p.clock() - t0, 3)}
        if p.clock() - t0 >= m.s.ready_timeout:
            raise _not_ready(m, props)
        # Woken at once if the main process exits (systemd then says failed within milliseconds), else the
        # next poll of the unit and /health in 0.1 s.
        if props.get("MainPID") and p.wait_exit(props["MainPID"], 0.1):
            p.sleep(0.01)
        elif not props.get("MainPID"):
            p.sleep(0.1)


def _still_running(m: Machine, props: dict, since: tuple | None) -> tuple | None:
    """A rank above 0 (no HTTP to ask): (when its main process first logged, the process), or None while it has
    not. Its process runs its own code, a line of its own in the journal, and still runs 2 s on. Counted from the
    unit's start instead, a process slow to get going (Python on a busy host) outlasts the 2 s before it even
    reaches what kills it. Its own: the main process's, not the ExecStartPre gate's ("GPUs [..] clean after"),
    written under the same invocation. The 2 s are the one process's: a new one (died, started again between two
    polls) starts them over."""
    process = (props.get("InvocationID"), props.get("MainPID"))
    if since is not None and since[1] != process:
        since = None
    if since is None and m.logged(*process):
        since = (m.ports.clock(), process)
    return since


def _ready(m: Machine, props: dict, watch: LoadFollower | None) -> None:
    """The start phase's process is the one that serves: its argv and invocation kept (saved for a multi-node
    phase's next call)."""
    if watch is not None:
        watch.poll(props.get("InvocationID"), last=True)
    m.argv, m.invocation = m.ports.cmdline(props["MainPID"]), props.get("InvocationID")
    if m.s.phase in SAVES_STARTED:
        m.save_started()


def _not_ready(m: Machine, props: dict) -> Failure:
    i = m.inst
    lines = m.ports.journal(i.unit, props.get("InvocationID") or None)
    # The server's own last line, not systemd's about the unit ("sglang-a.service: ...").
    said = [line for line in lines if not line.startswith(f"{i.unit}: ")]
    return Failure(
        outcomes.START,
        f"{i.unit} not ready after {m.s.ready_timeout:g}s (unit "
        f"{unit.state(props)}; /health never answered 200). "
        f"Last log line: {said[-1] if said else 'none'}",
        invocation=props.get("InvocationID") or None,
        journal_tail=lines[-40:],
        traceback=unit.traceback_of(lines),
    )


def generation(m: Machine) -> dict:
    i, t, p = m.inst, m.s.thresholds, m.ports
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
            raise m.failure_from_journal(
                outcomes.GENERATE, props, f"the server died on its first generation ({exc})"
            ) from exc
        raise Failure(outcomes.GENERATE, f"generation failed: {exc}") from None


def verify(m: Machine) -> dict:
    v = run_checks(m.running, m.s.thresholds, m.ports, m.s.patch_manifest)
    m.verified = v
    if not v["ok"]:
        raise Failure(outcomes.VERIFY, "verification failed: " + "; ".join(v["failed_checks"]), verify=v)
    return {"checks": len(v["checks"]), "warnings": v["warnings"]}


def record(m: Machine) -> dict:
    """What started and verified becomes a known-good generation, if it is still what runs."""
    now = m.store.snapshot()
    props = m.ports.show(m.inst.unit)
    argv = m.ports.cmdline(props["MainPID"]) if props["MainPID"] else []
    if m.started is None or now["config_hash"] != m.started["config_hash"] or masked(argv) != masked(m.argv):
        put_back = ""
        if m.started is not None and now["config_hash"] != m.started["config_hash"]:
            # What is on disk is not what verified: a crash or a boot must start what did.
            for path, content in m.started["files"].items():
                write_atomic(path, content, 0o600 if path.endswith(".env") else 0o644)
            m.systemctl_ok("daemon-reload")
            put_back = "; the files that started and verified were put back"
        raise Failure(
            outcomes.RECORD,
            "the unit's configuration or command line changed during the restart "
            f"(another tool wrote it?): not recorded as known-good{put_back}",
        )
    summary = m.store.record(m.started, argv, m.verified or {})
    m.quietly(lambda: os.unlink(m.contained_path) if os.path.exists(m.contained_path) else None)
    try:
        m.systemctl_ok("enable", m.inst.unit)  # verified: now it may start at boot
        summary["enabled"] = True
    except (Exception, KeyboardInterrupt) as exc:
        summary.update(enabled=False, enable_error=as_failure(outcomes.RECORD, exc).cause)
    return summary


# ---------------------------------------------------------------------- a multi-node rank's confirmation


def rank0_serving(m: Machine) -> dict:
    """A rank above 0 confirms only once rank 0 serves the instance (it may have failed its start)."""
    i = m.inst
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


def load_started(m: Machine) -> dict:
    """The start phase's snapshot (written by this node's previous call), for the confirm phase's record."""
    with open(m.started_path, encoding="utf-8") as fh:
        saved = json.load(fh)
    m.started, m.argv = saved["started"], saved["argv"]
    m.invocation = saved.get("invocation")
    return {"started_hash": m.started["config_hash"]}


def confirm(m: Machine) -> dict:
    """A rank above 0, after every node's start phase: rank 0 serves, then this node's own checks, on the very
    process the start phase saw (one that died and was started again by Restart=on-failure is not confirmed)."""
    out = {**rank0_serving(m), **load_started(m)}
    now = m.ports.show(m.inst.unit).get("InvocationID")
    if m.invocation and now != m.invocation:
        raise Failure(
            outcomes.VERIFY,
            f"{m.inst.unit} is not the process its start phase saw (invocation {m.invocation}, now "
            f"{now or 'none'}): it exited and systemd started it again",
        )
    return {**out, **verify(m)}


# ---------------------------------------------------------------------- the machines as data

LOCK = Step(outcomes.LOCK, take_lock, outcomes.LOCKED)
VALIDATE = Step(outcomes.VALIDATE, validate, outcomes.INVALID_CONFIG)
STAGE = Step(outcomes.STAGE, stage, outcomes.INVALID_CONFIG)
PREFLIGHT = Step(outcomes.PREFLIGHT, preflight, outcomes.GPUS_NOT_CLEAN)
STOP = Step(outcomes.STOP, stop)
GPUS = Step(outcomes.GPUS, wait_gpus)
PROMOTE = Step(outcomes.PROMOTE, promote)
RESTORE = Step(outcomes.RESTORE, restore)
START = Step(outcomes.START, start)
GENERATE = Step(outcomes.GENERATE, generation)
VERIFY = Step(outcomes.VERIFY, verify)
RECORD = Step(outcomes.RECORD, record)
CONFIRM = Step(outcomes.VERIFY, confirm)
LOAD_STARTED = Step(outcomes.RECORD, load_started)

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


@dataclass(frozen=True)
class PlanStep:
    """One step of restart_multinode.yml, run over every node of the batch (Ansible ends a task on every host before
    the next). `step`: judge (each group's verdict across nodes, group.yml), keep_refused (the groups out of step
    before the stop: never stopped, never rolled back), choose_rolled (the groups out of step since: rolled back),
    or phase (the module's `phase` on the instances `on` names). `soft`: a failed rank stays in the play, its group
    judged next. `judged`: the module is told the verdict (group_ok); else every group it runs on is in step.
    `rollback`: only on a node with a group to roll back."""

    step: str
    title: str
    phase: str = ""
    # held_back (refused before the stop), going (selected, in step), rolled, rolled_going (rolled, in step)
    on: str = ""
    soft: bool = False
    judged: bool = False
    rollback: bool = False


JUDGE = "Judge each multi-node group across its nodes"
# The multi-node restart in order: Python's, the YAML loops over it (restart_multinode.yml). A rank missing from the
# batch is found by the first verdict, which refuses its instance on every node before anything stops.
MULTINODE_PLAN = (
    PlanStep("judge", JUDGE + " before the stop"),
    PlanStep("keep_refused", "Keep the groups refused before the stop"),
    PlanStep("phase", "Stop each multi-node instance on every node", "stop", "going", soft=True),
    PlanStep("judge", JUDGE + " after the stop"),
    PlanStep("phase", "Start each multi-node instance on every node", "start", "going", soft=True, judged=True),
    PlanStep("judge", JUDGE + " after the start"),
    PlanStep("phase", "Confirm the other ranks", "confirm", "going", soft=True, judged=True),
    PlanStep("judge", JUDGE + " after the confirmation"),
    # A record that fails leaves the instance serving, verified: no rollback.
    PlanStep("phase", "Record every rank of each confirmed multi-node instance", "record", "going"),
    PlanStep("choose_rolled", "Choose the groups to roll back"),
    PlanStep("phase", "Stop every rank of each failed group", "rollback_stop", "rolled", soft=True, rollback=True),
    PlanStep("judge", JUDGE + " being rolled back after its stop", rollback=True),
    PlanStep("phase", "Start every rank of each failed group on its known-good generation", "rollback_start",
             "rolled_going", soft=True, rollback=True),
    PlanStep("judge", JUDGE + " being rolled back after its start", rollback=True),
    # Not soft: each rank's result is the group's outcome (rolled_back, or not_recovered and contained).
    PlanStep("phase", "Confirm every rank of each rolled-back group, or contain the group", "rollback_confirm",
             "rolled", judged=True, rollback=True),
    # Last, and not soft: the refusal (outcome refused, nothing stopped) fails the host, so the run says so; before,
    # it would take the host out of the play with its other groups not yet restarted, half of each stopped elsewhere.
    PlanStep("phase", "Refuse each multi-node instance with a rank missing from this batch", "stop", "held_back",
             judged=True),
)  # fmt: skip
assert tuple(s.phase for s in (*REFUSALS, *RESTART, RECORD)) == outcomes.RESTART_PHASES
assert tuple(s.phase for s in ROLLBACK) == outcomes.ROLLBACK_PHASES
assert all(s.refusal for s in REFUSALS) and not any(s.refusal for s in (*RESTART, *ROLLBACK, RECORD, CONFIRM))
assert [s.phase for s in MULTINODE_PLAN if s.step == "phase"][:-1] == list(MULTINODE_PHASES)
