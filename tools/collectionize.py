"""Issue #33: the repository as the Ansible collection sglang.deploy, every move and mechanical rewrite in one place.

    python tools/collectionize.py             # move, rewrite, then ruff's import order on the Python it changed
    python tools/collectionize.py --dry-run   # print what would change, change nothing
    python tools/collectionize.py --check     # exit 1 when anything is left to do (a second run changes nothing)

Deterministic and idempotent, standard library only, so that it can be run again on a newer main (then the
hand-made commits - galaxy.yml, meta/runtime.yml, changelogs/, the collections/ symlink tree, the test runners'
hand fixes - go on top). What it does, in order:

1. git mv: library -> plugins/modules, module_utils/sglang_deploy -> plugins/module_utils/sglang_deploy,
   filter_plugins -> plugins/filter, action_plugins -> plugins/action (roles/ and playbooks/ stay).
2. One import name for the host package, ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy
   (PACKAGE), in every Python file: the modules' ansible.module_utils.sglang_deploy, the driver's
   module_utils.sglang_deploy, the tests' and bench's bare `from sglang_deploy ...` (import statements only:
   a string that names the bare package is the host layout - gate, launcher, sentinel - and stays), and the
   tests' filter_plugins.sglang_config; the plugins' sys.path edits are removed.
3. Path strings everywhere (code, comments, docs, config): module_utils/ -> plugins/module_utils/, library/ ->
   plugins/modules/, filter_plugins/ -> plugins/filter/, action_plugins/ -> plugins/action/, REPO / "library"
   and the like in Python, and the roles' {{ role_path }}/../../module_utils copies.
4. FQCN in YAML: the project's modules (sglang.deploy.<module>) as task keys in roles/, playbooks/, molecule/
   and tests/golden/; its filters (| sglang.deploy.<filter>) in those and in templates; its roles
   (role: sglang.deploy.<role>, include_role/import_role name:) in playbooks/, roles/ and molecule/.
5. The configuration that named the old directories: ansible.cfg (collections_path), molecule's shared config,
   pytest.ini (pythonpath), .coveragerc, ruff.toml, .ansible-lint, .yamllint, the driver's runner environment,
   tools/mutate.py's paths, tests/test_secret_rule.py's list of code directories.
6. ruff check --fix --select I (import order) and ruff format on the Python files it changed, when the
   virtualenv has ruff.

Left alone: tests/vectors/ and docs/gpu-runs/ (recorded data), this file, and tools/sanity.py (hand-written for
the layout).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMESPACE, NAME = "sglang", "deploy"
FQ = f"{NAMESPACE}.{NAME}"
COLLECTION = f"ansible_collections.{NAMESPACE}.{NAME}"
PACKAGE = f"{COLLECTION}.plugins.module_utils.sglang_deploy"

MOVES = [
    ("library", "plugins/modules"),
    ("module_utils/sglang_deploy", "plugins/module_utils/sglang_deploy"),
    ("filter_plugins", "plugins/filter"),
    ("action_plugins", "plugins/action"),
]
SKIP = ("tests/vectors/", "docs/gpu-runs/", "tools/collectionize.py", "tools/sanity.py")
# The mutation tool's docstring explains names it no longer uses the same way: paths only, its prose by hand.
NO_IMPORT_REWRITE = ("tools/mutate.py",)
NOT_PATH_SEP = r"(?<![\w/.\-$])"  # not inside another path or a dotted name

# ------------------------------------------------------------------------------------------------ the rules

# Python: the host package's one import name.
PY_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bansible\.module_utils\.sglang_deploy\b"), PACKAGE),
    (
        re.compile(r"\bfrom ansible\.module_utils import sglang_deploy\b"),
        f"from {COLLECTION}.plugins.module_utils import sglang_deploy",
    ),
    (re.compile(r"(?<![\w.])module_utils\.sglang_deploy\b"), PACKAGE),
    (re.compile(r"^(\s*)from sglang_deploy((?:\.\w+)*) import ", re.M), rf"\1from {PACKAGE}\2 import "),
    (re.compile(r"^(\s*)from filter_plugins\.(\w+) import ", re.M), rf"\1from {COLLECTION}.plugins.filter.\2 import "),
    (re.compile(r"^(\s*)from filter_plugins import ", re.M), rf"\1from {COLLECTION}.plugins.filter import "),
    # the plugins' own sys.path edits, and the comment that introduced the filter plugin's
    (
        re.compile(r"^# One source of truth: the instance record's secret handling lives beside the modules\.\n", re.M),
        "",
    ),
    (
        re.compile(
            r"^sys\.path\.insert\(0, str\(Path\(__file__\)\.resolve\(\)\.parents\[1\] / \"module_utils\"\)\)\n", re.M
        ),
        "",
    ),
    # bench/: the checkout's collections/ (the symlink tree) on the path instead of module_utils/
    (
        re.compile(r"sys\.path\.insert\(0, str\(REPO / \"module_utils\"\)\)"),
        'sys.path.insert(0, str(REPO / "collections"))',
    ),
]
PY_PATH_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"""\b(REPO|ROOT) / (["'])module_utils\2"""), r"\1 / \2plugins\2 / \2module_utils\2"),
    (re.compile(r"""\b(REPO|ROOT) / (["'])library\2"""), r"\1 / \2plugins\2 / \2modules\2"),
    (re.compile(r"""\b(REPO|ROOT) / (["'])filter_plugins\2"""), r"\1 / \2plugins\2 / \2filter\2"),
    (re.compile(r"""\b(REPO|ROOT) / (["'])action_plugins\2"""), r"\1 / \2plugins\2 / \2action\2"),
]
# Every text file: paths in code, comments, docs and config.
PATH_RULES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\.\./module_utils/"), "../plugins/module_utils/"),
    (re.compile(r"\.\./library/"), "../plugins/modules/"),
    (re.compile(r"\.\./filter_plugins/"), "../plugins/filter/"),
    (re.compile(r"\.\./action_plugins/"), "../plugins/action/"),
    (re.compile(NOT_PATH_SEP + r"module_utils/"), "plugins/module_utils/"),
    (re.compile(NOT_PATH_SEP + r"library/"), "plugins/modules/"),
    (re.compile(NOT_PATH_SEP + r"filter_plugins/"), "plugins/filter/"),
    (re.compile(NOT_PATH_SEP + r"action_plugins/"), "plugins/action/"),
]

