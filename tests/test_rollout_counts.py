"""The rollout's counts (sglang_deploy.rollout.count_of, the sglang_count_of filter): --max-unavailable and
--max-fail as a count or a percentage of the replicas, as playbooks/vars/rollout.yml derives the batch and the
failures allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.rollout import count_of
from support import local_play

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("value", "total", "at_least", "count"),
    [
        ("25%", 10, 0, 2),  # rounded down
        ("25%", 2, 0, 0),
        ("25%", 2, 1, 1),  # a batch of at least one host
        ("100%", 7, 1, 7),
        (" 3 ", 10, 1, 3),
        (3, 10, 0, 3),
        ("0", 10, 1, 0),  # a count is as given: the playbook's check refuses a batch of 0
    ],
)
def test_a_count_or_a_percentage_of_the_hosts(value, total, at_least, count):
    assert count_of(value, total, at_least) == count


@pytest.mark.parametrize("value", ["-1", "1.5", "25%%", "%", "", "two", None])
def test_anything_else_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="neither a count"):
        count_of(value, 10)


PLAY = """
- hosts: all
  gather_facts: false
  vars_files: ["%(repo)s/playbooks/vars/rollout.yml"]
  tasks:
    - ansible.builtin.copy:
        content: "{{ {'batch': _sglang_service_rollout_batch | int, 'allowed': _sglang_service_rollout_allowed | int}
                     | to_json }}"
        dest: "%(out)s"
      delegate_to: localhost
      run_once: true
"""


def rendered(tmp_path, *extra: str) -> dict:
    """playbooks/vars/rollout.yml's batch and failures allowed as Ansible renders them over 8 replicas (1 in the
    canary, 7 after it), for the -e given."""
    hosts = [f"r{i}" for i in range(1, 9)]
    inventory = {"children": {"sglang_rollout_canary": {"hosts": {h: None for h in hosts[:1]}},
                              "sglang_rollout_rest": {"hosts": {h: None for h in hosts[1:]}}}}  # fmt: skip
    return local_play(tmp_path, inventory, PLAY, *extra)


def test_the_playbooks_batch_and_failures_allowed_are_the_filters_counts_of_the_replicas(tmp_path):
    # 5 % of 8 is no host: the batch is at least one; 25 % of the 8 in the canary and after it is 2.
    out = rendered(tmp_path, "-e", "sglang_rollout_max_unavailable=5%", "-e", "sglang_rollout_max_fail=25%")
    assert out == {"batch": 1, "allowed": 2}
