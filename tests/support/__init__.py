"""Helpers shared by the test modules (not tests themselves): `from support import ...`.

Importable because pytest.ini puts tests/ on the path (`pythonpath`), as it puts collections/ (the checkout as
the collection sglang.deploy: ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy), lab/ (lab.py)
and lab/gpu_sim/ (nvsim). Fixtures live in tests/conftest.py
and tests/e2e/conftest.py; no test module imports from another test module.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
MODULE_UTILS = REPO / "plugins" / "module_utils"
# The checkout as the collection (collections/ansible_collections/sglang/deploy -> ../../..): on a subprocess's
# PYTHONPATH, the modules' imports of the host package and the collection's plugins resolve to this repository.
COLLECTIONS = REPO / "collections"

T = TypeVar("T")


def trusted(x):
    """Data as Ansible holds a playbook's or a role's: every string trusted as a template (ansible-core 2.19)."""
    from ansible.template import trust_as_template

    if isinstance(x, str):
        return trust_as_template(x)
    if isinstance(x, dict):
        return {k: trusted(v) for k, v in x.items()}
    if isinstance(x, list):
        return [trusted(v) for v in x]
    return x


def lab_standin():
    """The lab's SGLang stand-in (lab/standin/lab_sglang_standin.py) as a module, imported from its path."""
    spec = importlib.util.spec_from_file_location(
        "lab_sglang_standin", REPO / "lab" / "standin" / "lab_sglang_standin.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_for(what: str, fn: Callable[[], T], timeout: float = 10.0, interval: float = 0.01) -> T:
    """Poll fn until it returns something true, and return that; AssertionError naming `what` at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def started(argv: list[str]) -> subprocess.Popen:
    """A process whose exec has finished: /proc shows its own command line, not an empty one mid-exec."""
    proc = subprocess.Popen(argv)
    wait_for(f"{argv[0]} to exec", lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes())
    return proc


def env_with_pythonpath(env: dict[str, str], *paths: Path | str) -> dict[str, str]:
    """env with paths put first on PYTHONPATH: a subprocess's import path (tests never change their own sys.path)."""
    old = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    return {**env, "PYTHONPATH": ":".join([*map(str, paths), *old])}


def refused(capsys, *argv: str) -> str:
    """Run the driver in-process; it must exit 2 (a usage error) with nothing on stdout; its stderr."""
    from driver import cli, exitcodes

    assert cli.main(list(argv)) == exitcodes.USAGE
    out, err = capsys.readouterr()
    assert out == ""
    return err


def code_lines(path: Path) -> int:
    """A module's lines but its DOCUMENTATION, EXAMPLES and RETURN strings: what it does, not what it says."""
    text = path.read_text()
    docs = [
        n.end_lineno - n.lineno + 1
        for n in ast.parse(text).body
        if isinstance(n, ast.Assign) and {ast.unparse(t) for t in n.targets} <= {"DOCUMENTATION", "EXAMPLES", "RETURN"}
    ]
    return len(text.splitlines()) - sum(docs)


def local_play(tmp_path: Path, inventory: dict, play: str, *extra: str) -> dict:
    """Run `play` (a playbook's text; %(repo)s and %(out)s filled in) with ansible-playbook over `inventory` (every
    host reached locally with this interpreter), from tmp_path/playbooks/ with the repository's roles beside it (a
    role default read by `playbook_dir ~ '/../roles/...'`), and return the JSON it wrote to %(out)s."""
    import json
    import os
    import sys

    import yaml

    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}

    def localized(group: dict) -> dict:
        hosts = {h: {**local, **(v or {})} for h, v in (group.get("hosts") or {}).items()}
        children = {name: localized(child) for name, child in (group.get("children") or {}).items()}
        return {**({"hosts": hosts} if hosts else {}), **({"children": children} if children else {})}

    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": localized(inventory)}))
    book = tmp_path / "playbooks" / "play.yml"
    book.parent.mkdir(exist_ok=True)
    if not (tmp_path / "roles").exists():
        (tmp_path / "roles").symlink_to(REPO / "roles")
    book.write_text(play % {"repo": REPO, "out": tmp_path / "out.json"})
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(tmp_path / "hosts.yml"), str(book), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return json.loads((tmp_path / "out.json").read_text())