# Exact edits of one file each: (path, old, new). Applied when old is there; a note when neither is.
# Edits whose result a later hand-made commit replaced: in these files, the text given here (the hand fix's) stands
# for the edit's result, so that --check stays quiet on them. driver/runner.py: the installed driver (issue #33's
# pyproject.toml) names its collections path through driver/paths.py, a checkout's collections/ or site-packages.
SUPERSEDED = {"driver/runner.py": "str(paths.collections_path())"}

EDITS: list[tuple[str, str, str]] = [
    (
        "ansible.cfg",
        "library = library\naction_plugins = action_plugins\nmodule_utils = module_utils\nfilter_plugins = filter_plugins\n",
        "# The repository is the collection sglang.deploy (galaxy.yml): collections/ansible_collections/sglang/deploy\n"
        "# is a symlink onto this checkout, so its modules, plugins and roles run from here as from an installed copy.\n"
        "collections_path = collections:~/.ansible/collections:/usr/share/ansible/collections\n",
    ),
    (
        ".config/molecule/config.yml",
        "      library: ${MOLECULE_PROJECT_DIRECTORY}/library\n"
        "      action_plugins: ${MOLECULE_PROJECT_DIRECTORY}/action_plugins\n"
        "      module_utils: ${MOLECULE_PROJECT_DIRECTORY}/module_utils\n"
        "      filter_plugins: ${MOLECULE_PROJECT_DIRECTORY}/filter_plugins\n",
        "      # The checkout as the collection sglang.deploy (collections/: a symlink tree onto the repository).\n"
        "      collections_path: ${MOLECULE_PROJECT_DIRECTORY}/collections:~/.ansible/collections:/usr/share/ansible/collections\n",
    ),
    (
        "pytest.ini",
        "# The import path, explicit (no test changes sys.path itself): the repository (driver, filter_plugins, tools),\n"
        "# module_utils (sglang_deploy), lab (lab.py), lab/gpu_sim (nvsim), and tests (the helpers\n",
        "# The import path, explicit (no test changes sys.path itself): the repository (driver, tools), collections\n"
        f"# (the checkout as the collection: {PACKAGE} and the\n"
        f"# filter plugin as {COLLECTION}.plugins.filter), lab (lab.py), lab/gpu_sim (nvsim), and tests (the helpers\n",
    ),
    (
        "pytest.ini",
        "pythonpath = . module_utils lab lab/gpu_sim tests\n",
        "pythonpath = . collections lab lab/gpu_sim tests\n",
    ),
    (".coveragerc", "\n    library\n", "\n    plugins/modules\n"),
    (".coveragerc", "\n    filter_plugins\n", "\n    plugins/filter\n    plugins/action\n"),
    (
        "ruff.toml",
        'known-first-party = ["driver", "sglang_deploy", "module_utils", "lab", "support", "nvsim", "filter_plugins", "tools"]',
        'known-first-party = ["driver", "ansible_collections", "lab", "support", "nvsim", "tools"]',
    ),
    (
        "ruff.toml",
        'extend-exclude = [".venv", ".lab-tests", "lab/image/rootfs", ".mutate"]',
        'extend-exclude = [".venv", ".lab-tests", "lab/image/rootfs", ".mutate", "collections"]',
    ),
    (".ansible-lint", "  - .mutate/\n", "  - .mutate/\n  - collections/\n"),
    (".yamllint", "  .mutate/\n", "  .mutate/\n  collections/\n"),
    (
        "driver/runner.py",
        '        "ANSIBLE_LIBRARY": str(REPO / "library"),\n'
        '        "ANSIBLE_ACTION_PLUGINS": str(REPO / "action_plugins"),\n'
        '        "ANSIBLE_MODULE_UTILS": str(REPO / "module_utils"),\n'
        '        "ANSIBLE_FILTER_PLUGINS": str(REPO / "filter_plugins"),\n',
        "        # The checkout is the collection sglang.deploy (collections/ansible_collections/sglang/deploy: a\n"
        "        # symlink onto it), ahead of any installed copy.\n"
        '        "ANSIBLE_COLLECTIONS_PATH": os.pathsep.join(\n'
        '            [str(REPO / "collections"), "~/.ansible/collections", "/usr/share/ansible/collections"]\n'
        "        ),\n",
    ),
    ("tools/mutate.py", '    "filter_plugins/sglang_config.py",\n', '    "plugins/filter/sglang_config.py",\n'),
    (
        "tools/mutate.py",
        'SOURCE_DIRS = ["sglang_deploy", "driver", "filter_plugins"]',
        'SOURCE_DIRS = ["sglang_deploy", "driver", "plugins/filter"]',
    ),
    (
        "tools/mutate.py",
        'link.symlink_to("module_utils/sglang_deploy")',
        'link.symlink_to("plugins/module_utils/sglang_deploy")',
    ),
    ("tools/mutate.py", '(REPO / "module_utils" / rel)', '(REPO / "plugins" / "module_utils" / rel)'),
    (
        "tests/test_secret_rule.py",
        'CODE = ["driver", "module_utils", "library", "filter_plugins", "action_plugins", "lab", "tools", "bench"]',
        'CODE = ["driver", "plugins", "lab", "tools", "bench"]',
    ),
]

