"""Each role's entry points as Ansible sees them (meta/argument_specs.yml): every `tasks_from` a playbook or a role
names has its entry, and every internal variable an entry point of roles/sglang_service reads that a playbook or
another entry point sets is declared there, "Internal only" (prometheus-community's `_common` role's rule), so that
the boundary between the playbooks and the role is written down where Ansible checks it."""

from __future__ import annotations

import re

import pytest
import yaml

from support import REPO

ROLES = REPO / "roles"
SERVICE = ROLES / "sglang_service"
INTERNAL = re.compile(r"\b(_sglang_[a-z0-9_]+)")


def specs(role: str) -> dict:
    return yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]


def included_from(node) -> list[tuple[str, str]]:
    """(role, tasks_from) of each include_role/import_role in a parsed playbook or task file, at any depth."""
    found = []
    if isinstance(node, dict):
        for key in ("ansible.builtin.include_role", "ansible.builtin.import_role"):
            args = node.get(key)
            if isinstance(args, dict) and "tasks_from" in args:
                found.append((args["name"].removeprefix("sglang.deploy."), args["tasks_from"]))
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            found += included_from(item)
    return found


def reach(name: str, seen: list[str] | None = None) -> list[str]:
    """The task files of sglang_service an entry point runs: its own and those it includes, transitively."""
    seen = [] if seen is None else seen
    path = SERVICE / "tasks" / f"{name}.yml"
    if name not in seen and path.exists():
        seen.append(name)
        for other in re.findall(r"(?:include_tasks|import_tasks):\s*([a-z_]+)\.yml", path.read_text()):
            reach(other, seen)
    return seen


def set_in(text: str) -> set[str]:
    """The internal variables a text sets: as vars or set_fact keys, registered, or as a loop variable."""
    found = set(re.findall(r"^\s*(_sglang_[a-z0-9_]+):", text, re.M))
    return found | set(re.findall(r"(?:register|loop_var):\s*(_sglang_[a-z0-9_]+)", text))


def crossing(entry: str, entries: list[str]) -> set[str]:
    """The internal variables `entry` reads and does not set itself that a playbook or another entry point sets."""
    files = reach(entry)
    text = "".join((SERVICE / "tasks" / f"{f}.yml").read_text() for f in files)
    outside = "".join(p.read_text() for p in (REPO / "playbooks").rglob("*.yml"))
    outside += "".join((SERVICE / "tasks" / f"{e}.yml").read_text() for e in entries if e not in files)
    role_own = {
        *yaml.safe_load((SERVICE / "defaults" / "main.yml").read_text()),
        *yaml.safe_load((SERVICE / "vars" / "main.yml").read_text()),
    }
    return (set(INTERNAL.findall(text)) - set_in(text) - role_own) & set_in(outside)


def test_every_tasks_from_a_playbook_or_a_role_names_is_an_entry_point_of_that_role():
    named = set()
    for path in [*(REPO / "playbooks").rglob("*.yml"), *ROLES.rglob("tasks/*.yml")]:
        named |= set(included_from(yaml.safe_load(path.read_text())))
    assert ("sglang_service", "restart") in named and ("sglang", "preflight") in named  # the scan reads them
    missing = sorted(f"{role}: {entry}" for role, entry in named if entry not in specs(role))
    assert missing == []


ENTRIES = list(specs("sglang_service"))


@pytest.mark.parametrize("entry", ENTRIES)
def test_each_entry_point_declares_the_internal_variables_that_cross_into_it(entry):
    options = specs("sglang_service")[entry].get("options") or {}
    assert sorted(crossing(entry, ENTRIES) - set(options)) == []
    for name, option in options.items():
        if name.startswith("_"):
            assert str(option["description"]).startswith("Internal only"), name


def test_the_check_finds_a_variable_set_by_a_playbook():
    assert "_sglang_service_validate_in_restart" in crossing("restart", ENTRIES)
    assert "_sglang_service_instances" in crossing("stage", ENTRIES)  # set by the render entry point
