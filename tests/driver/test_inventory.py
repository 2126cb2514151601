"""The inventory and --limit, checked with Ansible's own loader before anything runs: exit 2 with the parser's
message, no playbook started and no run recorded (driver/inventory.py)."""

from __future__ import annotations

import json

import pytest

from driver import cli, exitcodes, inventory
from support import refused

TWO_HOSTS = (
    "all:\n  children:\n    sglang_nodes:\n      hosts:\n"
    "        lab-node-1: {ansible_connection: local}\n        lab-node-2: {ansible_connection: local}\n"
)
MALFORMED = "all:\n  hosts:\n    lab-node-1: {ansible_host: 10.0.0.1\n  oops\n"


@pytest.fixture
def two_hosts(tmp_path):
    path = tmp_path / "hosts.yml"
    path.write_text(TWO_HOSTS)
    return path


def test_a_nonexistent_inventory_exits_2_before_anything_runs(tmp_path, ledger_path, no_playbook, capsys):
    err = refused(capsys, "restart", "-i", str(tmp_path / "nosuch.yml"))
    assert f"inventory {tmp_path / 'nosuch.yml'}: no such file or directory" in err
    assert not ledger_path.exists(), "nothing ran: no run is recorded"


def test_a_malformed_inventory_exits_2_with_ansibles_parse_error(tmp_path, ledger_path, no_playbook, capsys):
    bad = tmp_path / "hosts.yml"
    bad.write_text(MALFORMED)
    err = refused(capsys, "status", "-i", str(bad))
    assert f"inventory {bad} could not be parsed:" in err
    assert "YAML parsing failed: While parsing a flow mapping did not find expected ',' or '}'" in err
    assert f"({bad}:5)" in err, "where in the file, as Ansible's loader says"
    assert not ledger_path.exists()


@pytest.mark.parametrize("content", ["", "all:\n  hosts: {}\n"], ids=["empty file", "no hosts"])
def test_an_inventory_without_hosts_exits_2(tmp_path, ledger_path, no_playbook, capsys, content):
    empty = tmp_path / "hosts.yml"
    empty.write_text(content)
    assert f"inventory {empty} has no hosts" in refused(capsys, "deploy", "-i", str(empty))


def test_an_empty_inventory_argument_exits_2(ledger_path, no_playbook, capsys):
    assert "no inventory: -i was given an empty value" in refused(capsys, "verify", "-i", "")


def test_without_inventory_and_without_the_lab_says_so(tmp_path, ledger_path, no_playbook, capsys, monkeypatch):
    monkeypatch.setattr(inventory, "DEFAULT", tmp_path / "inventory" / "lab" / "hosts.yml")
    monkeypatch.delenv("ANSIBLE_INVENTORY", raising=False)
    assert "no inventory: the lab is not up (make lab-up) or pass -i" in refused(capsys, "status")


def test_a_limit_that_matches_no_host_exits_2_naming_it(two_hosts, ledger_path, no_playbook, capsys):
    err = refused(capsys, "restart", "-i", str(two_hosts), "--limit", "lab-node-9")
    assert f"--limit lab-node-9 matches no host in inventory {two_hosts}" in err
    assert not ledger_path.exists()


@pytest.mark.parametrize(
    "limit,unmatched",
    [("lab-node-1,nosuchhost", "'nosuchhost'"), ("lab-node-*:nosuchgroup", "'nosuchgroup'"), ("all,!typo", "'!typo'")],
)
def test_a_limit_that_partly_matches_exits_2_naming_the_part(two_hosts, no_playbook, capsys, limit, unmatched):
    err = refused(capsys, "status", "-i", str(two_hosts), "--limit", limit)
    assert f"--limit {limit}: {unmatched} matched no host in inventory {two_hosts}" in err


def test_a_limit_file_that_does_not_exist_exits_2(two_hosts, tmp_path, no_playbook, capsys):
    err = refused(capsys, "status", "-i", str(two_hosts), "--limit", f"@{tmp_path / 'hosts.txt'}")
    assert "Unable to find limit file" in err


@pytest.mark.parametrize(
    "limit,hosts",
    [
        (None, ["lab-node-1", "lab-node-2"]),
        ("lab-node-2", ["lab-node-2"]),
        ("sglang_nodes:!lab-node-1", ["lab-node-2"]),
        ("lab-node-*", ["lab-node-1", "lab-node-2"]),
    ],
)
def test_a_limit_that_matches_passes_with_the_hosts_it_selects(two_hosts, limit, hosts):
    assert sorted(inventory.check(str(two_hosts), limit).hosts) == hosts


def test_json_says_the_error_in_its_one_document(tmp_path, ledger_path, no_playbook, capsys):
    assert cli.main(["status", "-i", str(tmp_path / "nosuch.yml"), "--json"]) == exitcodes.USAGE
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and "no such file or directory" in doc["error"] and doc["run_id"] is None
    assert "no such file or directory" in err


def test_as_a_command_a_malformed_inventory_exits_2_and_starts_nothing(tmp_path, ledger_path, driver):
    """The same, end to end: python -m driver in its own process, ansible-runner never started."""
    bad = tmp_path / "hosts.yml"
    bad.write_text(MALFORMED)
    proc = driver("restart", "-i", str(bad))
    assert proc.returncode == 2, proc.stderr
    assert "could not be parsed" in proc.stderr and "YAML parsing failed" in proc.stderr
    assert "success" not in proc.stdout + proc.stderr
    assert not ledger_path.exists()
