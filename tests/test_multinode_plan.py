"""The multi-node restart's order is the state machine's (sglang_deploy.phases.MULTINODE_PLAN): restart_multinode.yml
loops over it. Here the role's restart_multinode.yml, multinode_step.yml and group.yml run in ansible-playbook on
this machine (local connection) with server.yml replaced by a stand-in that writes down each call (phase, instance,
what the module would be told of its group) and fails the ranks a test names: which phases run on which ranks, in
which order, and what a failed rank leads to on every node. The module's own side of each phase is
tests/test_restart_machine.py; the whole run on two lab nodes is tests/e2e/test_restart_multinode.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.filter.sglang_restart import sglang_multinode_plan
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import phases
from support import REPO

TASKS = REPO / "roles" / "sglang_service" / "tasks"

# What server.yml does for the plan, without the module: each selected multi-node instance the step runs on is one
# call, written down; a rank named in `fail_at[phase]` fails (softly where the step says so), as its module would.
SERVER = """\
- name: Write down each call of this phase
  ansible.builtin.lineinfile:
    path: "%(out)s/{{ inventory_hostname }}.log"
    line: "{{ _sglang_service_phase }} {{ i.name }} {{ i.name not in _sglang_service_mn_judged }}"
    create: true
    mode: "0600"
  loop: &instances >-
    {{ _sglang_service_instances | selectattr('name', 'in', sglang_service_instances_selected)
       | selectattr('nnodes', 'gt', 1) | selectattr('name', 'in', _sglang_service_mn_only) | list }}
  loop_control:
    loop_var: i

- name: The phase's outcome on each rank (told its group is out of step, the module refuses a stop and contains at
    the rollback's end)
  ansible.builtin.assert:
    that:
      - __sglang_service_i.name not in (fail_at[_sglang_service_phase] | default([]))
      - __sglang_service_i.name not in _sglang_service_mn_judged
    quiet: true
  loop: *instances
  loop_control:
    loop_var: __sglang_service_i
  register: __sglang_service_result
  ignore_errors: "{{ _sglang_service_mn_soft }}"
"""

PLAYBOOK = """\
- name: A multi-node restart as restart.yml includes it
  hosts: nodes
  gather_facts: false
  vars:
    _sglang_service_instances: "{{ sglang_instances }}"
    sglang_service_instances_selected: "{{ sglang_instances | map(attribute='name') | list }}"
    sglang_service_cancel_file: ""
  tasks:
    - name: The restart
      ansible.builtin.include_tasks: "%(tasks)s/restart_multinode.yml"
"""


def inst(name: str, rank: int) -> dict:
    return {"name": name, "port": 30000, "gpus": [0], "nnodes": 2, "node_rank": rank}


@pytest.fixture
def restart(tmp_path):
    """restart(fail_at_on_b) -> {host: [(phase, instance, in step)]}: ranks of mn and mf on a and b; b's ranks named
    in fail_at_on_b ({phase: [instance]}) fail that phase."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("restart_multinode.yml", "multinode_step.yml", "group.yml"):
        shutil.copy(TASKS / name, tasks / name)
    out = tmp_path / "out"
    out.mkdir()
    (tasks / "server.yml").write_text(SERVER % {"out": out})
    (tmp_path / "play.yml").write_text(PLAYBOOK % {"tasks": tasks})
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}

    def run(fail_at_on_b: dict, more_on_a: tuple[dict, ...] = ()) -> dict:
        python = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
        hosts = {
            "a": {**python, "sglang_instances": [inst("mn", 0), inst("mf", 0), *more_on_a]},
            "b": {**python, "sglang_instances": [inst("mn", 1), inst("mf", 1)], "fail_at": fail_at_on_b},
        }
        (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"nodes": {"hosts": hosts}}}}))
        playbook = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
        proc = subprocess.run(
            [*playbook, str(tmp_path / "play.yml")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert "ERROR!" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-2000:]
        logs = {p.stem: p.read_text().split("\n") for p in sorted(out.iterdir())}
        return {h: [tuple(line.split()) for line in lines if line] for h, lines in logs.items()}

    return run


def test_every_rank_stops_before_any_starts_and_nothing_is_recorded_before_every_rank_is_confirmed(restart):
    calls = restart({})
    both = [(phase, name, "True") for phase in ("stop", "start", "confirm", "record") for name in ("mn", "mf")]
    assert calls == {"a": both, "b": both}  # no rollback phase: no group out of step


def test_a_rank_that_fails_its_start_rolls_its_group_back_on_every_node_in_step_and_leaves_the_other(restart):
    calls = restart({"start": ["mf"]})
    for host in ("a", "b"):
        assert calls[host] == [
            ("stop", "mn", "True"),
            ("stop", "mf", "True"),
            ("start", "mn", "True"),
            ("start", "mf", "True"),
            ("confirm", "mn", "True"),  # mf, out of step, goes no further
            ("record", "mn", "True"),
            ("rollback_stop", "mf", "True"),  # every rank of mf, on every node
            ("rollback_start", "mf", "True"),
            ("rollback_confirm", "mf", "True"),
        ], host


def test_a_group_whose_rollback_fails_to_start_is_contained_in_its_last_phase(restart):
    calls = restart({"start": ["mf"], "rollback_start": ["mf"]})
    assert calls["a"][-2:] == [("rollback_start", "mf", "True"), ("rollback_confirm", "mf", "False")]


def test_a_group_refused_for_a_rank_missing_from_the_batch_is_refused_last_the_nodes_other_groups_restarted(restart):
    """mr's rank 1 is on no host of the batch: refused (nothing stopped), and the refusal, which fails its host, comes
    once the host's other groups are through: refused first, it took a out of the play with mn and mf stopped on b."""
    calls = restart({}, more_on_a=(inst("mr", 0),))
    both = [(phase, name, "True") for phase in ("stop", "start", "confirm", "record") for name in ("mn", "mf")]
    assert calls == {"a": [*both, ("stop", "mr", "False")], "b": both}


def test_the_plan_is_the_state_machines_and_the_yaml_names_no_phase():
    steps = sglang_multinode_plan(["mn"])
    assert steps == [asdict(s) for s in phases.MULTINODE_PLAN] and sglang_multinode_plan([]) == []
    assert [s["phase"] for s in steps if s["step"] == "phase"] == [*phases.MULTINODE_PHASES, "stop"]
    yaml_text = (TASKS / "restart_multinode.yml").read_text() + (TASKS / "multinode_step.yml").read_text()
    assert not any(f"_sglang_service_phase: {p}" in yaml_text for p in phases.MULTINODE_PHASES)


def test_loading_the_collections_filters_leaves_the_state_machine_unloaded_until_a_plan_is_asked():
    """Ansible loads every filter file of the collection in each process that templates one of its filters: a
    filter file that imports the state machine at load time makes every playbook pay for it, multi-node or not."""
    names = sorted(p.stem for p in (REPO / "plugins" / "filter").glob("*.py"))
    package = "ansible_collections.sglang.deploy.plugins"
    probe = (
        "import importlib, json, sys\n"
        f"for n in {names!r}: importlib.import_module('{package}.filter.' + n)\n"
        f"print(json.dumps([m for m in sys.modules if m.startswith('{package}.module_utils.sglang_deploy.')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO / "collections"
    )
    loaded = set(json.loads(out.stdout))
    assert "sglang_restart" in names and f"{package}.module_utils.sglang_deploy.render" in loaded
    assert not loaded & {
        f"{package}.module_utils.sglang_deploy.{m}" for m in ("phases", "machine", "recover", "operate")
    }
