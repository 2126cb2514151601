"""Software generations (plugins/module_utils/sglang_deploy/software.py, plugins/modules/sglang_generations.py).

Pruning, references and migration on temporary directories; the generation id the sglang role
computes on the controller (its Jinja, rendered by Ansible's own templar) against the Python one;
the module run as Ansible runs it (an args file). molecule/stack checks the real thing on a node.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import software
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.software import (
    generation_id,
    lock_sha256,
    patch_series_sha256,
    plan,
    prune,
)
from support import COLLECTIONS, code_lines, env_with_pythonpath, trusted

REPO = Path(__file__).resolve().parents[1]

MODULE = REPO / "plugins" / "modules" / "sglang_generations.py"


def make_generation(gen_dir: Path, name: str, created: str | None = "2026-01-01T00:00:00Z", venv: bool = True) -> Path:
    path = gen_dir / name
    (path / "bin").mkdir(parents=True)
    if venv:
        (path / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    if created is not None:
        (path / "sglang-deploy").mkdir()
        record = {"generation": name, "created": created, "sglang_version": "0.5.23"}
        (path / "sglang-deploy" / "generation.json").write_text(json.dumps(record))
    return path


@pytest.fixture
def gens(tmp_path: Path) -> Path:
    d = tmp_path / "ml-env.d"
    d.mkdir()
    return d


def by_name(entries: list[dict]) -> dict[str, str]:
    return {e["name"]: e["reason"] for e in entries}


# ---------------------------------------------------------------- the id


@functools.cache
def plugins() -> None:
    """ansible.builtin's lookups (fileglob, file) loadable, as ansible-playbook loads them; once (and quietly where
    another test already configured Ansible's collection finder in this process)."""
    from ansible.plugins.loader import init_plugin_loader

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="AnsibleCollectionFinder has already been configured")
        init_plugin_loader()


