"""What the run ledger keeps and gives back (issue #31: the behaviours behind the mutants the unit suite let survive
in driver/ledger.py).

Where it is when nothing names it (~/.local/state); which directories it narrows to 0700 (its own, never one others
share: /tmp's kind, the home directory, another user's); that it migrates an older driver's modes once; the times
it writes (UTC, ISO 8601 to the second, whatever the host's zone); a run's row and its measurements whole, as
`history` and `history --compare` show them (rounded as the table prints them); a sweep's combination as stored
(canonical JSON, a value JSON cannot write kept as its text) and as a measurement; a ledger an older driver made.
"""

from __future__ import annotations

import calendar
import os
import re
import sqlite3
import stat
import tempfile
import time
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable
from driver import ledger

ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


pytestmark = pytest.mark.usefixtures("usual_umask")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A home of its own, and nothing that names the ledger: neither $SGLANG_DEPLOY_LEDGER nor $XDG_STATE_HOME."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SGLANG_DEPLOY_LEDGER", raising=False)
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    return home


@pytest.fixture
def far_zone():
    """The host's local time 11 h 30 min ahead of UTC (a zone the ledger must not write its times in)."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "<+1130>-11:30"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def stored(path: Path, query: str) -> list[dict]:
    """The ledger as sqlite3 itself reads it (what an operator's own query sees)."""
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    out = [dict(r) for r in db.execute(query)]
    db.close()
    return out


def measurement(**over) -> dict:
    m = {
        "host": "n1",
        "instance": "main",
        "outcome": "restarted",
        "profile": "p",
        "running_profile": "p",
        "config_hash": "h1",
        "downtime_s": 3.2,
        "tokens_per_s": 90.0,
        "accept_length": 2.5,
        "load_s": 300.0,
        "capture_s": 41.0,
    }
    return {**m, **over}


# ------------------------------------------------------------------ where it is, and its modes


def test_without_a_setting_the_ledger_is_in_the_users_local_state(home):
    """~/.local/state/sglang-deploy/ledger.sqlite3 (XDG's default), its missing directories made on the way."""
    book = ledger.Ledger()
    book.start("status", ["status"], None, None)
    book.close()
    path = home / ".local" / "state" / "sglang-deploy" / "ledger.sqlite3"
    assert ledger.default_path() == path
    assert [r["command"] for r in stored(path, "SELECT * FROM runs")] == ["status"]
    assert mode(path) == 0o600 and mode(path.parent) == mode(path.parent / "runs") == 0o700


def test_a_ledger_named_in_directories_that_do_not_exist_yet_makes_them(tmp_path):
    path = tmp_path / "a" / "b" / "ledger.sqlite3"
    book = ledger.Ledger(path)
    run_dir = book.events_dir(book.start("status", [], None, None))
    book.close()
    assert run_dir == path.parent / "runs" / "1" and run_dir.is_dir()
    assert mode(path) == 0o600 and mode(path.parent) == mode(run_dir) == 0o700


def another_users(d: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    os.chown(d, 4242, 4242)


@pytest.mark.parametrize(
    "kind,before,after",
    [
        ("ours", 0o755, 0o700),
        ("sticky, as /tmp", 0o1777, 0o1777),
        ("the home directory", 0o755, 0o755),
        ("another user's", 0o755, 0o755),
    ],
)
def test_the_default_directory_is_narrowed_only_when_it_is_the_users_alone(tmp_path, monkeypatch, kind, before, after):
    """$XDG_STATE_HOME/sglang-deploy: 0700 when it is this user's own; a directory others share (sticky, as /tmp),
    the home directory itself, or another user's is left as it is (the ledger file in it is private still)."""
    monkeypatch.delenv("SGLANG_DEPLOY_LEDGER", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    d = tmp_path / "sglang-deploy"
    d.mkdir()
    if kind == "the home directory":
        monkeypatch.setenv("HOME", str(d))
    if kind == "another user's":
        another_users(d)
    os.chmod(d, before)
    ledger.Ledger().close()
    assert mode(d) == after, kind
    assert mode(d / "ledger.sqlite3") == 0o600 and mode(d / "runs") == 0o700


def test_what_the_ledger_makes_is_never_open_to_others_not_even_before_its_chmod(tmp_path, monkeypatch):
    """The directory, the database and the run directories are made private (mkdir's and open's own mode): none is
    0755 or 0644 for a moment first, when another user could open it and keep what is written in it later."""
    made = {}
    real = os.chmod

    def chmod(path, to, *args, **kwargs):
        made.setdefault(str(path), stat.S_IMODE(os.stat(path).st_mode))
        real(path, to, *args, **kwargs)

    monkeypatch.setattr(os, "chmod", chmod)
    path = tmp_path / "state" / "ledger.sqlite3"
    book = ledger.Ledger(path)
    run_dir = book.events_dir(book.start("restart", [], None, None))
    book.close()
    assert {str(path.parent), str(run_dir)} <= set(made), "made, then set to exactly 0700 (whatever the umask)"
    assert {p: m for p, m in made.items() if m & 0o077} == {}
    assert mode(path) == 0o600 and mode(path.parent) == mode(run_dir) == 0o700


def test_a_ledger_already_private_is_opened_without_remoding_its_run_directories(tmp_path):
    """An older driver's modes are narrowed once (the runs directory wider than 0700); a private one is opened as
    it is: what the user shared of one run since (a group-readable event stream) stays shared."""
    path = tmp_path / "state" / "ledger.sqlite3"
    book = ledger.Ledger(path)
    run_dir = book.events_dir(book.start("restart", [], None, None))
    book.close()
    (run_dir / "events.jsonl").write_text("{}\n")
    os.chmod(run_dir, 0o750)
    os.chmod(run_dir / "events.jsonl", 0o640)
    ledger.Ledger(path).close()
    assert mode(path.parent / "runs") == 0o700
    assert mode(run_dir) == 0o750 and mode(run_dir / "events.jsonl") == 0o640


def test_a_ledger_file_its_owner_cannot_read_is_made_0600_and_opened():
    """An existing ledger with no permission at all (chmod 000): made 0600 again, not opened to be read first."""
    root = os.geteuid() == 0
    d = Path(tempfile.mkdtemp(dir="/tmp"))  # tmp_path's parents are root's alone: the other user could not reach it
    try:
        path = d / "ledger.sqlite3"
        path.touch()
        os.chmod(path, 0o000)
        if root:  # as root every file is readable: the ledger's user here is another one
            os.chown(d, 4242, 4242)
            os.chown(path, 4242, 4242)
            os.seteuid(4242)
        try:
            assert ledger.private_file(path) == path
            assert mode(path) == 0o600
        finally:
            if root:
                os.seteuid(0)
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_a_new_ledgers_name_is_made_durable_in_its_own_directory(tmp_path, monkeypatch):
    """SQLite syncs its journal's directory, never the database's: the ledger syncs the directory its new file is
    in (a crash right after keeps the name), and not only some other one (the working directory)."""
    synced = []
    real = durable.fsync_dir

    def fsync_dir(path):
        synced.append(os.path.realpath(path or "."))  # the real one syncs "." for no path
        real(path)

    monkeypatch.setattr(durable, "fsync_dir", fsync_dir)
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "state" / "ledger.sqlite3"
    ledger.private_dir(path.parent)
    synced.clear()
    ledger.private_file(path)
    assert synced == [str(path.parent)]
    ledger.private_file(path)
    assert synced == [str(path.parent)], "an existing file's name is not new"


# ------------------------------------------------------------------ times


def test_every_time_is_utc_to_the_second_whatever_the_hosts_zone(tmp_path, far_zone):
    """started_at, finished_at, a sweep's measured_at: YYYY-MM-DDTHH:MM:SSZ, in UTC (a local 11:30 ahead would be
    a run in the future, and mis-sorted among hosts)."""
    before = int(time.time())
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    run = book.start("tune", [], None, None)
    book.finish(run, 0, "success", 1.0, ["n1"], [], None)
    book.tune_record(tune_row(run))
    after = time.time()
    (row,) = book.runs()
    (result,) = book.tune_results("s1")
    book.close()
    for value in (row["started_at"], row["finished_at"], result["measured_at"]):
        assert ISO.fullmatch(value), value
        assert before <= calendar.timegm(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")) <= after, value


# ------------------------------------------------------------------ a run and its measurements


def test_a_finished_run_is_recorded_whole_with_each_measurement(tmp_path):
    """What `history` lists: the hosts sorted, the configurations and profiles measured (each once, sorted, comma
    joined) when the run named no profile, and each instance's measurement field by field."""
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    run = book.start("restart", ["restart"], "inventory/prod", None)
    one = measurement(host="n2", profile="p2", running_profile="p1", config_hash="h2", accept_length=None)
    two = measurement(outcome="rolled_back", profile="p1", downtime_s=7.5, load_s=None, capture_s=None)
    three = measurement(host="n3", profile="p1", config_hash=None, tokens_per_s=None, downtime_s=None)
    book.finish(run, 3, "rolled back", 42.5, ["n3", "n1", "n2"], [one, two, three], "/r/events.jsonl")
    (row,) = book.runs()
    book.close()
    assert ISO.fullmatch(row.pop("started_at")) and ISO.fullmatch(row.pop("finished_at"))
    assert row.pop("user")
    measured = row.pop("measurements")
    assert row == {
        "id": run,
        "command": "restart",
        "argv": '["restart"]',
        "inventory": "inventory/prod",
        "hosts": "n1,n2,n3",
        "profile": "p1,p2",
        "config_hash": "h1,h2",
        "outcome": "rolled back",
        "exit_code": 3,
        "duration_s": 42.5,
        "events_path": "/r/events.jsonl",
        "evidence_path": None,
    }
    assert measured == [{"run_id": run, **m} for m in (one, two, three)]


def test_a_run_that_named_its_profile_keeps_it_and_one_without_measurements_says_none(tmp_path):
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    named = book.start("restart", [], None, "eagle3")
    book.finish(named, 0, "success", 1.0, ["n1"], [measurement(profile="other")], None)
    bare = book.start("status", [], None, None)
    book.finish(bare, 0, "success", 1.0, [], [], None)
    runs = {r["id"]: r for r in book.runs()}
    book.close()
    assert runs[named]["profile"] == "eagle3" and runs[named]["config_hash"] == "h1"
    assert (runs[bare]["profile"], runs[bare]["config_hash"], runs[bare]["hosts"]) == (None, None, "")


def test_history_lists_the_last_20_runs_newest_first_unless_told(tmp_path):
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    for i in range(21):
        book.start("status", [str(i)], None, None)
    assert [r["id"] for r in book.runs()] == list(range(21, 1, -1))
    assert [r["id"] for r in book.runs(3)] == [21, 20, 19]
    book.close()


def test_a_runs_evidence_bundle_is_recorded_on_its_row(tmp_path):
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    first, second = book.start("restart", [], None, None), book.start("restart", [], None, None)
    book.set_evidence(first, "/var/evidence/1.tar.gz")
    rows = {r["id"]: r["evidence_path"] for r in book.runs()}
    book.close()
    assert rows == {first: "/var/evidence/1.tar.gz", second: None}


OLD_SCHEMA = """
CREATE TABLE runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, started_at TEXT NOT NULL, finished_at TEXT, user TEXT NOT NULL,
    command TEXT NOT NULL, argv TEXT NOT NULL, inventory TEXT, hosts TEXT, profile TEXT, config_hash TEXT,
    outcome TEXT, exit_code INTEGER, duration_s REAL, events_path TEXT
);
CREATE TABLE measurements (
    run_id INTEGER NOT NULL REFERENCES runs(id), host TEXT NOT NULL, instance TEXT NOT NULL, outcome TEXT,
    profile TEXT, running_profile TEXT, config_hash TEXT, downtime_s REAL, tokens_per_s REAL, accept_length REAL
);
INSERT INTO runs (started_at, user, command, argv) VALUES ('2024-01-02T03:04:05Z', 'op', 'restart', '[]');
INSERT INTO measurements (run_id, host, instance, profile, tokens_per_s) VALUES (1, 'n1', 'main', 'p', 80.0);
"""


def test_a_ledger_made_before_the_evidence_bundle_and_the_progress_steps_is_opened_and_extended(tmp_path):
    """Its runs and measurements kept; the evidence bundle and the load and capture times recorded from now on."""
    path = tmp_path / "ledger.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(OLD_SCHEMA)
    db.close()
    book = ledger.Ledger(path)
    book.set_evidence(1, "/e/1.tar.gz")
    run = book.start("restart", [], None, None)
    book.finish(run, 0, "success", 1.0, ["n1"], [measurement(load_s=12.5, capture_s=3.25)], None)
    runs = {r["id"]: r for r in book.runs()}
    book.close()
    assert runs[1]["evidence_path"] == "/e/1.tar.gz" and runs[1]["started_at"] == "2024-01-02T03:04:05Z"
    assert runs[1]["measurements"][0]["tokens_per_s"] == 80.0 and runs[1]["measurements"][0]["load_s"] is None
    assert (runs[run]["measurements"][0]["load_s"], runs[run]["measurements"][0]["capture_s"]) == (12.5, 3.25)


# ------------------------------------------------------------------ history --compare


def test_compare_gives_each_profile_its_figures_as_the_table_prints_them(tmp_path):
    """Medians and best of tok/s to one decimal, accept length to two, load and capture to one; what was measured
    without a profile under "?"; the verified share; each configuration once; the last measurement's time."""
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    first = book.start("restart", [], None, None)
    book.finish(
        first,
        0,
        "success",
        1.0,
        ["n1"],
        [
            measurement(tokens_per_s=82.34, accept_length=1.8571, load_s=300.04, capture_s=None, config_hash="h2"),
            measurement(tokens_per_s=80.01, accept_length=None, load_s=None, capture_s=41.26, running_profile="q"),
            measurement(profile=None, running_profile=None, tokens_per_s=70.0, accept_length=None, config_hash=None),
            measurement(profile="q", tokens_per_s=None),  # no throughput: not compared
        ],
        None,
    )
    second = book.start("restart", [], None, None)
    book.finish(
        second,
        0,
        "success",
        1.0,
        ["n1"],
        [measurement(tokens_per_s=90.06, accept_length=2.0, load_s=320.0, capture_s=None)],
        None,
    )
    started = {r["id"]: r["started_at"] for r in book.runs()}
    compared = book.compare()
    book.close()
    assert compared == [
        {
            "profile": "?",
            "measurements": 1,
            "median_tokens_per_s": 70.0,
            "best_tokens_per_s": 70.0,
            "median_accept_length": None,
            "verified_running": "0/1",
            "median_load_s": 300.0,
            "median_capture_s": 41.0,
            "config_hashes": [],
            "last_measured": started[first],
        },
        {
            "profile": "p",
            "measurements": 3,
            "median_tokens_per_s": 82.3,
            "best_tokens_per_s": 90.1,
            "median_accept_length": 1.93,
            "verified_running": "2/3",
            "median_load_s": 310.0,
            "median_capture_s": 41.3,
            "config_hashes": ["h1", "h2"],
            "last_measured": started[second],
        },
    ]


# ------------------------------------------------------------------ a sweep's combinations


def tune_row(run: int, **over) -> dict:
    row = {
        "sweep": "s1",
        "combination": "tune_a",
        "run_id": run,
        "host": "n1",
        "instance": "main",
        "start_profile": "eagle3",
        "label": "steps=3",
        "combo": {"profile": {"flags": {"b": 2, "a": 1}}, "name": "tune_a"},
        "outcome": "measured",
        "restart_outcome": "restarted",
        "config_hash": "c1",
        "software": {"sglang_version": "0.5.2", "lock_hash": "l1"},
        "gpu_model": "NVIDIA H200",
        "running_profile": "tune_a",
        "tokens_per_s": 120.5,
        "accept_length": 2.25,
        "bench": {"seconds": 4.5, "levels": []},
    }
    return {**row, **over}


def test_a_measured_combination_is_also_a_measurement_of_its_run(tmp_path):
    """history --compare ranks it with the profiles: its throughput, accept length and the configuration that ran."""
    book = ledger.Ledger(tmp_path / "ledger.sqlite3")
    run = book.start("tune", [], None, "eagle3")
    book.tune_record(tune_row(run))
    book.tune_record(tune_row(run, combination="tune_b", outcome="failed", tokens_per_s=None, accept_length=None))
    (row,) = book.runs()
    compared = book.compare()
    book.close()
    assert row["measurements"] == [
        {
            "run_id": run,
            "host": "n1",
            "instance": "main",
            "outcome": "measured",
            "profile": "tune_a",
            "running_profile": "tune_a",
            "config_hash": "c1",
            "downtime_s": None,
            "tokens_per_s": 120.5,
            "accept_length": 2.25,
            "load_s": None,
            "capture_s": None,
        }
    ]
    assert [(c["profile"], c["median_accept_length"], c["config_hashes"]) for c in compared] == [
        ("tune_a", 2.25, ["c1"])
    ]


def test_a_combination_is_stored_as_canonical_json_and_given_back_as_recorded(tmp_path):
    """Its values, software and benchmark as JSON with sorted keys (one combination, one text, whatever order it
    was given in: a query on the ledger can compare them); a value JSON cannot write (a path) kept as its text."""
    path = tmp_path / "ledger.sqlite3"
    book = ledger.Ledger(path)
    run = book.start("tune", [], None, None)
    bench = {"seconds": 4.5, "dataset": Path("/data/prompts.jsonl")}
    book.tune_record(tune_row(run, bench=bench))
    book.tune_record(tune_row(run, sweep="s2", combo={"name": "tune_a", "profile": {"flags": {"a": 1, "b": 2}}}))
    results = book.tune_results("s1")
    book.close()
    texts = stored(path, "SELECT sweep, combo, software, bench FROM tune_results ORDER BY sweep")
    combo = '{"name": "tune_a", "profile": {"flags": {"a": 1, "b": 2}}}'
    assert [t["combo"] for t in texts] == [combo, combo]
    assert texts[0]["software"] == '{"lock_hash": "l1", "sglang_version": "0.5.2"}'
    assert texts[0]["bench"] == '{"dataset": "/data/prompts.jsonl", "seconds": 4.5}'
    (result,) = results
    assert result["bench"] == {"seconds": 4.5, "dataset": "/data/prompts.jsonl"}
    assert result["combo"] == {"name": "tune_a", "profile": {"flags": {"a": 1, "b": 2}}}
