"""roles/sglang_router serves either gateway (sglang_router_impl): its tables agree with one another, and every call
of the rollout's worker client names the gateway it speaks to. Read as YAML, as Ansible reads the files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import REPO, local_play
from support.fake_gateway import closed_port

ROLE = REPO / "roles" / "sglang_router"
VARS = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
DEFAULTS = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
SPECS = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
GATEWAYS = VARS["_sglang_router_gateways"]
LINE = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)==(?P<version>\S+) --hash=sha256:[0-9a-f]{64}$")


def test_the_impl_choices_are_the_gateways_and_the_default_is_smg():
    assert set(SPECS["sglang_router_impl"]["choices"]) == set(GATEWAYS) == {"smg", "sglang-router"}
    assert DEFAULTS["sglang_router_impl"] == SPECS["sglang_router_impl"]["default"] == "smg"


@pytest.mark.parametrize("impl", sorted(GATEWAYS))
def test_each_gateways_pinned_release_has_a_hashed_complete_lock_and_its_policies(impl):
    gateway = GATEWAYS[impl]
    lock = VARS["_sglang_router_locks"][impl][gateway["version"]]
    parsed = [LINE.match(line) for line in lock]
    assert all(parsed), [line for line in lock if not LINE.match(line)]
    names = [m["name"].lower().replace("_", "-") for m in parsed]
    assert len(names) == len(set(names)), "one line per package"
    assert f"{gateway['package']}=={gateway['version']}" in [f"{m['name']}=={m['version']}" for m in parsed]
    assert set(VARS["_sglang_router_policies"][impl]) == set(VARS["_sglang_router_locks"][impl])
    assert "round_robin" in VARS["_sglang_router_policies"][impl][gateway["version"]]  # the role's default policy


def test_the_gateways_keep_their_own_virtualenvs():
    venvs = [g["venv"] for g in GATEWAYS.values()]
    assert len(set(venvs)) == len(venvs)
    assert GATEWAYS["sglang-router"]["venv"] == "/opt/sglang-router"  # where fleets have it
    assert {g["module"] for g in GATEWAYS.values()} == {"smg", "sglang_router"}  # the launcher's MODULES


@pytest.mark.parametrize("key", sorted({k for g in GATEWAYS.values() for k in g["settings"]}))
def test_a_gateways_own_setting_is_a_variable_that_defaults_to_null(key):
    """Null: the role's value for the gateway that has it, and nothing the preflight refuses for the other."""
    assert DEFAULTS[f"sglang_router_{key}"] is None
    spec = SPECS[f"sglang_router_{key}"]
    assert "default" not in spec
    owners = [impl for impl, g in GATEWAYS.items() if key in g["settings"]]
    assert all(f"{impl} only" in " ".join(spec["description"]) for impl in owners)


def worker_calls():
    """Every sglang_router_worker task of the roles and playbooks: (file, its arguments)."""
    for path in sorted([*REPO.glob("roles/*/tasks/*.yml"), *REPO.glob("playbooks/*.yml")]):
        for item in walk(yaml.safe_load(path.read_text()) or []):
            args = item.get("sglang.deploy.sglang_router_worker")
            if isinstance(args, dict):
                yield path.relative_to(REPO), args


def walk(tasks):
    for task in tasks if isinstance(tasks, list) else []:
        if isinstance(task, dict):
            yield task
            for key in ("block", "rescue", "always", "tasks"):
                yield from walk(task.get(key))


def quorum_of(path: str, action: str, reports: set) -> object:
    """The quorum a call must pass: none for view (it reads every gateway and never fails on one), 1 for a report's
    reading, else the rollout's."""
    return None if action == "view" else 1 if (path, action) in reports else "{{ sglang_rollout_gateway_quorum }}"


def test_every_call_of_the_worker_client_speaks_to_every_gateway_with_the_quorum():
    calls = list(worker_calls())
    assert len(calls) >= 13
    # measure speaks to a worker only; every other call names the gateways (drain: for their in-flight counts)
    # the run's closing report reads every gateway that answers (quorum 1): it says, it decides nothing
    reports = {("playbooks/rollout.yml", "inspect")}
    wrong = [
        f"{path}: {args['action']}"
        for path, args in calls
        if args["action"] != "measure"
        and (
            args.get("routers") != "{{ sglang_rollout_routers }}"
            or args.get("quorum") != quorum_of(str(path), args["action"], reports)
            or {"router_url", "impl", "api_key"} & set(args)
        )
    ]
    assert wrong == []


PLAY = """
- hosts: r1
  gather_facts: false
  vars_files: ["%(repo)s/playbooks/vars/rollout.yml"]
  tasks:
    - ansible.builtin.copy:
        content: "{{ {'routers': sglang_rollout_routers, 'quorum': sglang_rollout_gateway_quorum | int,
                      'on': sglang_rollout_router, 'become': _sglang_rollout_gateway_become | bool,
                      'far': _sglang_rollout_far_files} | to_json }}"
        dest: "%(out)s"
      delegate_to: localhost
"""


def rendered(tmp_path, routers: dict, extra: tuple = ()) -> dict:
    """playbooks/vars/rollout.yml's gateways as Ansible renders them for an inventory whose sglang_routers are
    `routers` (host -> variables); its playbook_dir made the repository's playbooks/ (the role default's lookup)."""
    return local_play(tmp_path, {"children": {"sglang_routers": {"hosts": routers}}}, PLAY, *extra)