def render(tasks_file: Path, task_name: str, variables: dict) -> dict:
    """Render one set_fact task of a role as Ansible does: its own templar and filters, the task's vars lazily."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar

    plugins()
    task = next(t for t in yaml.safe_load(tasks_file.read_text()) if t["name"] == task_name)
    templar = Templar(loader=DataLoader(), variables={**variables, **trusted(task.get("vars", {}))})
    return templar.template(trusted(task["ansible.builtin.set_fact"]))


def test_the_role_names_the_generation_as_software_py_does():
    patches = [{"name": "0001-a.patch", "content": "--- a/x\n+++ b/x\n"}, {"name": "0002-b.patch", "content": "é\n"}]
    series = [{"name": p["name"], "sha256": software.sha256_text(p["content"])} for p in patches]
    variables = {
        "sglang_python_version": "3.11",
        "sglang_version": "0.5.23",
        "sglang_install_profile": "parser",
        "ml_env_requirements": ["six==1.16.0", "Jinja2==3.1.6"],
        "ml_env_generations_dir": "/opt/x.d",
        "_sglang_lock": ["sglang==0.5.23", "jinja2==3.1.6", "MarkupSafe==3.0.4", "six==1.16.0"],
        "_sglang_patch_series": series,
    }
    defaults = yaml.safe_load((REPO / "roles" / "sglang" / "defaults" / "main.yml").read_text())
    preflight = REPO / "roles" / "sglang" / "tasks" / "preflight.yml"
    task = "Name the software generation (sglang_software, with its patch manifest)"
    add_manifest = "Add the generation's patch manifest to sglang_software"
    manifest = {"sglang_patch_manifest": trusted(defaults["sglang_patch_manifest"])}
    facts = render(preflight, task, {**variables, **manifest})
    # The second task, with the first's fact (a fact of an earlier run of the role would otherwise be read).
    facts.update(
        render(preflight, add_manifest, {**variables, **manifest, "sglang_software": facts["sglang_software"]})
    )
    identity = facts["_sglang_identity"]
    assert identity == {
        "python_version": "3.11",
        "sglang_version": "0.5.23",
        "install_profile": "parser",
        "lock_sha256": lock_sha256(variables["ml_env_requirements"] + variables["_sglang_lock"]),
        "patch_series_sha256": patch_series_sha256(patches),
    }
    assert facts["_sglang_generations_dir"] == "/opt/x.d"
    gen = generation_id(identity)
    assert facts["sglang_software"] == {
        "generation": gen,
        "venv": f"/opt/x.d/{gen}",
        "python": f"/opt/x.d/{gen}/bin/python",
        "sglang_version": "0.5.23",
        "lock_sha256": identity["lock_sha256"],
        "patch_series_sha256": identity["patch_series_sha256"],
        "manifest": f"/opt/x.d/{gen}/sglang-deploy/patches.json",
    }
    first = render(preflight, task, variables)["sglang_software"]
    custom = render(
        preflight, add_manifest, {**variables, "sglang_patch_manifest": "/srv/p.json", "sglang_software": first}
    )["sglang_software"]
    assert custom["manifest"] == "/srv/p.json"


def test_the_role_reads_the_patch_series_in_order_as_software_py_hashes_it(tmp_path):
    series_dir = tmp_path / "series"
    series_dir.mkdir()
    patches = [{"name": "0002-b.patch", "content": "é\n"}, {"name": "0001-a.patch", "content": "--- a/x\n+++ b/x\n\n"}]
    for p in patches:
        (series_dir / p["name"]).write_text(p["content"], encoding="utf-8")
    (series_dir / "notes.txt").write_text("not a patch")
    variables = {
        "sglang_requirements": ["sglang==0.5.23"],
        "sglang_patch_series_dir": str(series_dir),
        "sglang_patches_enabled": True,
    }
    preflight = REPO / "roles" / "sglang" / "tasks" / "preflight.yml"
    facts = render(preflight, "Choose the lock and read the patch series", variables)
    ordered = sorted(patches, key=lambda p: p["name"])
    assert facts["_sglang_lock"] == ["sglang==0.5.23"]
    assert facts["_sglang_patch_files"] == [str(series_dir / p["name"]) for p in ordered]
    assert facts["_sglang_patches"] == ordered, "whole contents, the trailing newlines kept"
    assert patch_series_sha256(facts["_sglang_patches"]) == patch_series_sha256(ordered)
    assert facts["_sglang_patch_series"] == [
        {"name": p["name"], "sha256": software.sha256_text(p["content"])} for p in ordered
    ]
    off = render(preflight, "Choose the lock and read the patch series", {**variables, "sglang_patches_enabled": False})
    assert (off["_sglang_patches"], off["_sglang_patch_series"]) == ([], [])


def test_ml_env_alone_names_its_generation_as_software_py_does():
    main = REPO / "roles" / "ml_env" / "tasks" / "main.yml"
    facts = render(
        main,
        "Name the generation of ml_env_requirements alone",
        {"ml_env_python_version": "3.11", "ml_env_requirements": ["six==1.16.0", "idna==3.10"]},
    )
    assert facts["_ml_env_identity"] == {
        "python_version": "3.11",
        "sglang_version": None,
        "install_profile": None,
        "lock_sha256": lock_sha256(["idna==3.10", "six==1.16.0"]),
        "patch_series_sha256": None,
    }


def test_the_id_changes_with_everything_installed_and_only_with_it():
    base = {
        "python_version": "3.11",
        "sglang_version": "0.5.23",
        "install_profile": "full",
        "lock_sha256": lock_sha256(["a==1", "b==2"]),
        "patch_series_sha256": patch_series_sha256([]),
    }
    gen = generation_id(base)
    assert len(gen) == 16 and int(gen, 16) >= 0
    assert generation_id(dict(base, lock_sha256=lock_sha256(["b==2", "a==1", "a==1"]))) == gen  # a lock is a set
    assert generation_id(dict(base, created="later", generation="x")) == gen  # only IDENTITY counts
    for key, value in [
        ("python_version", "3.12"),
        ("sglang_version", "0.5.24"),
        ("install_profile", "parser"),
        ("lock_sha256", lock_sha256(["a==1", "b==3"])),
        ("patch_series_sha256", patch_series_sha256([{"name": "0001.patch", "content": "x"}])),
    ]:
        assert generation_id(dict(base, **{key: value})) != gen, key
    assert lock_sha256(["A==1"]) != lock_sha256(["a==1"])
    one = [{"name": "0001.patch", "content": "x"}, {"name": "0002.patch", "content": "y"}]
    assert patch_series_sha256(one) != patch_series_sha256(one[::-1])  # a series is ordered


# ---------------------------------------------------------------- pruning


def test_keeps_the_current_and_the_newest_others_up_to_keep(gens):
    for i, name in enumerate(["old", "older", "newer", "cur"]):
        make_generation(gens, name, created=f"2026-01-0{[2, 1, 3, 1][i]}T00:00:00Z")
    res = prune(str(gens), "cur", keep=2, patterns=[])
    assert res["changed"] is True
    assert by_name(res["kept"]) == {
        "cur": "current: the generation just installed",
        "newer": "newest but the current one (keep=2: the current one and the newest other)",
    }
    assert set(by_name(res["removed"])) == {"old", "older"}
    assert (
        by_name(res["removed"])["old"]
        == "older (keep=2: the current one and the newest other), referenced by no unit or record"
    )
    assert sorted(os.listdir(gens)) == ["cur", "newer"]
    assert prune(str(gens), "cur", keep=2, patterns=[])["changed"] is False


def test_keep_three_and_keep_one(gens):
    for d in range(1, 5):
        make_generation(gens, f"g{d}", created=f"2026-01-0{d}T00:00:00Z")
    assert set(by_name(prune(str(gens), "g1", keep=3, patterns=[], check_mode=True)["kept"])) == {"g1", "g4", "g3"}
    assert set(by_name(prune(str(gens), "g1", keep=1, patterns=[])["kept"])) == {"g1"}
    with pytest.raises(software.SoftwareError, match="keep must be at least 1"):
        plan(str(gens), "g1", 0, {})


def test_never_removes_one_a_unit_a_staged_unit_or_a_known_good_record_names(gens, tmp_path):
    for d, name in enumerate(["cur", "unit", "dropin", "pending", "kg", "free", "prefix"], start=1):
        make_generation(gens, name, created=f"2026-01-0{d}T00:00:00Z")
    units = tmp_path / "system"
    (units / "sglang-main.service.d").mkdir(parents=True)
    (units / "sglang-main.service").write_text(f"[Service]\nExecStart={gens}/unit/bin/python -m sglang.launch_server\n")
    (units / "sglang-main.service.d" / "x.conf").write_text(f"[Service]\nEnvironment=PATH={gens}/dropin/bin:/usr/bin\n")
    (units / "other.service").write_text(f"ExecStart={gens}/free/bin/python\n")  # not an sglang unit
    pending = tmp_path / "etc" / "pending"
    pending.mkdir(parents=True)
    (pending / "sglang-b.service").write_text(f"ExecStart={gens}/pending/bin/python\n")
    kg = tmp_path / "known-good" / "main" / "generations"
    kg.mkdir(parents=True)
    (kg / "20260101-x.json").write_text(
        json.dumps({"software": {"venv": f"{gens}/kg"}, "argv": [f"{gens}/prefixx/bin/python"]})
    )
    patterns = [
        str(units / "sglang-*.service"),
        str(units / "sglang-*.service.d" / "*.conf"),
        str(pending / "*"),
        str(tmp_path / "known-good" / "**" / "*.json"),
    ]
    res = prune(str(gens), "cur", keep=1, patterns=patterns)
    kept = by_name(res["kept"])
    assert kept["unit"] == f"referenced by {units}/sglang-main.service"
    assert kept["dropin"] == f"referenced by {units}/sglang-main.service.d/x.conf"
    assert kept["pending"] == f"referenced by {pending}/sglang-b.service"
    assert kept["kg"] == f"referenced by {kg}/20260101-x.json"
    assert set(by_name(res["removed"])) == {"free", "prefix"}  # "prefixx" names no generation "prefix"


def test_the_linked_one_stays_and_incomplete_ones_go(gens, tmp_path):
    make_generation(gens, "cur")
    make_generation(gens, "linked", created="2025-01-01T00:00:00Z")
    make_generation(gens, "failed", created=None)  # a venv without generation.json
    make_generation(gens, "stranger", created=None, venv=False)
    (gens / "afile").write_text("x")
    link = tmp_path / "ml-env"
    link.symlink_to(gens / "linked")
    res = prune(str(gens), "cur", keep=1, patterns=[], link=str(link))
    assert by_name(res["kept"]) == {
        "cur": "current: the generation just installed",
        "linked": f"current: {link} points at it",
        "stranger": "not a virtualenv (no pyvenv.cfg, no generation.json): left alone",
    }
    assert by_name(res["removed"]) == {
        "failed": "incomplete: no sglang-deploy/generation.json (an install that failed or was interrupted)"
    }


def test_check_mode_reports_and_removes_nothing(gens):
    make_generation(gens, "cur")
    make_generation(gens, "a", created="2025-01-02T00:00:00Z")
    make_generation(gens, "b", created="2025-01-01T00:00:00Z")
    res = prune(str(gens), "cur", keep=2, patterns=[], check_mode=True)
    assert res["changed"] is True and [e["name"] for e in res["removed"]] == ["b"]
    assert sorted(os.listdir(gens)) == ["a", "b", "cur"]


def test_newest_by_created_else_by_the_directorys_time(gens):
    make_generation(gens, "cur")
    make_generation(gens, "recorded", created="2025-06-01T00:00:00Z")
    migrated = make_generation(gens, "nodate", created="2025-01-01T00:00:00Z")
    (migrated / "sglang-deploy" / "generation.json").write_text(json.dumps({"generation": "nodate"}))
    os.utime(migrated, (1e9, 1e9))  # 2001
    assert [e["name"] for e in prune(str(gens), "cur", keep=2, patterns=[])["removed"]] == ["nodate"]


def test_unreadable_references_prune_nothing(gens, tmp_path, monkeypatch):
    make_generation(gens, "cur")
    make_generation(gens, "old", created="2020-01-01T00:00:00Z")
    ref = tmp_path / "sglang-a.service"
    ref.write_text("x")
    real_open = open

    def deny(path, *args, **kwargs):
        if str(path) == str(ref):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(software, "open", deny, raising=False)
    res = prune(str(gens), "cur", keep=1, patterns=[str(ref)])
    assert res["changed"] is False and res["removed"] == []
    assert res["warnings"] == [f"nothing pruned: could not read {ref}: Permission denied"]
    assert by_name(res["kept"])["old"] == "not pruned: references unreadable"


def test_an_interrupted_removal_never_looks_complete_and_is_finished_later(gens, monkeypatch):
    make_generation(gens, "cur")
    make_generation(gens, "old", created="2020-01-01T00:00:00Z")

    def crash(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(software.shutil, "rmtree", crash)
    res = prune(str(gens), "cur", keep=1, patterns=[])
    assert res["changed"] is False and by_name(res["kept"])["old"].startswith("removal failed")
    assert sorted(os.listdir(gens)) == [".old.removing", "cur"]
    monkeypatch.undo()
    res = prune(str(gens), "cur", keep=1, patterns=[])
    assert by_name(res["removed"]) == {".old.removing": "the rest of an interrupted removal"}
    assert os.listdir(gens) == ["cur"]


def test_no_generations_directory_yet(tmp_path):
    assert prune(str(tmp_path / "absent"), "cur", keep=2, patterns=[]) == {
        "changed": False,
        "kept": [],
        "removed": [],
        "warnings": [],
    }


# ---------------------------------------------------------------- migration


def old_venv(path: Path) -> None:
    site = path / "lib" / "python3.11" / "site-packages"
    (site / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n")
    (path / "bin").mkdir()
    (path / "bin" / "python").write_text("")


def test_migrates_a_real_virtualenv_into_a_legacy_generation(tmp_path, gens):
    link = tmp_path / "ml-env"
    old_venv(link)
    manifest = tmp_path / "patches.json"
    manifest.write_text('{"version": "0.5.23"}')
    assert software.migrate(str(link), str(gens), str(manifest), check_mode=True)["changed"] is True
    assert link.is_dir() and not link.is_symlink()
    res = software.migrate(str(link), str(gens), str(manifest), now=1767225600)  # 2026-01-01
    assert res["changed"] is True and res["generation"] == "legacy-20260101T000000Z"
    legacy = gens / "legacy-20260101T000000Z"
    assert link.is_symlink() and os.readlink(link) == str(legacy)
    assert (link / "bin" / "python").exists()
    record = json.loads((legacy / "sglang-deploy" / "generation.json").read_text())
    assert record == {
        "generation": "legacy-20260101T000000Z",
        "python_version": "3.11",
        "sglang_version": "0.5.23",
        "install_profile": None,
        "lock_sha256": None,
        "patch_series_sha256": None,
        "created": "2026-01-01T00:00:00Z",
        "migrated_from": str(link),
    }
    assert (legacy / "sglang-deploy" / "patches.json").read_text() == manifest.read_text()
    assert software.migrate(str(link), str(gens))["changed"] is False
    # The legacy generation is an ordinary complete one: kept as the newest other, then pruned.
    make_generation(gens, "new", created="2026-02-01T00:00:00Z")
    assert set(by_name(prune(str(gens), "new", keep=2, patterns=[])["kept"])) == {"new", legacy.name}


def test_migration_refuses_a_file_and_ignores_nothing_there(tmp_path, gens):
    assert software.migrate(str(tmp_path / "absent"), str(gens))["changed"] is False
    (tmp_path / "f").write_text("x")
    with pytest.raises(software.SoftwareError, match="neither a directory nor a link"):
        software.migrate(str(tmp_path / "f"), str(gens))


# ---------------------------------------------------------------- the module


DRIVER = """
import runpy
runpy.run_path({module!r}, run_name="__main__")
"""


def run_module(tmp_path: Path, check_mode: bool = False, **args) -> dict:
    if check_mode:
        args["_ansible_check_mode"] = True
    path = tmp_path / f"args-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    driver = DRIVER.format(module=str(MODULE))
    env = env_with_pythonpath(dict(os.environ), COLLECTIONS)  # the collection's package for the module
    proc = subprocess.run(
        [sys.executable, "-c", driver, str(path)], env=env, capture_output=True, text=True, check=False
    )
    return json.loads(proc.stdout)


def test_module_prunes_in_check_mode_then_for_real(tmp_path, gens):
    make_generation(gens, "cur")
    make_generation(gens, "prev", created="2025-02-01T00:00:00Z")
    make_generation(gens, "old", created="2025-01-01T00:00:00Z")
    common = dict(dir=str(gens), link=str(tmp_path / "ml-env"), current="cur", references=[])
    res = run_module(tmp_path, check_mode=True, **common)
    assert res["changed"] is True and [e["name"] for e in res["removed"]] == ["old"]
    assert (gens / "old").exists()
    res = run_module(tmp_path, **common)
    assert res["changed"] is True and not (gens / "old").exists()
    assert {e["name"] for e in res["kept"]} == {"cur", "prev"}
    assert run_module(tmp_path, **common)["changed"] is False
    assert "current" in run_module(tmp_path, dir=str(gens), link="/x")["msg"]  # required with state=pruned


def test_module_migrates_and_fails_clearly(tmp_path, gens):
    link = tmp_path / "ml-env"
    old_venv(link)
    res = run_module(tmp_path, state="migrated", dir=str(gens), link=str(link))
    assert res["changed"] is True and res["generation"].startswith("legacy-") and link.is_symlink()
    assert run_module(tmp_path, state="migrated", dir=str(gens), link=str(link))["changed"] is False
    (tmp_path / "f").write_text("x")
    res = run_module(tmp_path, state="migrated", dir=str(gens), link=str(tmp_path / "f"))
    assert res["failed"] is True and "neither a directory nor a link" in res["msg"]


def test_module_is_thin():
    assert code_lines(MODULE) < 100  # its documentation aside


# ---------------------------------------------------------------- what pruning reads, where it is written


def role_defaults(role: str) -> dict:
    return yaml.safe_load((REPO / "roles" / role / "defaults" / "main.yml").read_text())


def references_rendered(overrides: dict, roles=("ml_env", "sglang_service")) -> list[str]:
    """ml_env_generations_references as Ansible renders it in a play of these roles, the inventory's overrides on top."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar

    plugins()
    variables = {k: v for role in roles for k, v in trusted(role_defaults(role)).items()}
    templar = Templar(loader=DataLoader(), variables={**variables, **overrides})
    return templar.template(trusted(role_defaults("ml_env")["ml_env_generations_references"]))


