"""python -m driver report: the driver's account of a run AWX or ansible-navigator played (driver/report.py,
docs/awx.md), fed the event streams recorded from real driver runs on lab nodes (tests/driver/streams) in the shapes
AWX and ansible-runner keep them. The expected exit code is each stream's own (its last line, the driver's result)."""

from __future__ import annotations

import gzip
import json
import sqlite3

import pytest

from driver import cli, commands, exitcodes
from driver.events import RESULT
from support.streams import STREAMS

NAMES = sorted(p.name.removesuffix(".jsonl.gz") for p in STREAMS.glob("*.jsonl.gz"))


def recorded(name: str) -> tuple[list[dict], dict]:
    with gzip.open(STREAMS / f"{name}.jsonl.gz", "rt", encoding="utf-8") as fh:
        *stream, ending = [json.loads(line) for line in fh]
    assert ending["event"] == RESULT
    return stream, ending


def awx_status(ending: dict) -> str:
    """What AWX's job says of the run the stream recorded."""
    if ending["interrupted"] or ending["runner_status"] == "canceled":
        return "canceled"
    return "failed" if ending["runner_status"] in ("failed", "timeout") else "successful"


def as_awx(stream: list[dict]) -> dict:
    """The events as AWX's /api/v2/jobs/N/job_events/ pages them: AWX's own fields beside ansible-runner's, the
    playbook named as a project's path, newest first (its default order is by counter; a saved page may not be)."""
    results = [
        {"id": 1000 + n, "type": "job_event", "job": 42, "host_name": (e.get("event_data") or {}).get("host", ""), **e}
        for n, e in enumerate(stream)
    ]
    for e in results:
        if e["event"] == "playbook_on_start":
            e["event_data"] = {
                **e["event_data"],
                "playbook": "playbooks/" + e["event_data"]["playbook"].rsplit("/", 1)[-1],
            }
    return {"count": len(results), "next": None, "previous": None, "results": results[::-1]}


def report(*args: str) -> int:
    return cli.main(["report", *args])


@pytest.mark.parametrize("name", NAMES)
def test_an_awx_jobs_events_give_the_exit_code_the_driver_gave(name, tmp_path, ledger_path, capsys):
    stream, ending = recorded(name)
    path = tmp_path / "job_events.json"
    path.write_text(json.dumps(as_awx(stream)))
    code = report(str(path), "--status", awx_status(ending), "--json")
    doc = json.loads(capsys.readouterr().out)
    assert code == ending["exit_code"] == doc["exit_code"], (name, code, ending)
    assert doc["command"] == name.split("-", 1)[0]  # from the playbook the events name


@pytest.mark.parametrize("name", NAMES)
def test_the_drivers_own_stream_gives_its_exit_code_without_being_told_the_status(name, tmp_path, ledger_path):
    stream, ending = recorded(name)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [*stream, ending]))
    assert report(str(path)) == ending["exit_code"]


def test_ansible_runners_artifacts_and_the_ledger_row(tmp_path, ledger_path, capsys):
    stream, ending = recorded("restart-rolled-back")
    events = tmp_path / "artifacts" / "job_events"
    events.mkdir(parents=True)
    for e in stream:
        (events / f"{e['counter']}-{e['uuid']}.json").write_text(json.dumps(e))
    code = report(str(tmp_path / "artifacts"), "--status", "failed", "--record")
    assert code == exitcodes.ROLLED_BACK == ending["exit_code"]
    out = capsys.readouterr().out
    assert "rolled_back" in out or "rolled back" in out, out
    db = sqlite3.connect(ledger_path)
    (command, exit_code, hosts) = db.execute("SELECT command, exit_code, hosts FROM runs").fetchone()
    assert (command, exit_code) == ("restart", exitcodes.ROLLED_BACK) and "lab-node1" in hosts


def test_a_run_that_never_reached_its_end_is_a_failure_unless_its_hosts_say_worse(tmp_path, ledger_path):
    stream, _ = recorded("verify-ok")
    cut = [e for e in stream if e["event"] != "playbook_on_stats"]
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(cut))
    assert report(str(path)) == exitcodes.FAILED
    assert report(str(path), "--status", "successful") == exitcodes.OK


@pytest.mark.parametrize(
    ("content", "args", "says"),
    [
        ("", (), "no event in it"),
        ("{not json\n", (), "neither one JSON document nor JSON Lines"),
        (json.dumps({"results": []}), (), "no event in it"),
        (json.dumps([{"event": "verbose", "stdout": "x"}]), (), "--command: None is no driver command"),
        (json.dumps([{"event": "verbose", "stdout": "x"}]), ("--command", "restrat"), "'restrat' is no driver command"),
    ],
)
def test_unreadable_events_are_a_usage_error_naming_the_file_or_the_flag(tmp_path, capsys, content, args, says):
    path = tmp_path / "events.json"
    path.write_text(content)
    assert report(str(path), *args) == exitcodes.USAGE
    assert says in capsys.readouterr().err


