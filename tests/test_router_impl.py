"""roles/sglang_router serves either gateway (sglang_router_impl): its tables agree with one another, and every call
of the rollout's worker client names the gateway it speaks to. Read as YAML, as Ansible reads the files."""

from __future__ import annotations

import re

import pytest
import yaml

from support import REPO

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
            args = item.get("sglang_router_worker")
            if isinstance(args, dict):
                yield path.relative_to(REPO), args


def walk(tasks):
    for task in tasks if isinstance(tasks, list) else []:
        if isinstance(task, dict):
            yield task
            for key in ("block", "rescue", "always", "tasks"):
                yield from walk(task.get(key))


def test_every_call_of_the_worker_client_names_the_routers_gateway():
    calls = list(worker_calls())
    assert len(calls) >= 13
    missing = [
        f"{path}: {args['action']}"
        for path, args in calls
        if args.get("router_url") and args.get("impl") != "{{ sglang_rollout_router_impl }}"
    ]
    assert missing == []


def test_the_rollout_reads_the_routers_impl_else_the_roles_default():
    text = (REPO / "playbooks" / "vars" / "rollout.yml").read_text()
    rollout = yaml.safe_load(text)
    expr = rollout["sglang_rollout_router_impl"]
    assert "hostvars[sglang_rollout_router].sglang_router_impl" in expr
    assert "roles/sglang_router/defaults/main.yml" in expr and ").sglang_router_impl" in expr
