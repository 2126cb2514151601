"""A selection that matches nothing is refused before anything runs (issue #29): exit 2 naming what matched
nothing, no playbook started and no run recorded (driver/inventory.py, given the command's playbook).

- an --instance that none of the selected hosts defines in its sglang_instances (as Ansible's variable
  precedence gives it: group_vars/all.yml beside the playbooks, the inventory's group_vars, host vars, -e);
- a --limit whose hosts are none of those the command's playbook plays on (its plays' `hosts:`, rendered).
"""

from __future__ import annotations

import json

import pytest
import yaml

from driver import commands, inventory
from support import REPO, refused

RESTART = commands.PLAYBOOKS["restart"][0]
ROLLOUT = commands.PLAYBOOKS["rollout"][0]

# node-1 defines its own instances; node-2 none (it gets group_vars/all.yml's); router-1 is in no GPU group.
FLEET = """\
all:
  children:
    sglang_nodes:
      children:
        sglang_replicas:
          hosts:
            node-1:
              ansible_connection: local
              sglang_instances:
                - {name: main, port: 30000, gpus: [0, 1, 2, 3]}
                - {name: bench, port: 30001, gpus: [4, 5, 6, 7]}
            node-2: {ansible_connection: local}
    sglang_routers:
      hosts:
        router-1: {ansible_connection: local}
"""


def repo_default_instances() -> list[str]:
    """The instances a host that sets none runs: group_vars/all.yml's (no role defaults sglang_instances)."""
    doc = yaml.safe_load((REPO / "group_vars" / "all.yml").read_text())
    return [i["name"] for i in doc["sglang_instances"]]


@pytest.fixture
def fleet(tmp_path):
    path = tmp_path / "hosts.yml"
    path.write_text(FLEET)
    return path


def selected(fleet, playbook=RESTART, limit=None, instances=(), extravars=()) -> list[str]:
    return inventory.check(str(fleet), limit, playbook, instances, extravars).hosts


# ------------------------------------------------------------------ --instance


def test_an_instance_typo_exits_2_naming_it_and_the_instances_defined(fleet, ledger_path, no_playbook, capsys):
    err = refused(capsys, "restart", "-i", str(fleet), "--instance", "mian")
    assert "--instance mian: no selected host defines it (defined: main, bench)" in err
    assert not ledger_path.exists(), "nothing ran: no run is recorded"


def test_an_instance_typo_is_an_inventory_error_naming_every_missing_one(fleet):
    with pytest.raises(inventory.InventoryError) as e:
        selected(fleet, instances=["main", "mian", "bnech"])
    assert str(e.value) == "--instance mian, bnech: no selected host defines them (defined: main, bench)"


@pytest.mark.parametrize("names", [["main"], ["bench"], ["main", "bench"]])
def test_a_defined_instance_passes(fleet, names):
    assert selected(fleet, instances=names) == ["node-1", "node-2"]


def test_an_instance_defined_only_on_a_host_left_out_by_the_limit_fails(fleet):
    with pytest.raises(inventory.InventoryError) as e:
        selected(fleet, limit="node-2", instances=["bench"])
    assert (
        str(e.value)
        == f"--instance bench: no selected host defines it (defined: {', '.join(repo_default_instances())})"
    )
    assert selected(fleet, limit="node-1", instances=["bench"]) == ["node-1"]


def test_a_host_that_sets_no_instances_defines_the_repositorys_default(fleet):
    default = repo_default_instances()
    assert default == ["main"]
    assert selected(fleet, limit="node-2", instances=default) == ["node-2"]
    with pytest.raises(inventory.InventoryError, match=r"\(defined: main\)$"):
        selected(fleet, limit="node-2", instances=["mian"])


def test_the_inventorys_group_vars_are_read_over_the_repositorys(tmp_path):
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "group_vars" / "sglang_nodes.yml").write_text("sglang_instances:\n  - {name: a, port: 1, gpus: [0]}\n")
    (tmp_path / "hosts.yml").write_text("all:\n  children:\n    sglang_nodes:\n      hosts:\n        n1:\n")
    assert inventory.check(str(tmp_path / "hosts.yml"), None, RESTART, ["a"]).hosts == ["n1"]
    with pytest.raises(inventory.InventoryError, match=r"--instance main: no selected host defines it \(defined: a\)"):
        inventory.check(str(tmp_path / "hosts.yml"), None, RESTART, ["main"])


def test_extra_vars_set_the_instances_as_ansible_playbook_takes_them(fleet):
    """-e wins over every other source: as JSON, as key=value of a variable sglang_instances renders, from @file."""
    mine = json.dumps({"sglang_instances": [{"name": "a", "port": 30000, "gpus": [0]}]})
    assert selected(fleet, instances=["a"], extravars=[mine]) == ["node-1", "node-2"]
    with pytest.raises(inventory.InventoryError, match=r"--instance main: no selected host defines it \(defined: a\)"):
        selected(fleet, instances=["main"], extravars=[mine])


def test_a_run_through_the_cli_passes_its_extra_vars_to_the_check(fleet, ledger_path, no_playbook, capsys):
    mine = json.dumps({"sglang_instances": [{"name": "a", "port": 30000, "gpus": [0]}]})
    err = refused(capsys, "status", "-i", str(fleet), "--instance", "main", "-e", mine)
    assert "--instance main: no selected host defines it (defined: a)" in err


