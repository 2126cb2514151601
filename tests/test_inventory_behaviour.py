"""What the inventory check refuses and lets through, word for word (issue #31: the behaviours behind the mutants the
unit suite let survive in driver/inventory.py).

The inventory a run uses (-i, $ANSIBLE_INVENTORY, the lab's; a host list), with the repository's ansible.cfg; the
message of a source Ansible cannot parse (each plugin's error and where, plugins that agree together, Ansible's own
warning, a source Ansible is told to refuse whole); --limit's parts (a limit file among them, several typos, an
invalid pattern); -e as ansible-playbook reads it; a playbook's `hosts:` rendered as ansible-playbook renders it (its
vars and vars_files, the magic variables, lookups, lists, from any working directory) and what the message names;
--instance against what each host defines (templated, read by a lookup, none at all).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from driver import commands, inventory
from support import REPO

RESTART = commands.PLAYBOOKS["restart"][0]

# node-1 defines its own instances; node-2 none (it gets group_vars/all.yml's); router-1 is in no GPU group.
FLEET = """\
all:
  children:
    sglang_nodes:
      hosts:
        node-1:
          sglang_instances:
            - {name: main, port: 30000, gpus: [0, 1, 2, 3]}
            - {name: bench, port: 30001, gpus: [4, 5, 6, 7]}
        node-2:
    sglang_routers:
      hosts:
        router-1:
