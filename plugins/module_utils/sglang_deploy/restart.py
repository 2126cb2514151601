"""The safe restart of one instance, and what each failure leads to.

The phases are data (phases.py: the sequences REFUSALS, RESTART, ROLLBACK and MULTINODE, each a tuple of Steps,
each step one function of the machine, machine.py). What a failure leads to is the sequence's rule:

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
not recovered (stopped, with the cause); or a refusal that touched nothing. The operator's rollback, verify and
status are operate.py's; they end the same way (end, escaped, contain).
"""

from __future__ import annotations

import json
import signal

from . import bench as benchmark
from . import boot, job, outcomes, unit
from .durable import write_atomic
from .failure import Terminated, as_failure, ignore_sigterm
from .machine import Machine, Step
from .phases import (
    GROUP_ENDS,
    LOCK,
    MULTINODE,
    MULTINODE_ROLLBACK,
    PROMOTE,
    RECORD,
    REFUSALS,
    RESTART,
    RESTORE,
    ROLLBACK,
    START,
    VERIFY,
    restore,
)
from .secret_rule import clip


def result(m: Machine) -> dict:
    i = m.inst
    return {"changed": False, "instance": i.name, "unit": i.unit, "profile": i.profile, "phases": []}


def stopped_in(res: dict) -> list[dict]:
    """Every process a result's GPU waits stopped (its own phases', its rollback's), each with its phase."""
    phases = [*res["phases"], *(res.get("rollback") or {}).get("phases", [])]
    details = [(p["phase"], p["detail"]) for p in phases if isinstance(p.get("detail"), dict)]
    return [{**x, "phase": phase} for phase, d in details for x in d.get("stopped_processes", [])]


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
    contain(m, res)


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
        contain(m, res)
        return
    rb = {**m.retarget(record), "phases": []}
    res["rollback"] = rb
    failed = m.run_steps(ROLLBACK, rb["phases"], outcomes.ROLLBACK_PREFIX)
    if failed is None:
        rb.update(outcome="serving", verify=m.verified)
        res["outcome"] = outcomes.ROLLED_BACK
    else:
        rb.update(outcome="failed", failure=failed[1].as_dict())
        contain(m, res)


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
    if failed is not None and phase == "record":  # every rank confirmed and serving: only the record is lost
        res.update(outcome=outcomes.RESTARTED, known_good={"recorded": False, "why": failed[1].cause})
        return res
    if failed is not None:
        res["failure"] = failed[1].as_dict()
        take_evidence(m, res, failed[0].phase)
        res["rollback"] = {
            "attempted": False,
            "why": f"{i.name} spans {i.nnodes} nodes: restart.yml rolls every node of it back in step",
        }
        contain(m, res)
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
        contain(m, res)
        return res
    res["rollback"] = m.retarget(record)
    steps = MULTINODE_ROLLBACK[phase]
    if phase == "rollback_start" and not i.serves_http:
        steps = (RESTORE, START)
    if phase == "rollback_confirm" and i.serves_http:
        steps = (VERIFY,)
    failed = m.run_steps(steps, res["phases"], outcomes.ROLLBACK_PREFIX)
    if failed is not None:
        res["failure"] = failed[1].as_dict()
        res["rollback"].update(outcome="failed", failure=res["failure"])
        contain(m, res)
        return res
    if phase == "rollback_confirm":
        res.update(outcome=outcomes.ROLLED_BACK, profile=record["profile"], verify=m.verified)
        res["rollback"]["outcome"] = "serving"
    else:
        res["outcome"] = outcomes.STOPPED if phase == "rollback_stop" else outcomes.STARTED
    return res


def contain(m: Machine, res: dict) -> None:
    """Stopped and not recovered: the unit stopped (no crash loop), the files on disk ones that may start at boot."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish containing: a second SIGTERM must not cut it short
    except ValueError:  # not the main thread (tests): nothing to mask
        previous = None
    end: dict = {}
    try:
        end["stop"] = m.quietly(lambda: m.systemctl_ok("stop", m.inst.unit))
        record = m.target.record or m.quietly_value(m.store.latest)
        live = live_hash_of(m)
        failed = None
        if record and live != record.get("config_hash"):
            m.retarget(record)
            failed = m.quietly(lambda: restore(m))
            end["files"] = failed or f"known-good generation {record.get('generation')} put back, not started"
            if failed:  # the failed files stay on disk: a boot must not start them
                end["disable"] = m.quietly(lambda: m.systemctl_ok("disable", m.inst.unit)) or "unit disabled"
        if record and not failed:  # the operator's rollback starts this one, not the one before it
            note = {"generation": record.get("generation"), "at": m.ports.wall()}
            m.quietly(lambda: write_atomic(m.contained_path, json.dumps(note), 0o600))
        elif not record:
            end["files"] = m.quietly(lambda: m.systemctl_ok("disable", m.inst.unit)) or (
                "no known-good generation: the unit is disabled so that a boot does not start it"
            )
        props = m.quietly_value(lambda: m.ports.show(m.inst.unit)) or {}
        end["unit_state"] = unit.state(props) if props else "unknown"
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    res["outcome"] = outcomes.NOT_RECOVERED
    res["contained"] = end


def live_hash_of(m: Machine) -> str | None:
    return Machine.quietly_value(lambda: m.store.snapshot()["config_hash"])


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