@pytest.mark.parametrize("instances", ["{{ nowhere_defined }}", "main"], ids=["undefined variable", "not a list"])
def test_instances_that_cannot_be_read_here_are_left_to_ansible_playbook(fleet, instances):
    """Never refused on a guess: the role's own checks say what is wrong with such a sglang_instances."""
    extra = json.dumps({"sglang_instances": instances})
    assert selected(fleet, instances=["x"], extravars=[extra]) == ["node-1", "node-2"]


@pytest.mark.parametrize("unread", ["@{tmp}/nosuch.yml", "./vars.yml", "[1, 2]"], ids=["no file", "no @", "a list"])
def test_extra_vars_ansible_cannot_read_are_left_to_ansible_playbook(fleet, tmp_path, unread):
    """Without its -e, not even the playbook's hosts are known here: the hosts are --limit's (here, every one)."""
    extra = [unread.format(tmp=tmp_path)]
    assert selected(fleet, instances=["x"], extravars=extra) == ["router-1", "node-1", "node-2"]


# ------------------------------------------------------------------ --limit against the playbook's hosts


def test_a_limit_outside_the_playbooks_groups_exits_2_naming_it_and_them(fleet, ledger_path, no_playbook, capsys):
    err = refused(capsys, "restart", "-i", str(fleet), "--limit", "router-1")
    assert f"--limit router-1 matches none of the hosts {RESTART} plays on (sglang_nodes)" in err
    assert not ledger_path.exists()


def test_a_limit_of_hosts_the_playbook_plays_on_passes_with_those_hosts(fleet):
    assert selected(fleet, limit="node-2") == ["node-2"]
    assert selected(fleet, limit="all") == ["node-1", "node-2"], "router-1 is not the run's"
    assert selected(fleet, limit="node-1,router-1") == ["node-1"]


def test_the_playbooks_hosts_are_its_own_every_play_and_import_counted(fleet):
    """deploy.yml imports router.yml (sglang_routers): the router is deploy's, not restart's."""
    assert selected(fleet, commands.PLAYBOOKS["deploy"][0], limit="router-1") == ["router-1"]
    with pytest.raises(inventory.InventoryError, match=r"matches none of the hosts playbooks/status\.yml plays on"):
        selected(fleet, commands.PLAYBOOKS["status"][0], limit="router-1")


def test_a_templated_hosts_line_is_rendered_with_its_default_or_with_extra_vars(fleet):
    """rollout.yml plays on {{ sglang_rollout_hosts | default('sglang_replicas') }} (and the multi-node groups)."""
    with pytest.raises(inventory.InventoryError) as e:
        selected(fleet, ROLLOUT, limit="router-1")
    assert str(e.value) == f"--limit router-1 matches none of the hosts {ROLLOUT} plays on (sglang_replicas)"
    assert selected(fleet, ROLLOUT, limit="router-1", extravars=["sglang_rollout_hosts=sglang_routers"]) == ["router-1"]


def test_an_inventory_with_none_of_the_playbooks_hosts_exits_2(tmp_path, ledger_path, no_playbook, capsys):
    routers = tmp_path / "hosts.yml"
    routers.write_text("all:\n  children:\n    sglang_routers:\n      hosts:\n        r1:\n")
    err = refused(capsys, "verify", "-i", str(routers))
    assert f"inventory {routers} has none of the hosts playbooks/verify.yml plays on (sglang_nodes)" in err


@pytest.mark.parametrize("command", sorted(commands.PLAYBOOKS))
def test_every_commands_playbook_plays_on_the_example_fleet(command):
    """Each playbook's hosts render; the example fleet's GPU nodes are every command's, its router deploy's only."""
    example = str(REPO / "inventory" / "example" / "hosts.yml")
    hosts = inventory.check(example, None, commands.PLAYBOOKS[command][0]).hosts
    gpus = [f"gpu-node-0{i}.example.internal" for i in (1, 2, 3, 4)]
    expected = {"deploy": [*gpus, "router-01.example.internal"], "rollout": gpus}.get(command, gpus)
    assert sorted(hosts) == sorted(expected)


def test_a_plays_vars_files_and_an_imports_vars_render_its_hosts(fleet, tmp_path):
    """As ansible-playbook renders `hosts:`: the play's vars_files over its vars, an import's vars over its plays'."""
    (tmp_path / "where.yml").write_text("where: sglang_routers\n")
    (tmp_path / "inner.yml").write_text("- hosts: '{{ inner_hosts }}'\n  vars: {inner_hosts: node-1}\n  tasks: []\n")
    playbook = tmp_path / "pb.yml"
    playbook.write_text(
        "- hosts: \"{{ where | default('sglang_nodes') }}\"\n  vars: {where: node-1}\n  vars_files: [where.yml]\n"
        "  tasks: []\n- import_playbook: inner.yml\n  vars: {inner_hosts: node-2}\n"
    )
    assert selected(fleet, str(playbook), limit="router-1") == ["router-1"]
    assert selected(fleet, str(playbook), limit="node-2") == ["node-2"]
    with pytest.raises(inventory.InventoryError) as e:
        selected(fleet, str(playbook), limit="node-1")
    assert str(e.value) == f"--limit node-1 matches none of the hosts {playbook} plays on (sglang_routers, node-2)"
