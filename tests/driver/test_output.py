"""What the driver prints when its output is no terminal (a pipe, a file, CI): every cell whole, never squeezed
into 80 columns ("lab-n…"); on a narrow terminal cells fold instead of being cut; --json is the result only."""

from __future__ import annotations

import json

import pytest

from driver import display, ledger
from driver.events import Tracker
from support.streams import replay

LONG_HOSTS = [f"gpu-node-{i:02d}.rack-17.eu-west.example.internal" for i in range(1, 4)]


def replayed(name: str, command: str) -> Tracker:
    return replay(name, command)[0]


@pytest.fixture
def long_history(ledger_path):
    book = ledger.Ledger()
    for _ in range(3):
        run = book.start("restart", ["restart", "--profile", "eagle3_5tok_cuda_graph"], "inventory/prod", None)
        m = {
            "host": LONG_HOSTS[0],
            "instance": "main",
            "outcome": "restarted",
            "profile": "eagle3_5tok_cuda_graph",
            "running_profile": "eagle3_5tok_cuda_graph",
            "config_hash": "0123456789abcdef",
            "downtime_s": 3.2,
            "tokens_per_s": 82.3,
            "accept_length": 1.93,
        }
        book.finish(run, 0, "success", 41.7, LONG_HOSTS, [m], None)
    book.close()


def test_history_piped_shows_every_cell_whole(long_history, driver):
    proc = driver("history")
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    assert ",".join(sorted(LONG_HOSTS)) in proc.stdout and "eagle3_5tok_cuda_graph" in proc.stdout
    assert "0123456789abcdef" in proc.stdout and "success" in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) > 80, "wider than a terminal's default, not cut"


def test_history_compare_piped_shows_every_cell_whole(long_history, driver):
    proc = driver("history", "--compare")
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout and "eagle3_5tok_cuda_graph" in proc.stdout and "0123456789abcdef" in proc.stdout


def test_status_and_summary_piped_show_every_cell_whole(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    for name, command in (("status-ok", "status"), ("restart-ok", "restart")):
        tracker = replayed(name, command)
        display.summary(tracker, 0, run_id=3)
        out = capsys.readouterr().out
        assert "…" not in out and "lab-node1" in out
        assert ("active/running" if command == "status" else "restarted") in out
        assert "eagle3_topk1" in out or command == "restart"


def test_on_a_narrow_terminal_cells_fold_instead_of_being_cut(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "50")  # rich reads the terminal's width from COLUMNS
    tracker = replayed("status-ok", "status")
    display.summary(tracker, 0, run_id=None)
    out = capsys.readouterr().out
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 50


def test_json_is_one_document_on_stdout_and_nothing_else(held_inventory, ledger_path, driver):
    """A real run (its host's module calls fail at once): stdout parses as exactly one JSON document; Ansible's
    own output (recap, warnings) is not on it."""
    held_inventory.release.touch()
    proc = driver("status", "-i", str(held_inventory.inventory), "--json")
    doc = json.loads(proc.stdout)
    assert doc["command"] == "status" and doc["exit_code"] == proc.returncode != 0
    assert "here" in doc["hosts"] and "PLAY RECAP" not in proc.stdout + proc.stderr
