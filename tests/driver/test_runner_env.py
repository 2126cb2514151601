"""driver/runner.py: what ansible-playbook gets of the operator's ANSIBLE_* and -e @file, run in the collection's
directory rather than the operator's (the adversarial review's finding: a relative ANSIBLE_INVENTORY matched no
host there and the run ended 0)."""

from __future__ import annotations

import os

from driver import runner


def test_relative_inventory_and_config_are_made_absolute_and_our_collections_come_first(tmp_path, monkeypatch):
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "hosts.yml").write_text("all: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ANSIBLE_INVENTORY", "inv/hosts.yml,not-a-path-but-a-host")
    monkeypatch.setenv("ANSIBLE_CONFIG", "my.cfg")
    monkeypatch.setenv("ANSIBLE_COLLECTIONS_PATH", "~/.ansible/collections")
    monkeypatch.setenv("ANSIBLE_FORKS", "7")
    env = runner.operators_ansible_env("/ours")
    assert env["ANSIBLE_INVENTORY"] == f"{tmp_path}/inv/hosts.yml,not-a-path-but-a-host"
    assert env["ANSIBLE_CONFIG"] == f"{tmp_path}/my.cfg"
    assert env["ANSIBLE_COLLECTIONS_PATH"] == f"/ours{os.pathsep}~/.ansible/collections"
    assert env["ANSIBLE_FORKS"] == "7"  # the rest as it is


def test_nothing_set_adds_nothing(monkeypatch):
    for k in [k for k in os.environ if k.startswith("ANSIBLE_")]:
        monkeypatch.delenv(k)
    assert runner.operators_ansible_env("/ours") == {}


def test_an_operators_vars_file_is_given_by_its_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vars.yml").write_text("a: 1\n")
    args = runner.extravars_args(["@vars.yml", "b=2"], tmp_path / "ev")
    assert args[:2] == ["-e", f"@{tmp_path}/vars.yml"]
    assert args[2] == "-e" and args[3].startswith(f"@{tmp_path}/ev/")
