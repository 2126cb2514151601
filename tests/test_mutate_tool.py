"""tools/mutate.py --ci (make test): which core functions changed since the record, and the build's verdict on
their mutants. mutmut itself is not run here (the subprocess is replaced); its hashing and status table are real."""

from __future__ import annotations

import ast
import importlib
import json
import subprocess
from pathlib import Path

import pytest
from mutmut import configuration

from tools import mutate

CORE = "sglang_deploy/known_good.py"  # the short name (the record's key); mutmut's path and module are the collection's
STAGED = f"ansible_collections/sglang/deploy/plugins/module_utils/{CORE}"
MODULE = "ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good"
SOURCE = '''
def pick(records, live):
    """The newest that is not live."""
    return next((r for r in records if r != live), None)


def keep(n):
    return max(n, 1)
'''


@pytest.fixture
def stage(tmp_path, monkeypatch):
    """A stage with one core file, its record measured on SOURCE; mutmut's config read from the stage. The checkout is
    the collection, by the links the stage makes."""
    (tmp_path / "plugins" / "module_utils" / "sglang_deploy").mkdir(parents=True)
    (tmp_path / "plugins" / "module_utils" / CORE).write_text(SOURCE)
    (tmp_path / "collections" / "ansible_collections" / "sglang").mkdir(parents=True)
    (tmp_path / "collections" / "ansible_collections" / "sglang" / "deploy").symlink_to("../../..")
    mutate.link_collection(tmp_path)
    cfg = f"[mutmut]\nsource_paths =\n    {Path(STAGED).parent}/\n"
    (tmp_path / "setup.cfg").write_text(cfg)
    out = tmp_path / "mutation.json"
    monkeypatch.setattr(mutate, "STAGE", tmp_path)
    monkeypatch.setattr(mutate, "OUT", out)
    monkeypatch.setattr(mutate, "REPO", tmp_path)
    monkeypatch.setattr(mutate, "CORE", [CORE])
    monkeypatch.setattr(mutate, "stage_tree", lambda: None)
    monkeypatch.setattr(mutate, "config", lambda files: cfg)
    monkeypatch.chdir(tmp_path)
    configuration.reset_config()
    from mutmut.mutation.file_mutation import mutate_file_contents

    functions = dict(mutate_file_contents(STAGED, SOURCE).hash_by_function_name)
    record = {"functions": functions, "tree": mutate.tree_hash(CORE), "survivors": []}
    out.write_text(json.dumps({"files": {CORE: record}}))
    yield tmp_path
    configuration.reset_config()


def edit(stage, old: str, new: str) -> None:
    path = stage / STAGED
    path.write_text(path.read_text().replace(old, new))


def test_a_comment_or_a_blank_line_changes_no_function(stage):
    edit(stage, "def keep(n):\n", "# why: a comment\n\ndef keep(n):\n")
    assert mutate.changed_functions(CORE, json.loads(mutate.OUT.read_text())["files"][CORE]) == []


def test_the_changed_function_and_a_new_one_are_named_and_no_other(stage):
    edit(stage, "max(n, 1)", "max(n, 2)")
    edit(stage, "def keep(n):", "def fresh(a):\n    return a + 1\n\n\ndef keep(n):")
    record = json.loads(mutate.OUT.read_text())["files"][CORE]
    assert mutate.changed_functions(CORE, record) == ["x_fresh", "x_keep"]


def test_a_file_without_a_record_is_changed_in_every_function(stage):
    assert mutate.changed_functions(CORE, {}) == ["x_keep", "x_pick"]


def test_nothing_changed_runs_no_mutant_and_passes(stage, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("mutmut run with nothing changed"))
    assert mutate.ci(600, 2) == 0
    assert "no function of the 1 recorded core files changed" in capsys.readouterr().out


def test_a_core_file_without_a_record_is_said_and_not_run(stage, monkeypatch, capsys):
    mutate.OUT.write_text(json.dumps({"files": {}}))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("mutmut run on a file never measured"))
    assert mutate.ci(600, 2) == 0
    assert f"{CORE} not gated: it has no record" in capsys.readouterr().out


class FakeMutmut:
    """`mutmut run` replaced: records its argv and leaves the meta a run would (exit codes by mutant)."""

    def __init__(self, stage, codes: dict[str, int | None]):
        self.stage, self.codes, self.argv = stage, codes, None

    def __call__(self, argv, **kw):
        self.argv = argv
        meta = self.stage / "mutants" / f"{STAGED}.meta"
        meta.parent.mkdir(parents=True, exist_ok=True)
        keys = {f"{MODULE}.{name}": code for name, code in self.codes.items()}
        from mutmut.mutation.file_mutation import mutate_file_contents  # the mutated copy, as mutmut writes it

        meta.with_suffix("").write_text(mutate_file_contents(STAGED, (self.stage / STAGED).read_text()).code)
        meta.write_text(json.dumps({"exit_code_by_key": keys, "hash_by_function_name": {}}))
        return self

    pid = 4242
    waits = 0
    stubborn = 0  # how many waits time out before it ends
    code = 0

    def wait(self, timeout=None):
        self.waits += 1
        if self.waits <= self.stubborn:
            raise subprocess.TimeoutExpired("mutmut", timeout)
        return self.code


