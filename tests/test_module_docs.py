"""Each module's DOCUMENTATION, EXAMPLES and RETURN (issue #33): YAML that parses, and every option of its argument
spec documented as the spec has it (type, elements, default, choices, required, suboptions), nothing more. The same
for each filter: its sidecar plugins/filter/NAME.yml documents `_input` and every argument of the function
FilterModule().filters() maps it to (positional order, required, default), nothing more.

The quick half of tools/sanity.py (ansible-test's validate-modules and ansible-doc, in make lint-only), run with the
unit tests: a description dropped or a default changed on one side only fails here first.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import COLLECTIONS, REPO, env_with_pythonpath

LIBRARY = sorted((REPO / "plugins" / "modules").glob("*.py"))
NAMES = {p.stem for p in LIBRARY}
FQCN = "sglang.deploy"

# Each module's argument spec as its main() passes it to AnsibleModule: main() runs with AnsibleModule replaced by a
# recorder that stops it there (before any parameter is read), so a spec built inline needs no refactoring. In a
# subprocess (never in the test process: main() is run), with collections/ on its PYTHONPATH for the package.
CAPTURE = r"""
import json, runpy, sys


class Captured(Exception):
    pass


def record(*args, **kwargs):
    raise Captured(args[0] if args else kwargs["argument_spec"])


specs = {}
for path in sys.argv[1:]:
    main = runpy.run_path(path, run_name="module_docs_capture")["main"]
    main.__globals__["AnsibleModule"] = record
    try:
        main()
    except Captured as exc:
        specs[path] = exc.args[0]
print(json.dumps(specs))
"""


@pytest.fixture(scope="module")
def specs() -> dict[str, dict]:
    proc = subprocess.run(
        [sys.executable, "-c", CAPTURE, *map(str, LIBRARY)],
        env=env_with_pythonpath(dict(os.environ), COLLECTIONS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return {Path(k).stem: v for k, v in json.loads(proc.stdout).items()}


def docs(path: Path) -> dict[str, object]:
    """DOCUMENTATION, EXAMPLES and RETURN parsed, read from the file as Ansible reads them (never imported)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("DOCUMENTATION", "EXAMPLES", "RETURN"):
                out[name] = yaml.safe_load(node.value.value)
    return out


def same(want: object, got: object) -> bool:
    """Equal, and no bool standing for a number (YAML's 1 is not true; 60 and 60.0 are the same default)."""
    return want == got and isinstance(want, bool) == isinstance(got, bool)


def mismatches(options: dict, spec: dict, where: str = "") -> list[str]:
    """Every difference between documented options and an argument spec, one line each, suboptions included."""
    out = [f"{where}{n}: in the argument spec, not documented" for n in sorted(set(spec) - set(options))]
    out += [f"{where}{n}: documented, not in the argument spec" for n in sorted(set(options) - set(spec))]
    for name in sorted(set(spec) & set(options)):
        s, d, at = spec[name], options[name] or {}, f"{where}{name}"
        if not d.get("description"):
            out.append(f"{at}: no description")
        if d.get("type") != s.get("type", "str"):
            out.append(f"{at}: type {s.get('type', 'str')!r} in the spec, {d.get('type')!r} documented")
        for key, absent in (("elements", None), ("default", None), ("choices", None), ("required", False)):
            if not same(s.get(key, absent), d.get(key, absent)):
                out.append(f"{at}: {key} {s.get(key, absent)!r} in the spec, {d.get(key, absent)!r} documented")
        if "options" in s or "suboptions" in d:
            out += mismatches(d.get("suboptions") or {}, s.get("options") or {}, f"{at}.")
    return out


def undescribed(returns: dict, top: bool = True, where: str = "") -> list[str]:
    """Return values without a description, a type, or (at the top) a `returned`."""
    out = []
    for name, value in (returns or {}).items():
        keys = ("description", "type", "returned") if top else ("description", "type")
        out += [f"{where}{name}: no {k}" for k in keys if not (value or {}).get(k)]
        out += undescribed((value or {}).get("contains") or {}, False, f"{where}{name}.")
    return out


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.stem)
def test_the_documentation_names_the_module_and_documents_its_argument_spec_exactly(path, specs):
    doc = docs(path)["DOCUMENTATION"]
    assert doc["module"] == path.stem
    assert doc.get("short_description") and doc.get("description") and doc.get("author")
    assert mismatches(doc.get("options") or {}, specs[path.stem]) == []


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.stem)
def test_every_return_value_is_described_with_its_type_and_when(path):
    returns = docs(path)["RETURN"]
    assert returns, "RETURN is empty"
    assert undescribed(returns) == []


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: p.stem)
def test_the_examples_are_named_tasks_calling_the_module_by_its_collection_name(path):
    tasks = docs(path)["EXAMPLES"]
    assert isinstance(tasks, list) and tasks
    for task in tasks:
        assert task.get("name"), task
        # Our modules only by their fully qualified names: the project is the collection sglang.deploy.
        assert not NAMES & set(task), f"a short module name in {task['name']!r}"
    assert any(f"{FQCN}.{path.stem}" in task for task in tasks), f"no example calls {FQCN}.{path.stem}"


