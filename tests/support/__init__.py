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
