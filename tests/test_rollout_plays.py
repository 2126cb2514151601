"""playbooks/rollout.yml's plays, read as Ansible reads them: which hosts each play runs, in which order."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

REPO = Path(__file__).resolve().parents[1]
PLAYS = {p["name"]: p for p in yaml.safe_load((REPO / "playbooks" / "rollout.yml").read_text())}
ROLLED = ("Roll the canary", "Roll the other replicas, in batches")


def hosts_of(inventory: InventoryManager, play: str, **variables) -> list[str]:
    """The hosts a play of rollout.yml runs, in their order, its hosts templated as Ansible does (each item)."""
    pattern = PLAYS[play]["hosts"]
    items = pattern if isinstance(pattern, list) else [pattern]
    templar = Templar(loader=DataLoader(), variables=variables)
    return [h.name for h in inventory.get_hosts([templar.template(trust_as_template(i)) for i in items])]


@pytest.fixture
def inventory(tmp_path):
    """Four replicas in inventory order; the groups the plan play builds (group_by) hold them in another order,
    as they do when the plan's tasks finish out of order."""
    (tmp_path / "hosts.yml").write_text(
        yaml.safe_dump(
            {
                "all": {
                    "children": {
                        "sglang_replicas": {"hosts": {h: None for h in ("r1", "r2", "r3", "r4")}},
                        "sglang_rollout_canary": {"hosts": {"r1": None}},
                        "sglang_rollout_rest": {"hosts": {h: None for h in ("r4", "r2", "r3")}},
                    }
                }
            },
            sort_keys=False,
        )
    )
    return InventoryManager(loader=DataLoader(), sources=[str(tmp_path / "hosts.yml")])


@pytest.mark.parametrize(("play", "expected"), [(ROLLED[0], ["r1"]), (ROLLED[1], ["r2", "r3", "r4"])])
def test_replicas_roll_in_inventory_order_whatever_order_the_plan_grouped_them_in(inventory, play, expected):
    assert hosts_of(inventory, play) == expected


@pytest.mark.parametrize(
    ("hosts", "canary", "rest"),
    [
        ("sglang_replicas:!r3", ["r1"], ["r2", "r4"]),
        # A comma: Ansible splits such a pattern on commas only ("r1,r2,r3,r4:&g" would intersect r4 alone).
        ("r1,r2,r3,r4", ["r1"], ["r2", "r3", "r4"]),
        ("r4,r3,r2,r1", ["r1"], ["r4", "r3", "r2"]),
        ("~r[12]", ["r1"], ["r2"]),
        ("all", ["r1"], ["r2", "r3", "r4"]),
    ],
)
def test_the_replicas_pattern_given_by_the_operator_is_kept(inventory, hosts, canary, rest):
    assert hosts_of(inventory, ROLLED[0], sglang_rollout_hosts=hosts) == canary
    assert hosts_of(inventory, ROLLED[1], sglang_rollout_hosts=hosts) == rest
