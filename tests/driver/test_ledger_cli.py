"""driver/ledger.py (SQLite) and driver/cli.py's argument handling, without Ansible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from driver import commands, exitcodes, ledger

REPO = Path(__file__).resolve().parents[2]


def measurement(profile, tok, acc, running=None, host="n1", config_hash="abc", load_s=None, capture_s=None):
    return {
        "load_s": load_s,
        "capture_s": capture_s,
        "host": host,
        "instance": "main",
        "outcome": "restarted",
        "profile": profile,
        "running_profile": running or profile,
        "config_hash": config_hash,
        "downtime_s": 3.2,
        "tokens_per_s": tok,
        "accept_length": acc,
    }


def test_runs_are_recorded_and_listed_newest_first(tmp_path):
    book = ledger.Ledger(tmp_path / "l.sqlite3")
    first = book.start("restart", ["restart", "--profile", "eagle3_topk1"], None, "eagle3_topk1")
    book.finish(first, 0, "success", 12.5, ["n1"], [measurement("eagle3_topk1", 95.0, 2.6)], "/x/events.jsonl")
    second = book.start("verify", ["verify"], "inventory/prod", None)
    book.finish(second, 7, "verification failed", 4.0, ["n1", "n2"], [], None)
    runs = book.runs()
    assert [r["id"] for r in runs] == [second, first]
    assert runs[1]["profile"] == "eagle3_topk1" and runs[1]["config_hash"] == "abc" and runs[1]["exit_code"] == 0
    assert runs[1]["measurements"][0]["tokens_per_s"] == 95.0 and runs[0]["hosts"] == "n1,n2"
    assert json.loads(runs[1]["argv"]) == ["restart", "--profile", "eagle3_topk1"]


def test_compare_answers_which_config_gave_what_and_whether_it_ran(tmp_path):
    book = ledger.Ledger(tmp_path / "l.sqlite3")
    run = book.start("restart", [], None, None)
    book.finish(
        run,
        0,
        "success",
        1,
        ["n1"],
        [
            measurement("eagle3_5tok_cuda_graph", 82.3, 1.9, config_hash="h1", load_s=300.0, capture_s=41.0),
            measurement("eagle3_5tok_cuda_graph", 80.1, 1.8, running="eagle3_topk1", config_hash="h2", load_s=320.0),
            measurement("baseline_no_spec", 90.0, None, config_hash="h3"),
        ],
        None,
    )
    rows = {r["profile"]: r for r in book.compare()}
    five = rows["eagle3_5tok_cuda_graph"]
    assert five["measurements"] == 2 and five["best_tokens_per_s"] == 82.3 and five["median_tokens_per_s"] == 81.2
    assert five["verified_running"] == "1/2" and five["config_hashes"] == ["h1", "h2"]
    assert rows["baseline_no_spec"]["median_accept_length"] is None
    # How long each profile takes to load and capture: from the restarts' progress steps, where they reported them.
    assert five["median_load_s"] == 310.0 and five["median_capture_s"] == 41.0
    assert rows["baseline_no_spec"]["median_load_s"] is None


def test_a_ledger_made_before_the_progress_steps_gains_their_columns(tmp_path):
    import sqlite3

    path = tmp_path / "l.sqlite3"
    ledger.Ledger(path).close()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE measurements DROP COLUMN load_s")
    db.execute("ALTER TABLE measurements DROP COLUMN capture_s")
    db.commit()
    db.close()
    book = ledger.Ledger(path)
    run = book.start("restart", [], None, None)
    book.finish(run, 0, "success", 1, ["n1"], [measurement("p", 90.0, 2.0, load_s=12.5)], None)
    assert book.compare()[0]["median_load_s"] == 12.5


def test_extra_vars_from_options():
    args = commands.parser().parse_args(
        ["restart", "--profile", "p1", "--instance", "a", "--no-rollback", "--force-stop", "-e", "x=1"]
    )
    ev = commands.extravars(args)
    assert ev[0] == "x=1"
    assert [json.loads(e) for e in ev[1:]] == [
        {"sglang_profile": "p1"},
        {"sglang_service_instances_selected": ["a"]},
        {"sglang_service_rollback": False},
        {"sglang_service_stop_policy": "force"},
    ]


def test_every_command_has_a_playbook_that_exists():
    for name, (playbook, _) in commands.PLAYBOOKS.items():
        assert (REPO / playbook).is_file(), name


def test_exit_codes_are_distinct_and_documented_in_help():
    codes = [
        exitcodes.OK,
        exitcodes.INVALID_CONFIG,
        exitcodes.GPUS_NOT_CLEAN,
        exitcodes.ROLLED_BACK,
        exitcodes.NOT_RECOVERED,
        exitcodes.VERIFY_FAILED,
        exitcodes.UNREACHABLE,
        exitcodes.LOCKED,
        exitcodes.INTERRUPTED,
    ]
    assert len(set(codes)) == len(codes)
    out = subprocess.run(
        [sys.executable, "-m", "driver", "--help"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    for code in codes:
        assert f"{code:>3}  {exitcodes.MEANING[code]}" in out


def test_help_imports_neither_ansible_runner_nor_rich():
    heavy = "('ansible_runner', 'rich', 'ansible', 'yaml')"
    loaded = f"sorted(m for m in sys.modules if m.split('.')[0] in {heavy})"
    code = f"import sys; from driver import cli, commands; commands.parser(); print({loaded})"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_command_line_exits_2():
    proc = subprocess.run([sys.executable, "-m", "driver", "restrat"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice: 'restrat'" in proc.stderr


@pytest.mark.parametrize("codes,worst", [([], 0), ([3, 7], 7), ([5, 4, 3], 5), ([6, 5], 6), ([8, 5], 8), ([1, 5], 1)])
def test_the_most_serious_outcome_decides(codes, worst):
    assert exitcodes.worst(codes) == worst