@pytest.mark.parametrize("roles", [("ml_env", "sglang_service"), ("ml_env",)], ids=["same play", "ml_env alone"])
def test_pruning_reads_the_records_where_sglang_service_writes_them(tmp_path, gens, roles):
    """Overriding sglang_service_state_dir (and _config_dir) alone moves the known-good records and the staged
    units; pruning must look there, or it removes the generation a rollback would put back (issue #30)."""
    state, config = tmp_path / "state", tmp_path / "config"
    overrides = {"sglang_service_state_dir": str(state), "sglang_service_config_dir": str(config)}
    patterns = references_rendered(overrides, roles)
    assert f"{state}/known-good/**/*.json" in patterns
    assert f"{config}/pending/*" in patterns
    assert references_rendered({}, roles)[2:] == ["/etc/sglang/pending/*", "/var/lib/sglang/known-good/**/*.json"]
    assert references_rendered({"gpu_node_state_dir": "/srv/s"}, roles)[3] == "/srv/s/known-good/**/*.json"
    for name in ("cur", "recorded", "staged", "old"):
        make_generation(gens, name, created=f"2026-01-0{1 + len(name) % 9}T00:00:00Z")
    record = state / "known-good" / "main" / "generations" / "000001-x.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"software": {"venv": f"{gens}/recorded"}}))
    (config / "pending").mkdir(parents=True)
    (config / "pending" / "sglang-main.service").write_text(f"ExecStart={gens}/staged/bin/python -m sglang\n")
    res = prune(str(gens), "cur", keep=1, patterns=patterns)
    assert sorted(e["name"] for e in res["removed"]) == ["old"]
    assert by_name(res["kept"])["recorded"].startswith("referenced by " + str(record))
