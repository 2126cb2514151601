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


@pytest.mark.parametrize(
    ("play", "expected"), [("Roll the canary", ["r1"]), ("Roll the other replicas, in batches", ["r2", "r3", "r4"])]
)
def test_replicas_roll_in_inventory_order_whatever_order_the_plan_grouped_them_in(inventory, play, expected):
    pattern = Templar(loader=DataLoader(), variables={}).template(trust_as_template(PLAYS[play]["hosts"]))
    assert [h.name for h in inventory.get_hosts(pattern)] == expected


def test_the_replicas_pattern_given_by_the_operator_is_kept(inventory):
    pattern = Templar(loader=DataLoader(), variables={"sglang_rollout_hosts": "sglang_replicas:!r3"}).template(
        trust_as_template(PLAYS["Roll the other replicas, in batches"]["hosts"])
    )
    assert [h.name for h in inventory.get_hosts(pattern)] == ["r2", "r4"]