# ------------------------------------------------------------------------------------------------ helpers


def git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True, check=True).stdout


def tracked() -> list[str]:
    return [p for p in git("ls-files", "-z").split("\0") if p]


def names_of(kind: str) -> list[str]:
    """The project's modules, roles or filters, read from the tree (after the moves; before them on a dry run)."""
    if kind == "modules":
        where = REPO / "plugins" / "modules" if (REPO / "plugins" / "modules").is_dir() else REPO / "library"
        return sorted(p.stem for p in where.glob("*.py") if p.stem != "__init__")
    if kind == "roles":
        return sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks").is_dir())
    where = REPO / "plugins" / "filter" if (REPO / "plugins" / "filter").is_dir() else REPO / "filter_plugins"
    found: set[str] = set()
    for path in where.glob("*.py"):
        body = path.read_text().split("def filters", 1)
        if len(body) == 2:
            found |= set(re.findall(r'^\s+"(\w+)":', body[1].split("\n\n", 1)[0], re.M))
    return sorted(found)


def alternation(names: list[str]) -> str:
    return "|".join(map(re.escape, sorted(names, key=len, reverse=True)))


def is_task_file(rel: str) -> bool:
    """YAML whose mappings may be tasks (a module as a key): playbooks, roles' tasks and handlers, molecule's."""
    if not rel.endswith((".yml", ".yaml")):
        return False
    if rel.startswith("roles/"):
        return "/tasks/" in rel or "/handlers/" in rel
    if rel.startswith(("playbooks/", "tests/golden/")):
        return "/vars/" not in rel and "/group_vars/" not in rel
    if rel.startswith("molecule/"):
        return "/inventory/" not in rel and not rel.endswith("molecule.yml")
    return False


def fqcn_modules(text: str, modules: list[str]) -> str:
    pattern = re.compile(rf"^(\s*(?:-\s+)?)({alternation(modules)}):(?=\s|$)", re.M)
    return pattern.sub(rf"\1{FQ}.\2:", text)


def fqcn_filters(text: str, filters: list[str]) -> str:
    return re.sub(rf"(\|\s*)({alternation(filters)})\b(?!\.)", rf"\1{FQ}.\2", text)


