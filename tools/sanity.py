"""The modules judged as Ansible judges a collection's (issue #33): ansible-test's sanity tests, and ansible-doc.

    python tools/sanity.py            # every check below; exit 1 naming each failure
    python tools/sanity.py --keep     # and keep the collection it assembled (its path is printed)

ansible-test only runs inside ansible_collections/<namespace>/<name>/, so this assembles the collection
sglang.deploy in a temporary directory: plugins/modules (library/*.py), plugins/module_utils/sglang_deploy,
plugins/action, plugins/filter, a minimal galaxy.yml and meta/runtime.yml, and tests/sanity/ignore-X.Y.txt
from this repository's tests/sanity/. The one rewrite, in the copies only: the modules' imports of
ansible.module_utils.sglang_deploy become the collection's (ansible-test refuses the other spelling).
ansible-test builds one virtualenv per sanity test under ~/.ansible/test/venv (from PyPI, the first time only).
Then `ansible-doc -M library -t module NAME` for every module, from the repository as the playbooks use it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMESPACE, NAME = "sglang", "deploy"
PYTHON = "3.11"
# The sanity tests run, none needing a container. tests/sanity/ignore-X.Y.txt (ansible-core's X.Y) holds only what
# ansible-lint's production profile lets a collection ignore (its `sanity` rule), each line with its reason. Left out:
# pylint, pep8 and no-assert, whose findings are all in module_utils' code (`_` for an unused value, two local lambdas,
# four asserts), which ruff lints and which a permitted ignore cannot cover; shellcheck, pslint and changelog, which
# would check nothing (no shell or PowerShell plugin, no changelogs/).
TESTS = [
    "validate-modules",
    "ansible-doc",
    "action-plugin-docs",
    "compile",
    "import",
    "yamllint",
    "ignores",
    "runtime-metadata",
    "empty-init",
    "line-endings",
    "no-get-exception",
    "no-illegal-filenames",
    "no-smart-quotes",
    "replace-urlopen",
    "shebang",
    "symlinks",
    "use-argspec-type-path",
    "use-compat-six",
]
MODULE_UTILS = f"ansible_collections.{NAMESPACE}.{NAME}.plugins.module_utils"
IMPORTS = [
    (re.compile(r"\bansible\.module_utils\.sglang_deploy\b"), f"{MODULE_UTILS}.sglang_deploy"),
    (
        re.compile(r"^from ansible\.module_utils import sglang_deploy$", re.M),
        f"from {MODULE_UTILS} import sglang_deploy",
    ),
]
# ansible-test starts each sanity virtualenv with get-pip.py from its own download host, which this workplace (and
# CI) cannot reach: where none is cached, a stand-in is, that takes pip from the python's own ensurepip and then
# installs what ansible-test asked for (pip==X, from the package index as any pip install does).
GET_PIP = """\
\"\"\"Stand-in for get-pip.py, written by sglang-deploy's tools/sanity.py: ensurepip, then pip install.\"\"\"
import subprocess
import sys

subprocess.check_call([sys.executable, "-m", "ensurepip", "--default-pip"])
args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]  # get-pip.py's own flags
subprocess.check_call([sys.executable, "-m", "pip", "install", *args])
"""
GALAXY = f"""\
namespace: {NAMESPACE}
name: {NAME}
version: 0.1.0
readme: README.md
authors: [sglang-deploy]
"""


def ansible_version() -> str:
    """ansible-core's X.Y, as ansible-test names its ignore files."""
    from ansible.release import __version__

    return ".".join(__version__.split(".")[:2])


def rewrite(text: str) -> str:
    for pattern, spelling in IMPORTS:
        text = pattern.sub(spelling, text)
    return text