@pytest.mark.parametrize(
    ("recorded", "codes", "verdict"),
    [
        ([], {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 1, "x_pick__mutmut_1": 0}, 0),  # x_pick's is not new
        ([], {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 0}, 1),  # a survivor the record has not
        ([], {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 33}, 1),  # no test reaches it
        ([], {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": None}, 1),  # not tested: measured by make mutate, or fails
        (["x_keep__mutmut_7"], {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 0}, 0),  # as many as recorded
        (["x_keep__mutmut_7"], {"x_keep__mutmut_1": 0, "x_keep__mutmut_2": 0}, 1),  # one more
        (["x_pick__mutmut_3"], {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 0}, 1),  # another function's
        ({"no_test_names": ["x_keep__mutmut_4"]}, {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 33}, 0),
        ({"equivalents": {"x_keep__mutmut_4": "why"}}, {"x_keep__mutmut_1": 1, "x_keep__mutmut_2": 0}, 0),
    ],
)
def test_only_the_changed_functions_mutants_are_run_and_judged_against_the_record(
    stage, monkeypatch, recorded, codes, verdict
):
    doc = json.loads(mutate.OUT.read_text())
    doc["files"][CORE].update(recorded if isinstance(recorded, dict) else {"survivors": recorded})
    mutate.OUT.write_text(json.dumps(doc))
    edit(stage, "max(n, 1)", "max(n, 2)")
    fake = FakeMutmut(stage, codes)
    monkeypatch.setattr(subprocess, "Popen", fake)
    assert mutate.ci(600, 2) == verdict
    assert fake.argv[-1:] == [f"{MODULE}.x_keep__mutmut_*"]  # the name the tests import the module by
    assert fake.argv[1:4] == ["run", "--max-children", "2"]


def test_the_core_list_and_the_scope_agree():
    assert set(mutate.CORE) <= set(mutate.SCOPE)


def mutated_copy(tmp_path, monkeypatch, module: str, source: str):
    """mutmut's mutated copy of `source` as sglang_deploy/<module>.py in a stage at tmp_path; its functions."""
    from mutmut.mutation.file_mutation import mutate_file_contents

    staged = Path(mutate.staged(f"sglang_deploy/{module}.py"))
    (tmp_path / "mutants" / staged.parent).mkdir(parents=True)
    (tmp_path / "setup.cfg").write_text(f"[mutmut]\nsource_paths =\n    {staged.parent}/\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mutate, "STAGE", tmp_path)
    configuration.reset_config()
    mutated = mutate_file_contents(str(staged), source)
    (tmp_path / "mutants" / staged).write_text(mutated.code)
    configuration.reset_config()
    return mutated, mutate._functions(f"sglang_deploy/{module}.py")


def test_a_change_of_a_messages_wording_alone_is_told_apart_from_a_change_of_a_key_or_a_value(tmp_path, monkeypatch):
    source = 'def say(n):\n    return f"{n}" + "the generation was kept"\n\n\ndef key():\n    return {"name": None}\n'
    mutated, functions = mutated_copy(tmp_path, monkeypatch, "x", source)
    says = [n for n in mutated.mutant_names if n.startswith("x_say__")]
    keys = [n for n in mutated.mutant_names if n.startswith("x_key__")]
    assert says and keys
    # "XXthe generation was keptXX" and "THE GENERATION WAS KEPT" are wording; "+" made "-" is not
    assert sum(mutate.prose_only(functions, n) for n in says) == 2 < len(says)
    assert not any(mutate.prose_only(functions, n) for n in keys)  # "XXnameXX": a key a program reads
    assert not mutate.prose_only(functions, "x_gone__mutmut_1")


@pytest.mark.parametrize(("stubborn", "signals"), [(1, ["SIGINT"]), (2, ["SIGINT", "SIGKILL"])])
def test_past_its_budget_mutmut_is_interrupted_and_what_ran_is_judged(stage, monkeypatch, stubborn, signals):
    edit(stage, "max(n, 1)", "max(n, 2)")
    fake = FakeMutmut(stage, {"x_keep__mutmut_1": 0, "x_keep__mutmut_2": None})
    fake.stubborn = stubborn
    sent = []
    monkeypatch.setattr(subprocess, "Popen", fake)
    monkeypatch.setattr(mutate.os, "killpg", lambda pid, sig: sent.append((pid, sig.name)))
    assert mutate.ci(5, 2) == 1  # the survivor it reached in time fails the build
    assert sent == [(4242, name) for name in signals]


def test_mutmut_failing_fails_the_build_whatever_its_meta_says(stage, monkeypatch, capsys):
    edit(stage, "max(n, 1)", "max(n, 2)")
    fake = FakeMutmut(stage, {"x_keep__mutmut_1": 1})
    fake.code = 1  # "Failed to run clean test"
    monkeypatch.setattr(subprocess, "Popen", fake)
    assert mutate.ci(600, 2) == 1 and "mutmut failed (exit 1)" in capsys.readouterr().err


def test_a_core_file_gone_fails_the_build_naming_it(stage, capsys):
    (stage / "plugins" / "module_utils" / CORE).unlink()
    assert mutate.ci(600, 2) == 1 and f"core file(s) gone: {CORE}" in capsys.readouterr().err


def test_a_run_removes_the_copies_mutmut_would_take_for_already_mutated(stage):
    copy = stage / "mutants" / STAGED
    copy.parent.mkdir(parents=True)
    copy.write_text(SOURCE)  # left unmutated by a run that did not mutate this file, newer than its source
    mutate.fresh_copies([CORE])
    assert not copy.exists()


def test_a_string_the_code_compares_matches_or_looks_up_is_not_wording(tmp_path, monkeypatch):
    source = (
        "def f(text, d):\n"
        '    if "couldn\'t communicate" in text or text == "auto restart" or text.startswith("a b"):\n'
        '        return d["a key"], d.get("b key"), {"c key": 1}\n'
        '    raise ValueError("the driver is not loaded")\n'
    )
    mutated, functions = mutated_copy(tmp_path, monkeypatch, "y", source)
    wording = [n for n in mutated.mutant_names if mutate.prose_only(functions, n)]
    # the message's two rewordings, and nothing the code compares, looks up or matches
    said = sorted(
        next(m for m in ("XXthe driver is not loadedXX", "THE DRIVER IS NOT LOADED") if m in ast.unparse(functions[n]))
        for n in wording
    )
    assert said == ["THE DRIVER IS NOT LOADED", "XXthe driver is not loadedXX"]


def test_a_rewording_of_one_part_of_an_implicitly_concatenated_message_is_wording(tmp_path, monkeypatch):
    """Python joins "a b " "c d" into one constant; mutmut mutates one part: still a message's wording."""
    source = (
        "def say(n):\n"
        '    return f"{n}: " "the generation was put back; " "systemd starts it after this refused start"\n\n\n'
        "def flag():\n"
        '    return "--tp-size" "=8"\n'
    )
    mutated, functions = mutated_copy(tmp_path, monkeypatch, "z", source)
    says = [n for n in mutated.mutant_names if n.startswith("x_say__")]
    flags = [n for n in mutated.mutant_names if n.startswith("x_flag__")]
    assert says and flags
    assert all(mutate.prose_only(functions, n) for n in says)  # each part wrapped, or its case changed
    assert not any(mutate.prose_only(functions, n) for n in flags)  # no space: a value a program reads


@pytest.mark.parametrize(
    ("was", "now", "wording"),
    [
        ("a b; c d", "XXa b; c dXX", True),
        ("a b; c d", "a b; XXc dXX", True),
        ("a b; c d", "a b; C D", True),
        ("a b; c d", "a b; c e", False),  # another letter, not a case
        ("a b; c d", "aXX b;XX c d", False),  # wrapped around a part without a space of its own
        ("ab", "XXabXX", False),
        ("ab", "AB", False),
        ("a b", "XXa bX", False),
    ],
)
def test_reworded_is_one_part_wrapped_in_xx_or_its_case_changed(was, now, wording):
    assert mutate.reworded(was, now) is wording


def test_each_file_is_mutated_under_the_name_the_tests_import_it_by():
    """mutmut names a mutant after its file's path and runs it only in the module of that name: the collection's."""
    assert mutate.staged(CORE) == STAGED and mutate.module(CORE) == MODULE
    filter_module = "ansible_collections.sglang.deploy.plugins.filter.sglang_config"
    assert mutate.module("plugins/filter/sglang_config.py") == filter_module
    assert mutate.module("driver/ledger.py") == "driver.ledger"
    assert mutate.stage_name("sglang_deploy.known_good.x_keep__mutmut_*") == f"{MODULE}.x_keep__mutmut_*"
    assert mutate.stage_name("driver.ledger.x_a__mutmut_1") == "driver.ledger.x_a__mutmut_1"
    for rel in mutate.SCOPE:
        imported = importlib.import_module(mutate.module(rel))
        assert Path(imported.__file__).resolve() == (mutate.REPO / mutate.source(rel)).resolve(), rel


def test_mutmut_copies_no_link_and_no_source_file(monkeypatch):
    """mutmut's copies follow links: collections/'s onto the checkout would copy the stage into itself."""
    links = ["collections/ansible_collections/sglang/deploy", "playbooks/group_vars", ".venv"]
    files = [
        *links, "README.md", "driver/cli.py", "plugins/action/a.py", "plugins/filter/sglang_config.py",
        "plugins/module_utils/sglang_deploy/stage.py", "plugins/modules/m.py", "playbooks/deploy.yml",
        "playbooks/vars/x.yml", "tests/test_a.py",
    ]  # fmt: skip
    monkeypatch.setattr(mutate, "tracked", lambda: files)
    monkeypatch.setattr(mutate, "links", lambda: links)
    assert mutate.copied() == [
        "README.md", "playbooks/deploy.yml", "playbooks/vars", "plugins/action", "plugins/modules", "tests"
    ]  # fmt: skip
