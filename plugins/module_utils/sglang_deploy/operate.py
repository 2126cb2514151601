"""What an operator asks of one instance besides a restart: the rollback to a known-good generation (restarted and
verified, ending as a restart ends: restart.end, escaped, contain), verify of the running server, and its status.
The machine is restart.py's (machine.py); status and verify only read."""

from __future__ import annotations

import os

from . import boot, job, outcomes, unit
from .checks import verify as run_checks
from .failure import as_failure
from .http import get_json, healthy, server_accept_length
from .instance import masked
from .known_good import summary
from .lock import peek
from .machine import Machine
from .phases import LOCK, RECORD, RESTORE, ROLLBACK
from .recover import take_evidence
from .restart import end, escaped, refused, result


def rollback(m: Machine) -> dict:
    """The operator's rollback: the known-good generation before the one on disk back (the newest, for a unit a
    containment stopped with it put back), restarted and verified."""
    if m.action != "rollback":  # the lock names the operation: the machine is built for it
        raise ValueError(f"rollback of a machine built for {m.action!r}: Machine(..., action='rollback')")
    res = result(m)
    try:
        if m.inst.nnodes > 1:
            cause = (
                f"{m.inst.name} spans {m.inst.nnodes} nodes: rolling its ranks back one node at a time would start them "
                "out of step. Put the known-good settings back in group_vars and run restart (all its nodes at once)."
            )
            res.update(outcome=outcomes.REFUSED, failure={"phase": outcomes.RESTORE, "cause": cause})
            return res
        if refused(m, res, (LOCK,)):
            return res
        record, cause = generation_to_restore(m)
        if record is None:
            res.update(outcome=outcomes.REFUSED, failure={"phase": outcomes.RESTORE, "cause": cause})
            return res
        res["rollback"] = m.retarget(record)
        if m.s.check_mode:
            res["outcome"] = outcomes.WOULD_ROLL_BACK
            return res
        res["changed"] = True
        roll_back(m, res)
        return res
    except (Exception, KeyboardInterrupt) as exc:
        escaped(m, res, exc)
        return res
    finally:
        end(m, res)


def contained_with(m: Machine, newest: dict | None) -> bool:
    """Whether a containment left the unit stopped with `newest`'s files put back, not started since (its note
    names the newest generation and the files on disk are still its)."""
    note = job.read_json(m.contained_path) or {}
    return (
        newest is not None
        and note.get("generation") == newest.get("generation")
        and m.live_hash == newest.get("config_hash")
        and (Machine.quietly_value(lambda: m.ports.show(m.inst.unit)) or {}).get("ActiveState") != "active"
    )


def generation_to_restore(m: Machine) -> tuple[dict | None, str]:
    """The generation the operator's rollback puts back, or None and why not (nothing touched yet). The configuration
    on disk is what runs, or what last ran: the one before it is wanted. Only a unit a containment stopped with the
    newest generation's files put back (and never started) starts the newest."""
    newest = m.store.latest()
    record = newest if contained_with(m, newest) else m.store.rollback_target()
    if record is None:
        return None, (
            f"no known-good generation of {m.inst.name} is recorded in {m.store.dir}: a restart records one when "
            "it succeeds. Nothing was touched."
            if newest is None
            else f"every known-good generation of {m.inst.name} kept in {m.store.dir} is the configuration on disk "
            f"now (the newest, {newest.get('generation')}, verified): there is no other to roll back to. "
            "Nothing was touched."
        )
    program = (record["argv"] or [""])[0]
    if not os.access(program, os.X_OK):  # its software generation removed: refused before anything is stopped
        return None, (
            f"known-good generation {record.get('generation')} of {m.inst.name} runs {program or 'no program'}, "
            "which is not on this host (its software generation was removed?): deploy it again, or restart "
            "with the configuration you want. Nothing was touched."
        )
    return record, ""


def roll_back(m: Machine, res: dict) -> None:
    """The machine's target restored, started, verified and recorded; a restore that touched nothing is a refusal."""
    before = m.live_hash
    failed = m.run_steps(ROLLBACK, res["phases"])
    if failed is not None and failed[0] is RESTORE and before is not None and m.live_hash == before:
        # Nothing written, nothing stopped: the unit serves as it did.
        res.update(changed=False, outcome=outcomes.REFUSED, failure=failed[1].as_dict())
        res["rollback"]["outcome"] = "not attempted: nothing was touched"
    elif failed is None:
        res.update(outcome=outcomes.ROLLED_BACK, profile=m.target.profile, verify=m.verified)
        res["rollback"]["outcome"] = "serving"
        done = m.run_steps((RECORD,), res["phases"])
        res["known_good"] = res["phases"][-1]["detail"] if done is None else {"recorded": False, "why": done[1].cause}
    else:
        res["failure"] = failed[1].as_dict()
        res["rollback"]["outcome"] = "failed"
        m.contain(res)


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
    """What the instance is now, read part by part: a part that cannot be read is an error of its own, the others
    still said."""
    i = m.inst
    out = {
        "changed": False,
        "outcome": outcomes.STATUS,
        "instance": i.name,
        "unit": i.unit,
        "configured_profile": i.profile,
    }
    errors = []
    for name, part in STATUS_PARTS:
        try:
            part(m, out)
        except (Exception, KeyboardInterrupt) as exc:
            errors.append(f"{name}: {as_failure(name, exc).cause}")
    out["errors"] = errors
    out["msg"] = (
        f"{i.name}: {out.get('state', '?')}, profile {out.get('running_profile') or '?'}"
        + "".join(f"; {job.describe(j)}" for j in out.get("jobs") or [])
        + (f"; errors: {'; '.join(errors)}" if errors else "")
    )
    return out


def unit_status(m: Machine, out: dict) -> None:
    i, p = m.inst, m.ports
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


def gpu_status(m: Machine, out: dict) -> None:
    snap = m.ports.snapshot()
    out["gpu_memory_mib"] = {g["index"]: g["memory_used_mib"] for g in snap["gpus"] if g["index"] in m.inst.gpus}


def http_status(m: Machine, out: dict) -> None:
    i = m.inst
    out.update(health=None, accept_length=None)
    if i.serves_http:
        key = i.api_key()
        out["health"] = healthy(i.base, timeout=5, api_key=key)
        if out["health"]:
            info = get_json(f"{i.base}/server_info", timeout=5, api_key=key)
            accept = server_accept_length(i.base, info, key) if info.get("speculative_algorithm") else None
            out["accept_length"] = round(accept, 3) if accept is not None else None


def known_good_status(m: Machine, out: dict) -> None:
    record = m.store.latest()
    out["known_good"] = summary(record) if record else None
    out["pending"] = m.pending
    out["lock"] = peek(m.inst.name, m.ports.lock_dir)


def jobs_status(m: Machine, out: dict) -> None:
    out["jobs"] = job.of_instance(m.inst.name, boot.beside(m.ports.lock_dir, job.JOBS_DIR))


STATUS_PARTS = (
    ("unit", unit_status),
    ("gpus", gpu_status),
    ("http", http_status),
    ("known_good", known_good_status),
    ("jobs", jobs_status),
)