def fqcn_roles(text: str, roles: list[str]) -> str:
    names = alternation(roles)
    text = re.sub(rf"^(\s*-\s+role:[ \t]+)({names})[ \t]*$", rf"\1{FQ}.\2", text, flags=re.M)
    # include_role / import_role: the name: line of the block under it
    out, block = [], None
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if block is not None and line.strip() and indent <= block:
            block = None
        if block is not None:
            line = re.sub(rf"^(\s+name:\s+)({names})\s*$", rf"\1{FQ}.\2", line)
        if re.match(r"^\s*(?:-\s+)?(?:ansible\.builtin\.)?(?:include|import)_role:\s*$", line):
            block = indent + (2 if line.lstrip().startswith("- ") else 0)
        out.append(line)
    return "\n".join(out)


def action_plugin_fqcn(text: str, modules: list[str]) -> str:
    return re.sub(rf'module_name="({alternation(modules)})"', rf'module_name="{FQ}.\1"', text)


def apply(rules: list[tuple[re.Pattern[str], str]], text: str) -> str:
    for pattern, repl in rules:
        text = pattern.sub(repl, text)
    return text


# ------------------------------------------------------------------------------------------------ the steps


def move(dry: bool, changes: list[str]) -> None:
    for src, dst in MOVES:
        s, d = REPO / src, REPO / dst
        tracked_src = git("ls-files", src).strip()
        if not tracked_src:
            if not d.exists():
                print(f"collectionize: neither {src} nor {dst} exists", file=sys.stderr)
            continue
        if git("ls-files", dst).strip():
            raise SystemExit(f"collectionize: both {src} and {dst} are tracked; merge them by hand first")
        changes.append(f"git mv {src} {dst}")
        if not dry:
            d.parent.mkdir(parents=True, exist_ok=True)
            git("mv", src, dst)
            leftovers = s / "__pycache__"
            if leftovers.is_dir():
                for f in leftovers.iterdir():
                    f.unlink()
                leftovers.rmdir()
            for empty in (s, s.parent):
                if empty != REPO and empty.is_dir() and not any(empty.iterdir()):
                    empty.rmdir()


def rewrite(dry: bool, changes: list[str]) -> list[str]:
    modules, roles, filters = names_of("modules"), names_of("roles"), names_of("filters")
    edits: dict[str, list[tuple[str, str]]] = {}
    for rel, old, new in EDITS:
        edits.setdefault(rel, []).append((old, new))
    changed_py = []
    for rel in tracked():
        path = REPO / rel
        if rel.startswith(SKIP) or path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        new = text
        for old, repl in edits.get(rel, []):
            if repl in new:  # done already (a second run)
                continue
            if old in new:
                new = new.replace(old, repl)
            elif SUPERSEDED.get(rel, "\0") not in new:
                print(f"collectionize: {rel}: an edit found neither its text nor its result (look by hand)")
        steps: list[Callable[[str], str]] = []
        if rel.endswith(".py"):
            if not rel.startswith(NO_IMPORT_REWRITE):
                steps.append(lambda t: apply(PY_RULES, t))
            steps.append(lambda t: apply(PY_PATH_RULES, t))
            if rel.startswith("plugins/action/"):
                steps.append(lambda t: action_plugin_fqcn(t, modules))
        steps.append(lambda t: apply(PATH_RULES, t))
        in_ansible = rel.startswith(("roles/", "playbooks/", "molecule/", "tests/golden/", "group_vars/", "inventory/"))
        if in_ansible and rel.endswith((".yml", ".yaml", ".j2")):
            steps.append(lambda t: fqcn_filters(t, filters))
        if is_task_file(rel):
            steps.append(lambda t: fqcn_modules(t, modules))
            steps.append(lambda t: fqcn_roles(t, roles))
        for step in steps:
            new = step(new)
        if new != text:
            changes.append(f"rewrite {rel}")
            if rel.endswith(".py"):
                changed_py.append(rel)
            if not dry:
                path.write_text(new, encoding="utf-8")
    return changed_py


def tidy(files: list[str]) -> None:
    """ruff's import order and format on the rewritten Python (long import lines wrapped as the project does)."""
    ruff = REPO / ".venv" / "bin" / "ruff"
    if not files or not ruff.exists():
        print("collectionize: ruff not run (no virtualenv ruff, or nothing changed)")
        return
    subprocess.run([str(ruff), "check", "--quiet", "--fix", "--select", "I,F401", *files], cwd=REPO, check=False)
    subprocess.run([str(ruff), "format", "--quiet", *files], cwd=REPO, check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    ap.add_argument("--check", action="store_true", help="exit 1 when anything is left to do")
    args = ap.parse_args()
    dry = args.dry_run or args.check
    changes: list[str] = []
    move(dry, changes)
    changed_py = rewrite(dry, changes)
    for line in changes:
        print(line)
    if not dry:
        tidy(changed_py)
    print(f"collectionize: {len(changes)} change(s){' to make' if dry else ''}")
    return 1 if args.check and changes else 0


if __name__ == "__main__":
    sys.exit(main())