def test_a_directory_without_runner_events_and_a_missing_file_are_usage_errors(tmp_path, capsys):
    assert report(str(tmp_path)) == exitcodes.USAGE
    assert "without job_events/*.json" in capsys.readouterr().err
    assert report(str(tmp_path / "nope.json")) == exitcodes.USAGE
    assert "nope.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("played", "command"),
    [
        ("sglang.deploy.verify", "verify"),  # ansible-navigator run sglang.deploy.verify
        ("/runner/project/playbooks/verify.yml", "verify"),  # an AWX project's checkout
        ("verify.yml", "verify"),
        ("sglang.deploy.unverify", None),
        ("/x/playbooks/averify.yml", None),
    ],
)
def test_the_command_is_the_playbook_the_events_name_by_path_or_collection_name(played, command):
    from driver.report import command_of

    events = [{"event": "playbook_on_start", "event_data": {"playbook": played}}]
    assert command_of(events, {name: path for name, (path, _) in commands.PLAYBOOKS.items()}) == command


def pages_of(doc: dict, size: int) -> list[dict]:
    results = doc["results"]
    return [{**doc, "results": results[i : i + size]} for i in range(0, len(results), size)]


def test_a_job_whose_pages_are_not_all_there_is_refused_not_judged(tmp_path, ledger_path, capsys):
    stream, ending = recorded("restart-rolled-back")
    first, *rest = pages_of(as_awx(stream), 40)
    path = tmp_path / "page1.json"
    path.write_text(json.dumps(first))
    assert report(str(path), "--status", "failed") == exitcodes.USAGE
    assert f"40 of the job's {len(stream)} events: every page is needed" in capsys.readouterr().err
    # every page, one per line as `cat page*.json` leaves them, overlapping: each event once, the recorded verdict
    overlapping = [first, *rest, rest[0]]
    path.write_text("".join(json.dumps(p, separators=(",", ":")) + "\n" for p in overlapping))
    assert report(str(path), "--status", "failed") == ending["exit_code"] == exitcodes.ROLLED_BACK


@pytest.mark.parametrize(
    "bad",
    [
        {"event": "runner_on_ok", "event_data": "x", "counter": 1},
        {"event": "runner_on_ok", "event_data": {"host": ["h"]}, "counter": 1},
        {"event": "verbose", "stdout": None, "counter": 1},
        {"event": "runner_on_start", "created": "yesterday", "event_data": {"host": "h"}, "counter": 1},
    ],
)
def test_an_event_of_another_shape_is_a_usage_error_not_a_traceback(tmp_path, ledger_path, capsys, bad):
    path = tmp_path / "events.json"
    path.write_text(json.dumps([{"event": "playbook_on_start", "event_data": {"playbook": "verify.yml"}}, bad]))
    assert report(str(path)) == exitcodes.USAGE
    assert "is not ansible-runner's" in capsys.readouterr().err


def test_a_dying_runners_partial_files_are_skipped_and_counterless_events_come_last(tmp_path, ledger_path):
    events = tmp_path / "artifacts" / "job_events"
    events.mkdir(parents=True)
    start = {"event": "playbook_on_start", "counter": 1, "uuid": "a", "event_data": {"playbook": "verify.yml"}}
    task = {"event": "runner_on_start", "counter": 2, "uuid": "b", "event_data": {"host": "h", "task": "t"}}
    stats = {"event": "playbook_on_stats", "uuid": "c", "event_data": {}}  # what a partial file holds: no counter
    for name, e in (("1-a.json", start), ("2-b.json", task), ("c-partial.json", stats)):
        (events / name).write_text(json.dumps(e))
    assert report(str(tmp_path / "artifacts")) == exitcodes.FAILED, "the play never reached its end"
    from driver.report import load

    (events / "c-partial.json").rename(events / "c.json")  # a counter-less event of another kind: last, not first
    assert [e["event"] for e in load(tmp_path / "artifacts")][-1] == "playbook_on_stats"


def test_a_ledger_that_cannot_take_the_row_leaves_the_verdict(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SGLANG_DEPLOY_LEDGER", str(tmp_path / "file" / "ledger.sqlite3"))  # under a file: no dir
    stream, ending = recorded("restart-rolled-back")
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in [*stream, ending]))
    assert report(str(path), "--record") == exitcodes.ROLLED_BACK
    assert "not recorded in the ledger" in capsys.readouterr().err
