"""The modules judged as Ansible judges a collection's (issue #33): ansible-test's sanity tests, and ansible-doc.

    python tools/sanity.py            # every check below; exit 1 naming each failure
    python tools/sanity.py --keep     # and keep the collection it assembled (its path is printed)

The repository is the collection sglang.deploy (galaxy.yml). ansible-test only runs inside a real
ansible_collections/<namespace>/<name>/ directory (not through the checkout's collections/ symlink, which it
resolves), so this builds the collection as it ships (`ansible-galaxy collection build`: what galaxy.yml's
build_ignore leaves) and installs the tarball into a temporary directory, then adds tests/sanity/ (build_ignore
leaves tests/ out) and runs the sanity tests there: what is judged is what a user installs, unchanged.
ansible-test builds one virtualenv per sanity test under ~/.ansible/test/venv (from PyPI, the first time only).
Then `ansible-doc sglang.deploy.NAME` for every module, and `ansible-doc -t filter sglang.deploy.NAME` for every filter
the filter plugins' FilterModule().filters() return (each documented by its sidecar plugins/filter/NAME.yml), from the
checkout (ansible.cfg's collections_path) as the playbooks use it, and `antsibull-changelog lint` on changelogs/.
ansible-test's validate-modules leaves filter plugins out (a plugin file of several filters: its MULTI_FILE_PLUGINS), and
its ansible-doc test skips an UNDOCUMENTED filter: a missing or unparsable sidecar fails here, the sidecars' content
against each filter's Python signature fails tests/test_module_docs.py.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
# four asserts), which ruff lints and which a permitted ignore cannot cover; shellcheck and pslint, which would check
# nothing (no shell or PowerShell plugin); changelog, which wants antsibull-changelog in a virtualenv of its own from
# the index: the pinned one (requirements.lock) lints the fragments instead (changelog_lint).
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


def assemble(top: Path) -> Path:
    """The collection built from the repository and installed under top/ansible_collections/sglang/deploy (with
    tests/sanity/ added), returned."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["ANSIBLE_COLLECTIONS_PATH"] = str(top)  # where it is installed (ansible-galaxy warns of any other)
    galaxy = tool("ansible-galaxy")
    built = top / "build"
    run = {"env": env, "check": True, "stdout": subprocess.DEVNULL}
    subprocess.run([galaxy, "collection", "build", "--output-path", str(built), str(REPO)], cwd=top, **run)
    (tarball,) = built.glob(f"{NAMESPACE}-{NAME}-*.tar.gz")
    # from top, no-deps: the checkout (ansible.cfg's collections_path) would count as installed already, and
    # community.general is ansible's (pip), not needed by the sanity tests
    argv = [galaxy, "collection", "install", "--no-deps", "--force", "-p", str(top), str(tarball)]
    subprocess.run(argv, cwd=top, **run)
    root = top / "ansible_collections" / NAMESPACE / NAME
    shutil.copytree(REPO / "tests" / "sanity", root / "tests" / "sanity")
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
    names the checkout's collections/: the installed collection must be judged on its own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    argv = [tool("ansible-test"), "sanity", "--color", "no", "--python", PYTHON]
    argv += [a for t in tests for a in ("--test", t)]
    print("$", " ".join(argv), f"(in {root})", flush=True)
    return subprocess.run(argv, cwd=root, env=env).returncode


def filters() -> list[str]:
    """Every filter the collection's filter plugins provide: the names each plugins/filter/*.py's
    FilterModule().filters() returns (imported from the checkout's collections/, as the playbooks load them), so
    that a filter added without its sidecar documentation (plugins/filter/NAME.yml) fails docs()."""
    sys.path.insert(0, str(REPO / "collections"))
    try:
        names = set()
        for src in sorted((REPO / "plugins" / "filter").glob("*.py")):
            plugin = importlib.import_module(f"ansible_collections.{NAMESPACE}.{NAME}.plugins.filter.{src.stem}")
            names |= set(plugin.FilterModule().filters())
        return sorted(names)
    finally:
        sys.path.remove(str(REPO / "collections"))


def docs() -> list[str]:
    """The modules and filters whose `ansible-doc` fails or warns, each with its message."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    plugins = [("module", src.stem) for src in sorted((REPO / "plugins" / "modules").glob("*.py"))]
    bad = []
    try:
        plugins += [("filter", name) for name in filters()]
    except Exception as exc:  # a filter plugin that does not import: a failure to name, not a crash
        bad.append(f"plugins/filter: the filter plugins do not import: {exc!r}")
    for kind, name in plugins:
        argv = [tool("ansible-doc"), "-t", kind, f"{NAMESPACE}.{NAME}.{name}"]
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or proc.stderr.strip():
            bad.append(f"{' '.join(argv[1:])}: exit {proc.returncode}: {proc.stderr.strip() or proc.stdout[-500:]}")
    return bad


def changelog_lint() -> list[str]:
    """antsibull-changelog's findings on changelogs/ (its config, changelog.yaml and every fragment)."""
    proc = subprocess.run([tool("antsibull-changelog"), "lint"], cwd=REPO, capture_output=True, text=True)
    out = (proc.stdout + proc.stderr).strip()
    return [f"antsibull-changelog lint: exit {proc.returncode}: {out}"] if proc.returncode or out else []


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
        failures += changelog_lint()
    except FileNotFoundError as exc:  # no ansible-test or ansible-doc: the virtualenv is not set up
        failures.append(f"{exc.filename}: not found (make setup installs it)")
    except subprocess.CalledProcessError as exc:  # the collection did not build or install
        failures.append(f"{' '.join(exc.cmd[1:3])} exited {exc.returncode}")
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
