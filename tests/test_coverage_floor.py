"""tools/coverage_floor.py: the per-file floor `make pytest` applies to coverage's JSON report (issue #17)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import coverage_floor

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "coverage_floor.py"


def report(**percent: float) -> dict:
    """A `coverage json` report's shape: files (path -> summary, missing_lines) and totals."""
    return {
        "files": {
            name.replace("__", "/") + ".py": {
                "summary": {"percent_covered": p, "num_statements": 10},
                "missing_lines": list(range(1, 11 - round(p / 10))),
            }
            for name, p in percent.items()
        },
        "totals": {"percent_covered": sum(percent.values()) / max(len(percent), 1)},
    }


def test_below_names_each_file_under_the_floor_lowest_first():
    got = coverage_floor.below(report(driver__cli=79.9, driver__runner=80.0, plugins__modules__x=10.0, a__b=100.0), 80)
    assert [(s.path, s.percent) for s in got] == [("plugins/modules/x.py", 10.0), ("driver/cli.py", 79.9)]
    assert got[0].missing == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_a_file_exactly_at_the_floor_passes_and_the_floor_is_a_parameter():
    assert coverage_floor.below(report(a=80.0), 80) == []
    assert [s.path for s in coverage_floor.below(report(a=80.0), 90)] == ["a.py"]


def test_main_fails_naming_every_short_file_and_passes_otherwise(tmp_path, capsys):
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(report(driver__evidence=68.0, driver__cli=78.1, driver__ledger=95.0)))
    assert coverage_floor.main(["--floor", "80", str(path)]) == 1
    err = capsys.readouterr().err
    assert "driver/evidence.py: 68.0 % of its lines, below 80 % (missing: 1, 2, 3)" in err
    assert "driver/cli.py: 78.1 %" in err and "ledger" not in err
    assert "2 of 3 files below 80 %" in err
    assert coverage_floor.main(["--floor", "60", str(path)]) == 0
    assert "all 3 files at 60 % or more (lowest driver/evidence.py, 68.0 %)" in capsys.readouterr().out


def test_an_empty_report_fails_rather_than_passing_on_nothing(tmp_path, capsys):
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps({"files": {}, "totals": {}}))
    assert coverage_floor.main([str(path)]) == 1
    assert "holds no file" in capsys.readouterr().err


def test_a_long_list_of_missing_lines_is_cut():
    line = coverage_floor.Shortfall("x.py", 1.0, list(range(1, 100))).line(80)
    assert line.endswith("19, 20 ...)") and "21" not in line


@pytest.fixture
def measured(tmp_path) -> Path:
    """A real `coverage json` report of a tiny program whose one function never runs (its file at 60 %)."""
    (tmp_path / "prog.py").write_text("def unused():\n    a = 1\n    return a\n\n\nx = 1\nprint(x)\n")
    # This run's own subprocess measurement (patch = subprocess) stays out of the child coverage run.
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE_")}
    for argv in (["run", "prog.py"], ["json", "-q", "-o", "coverage.json"]):
        subprocess.run(
            [sys.executable, "-m", "coverage", *argv], cwd=tmp_path, env=env, check=True, capture_output=True
        )
    return tmp_path / "coverage.json"


def test_the_tool_reads_coverages_own_json_from_stdin_as_make_pytest_pipes_it(measured):
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--floor", "80", "-"],
        input=measured.read_text(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr
    assert "prog.py: 60.0 % of its lines, below 80 % (missing: 2, 3)" in proc.stderr
    proc = subprocess.run([sys.executable, str(TOOL), "--floor", "60", str(measured)], capture_output=True, text=True)
    assert proc.returncode == 0 and "all 1 files at 60 % or more" in proc.stdout