def test_the_rollout_reaches_each_gateway_with_its_own_impl_address_and_key(tmp_path):
    out = rendered(
        tmp_path,
        {
            # the role's default impl; its workers in smg's discovery file (edited where the rollout's gateway steps run)
            "r1": {"sglang_router_port": 30100, "sglang_router_api_key": "k1", "sglang_router_discovery": "file"},
            "r2": {
                "sglang_router_impl": "sglang-router",
                "sglang_router_address": "10.0.0.2",
                "sglang_router_port": 30200,
                "sglang_router_prometheus_port": 29200,
            },
            "r3": {"sglang_router_impl": "smg", "sglang_router_address": "fd00::3", "sglang_router_api_key": "k3"},
            "r5": {"ansible_host": "127.0.0.1"},  # the controller's way in (a tunnel): not how r1 reaches r5
            "r4": {"sglang_router_host": "10.0.0.4"},  # listening on one address: that one, from anywhere
        },
        ("-e", "sglang_service_api_key=fleet"),
    )
    assert out["on"] == "r1" and out["quorum"] == 5
    assert out["become"] is True and out["far"] == []  # r1's file is edited as root, on r1
    smg = DEFAULTS["sglang_router_impl"]
    file = DEFAULTS["sglang_router_discovery_file"]
    assert out["routers"] == [
        {"name": "r1", "impl": smg, "url": "http://127.0.0.1:30100", "metrics_url": "http://127.0.0.1:29000", "api_key": "k1", "discovery_file": file},
        {"name": "r2", "impl": "sglang-router", "url": "http://10.0.0.2:30200", "metrics_url": "http://10.0.0.2:29200", "api_key": "fleet", "discovery_file": None},
        {"name": "r3", "impl": "smg", "url": "http://[fd00::3]:30000", "metrics_url": "http://[fd00::3]:29000", "api_key": "k3", "discovery_file": None},
        {"name": "r4", "impl": smg, "url": "http://10.0.0.4:30000", "metrics_url": "http://r4:29000", "api_key": "fleet", "discovery_file": None},
        {"name": "r5", "impl": smg, "url": "http://r5:30000", "metrics_url": "http://r5:29000", "api_key": "fleet", "discovery_file": None},
    ]  # fmt: skip
    assert DEFAULTS["sglang_router_impl"] == "smg"
    # what the role's entry points accept for each gateway (their argument specs): every key rendered
    specs = yaml.safe_load((REPO / "roles" / "sglang_service" / "meta" / "argument_specs.yml").read_text())
    accepted = specs["argument_specs"]["rollout_replica"]["options"]["sglang_rollout_routers"]["options"]
    assert {k for r in out["routers"] for k in r} == set(accepted)


def test_the_quorum_is_the_operators_when_given(tmp_path):
    out = rendered(tmp_path, {"r1": {}, "r2": {}}, ("-e", "sglang_rollout_gateway_quorum=1"))
    assert out["quorum"] == 1 and [r["url"] for r in out["routers"]] == ["http://127.0.0.1:30000", "http://r2:30000"]


def gateway_view(tmp_path, routers: dict) -> tuple[subprocess.CompletedProcess, list]:
    """playbooks/status.yml's gateway play alone (the first needs a systemd host), over one local node serving
    nothing and `routers` (host -> variables): its run, and the view it kept (sglang_gateway_view)."""
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    node = {**local, "sglang_instances": [{"name": "ro", "port": 30010}], "sglang_router_worker_host": "127.0.0.1"}
    inventory = {"all": {"children": {"sglang_nodes": {"hosts": {"n1": node}}}}}
    if routers:
        inventory["all"]["children"]["sglang_routers"] = {"hosts": {h: {**local, **v} for h, v in routers.items()}}
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "vars").symlink_to(REPO / "playbooks" / "vars")
    (tmp_path / "roles").symlink_to(REPO / "roles")
    play = yaml.safe_load((REPO / "playbooks" / "status.yml").read_text())[1]
    play["tasks"].append(
        {"ansible.builtin.copy": {"content": "{{ sglang_gateway_view | default([]) | to_json }}", "dest": str(tmp_path / "view.json")},
         "delegate_to": "localhost"}
    )  # fmt: skip
    (tmp_path / "playbooks" / "view.yml").write_text(yaml.safe_dump([play], sort_keys=False))
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml")]
    proc = subprocess.run(
        [*argv, str(tmp_path / "playbooks" / "view.yml")], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    view = json.loads((tmp_path / "view.json").read_text()) if (tmp_path / "view.json").exists() else None
    return proc, view


def test_status_without_gateways_reads_none_and_fails_nothing(tmp_path):
    proc, view = gateway_view(tmp_path, {})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert view == []


def test_status_says_a_gateway_that_does_not_answer_for_each_instance(tmp_path):
    port = closed_port()
    proc, view = gateway_view(tmp_path, {"r1": {"sglang_router_port": port, "sglang_router_prometheus_port": port}})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert [(r["host"], r["instance"], r["gateway"], r["worker"], r["listed"]) for r in view] == [
        ("n1", "ro", "r1", "http://127.0.0.1:30010", None)
    ]
    assert view[0]["why"].startswith("the gateway did not answer: ")


def test_a_discovery_file_the_rollout_cannot_reach_is_named_and_without_one_nothing_becomes_root(tmp_path):
    out = rendered(tmp_path, {"r1": {}, "r3": {"sglang_router_impl": "smg", "sglang_router_discovery": "file"}})
    assert out["far"] == ["r3"] and out["become"] is True  # refused by the plan (playbooks/rollout.yml)
    (tmp_path / "api").mkdir()
    out = rendered(tmp_path / "api", {"r1": {}, "r3": {"sglang_router_impl": "smg"}})
    assert out["far"] == [] and out["become"] is False