def assemble(top: Path) -> Path:
    """The collection under top/ansible_collections/sglang/deploy, returned."""
    root = top / "ansible_collections" / NAMESPACE / NAME
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    (root / "plugins" / "modules").mkdir(parents=True)
    for src in sorted((REPO / "library").glob("*.py")):
        (root / "plugins" / "modules" / src.name).write_text(rewrite(src.read_text()))
    shutil.copytree(
        REPO / "module_utils" / "sglang_deploy", root / "plugins" / "module_utils" / "sglang_deploy", ignore=skip
    )
    shutil.copytree(REPO / "action_plugins", root / "plugins" / "action", ignore=skip)
    shutil.copytree(REPO / "filter_plugins", root / "plugins" / "filter", ignore=skip)
    (root / "galaxy.yml").write_text(GALAXY)
    (root / "README.md").write_text("# sglang.deploy\n\nAssembled by tools/sanity.py for ansible-test.\n")
    (root / "meta").mkdir()
    (root / "meta" / "runtime.yml").write_text(f'---\nrequires_ansible: ">={ansible_version()}.0"\n')
    (root / "tests" / "sanity").mkdir(parents=True)
    ignore = REPO / "tests" / "sanity" / f"ignore-{ansible_version()}.txt"
    if ignore.is_file():
        shutil.copy(ignore, root / "tests" / "sanity" / ignore.name)
    return root


def bootstrap_pip() -> None:
    """The stand-in get-pip.py in ansible-test's cache, for the pip version it asks for, where none is cached."""
    try:
        from ansible_test._internal.python_requirements import get_venv_packages

        class Python:  # all get_venv_packages reads of its PythonConfig
            version = PYTHON

        version = get_venv_packages(Python())["pip"]
    except (ImportError, KeyError, TypeError) as exc:  # another ansible-test: it downloads, or says why it cannot
        print(f"sanity: no get-pip.py stand-in ({exc!r})")
        return
    cached = Path.home() / ".ansible" / "test" / "cache" / f"get_pip_{version.replace('.', '_')}.py"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(GET_PIP)
        print(f"sanity: wrote {cached} (get-pip.py's stand-in: ensurepip, then pip install)")


def tool(name: str) -> str:
    """The virtualenv's own script beside this python, else the one on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def sanity(root: Path, tests: list[str]) -> int:
    """ansible-test's exit status; its output goes to ours. No ANSIBLE_* of the repository's (its ansible.cfg
    names library/ and module_utils/: the collection must be judged on its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    argv = [tool("ansible-test"), "sanity", "--color", "no", "--python", PYTHON]
    argv += [a for t in tests for a in ("--test", t)]
    print("$", " ".join(argv), f"(in {root})", flush=True)
    return subprocess.run(argv, cwd=root, env=env).returncode


def docs() -> list[str]:
    """The modules whose `ansible-doc` fails or warns, each with its message."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    bad = []
    for src in sorted((REPO / "library").glob("*.py")):
        argv = [tool("ansible-doc"), "-M", "library", "-t", "module", src.stem]
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or proc.stderr.strip():
            bad.append(f"{' '.join(argv[1:])}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout[-500:]}")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", action="store_true", help="keep the assembled collection")
    parser.add_argument("--test", action="append", choices=TESTS, help="only this sanity test (repeatable)")
    args = parser.parse_args()
    started = time.monotonic()
    top = Path(tempfile.mkdtemp(prefix="sglang-sanity-"))
    failures = []
    try:
        bootstrap_pip()
        rc = sanity(assemble(top), args.test or TESTS)
        if rc != 0:
            failures.append(f"ansible-test sanity exited {rc} (its errors above)")
        failures += docs()
    except FileNotFoundError as exc:  # no ansible-test or ansible-doc: the virtualenv is not set up
        failures.append(f"{exc.filename}: not found (make setup installs it)")
    finally:
        if args.keep:
            print(f"the collection: {top / 'ansible_collections' / NAMESPACE / NAME}")
        else:
            shutil.rmtree(top, ignore_errors=True)
    took = time.monotonic() - started
    for line in failures:
        print(f"sanity: FAILED: {line}", file=sys.stderr)
    print(f"sanity: {'failed' if failures else 'passed'} in {took:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