"""


@pytest.fixture
def fleet(tmp_path) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(FLEET)
    return path


def refusal(*args, **kwargs) -> str:
    with pytest.raises(inventory.InventoryError) as e:
        inventory.check(*args, **kwargs)
    return str(e.value)


def hosts(fleet, playbook=RESTART, limit=None, instances=(), extravars=()) -> list[str]:
    return inventory.check(str(fleet), limit, str(playbook), instances, extravars).hosts


def playbook(tmp_path: Path, text: str, name: str = "pb.yml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------ which inventory, with which settings


def test_the_inventory_is_minus_i_else_ansible_inventory_else_the_labs(fleet, tmp_path, monkeypatch):
    monkeypatch.setenv("ANSIBLE_INVENTORY", str(fleet))
    assert inventory.check(None, None) == inventory.Checked(str(fleet), ["node-1", "node-2", "router-1"])
    other = tmp_path / "other.yml"
    other.write_text("all:\n  hosts:\n    o1:\n")
    assert inventory.check(str(other), None) == inventory.Checked(str(other), ["o1"])
    monkeypatch.delenv("ANSIBLE_INVENTORY")
    monkeypatch.setattr(inventory, "DEFAULT", other)
    assert inventory.check(None, None) == inventory.Checked(str(other), ["o1"])


def test_a_comma_separated_host_list_is_an_inventory_not_a_missing_file():
    assert inventory.check("n1,n2,", None) == inventory.Checked("n1,n2,", ["n1", "n2"])


def test_ansible_reads_the_repositorys_ansible_cfg_as_ansible_playbook_does_unless_one_is_set(fleet, monkeypatch):
    """The check's own Ansible (and whatever Ansible this process starts) takes the settings runner.py gives
    ansible-playbook; an ANSIBLE_CONFIG the operator set stays theirs."""
    monkeypatch.delenv("ANSIBLE_CONFIG", raising=False)
    inventory.check(str(fleet), None)
    assert os.environ["ANSIBLE_CONFIG"] == str(REPO / "ansible.cfg")
    monkeypatch.setenv("ANSIBLE_CONFIG", "/etc/mine.cfg")
    inventory.check(str(fleet), None)
    assert os.environ["ANSIBLE_CONFIG"] == "/etc/mine.cfg"


# ------------------------------------------------------------------ a source Ansible cannot parse

MALFORMED = "all:\n  hosts:\n    lab-node-1: {ansible_host: 10.0.0.1\n  oops\n"


def test_a_malformed_inventory_is_refused_with_each_plugins_error_and_where_then_ansibles_warning(tmp_path):
    bad = tmp_path / "hosts.yml"
    bad.write_text(MALFORMED)
    yaml_error = "YAML parsing failed: While parsing a flow mapping did not find expected ',' or '}'."
    assert refusal(str(bad), None) == "\n".join(
        [
            f"inventory {bad} could not be parsed:",
            f"  auto: {yaml_error} ({bad}:5)",
            f"  yaml: {yaml_error}",
            f"  ini: Failed to parse inventory: Invalid host pattern 'all:' supplied, ending in ':' is not allowed,"
            f" this character is reserved to provide a port. ({bad})",
            f"  Unable to parse {bad} as an inventory source",
        ]
    )


def test_a_source_no_plugin_takes_is_refused_with_ansibles_warning(tmp_path):
    """An empty directory: no plugin failed, none parsed it; Ansible only warns (and would run on no host)."""
    empty = tmp_path / "inventory"
    empty.mkdir()
    assert refusal(str(empty), None) == (
        f"inventory {empty} could not be parsed:\n  Unable to parse {empty} as an inventory source"
    )


def test_a_source_ansible_is_told_to_refuse_whole_is_refused_in_its_words(tmp_path, monkeypatch):
    """ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED (ansible.cfg's any_unparsed_is_failed): Ansible raises."""
    from ansible import constants

    monkeypatch.setattr(constants, "INVENTORY_ANY_UNPARSED_IS_FAILED", True)
    bad = tmp_path / "hosts.yml"
    bad.write_text(MALFORMED)
    assert refusal(str(bad), None) == f"inventory {bad}: Completely failed to parse inventory source {bad}"


class Failed(Exception):
    def __init__(self, text, obj=None):
        super().__init__(text)
        if obj is not None:
            self.obj = obj


def test_plugins_that_fail_alike_are_named_together_and_other_warnings_left_out():
    """As InventoryManager tells its display: each failing plugin's message and exception, then its warning."""
    rec = inventory._Recorder(SimpleNamespace())
    where = SimpleNamespace(path="/inv/hosts", line_num=3)
    for plugin in ("auto", "yaml"):
        rec.error_as_warning(
            msg=f"Failed to parse inventory with {plugin!r} plugin.", exception=Failed("bad\n  x", where)
        )
    rec.error_as_warning(msg="Failed to parse inventory with 'ini' plugin.", exception=Failed("other", where))
    rec.warning("Unable to parse /inv/hosts as an inventory source")
    rec.warning("Skipping unexpected key (x) in group (y)")
    assert inventory._parse_failure("/inv/hosts", rec) == (
        "inventory /inv/hosts could not be parsed:\n"
        "  auto, yaml: bad x (/inv/hosts:3)\n"
        "  ini: other (/inv/hosts:3)\n"
        "  Unable to parse /inv/hosts as an inventory source"
    )


def test_what_the_display_is_told_in_any_shape_is_kept_as_said():
    """Display's error_as_warning(msg, exception=None): a message naming no plugin, no exception, an exception with
    no origin, an origin with no path or no line."""
    rec = inventory._Recorder(SimpleNamespace())
    rec.error_as_warning("Something failed.")
    rec.error_as_warning("It's broken.", Failed("no  origin"))
    rec.error_as_warning("Failed with 'toml' plugin.", Failed("no line", SimpleNamespace(path="/h", line_num=None)))
    rec.error_as_warning("Failed with 'x' plugin.", Failed("nowhere", SimpleNamespace(path=None, line_num=None)))
    rec.error_as_warning("Failed with 'y' plugin.", Failed("no attributes", object()))
    assert rec.failures == [
        ("Something failed.", "Something failed."),
        ("It's broken.", "no origin"),
        ("toml", "no line (/h)"),
        ("x", "nowhere"),
        ("y", "no attributes"),
    ]


# ------------------------------------------------------------------ --limit


TWO = "all:\n  children:\n    sglang_nodes:\n      hosts:\n        lab-node-1:\n        lab-node-2:\n        Xeon-1:\n"


@pytest.fixture
def two(tmp_path) -> Path:
    path = tmp_path / "two.yml"
    path.write_text(TWO)
    return path


def test_every_part_of_a_limit_that_matches_nothing_is_named(two):
    assert refusal(str(two), "lab-node-1,typo1,typo2") == (
        f"--limit lab-node-1,typo1,typo2: 'typo1', 'typo2' matched no host in inventory {two}"
    )


def test_a_limit_file_among_the_parts_is_read_and_the_parts_after_it_still_checked(two, tmp_path):
    listed = tmp_path / "limit.txt"
    listed.write_text("lab-node-1\n")
    assert inventory.check(str(two), f"@{listed},lab-node-2").hosts == ["lab-node-1", "lab-node-2"]
    assert refusal(str(two), f"@{listed},typo") == f"--limit @{listed},typo: 'typo' matched no host in inventory {two}"


def test_a_host_whose_name_starts_with_x_is_matched_as_written(two):
    assert inventory.check(str(two), "Xeon-1,lab-node-1").hosts == ["lab-node-1", "Xeon-1"]


def test_an_invalid_limit_pattern_is_refused_in_ansibles_words(two):
    assert refusal(str(two), "~(") == "--limit ~(: Invalid host list pattern: ~("


# ------------------------------------------------------------------ -e, as ansible-playbook reads them

MINE = json.dumps({"sglang_instances": [{"name": "a", "port": 30000, "gpus": [0]}]})


def test_an_empty_extra_vars_is_passed_over_and_the_next_read(fleet):
    assert refusal(str(fleet), None, RESTART, ["main"], ["", MINE]) == (
        "--instance main: no selected host defines it (defined: a)"
    )


def test_a_key_value_extra_vars_is_read_whatever_its_first_letter(fleet):
    assert refusal(str(fleet), None, RESTART, ["main"], ["Xtra=1", MINE]) == (
        "--instance main: no selected host defines it (defined: a)"
    )


def test_an_extra_vars_file_is_trusted_as_a_template_as_the_command_line_trusts_it(fleet, tmp_path):
    extra = tmp_path / "vars.yml"
    extra.write_text("mine: [{name: a, port: 30000, gpus: [0]}]\nsglang_instances: '{{ mine }}'\n")
    assert refusal(str(fleet), None, RESTART, ["main"], [f"@{extra}"]) == (
        "--instance main: no selected host defines it (defined: a)"
    )


def test_an_absolute_path_given_without_at_is_left_to_ansible_playbook(fleet, tmp_path):
    """ansible-playbook refuses it (a file is given with '@'): not even the playbook's hosts are known here."""
    extra = tmp_path / "vars.yml"
    extra.write_text(MINE)
    assert hosts(fleet, limit="router-1", instances=["x"], extravars=[str(extra)]) == ["router-1"]


# ------------------------------------------------------------------ a playbook's hosts


def test_a_plays_own_vars_render_its_hosts(fleet, tmp_path):
    pb = playbook(tmp_path, "- hosts: '{{ where }}'\n  vars: {where: sglang_routers}\n  tasks: []\n")
    assert hosts(fleet, pb) == ["router-1"]


def test_vars_files_as_one_name_each_name_in_order_and_the_first_that_exists_of_a_list(fleet, tmp_path):
    (tmp_path / "a.yml").write_text("where: node-1\n")
    (tmp_path / "b.yml").write_text("where: sglang_routers\n")
    one = playbook(tmp_path, "- hosts: '{{ where }}'\n  vars_files: a.yml\n  tasks: []\n", "one.yml")
    assert hosts(fleet, one) == ["node-1"]
    both = playbook(tmp_path, "- hosts: '{{ where }}'\n  vars_files: [a.yml, b.yml]\n  tasks: []\n", "both.yml")
    assert hosts(fleet, both) == ["router-1"], "b.yml over a.yml"
    first = playbook(tmp_path, "- hosts: '{{ where }}'\n  vars_files: [[nosuch.yml, a.yml, b.yml]]\n  tasks: []\n")
    assert hosts(fleet, first) == ["node-1"], "the first of the list that exists"


def test_a_templated_vars_files_name_is_not_followed(fleet, tmp_path):
    """Even where a file has that very name: Ansible would render the name first."""
    (tmp_path / "{{ env }}.yml").write_text("where: sglang_routers\n")
    pb = playbook(tmp_path, "- hosts: '{{ where }}'\n  vars: {where: node-1}\n  vars_files: ['{{ env }}.yml']\n")
    assert hosts(fleet, pb) == ["node-1"]


def test_a_vars_files_value_is_a_template_rendered_with_the_plays_vars(fleet, tmp_path):
    (tmp_path / "where.yml").write_text("where: '{{ group }}'\n")
    pb = playbook(tmp_path, "- hosts: '{{ where }}'\n  vars: {group: sglang_routers}\n  vars_files: [where.yml]\n")
    assert hosts(fleet, pb) == ["router-1"]


def test_an_entry_that_is_no_play_is_passed_over_and_the_plays_after_it_count(fleet, tmp_path):
    pb = playbook(tmp_path, "- just words\n- hosts: sglang_routers\n  tasks: []\n")
    assert hosts(fleet, pb) == ["router-1"]


def test_a_playbook_hosts_line_can_use_groups_playbook_dir_and_lookups(fleet, tmp_path):
    """The magic variables a play's hosts can use before it runs, and a lookup reading a file beside it."""
    by_groups = playbook(tmp_path, "- hosts: \"{{ groups['sglang_routers'] }}\"\n  tasks: []\n", "groups.yml")
    assert hosts(fleet, by_groups) == ["router-1"]
    by_dir = playbook(tmp_path, "- hosts: '{{ playbook_dir | basename }}'\n", "sglang_routers/pb.yml")
    assert hosts(fleet, by_dir) == ["router-1"]
    (tmp_path / "hosts.txt").write_text("sglang_routers\n")
    by_lookup = playbook(tmp_path, "- hosts: \"{{ lookup('file', playbook_dir ~ '/hosts.txt') }}\"\n", "lookup.yml")
    assert hosts(fleet, by_lookup) == ["router-1"]


def test_a_hosts_list_is_every_pattern_in_it(fleet, tmp_path):
    pb = playbook(tmp_path, "- hosts: [node-2, sglang_routers]\n  tasks: []\n")
    assert hosts(fleet, pb) == ["node-2", "router-1"]


def test_a_hosts_line_that_cannot_be_rendered_here_refuses_nothing(fleet, tmp_path):
    pb = playbook(tmp_path, "- hosts: '{{ nowhere_defined }}'\n  tasks: []\n")
    assert hosts(fleet, pb, limit="router-1") == ["router-1"]


def test_a_refusal_names_the_playbooks_patterns_that_match_hosts(tmp_path):
    """Those that match (an exclusion by what it excludes); all of them when none does."""
    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  children:\n    Xeon_nodes:\n      hosts:\n        x1:\n  hosts:\n    r1:\n")
    pb = playbook(tmp_path, "- hosts: 'Xeon_nodes:!nosuch_group'\n  tasks: []\n")
    assert refusal(str(inv), "r1", str(pb)) == f"--limit r1 matches none of the hosts {pb} plays on (Xeon_nodes)"
    pb = playbook(tmp_path, "- hosts: 'nosuch_group:!other_group'\n  tasks: []\n")
    assert refusal(str(inv), "r1", str(pb)) == (
        f"--limit r1 matches none of the hosts {pb} plays on (nosuch_group, !other_group)"
    )


def test_the_repositorys_playbook_and_group_vars_are_found_from_any_working_directory(fleet, tmp_path, monkeypatch):
    """commands.PLAYBOOKS names them from the repository's root; group_vars/all.yml beside them gives node-2 its
    instances (main), wherever the driver is started from."""
    monkeypatch.chdir(tmp_path)
    assert refusal(str(fleet), "router-1", RESTART) == (
        f"--limit router-1 matches none of the hosts {RESTART} plays on (sglang_nodes)"
    )
    assert hosts(fleet, limit="node-2", instances=["main"]) == ["node-2"]
    assert refusal(str(fleet), "node-2", RESTART, ["bench"]) == (
        "--instance bench: no selected host defines it (defined: main)"
    )


# ------------------------------------------------------------------ --instance


def test_hosts_that_define_no_instances_at_all_define_none(fleet, tmp_path):
    """A playbook of one's own (no group_vars beside it): no host has sglang_instances."""
    pb = playbook(tmp_path, "- hosts: sglang_nodes\n  tasks: []\n")
    assert refusal(str(fleet), "node-2", str(pb), ["main"]) == (
        "--instance main: no selected host defines it (defined: none)"
    )


def test_a_hosts_instances_are_rendered_from_its_variables_and_lookups(tmp_path):
    (tmp_path / "instances.json").write_text(json.dumps([{"name": "looked", "port": 1, "gpus": [0]}]))
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n"
        "        n1:\n          mine: [{name: templated, port: 1, gpus: [0]}]\n"
        "          sglang_instances: '{{ mine }}'\n"
        f"        n2:\n          sglang_instances: \"{{{{ lookup('file', '{tmp_path}/instances.json') | from_json }}}}\"\n"
    )
    assert refusal(str(inv), None, RESTART, ["typo"]) == (
        "--instance typo: no selected host defines it (defined: templated, looked)"
    )


def test_an_entry_without_a_name_defines_nothing_and_the_others_still_count(tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n        n1:\n"
        "          sglang_instances: [{port: 1, gpus: [0]}, named, {name: a, port: 2, gpus: [1]}]\n"
    )
    assert refusal(str(inv), None, RESTART, ["typo"]) == "--instance typo: no selected host defines it (defined: a)"
