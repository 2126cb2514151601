"""Live progress of python -m driver restart on a lab node (issue 16): the restart runs detached on the host and
reports each phase and each model-load step SGLang logs (the stand-in logs SGLang 0.5.23's lines over its load);
the driver records them in the run's event stream as they come, flags a load that makes no progress, and the
ledger's rows carry each step's time. Uses lab-node1's `main`; at the end it is back to deployed, never verified."""

from __future__ import annotations

import json

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from support.e2e import back_to_deployed, driver_runner, main_with

pytestmark = pytest.mark.lab

NODE = "lab-node1"
SLOW = {"LAB_STANDIN_LOAD_S": "6"}  # a load long enough to be seen in several answers


@pytest.fixture(scope="module")
def drive(deployed, tmp_path_factory):
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    ledger = tmp_path_factory.mktemp("ledger") / "ledger.sqlite3"
    run = driver_runner(the_lab, ledger, NODE)
    code, _, proc = run("restart")  # a known-good generation to roll back to
    assert code == 0, proc.stdout[-3000:]
    yield run, ledger
    back_to_deployed(the_lab, node, NODE)


def progress_of(ledger) -> list[dict]:
    """The newest run's progress events, in the order recorded."""
    runs = sorted((ledger.parent / "runs").iterdir(), key=lambda d: int(d.name))
    events = [json.loads(line) for line in (runs[-1] / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    return [e["event_data"] for e in events if e.get("event") == "sglang_progress"]


def in_order(seq: list) -> list:
    return list(dict.fromkeys(seq))


def test_a_restart_streams_its_phases_and_load_steps_in_order_and_records_their_times(drive):
    run, ledger = drive
    code, doc, proc = run("restart", "-e", main_with(env=SLOW))
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = progress_of(ledger)
    phases = in_order(p["phase"] for p in said if p.get("phase"))
    assert len(said) >= 3, said  # answers while it ran, not one at the end
    assert phases == [p for p in outcomes.RESTART_PHASES if p in phases], phases  # in the machine's order
    # Answers come at most every progress_every (2 s): phases shorter than that may pass between two answers,
    # the load's steps (5 s here) are seen as they come.
    live = in_order(p["step"] for p in said if p.get("phase") == "start" and p.get("step"))
    assert "start" in phases and len(live) >= 2, said
    [r] = [r for r in doc["rows"] if r["host"] == NODE]
    steps = [s["step"] for s in r["steps"] if s["phase"] == "start" and s["step"] != "starting"]
    # The stand-in's profile is speculative: the target's weights, the draft's, then the CUDA graphs.
    assert steps[:3] == ["loading weights", "loading draft weights", "capturing CUDA graphs"], r["steps"]
    assert all(s["seconds"] >= 0 for s in r["steps"])
    assert said[-1]["done"] is True and said[-1]["outcome"] == "restarted"
    # The last event's trail: every phase and step change, in order (each answer carries those since the last).
    trail = said[-1]["trail"]
    assert in_order(t["phase"] for t in trail) == list(outcomes.RESTART_PHASES), trail
    load = [t["step"] for t in trail if t["phase"] == outcomes.START and t["step"] not in ("", "starting")]
    assert in_order(load) == [
        "loading weights",
        "loading draft weights",
        "capturing CUDA graphs",
        "capturing draft CUDA graphs",
    ], trail
    assert [t["detail"] for t in trail if t["step"] == "capturing CUDA graphs"][-1] == "4/4 (100%)", trail
    assert not any(p.get("stalled_s") for p in said)
    assert "sglang_job" not in json.dumps(doc)  # the task's result is the module's own


def test_a_failing_restart_streams_its_rollback(drive):
    run, ledger = drive
    code, _, proc = run("restart", "-e", main_with(env={**SLOW, "LAB_STANDIN_FAULT": "crash-startup"}))
    assert code == 5, proc.stdout[-3000:] + proc.stderr[-3000:]
    phases = in_order(p["phase"] for p in progress_of(ledger) if p.get("phase"))
    rb_start, rb_verify = outcomes.ROLLBACK_PREFIX + outcomes.START, outcomes.ROLLBACK_PREFIX + outcomes.VERIFY
    assert phases.index(outcomes.START) < phases.index(rb_start), phases
    assert rb_verify in phases or phases[-1] == rb_start, phases  # verify may pass between two answers
    last = progress_of(ledger)[-1]
    assert last["outcome"] == "rolled_back"
    trail = in_order(t["phase"] for t in last["trail"])
    assert trail.index(outcomes.START) < trail.index(rb_start) and trail[-1] == rb_verify, trail


def test_a_stalled_load_is_flagged_with_its_last_line_and_not_killed_by_the_flag(drive):
    run, ledger = drive
    code, _, proc = run(
        "restart",
        "--stall-after",
        "3",
        "-e",
        main_with(env={"LAB_STANDIN_FAULT": "stall-load"}),
        "-e",
        json.dumps({"sglang_service_ready_timeout": 20}),
    )
    assert code == 5, proc.stdout[-3000:] + proc.stderr[-3000:]  # the ready timeout, then the rollback
    said = progress_of(ledger)
    # Each stretch without change is flagged once: validate (SGLang's parser) and the stand-in's start before its
    # first line may take 3 s on a busy machine as well; the load that never goes on is flagged in its step.
    flags = [p for p in said if p.get("stalled_s")]
    [flag] = [p for p in flags if p["phase"] == outcomes.START and p["step"] == "loading weights"][:1] or [flags]
    assert flag["stalled_s"] >= 3, flags
    assert "stall-load" in flag["last_line"]
    assert said[-1]["outcome"] == "rolled_back"
