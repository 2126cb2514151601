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
not recovered (stopped, with the cause); or a refusal that touched nothing. What follows a failure (the rollback to
the known-good generation, a multi-node group's phases) is recover.py's, the containment Machine.contain; the
operator's rollback, verify and status are operate.py's, and end as a restart ends (end, escaped).
"""

from __future__ import annotations

from . import bench as benchmark
from . import boot, outcomes
from .failure import Terminated, as_failure, ignore_sigterm
from .machine import Machine, Step
from .phases import GROUP_ENDS, LOCK, MULTINODE_ROLLBACK, REFUSALS, RESTART
from .recover import finish_restarted, multinode, recover, take_evidence
from .secret_rule import clip


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
