"""What a failed restart leads to: the known-good generation put back, started and verified (recover), else the
containment (Machine.contain); and a multi-node group's phases, one module call each (multinode, multinode_rollback:
every node in step, restart_multinode.yml running each phase over every node of the batch)."""

from __future__ import annotations

from . import outcomes
from .machine import Machine
from .phases import MULTINODE, MULTINODE_ROLLBACK, PROMOTE, RECORD, RESTORE, ROLLBACK, START, VERIFY


def finish_restarted(m: Machine, res: dict) -> None:
    """Verified: restarted, then recorded as known-good (a record that fails leaves it restarted, not recorded)."""
    res.update(outcome=outcomes.RESTARTED, verify=m.verified)
    failed = m.run_steps((RECORD,), res["phases"])
    if failed is None:
        res["known_good"] = res["phases"][-1]["detail"]
    else:
        res["known_good"] = {"recorded": False, "why": failed[1].cause}


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
    live = m.live_hash
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
    rb = {**m.retarget(record), "phases": []}
    res["rollback"] = rb
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
        m.contain(res)
        return res
    if phase == "rollback_confirm":
        res.update(outcome=outcomes.ROLLED_BACK, profile=record["profile"], verify=m.verified)
        res["rollback"]["outcome"] = "serving"
    else:
        res["outcome"] = outcomes.STOPPED if phase == "rollback_stop" else outcomes.STARTED
    return res