def test_the_comparison_finds_each_kind_of_difference():
    spec = {
        "a": {"type": "int", "default": 1},
        "b": {"type": "bool", "default": False},
        "c": {"type": "dict", "options": {"x": {"type": "str", "required": True}}},
        "d": {"type": "str"},
    }
    doc = {
        "a": {"description": "A.", "type": "int", "default": 2},
        "b": {"description": "B.", "type": "bool", "default": 0},
        "c": {"description": "C.", "type": "dict", "suboptions": {"x": {"type": "str"}}},
        "e": {"description": "E.", "type": "str"},
    }
    assert mismatches(doc, spec) == [
        "d: in the argument spec, not documented",
        "e: documented, not in the argument spec",
        "a: default 1 in the spec, 2 documented",
        "b: default False in the spec, 0 documented",
        "c.x: no description",
        "c.x: required True in the spec, False documented",
    ]
    assert undescribed({"k": {"description": "K.", "type": "dict", "contains": {"y": {"type": "str"}}}}) == [
        "k: no returned",
        "k.y: no description",
    ]


# ------------------------------------------------------------------ the filters' sidecar documentation

# Every filter of every filter plugin (plugins/filter/*.py), by name, as Ansible loads them.
FILTERS = {
    name: fn
    for src in sorted((REPO / "plugins" / "filter").glob("*.py"))
    for name, fn in importlib.import_module(f"ansible_collections.sglang.deploy.plugins.filter.{src.stem}")
    .FilterModule()
    .filters()
    .items()
}
SIDECARS = sorted((REPO / "plugins" / "filter").glob("*.yml"))


def function_of(fn):
    """The function a filter calls: the one a (*args, **kwargs) wrapper (sglang_config's _filter_error) closes over."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        (inner,) = [v for v in inspect.getclosurevars(fn).nonlocals.values() if inspect.isfunction(v)]
        return function_of(inner)
    return fn


def filter_mismatches(doc: dict, fn) -> list[str]:
    """Every difference between a filter's documented `positional` and options and its function's parameters: the
    first parameter is `_input`, the rest are named as in Python, in order; required when Python has no default,
    else the default documented (none for a None default)."""
    params = list(inspect.signature(function_of(fn)).parameters.values())
    names = ["_input", *(p.name for p in params[1:])]
    options = doc.get("options") or {}
    positional = [n.strip() for n in str(doc.get("positional") or "").split(",") if n.strip()]
    out = [] if positional == names else [f"positional {positional} documented, {names} in the function"]
    out += [f"{n}: a parameter, not documented" for n in names if n not in options]
    out += [f"{n}: documented, not a parameter" for n in options if n not in names]
    for name, param in zip(names, params, strict=True):
        d = options.get(name) or {}
        if name not in options:
            continue
        if not d.get("description") or not d.get("type"):
            out.append(f"{name}: no description or no type")
        required = param.default is inspect.Parameter.empty
        if bool(d.get("required", False)) != required:
            out.append(f"{name}: required {required} in the function, {d.get('required', False)!r} documented")
        default = None if required else param.default
        if not same(default, d.get("default")):
            out.append(f"{name}: default {default!r} in the function, {d.get('default')!r} documented")
    return out


def test_every_filter_has_its_sidecar_documentation_and_every_sidecar_a_filter():
    assert sorted(p.stem for p in SIDECARS) == sorted(FILTERS)


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_the_filters_documentation_names_it_and_documents_its_functions_parameters_exactly(name):
    doc = yaml.safe_load((REPO / "plugins" / "filter" / f"{name}.yml").read_text())
    assert set(doc) == {"DOCUMENTATION", "EXAMPLES", "RETURN"}
    d = doc["DOCUMENTATION"]
    assert d["name"] == name and str(d["version_added"]) == "0.1.0"
    assert d.get("short_description") and d.get("description") and d.get("author")
    assert filter_mismatches(d, FILTERS[name]) == []
    returns = doc["RETURN"]
    assert set(returns) == {"_value"} and returns["_value"].get("description") and returns["_value"].get("type")
    assert undescribed(returns["_value"].get("contains") or {}, False) == []
    assert f"sglang.deploy.{name}" in doc["EXAMPLES"], f"no example calls sglang.deploy.{name}"


def test_the_filter_comparison_finds_each_kind_of_difference():
    def f(instance, a, b=None, c="x", d=0):
        pass

    def wrapped(*args, **kwargs):
        return f(*args, **kwargs)

    doc = {
        "positional": "_input, a, c, b",
        "options": {
            "_input": {"description": "I.", "type": "dict", "required": True},
            "a": {"description": "A.", "type": "str"},
            "b": {"description": "B.", "type": "dict", "default": {}},
            "c": {"type": "str", "default": "x"},
            "e": {"description": "E.", "type": "str"},
        },
    }
    assert filter_mismatches(doc, wrapped) == [
        "positional ['_input', 'a', 'c', 'b'] documented, ['_input', 'a', 'b', 'c', 'd'] in the function",
        "d: a parameter, not documented",
        "e: documented, not a parameter",
        "a: required True in the function, False documented",
        "b: default None in the function, {} documented",
        "c: no description or no type",
    ]
