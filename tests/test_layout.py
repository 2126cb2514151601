"""The layout #10 asks for, kept: thin modules over module_utils, no Ansible in the logic, names defined once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from sglang_deploy import outcomes

REPO = Path(__file__).resolve().parents[1]
LIBRARY = sorted((REPO / "library").glob("*.py"))
LOGIC = sorted((REPO / "module_utils" / "sglang_deploy").glob("*.py"))


def test_every_module_in_library_is_a_thin_adapter_of_at_most_250_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in LIBRARY}
    assert sizes and all(n <= 250 for n in sizes.values()), sizes


def test_the_logic_imports_no_ansible_so_it_is_tested_and_shipped_without_it():
    for path in LOGIC:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            )
            assert not any(n.split(".")[0] == "ansible" for n in names), f"{path.name} imports {names}"


def test_outcome_names_are_spelled_once_in_the_modules_and_the_state_machine():
    """The modules and the state machine use outcomes.X, never the string: one source of truth."""
    words = sorted(outcomes.ALL, key=len, reverse=True)
    # A quoted outcome used as a value: not a dict key ("stopped": ...) nor a subscript (res["stopped"]).
    quoted = re.compile(r"""(?<!\[)["'](%s)["'](?!\s*[\]:])""" % "|".join(map(re.escape, words)))
    for path in [*LIBRARY, *(p for p in LOGIC if p.name != "outcomes.py")]:
        hits = [m.group(0) for m in quoted.finditer(path.read_text())]
        assert not hits, f"{path.relative_to(REPO)} spells outcomes as strings: {hits}"
