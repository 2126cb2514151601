"""Replay ansible-runner event streams recorded from real driver runs on lab nodes
(tests/driver/streams, written by the driver into its ledger) through the event handling,
the exit-code mapping, the summary and the JSON result.

Each stream ends with the driver's own line (driver.events.RESULT): how that run ended (ansible-runner's
status and rc, interrupted or not) and the exit code the driver gave. The replay (tests/support/streams.py)
maps the recorded ending again and must give the recorded exit code: the expectation comes from the stream,
not from the test.

To record a new one: run the driver against the lab; its stream is
~/.local/state/sglang-deploy/runs/<run id>/events.jsonl (`python -m driver history` lists run ids;
SGLANG_DEPLOY_LEDGER moves it); gzip it here.
"""

from __future__ import annotations

import json

import pytest

from driver import display, exitcodes
from support.streams import replay


def test_restart_ok():
    t, code = replay("restart-ok", "restart")
    assert code == exitcodes.OK
    (row,) = t.rows()
    assert (row["host"], row["instance"], row["phase"], row["result"]) == ("lab-node1", "main", "record", "restarted")
    assert row["tokens_per_s"] > 100 and row["accept_length"] > 1.5 and row["seconds"] < 10
    (m,) = t.measurements()
    assert m["profile"] == m["running_profile"] == "eagle3_topk1" and len(m["config_hash"]) == 16


def test_restart_rolled_back_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    t, code = replay("restart-rolled-back", "restart")
    assert code == exitcodes.ROLLED_BACK
    (row,) = t.rows()
    assert row["result"] == "rolled_back" and row["phase"] == "generate"
    cause = "AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'"
    assert f"{cause} -> rollback to eagle3_topk1: serving" in row["detail"]
    assert row["tokens_per_s"] > 100, "the rolled-back server's own measurement"
    display.summary(t, code, run_id=8)
    out = capsys.readouterr().out
    assert "traceback from the journal (generate)" in out and "self.adaptive_controller.on_verify()" in out


def test_invalid_configuration_names_the_setting():
    t, code = replay("restart-invalid-config", "restart")
    assert code == exitcodes.INVALID_CONFIG
    (row,) = t.rows()
    # The restart's own call validated (restart.yml's replicas): refused before anything was stopped.
    assert row["phase"] == "validate" and row["result"] == "invalid_config"
    assert (
        "--speculative-algorithm is EAGLE (set by sglang_instances[0].flags.speculative_algorithm): use EAGLE3"
        in row["detail"]
    )
    assert row["detail"].endswith("Nothing was stopped.") and row["seconds"] == 0.0


def test_gpus_not_clean_names_the_offender():
    t, code = replay("restart-gpus-not-clean", "restart")
    assert code == exitcodes.GPUS_NOT_CLEAN
    (row,) = t.rows()
    assert row["result"] == "gpus_not_clean" and "GPU 3: pid 1 holds 8148 MiB (user root" in row["detail"]


def test_not_recovered():
    t, code = replay("restart-not-recovered", "restart")
    assert code == exitcodes.NOT_RECOVERED
    (row,) = t.rows()
    assert row["result"] == "not_recovered" and row["detail"].startswith(
        "start: RuntimeError: CUDA error: out of memory"
    )


def test_verify_failed_says_which_check():
    t, code = replay("verify-failed", "verify")
    assert code == exitcodes.VERIFY_FAILED
    (row,) = t.rows()
    assert row["result"] == "verify_failed" and row["detail"].startswith(
        "verify: accept_length: average accept length 2."
    )


def test_verify_ok():
    t, code = replay("verify-ok", "verify")
    assert code == exitcodes.OK and t.rows()[0]["result"] == "verified"


def test_unreachable_host_beside_a_good_one(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    t, code = replay("status-unreachable", "status")
    assert code == exitcodes.UNREACHABLE
    assert t.hosts["lab-node9"].status == "unreachable" and len(t.hosts["lab-node9"].failures) == 1
    assert t.hosts["lab-node1"].instances["main"]["state"] == "active/running"
    display.summary(t, code, run_id=None)
    out = capsys.readouterr().out
    assert "lab-node9" in out and "Connection refused" in out


def test_status_table(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    t, code = replay("status-ok", "status")
    assert code == exitcodes.OK
    display.summary(t, code, run_id=7)
    out = capsys.readouterr().out
    assert "eagle3_topk1" in out and "active/running" in out and "GPU memory" in out


def test_interrupted_run_says_where_each_host_was():
    t, code = replay("restart-interrupted", "restart")
    assert code == exitcodes.INTERRUPTED
    (line,) = t.left_in()
    assert line.startswith("lab-node1: interrupted during 'Run the action on each instance' (restart)")


@pytest.mark.parametrize("name,command", [("restart-ok", "restart"), ("restart-rolled-back", "restart")])
def test_json_result_is_one_document(capsys, name, command):
    t, code = replay(name, command)
    display.as_json(t, code, run_id=1)
    doc = json.loads(capsys.readouterr().out)
    assert doc["exit_code"] == code and doc["command"] == command and doc["rows"][0]["instance"] == "main"
    assert doc["hosts"]["lab-node1"]["instances"]["main"]["phases"]
