"""driver/commands.py: the commands as one table, and the driver's modules importing one another without a cycle."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from driver import commands

DRIVER = Path(commands.__file__).parent


def imports_of(path: Path) -> set[str]:
    """The driver modules `path` imports, at its top or inside a function (a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "driver":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("driver."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("driver.")}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the path that closes it (depth first from each module)."""
    found, done = [], set()

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(name, ())):
            if nxt in path:
                found.append([*path[path.index(nxt) :], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(name)

    for name in sorted(graph):
        visit(name, [name])
    return found


def test_no_module_of_the_driver_imports_one_that_imports_it_back():
    graph = {p.stem: imports_of(p) - {p.stem} for p in DRIVER.glob("*.py")}
    assert graph["tune"] and "cli" not in graph["tune"]  # the graph is read: tune imports commands, not cli
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # the check finds one


@pytest.mark.parametrize("name", sorted(commands.COMMANDS))
def test_each_command_has_its_handler_and_its_playbook(name):
    c = commands.COMMANDS[name]
    module, function = c.handler.split(":")
    assert callable(getattr(importlib.import_module(module), function))
    if c.playbook:
        assert (DRIVER.parent / c.playbook).is_file()
    args = commands.parser().parse_args([name, *(["x.json"] if name == "report" else [])])
    assert args.command == name and commands.handler(name) is getattr(importlib.import_module(module), function)


def test_the_playbooks_view_is_the_commands_that_run_their_playbook_once():
    assert set(commands.PLAYBOOKS) == {n for n, c in commands.COMMANDS.items() if c.handler == commands.RUN_PLAYBOOK}
    assert "tune" not in commands.PLAYBOOKS and commands.COMMANDS["tune"].playbook == commands.TUNE_PLAYBOOK
    assert commands.PLAYBOOKS["restart"] == (
        commands.COMMANDS["restart"].playbook,
        commands.COMMANDS["restart"].summary,
    )
