"""Issue #33: the driver on top of the installed collection as well as the checkout.

`pip install .` (pyproject.toml, setup.py) gives the console script sglang-deploy and the collection sglang.deploy
as the package ansible_collections/sglang/deploy, where ansible-core finds it on sys.path. The wheel holds what
`ansible-galaxy collection build` packs, nothing of the checkout's own (tests, lab, .venv); installed into a fresh
virtualenv from its declared dependencies only, the driver runs the installed collection's playbooks from a
directory outside any checkout, with the settings of the checkout's ansible.cfg (carried as driver/ansible.cfg),
and without a default inventory. From the checkout, nothing changed: its collection, its ansible.cfg, the lab.
"""

from __future__ import annotations

import configparser
import email.parser
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from driver import paths
from support import REPO
from support.package import build_wheel, clean_env, installed_driver

COLLECTION_IN_WHEEL = "ansible_collections/sglang/deploy/"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    t0 = time.monotonic()
    built = build_wheel(tmp_path_factory.mktemp("wheel"))
    print(f"wheel {built.name}: {built.stat().st_size} bytes, built in {time.monotonic() - t0:.1f} s")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(sglang-deploy of a fresh virtualenv with the wheel and its dependencies, that virtualenv); removed after
    the module (it is half a gigabyte: the ansible package's collections)."""
    base = tmp_path_factory.mktemp("installed")
    t0 = time.monotonic()
    script = installed_driver(base / "venv", wheel)
    print(f"installed into a fresh virtualenv in {time.monotonic() - t0:.1f} s")
    yield script, base / "venv"
    shutil.rmtree(base, ignore_errors=True)


def galaxy_build_files(tmp_path: Path) -> set[str]:
    """The files `ansible-galaxy collection build` packs (its own FILES.json and MANIFEST.json aside), a symlinked
    directory as the files it holds (a wheel holds no links)."""
    out = tmp_path / "galaxy-build"
    subprocess.run(
        [str(Path(sys.executable).parent / "ansible-galaxy"), "collection", "build", "--output-path", str(out), "."],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    (tarball,) = out.glob("sglang-deploy-*.tar.gz")
    files = set()
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            if member.issym():
                target = (REPO / member.name).resolve()
                files |= {str(Path(member.name) / p.relative_to(target)) for p in target.rglob("*") if p.is_file()}
            elif member.isfile() and member.name not in ("FILES.json", "MANIFEST.json"):
                files.add(member.name)
    return files


# ------------------------------------------------------------------------------------------------ the wheel


def test_the_wheel_holds_the_console_script_the_driver_and_the_collection_as_ansible_galaxy_builds_it(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
        metadata = email.parser.Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        shipped_cfg = zf.read("driver/ansible.cfg")
    assert dict(entry_points["console_scripts"]) == {"sglang-deploy": "driver.cli:console"}

    tops = {n.split("/")[0] for n in names}
    assert tops == {"driver", "ansible_collections", dist_info}, tops
    driver = {n.removeprefix("driver/") for n in names if n.startswith("driver/")}
    assert driver == {p.name for p in (REPO / "driver").glob("*.py")} | {"ansible.cfg"}
    # One source of truth for Ansible's settings: the installed driver's are the checkout's ansible.cfg itself.
    assert shipped_cfg == (REPO / "ansible.cfg").read_bytes()

    collection = {n.removeprefix(COLLECTION_IN_WHEEL) for n in names if n.startswith(COLLECTION_IN_WHEEL)}
    assert len(collection) == len([n for n in names if n.startswith("ansible_collections/")])  # only sglang.deploy
    assert collection == galaxy_build_files(tmp_path) | {"galaxy.yml"}
    for wanted in ("playbooks/status.yml", "playbooks/group_vars/all.yml", "meta/runtime.yml", "galaxy.yml"):
        assert wanted in collection
    for kind in ("roles/sglang_service/tasks/", "plugins/modules/", "plugins/module_utils/sglang_deploy/"):
        assert any(n.startswith(kind) for n in collection), kind
    assert any(n.startswith("plugins/filter/") for n in collection) and any(
        n.startswith("plugins/action/") for n in collection
    )
    # Nothing of the checkout's own: its tests, lab, virtualenv, tooling, inventories, the packaging itself.
    own = {"tests", "lab", ".venv", "molecule", "tools", "inventory", "collections", "bench", ".git", "docs/gpu-runs"}
    assert not [n for n in collection if n.split("/")[0] in own or n.startswith("docs/gpu-runs")]
    assert not [n for n in names if "__pycache__" in n.split("/") or ".venv" in n.split("/") or n.endswith(".pyc")]
    assert not collection & {"pyproject.toml", "setup.py", "ansible.cfg", "Makefile", "requirements.lock"}

    galaxy = yaml.safe_load((REPO / "galaxy.yml").read_text())
    assert metadata["Name"] == "sglang-deploy"
    assert metadata["Version"] == galaxy["version"]


def test_the_dependencies_are_what_the_driver_imports_no_lower_than_requirements_lock():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {Requirement(r).name.lower(): Requirement(r) for r in project["dependencies"]}
    assert set(required) == {"ansible-core", "ansible-runner", "rich", "pyyaml", "ansible"}
    pins = dict(line.split("==", 1) for line in (REPO / "requirements.lock").read_text().splitlines() if "==" in line)
    pins = {name.lower(): version.split()[0] for name, version in pins.items()}
    for name, req in required.items():
        assert pins[name] in req.specifier, f"{req} refuses requirements.lock's {name}=={pins[name]}"


def test_the_packaging_leaves_nothing_for_git_or_for_the_collections_own_build():
    ignored = (REPO / ".gitignore").read_text().split()
    assert {"/build/", "/dist/", "*.egg-info/"} <= set(ignored)
    build_ignore = yaml.safe_load((REPO / "galaxy.yml").read_text())["build_ignore"]
    assert {"build", "dist", "*.egg-info", "pyproject.toml", "setup.py"} <= set(build_ignore)


# ------------------------------------------------------------------------------------------------ installed


def test_the_installed_driver_runs_the_installed_collections_playbooks_outside_any_checkout(installed, tmp_path):
    """sglang-deploy from a fresh virtualenv, in a directory that is no checkout, with an environment that names
    none (no PYTHONPATH, no ANSIBLE_*): its help; -i required; `status` on an inventory whose one host refuses
    SSH at once runs the installed collection's playbook and roles (their tasks' paths are in the virtualenv) and
    ends 8, host unreachable."""
    script, venv = installed
    env = clean_env(tmp_path / "home")
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(script), *argv], cwd=work, env=env, capture_output=True, text=True, timeout=120)

    shown = run("--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: sglang-deploy ")
    assert "status" in shown.stdout and "exit codes:" in shown.stdout

    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from driver import paths; print(paths.CHECKOUT, paths.collection())"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert where == ["None", str(site / "ansible_collections" / "sglang" / "deploy")]

    bare = run("status")
    assert bare.returncode == 2
    assert "sglang-deploy status: no inventory: pass -i/--inventory" in bare.stderr

    hosts = work / "hosts.yml"
    hosts.write_text(
        "all:\n  children:\n    sglang_nodes:\n      hosts:\n        gone-node:\n"
        "          ansible_host: 127.0.0.1\n          ansible_port: 9\n          ansible_user: nobody\n"
    )
    t0 = time.monotonic()
    done = run("status", "-i", "hosts.yml", "--json")
    print(f"sglang-deploy status on an unreachable host: {time.monotonic() - t0:.1f} s")
    result = json.loads(done.stdout.splitlines()[-1])
    assert done.returncode == 8, done.stderr[-3000:]
    assert result["exit_code"] == 8 and result["hosts"]["gone-node"]["status"] == "unreachable"
    # ansible.cfg's settings applied (ansible.posix's profile_tasks, the callback it enables, printed its recap).
    assert any("TASKS RECAP" in m for m in result["messages"])

    (stream,) = (tmp_path / "home").rglob("events.jsonl")
    task_paths = {
        e["event_data"]["task_path"]
        for e in map(json.loads, stream.read_text().splitlines())
        if (e.get("event_data") or {}).get("task_path")
    }
    assert task_paths
    in_collection = re.compile(
        re.escape(str(site / "ansible_collections" / "sglang" / "deploy")) + r"/(roles|playbooks)/"
    )
    assert all(in_collection.match(p) for p in task_paths), sorted(task_paths)
    assert any("/roles/sglang_service/" in p for p in task_paths)


# ------------------------------------------------------------------------------------------------ the checkout


def test_from_the_checkout_the_driver_uses_the_checkout_its_ansible_cfg_and_the_labs_inventory():
    assert paths.CHECKOUT == REPO
    assert paths.collection() == REPO
    assert paths.collections_path() == REPO / "collections"
    assert paths.ansible_cfg() == REPO / "ansible.cfg"
    assert paths.default_inventory() == REPO / "inventory" / "lab" / "hosts.yml"


def test_without_a_checkout_the_driver_takes_the_collection_python_imports_the_shipped_cfg_and_no_inventory(
    monkeypatch, capsys
):
    """driver/paths.py's installed side, in this process: the collection where ansible_collections.sglang.deploy
    is imported from (here the checkout's collections/, as site-packages installed), and -i required."""
    from driver import cli, commands, inventory

    monkeypatch.setattr(paths, "CHECKOUT", None)
    assert paths.collection() == REPO  # collections/ansible_collections/sglang/deploy, resolved
    assert paths.collections_path() == REPO / "collections"  # the directory holding ansible_collections, as imported
    assert paths.ansible_cfg() == REPO / "driver" / "ansible.cfg" == paths.SHIPPED_CFG
    assert paths.default_inventory() is None

    monkeypatch.setattr(inventory, "DEFAULT", None)
    monkeypatch.delenv("ANSIBLE_INVENTORY", raising=False)
    monkeypatch.setattr(commands, "PROG", commands.PROG)  # put back after console() below renames it
    monkeypatch.setattr(sys, "argv", ["sglang-deploy", "status"])
    with pytest.raises(SystemExit) as stopped:
        cli.console()
    assert stopped.value.code == 2
    assert "sglang-deploy status: no inventory: pass -i/--inventory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        commands.parser().parse_args(["status", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert shown.startswith("usage: sglang-deploy status ")
    assert "inventory (required: the installed driver has no default" in shown


def test_neither_a_checkout_nor_an_installed_collection_is_said_so(monkeypatch):
    monkeypatch.setattr(paths, "CHECKOUT", None)
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    paths._location.cache_clear()
    try:
        with pytest.raises(paths.NotInstalled, match=r"the collection sglang\.deploy"):
            paths.collection()
    finally:
        paths._location.cache_clear()
