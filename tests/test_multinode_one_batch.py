"""The one-batch rule of a multi-node restart: a model's ranks restart together or not at all (issue #17).

docs/restart.md: a multi-node instance is restarted with every one of its nodes in one batch; a rank missing from
the batch (a --limit that leaves it out, a node failed or unreachable) refuses the instance on every node before
anything stops, and a rank that fails a phase takes its whole group out of the next phases (then the group
rollback). The verdict is roles/sglang_service/tasks/group.yml, run by restart_multinode.yml after each phase on
every node of the batch; it hands each node {instance: why} for the groups out of step, which the next phase
gives the module as group_ok/group_why (the module's refusal, "<why>. Nothing was stopped on any node.", is
tests/test_restart_machine.py::test_a_multinode_stop_is_refused_when_a_rank_is_not_in_the_run; the whole run on
two lab nodes is tests/e2e/test_restart_multinode.py).

Here group.yml itself runs in ansible-playbook on this machine, over inventory hosts with a local connection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import REPO

GROUP = REPO / "roles" / "sglang_service" / "tasks" / "group.yml"
OUT_OF_RUN = "of them are in this run (the others failed, are unreachable or were left out)"


def inst(name: str, rank: int = 0, nnodes: int = 2) -> dict:
    return {"name": name, "port": 30000 + rank, "gpus": [0], "nnodes": nnodes, "node_rank": rank}


# a, b: the two ranks of mn (both fine) and of mf (its rank on b failed the last phase); c: rank 0 of mx, whose
# rank 1 is on a host that is not in the inventory's run at all; a also serves a replica r (one node: never judged).
HOSTS = {
    "a": {"sglang_instances": [inst("mn", 0), inst("mf", 0), inst("r", 0, nnodes=1)]},
    "b": {
        "sglang_instances": [inst("mn", 1), inst("mf", 1)],
        # the last phase's module results on b, as server.yml registers them: mf's rank failed
        "__sglang_service_result": {
            "results": [
                {"failed": False, "__sglang_service_i": {"name": "mn"}},
                {"failed": True, "__sglang_service_i": {"name": "mf"}},
            ]
        },
    },
    "c": {"sglang_instances": [inst("mx", 0)]},
}

PLAYBOOK = """\
- name: Judge the multi-node groups as restart_multinode.yml does after a phase
  hosts: nodes
  gather_facts: false
  vars:
    _sglang_service_instances: "{{ sglang_instances }}"
    sglang_service_instances_selected: "{{ sglang_instances | map(attribute='name') | list }}"
    _sglang_service_mn_failed: []
  tasks:
    - name: The verdict
      ansible.builtin.include_tasks: "%(group)s"

    - name: Write down what this node was handed
      ansible.builtin.copy:
        content: "{{ _sglang_service_mn_group | to_json }}"
        dest: "%(out)s/{{ inventory_hostname }}.json"
        mode: "0600"
"""


@pytest.fixture
def judge(tmp_path):
    """judge(*ansible-playbook args) -> {host: {instance: why}} as each node of the run was handed it."""
    python = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {"all": {"children": {"nodes": {"hosts": {h: {**python, **v} for h, v in HOSTS.items()}}}}}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "play.yml").write_text(PLAYBOOK % {"group": GROUP, "out": out})
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}

    def judged(*args: str) -> dict:
        for old in out.iterdir():
            old.unlink()
        playbook = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
        proc = subprocess.run(
            [*playbook, str(tmp_path / "play.yml"), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        return {p.stem: json.loads(p.read_text()) for p in sorted(out.iterdir())}

    return judged


def test_each_node_is_handed_its_groups_out_of_step_a_missing_rank_and_a_failed_rank(judge):
    assert judge() == {
        "a": {"mf": "mf failed on b"},
        "b": {"mf": "mf failed on b"},
        "c": {"mx": f"mx spans 2 nodes, but only c {OUT_OF_RUN}"},
    }, "mn has both ranks in the batch and none failed: not out of step; the replica r is never judged"


def test_a_limit_that_leaves_a_rank_out_refuses_every_group_of_the_node_left_in(judge):
    assert judge("--limit", "a") == {
        "a": {
            "mn": f"mn spans 2 nodes, but only a {OUT_OF_RUN}",
            "mf": f"mf spans 2 nodes, but only a {OUT_OF_RUN}",
        }
    }
