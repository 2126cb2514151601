"""`make mutate`: mutation testing of the operations core with mutmut (issue #31); docs/testing.md says why mutmut.

mutmut copies the code under test into mutants/ and names each mutant after its file's path; its trampoline runs a
mutant only where that name is the importing module's. The run happens in a copy of the tracked tree (.mutate/, kept
between runs: mutmut re-tests only the functions that changed) with an ansible_collections/ link at the top onto
collections/'s, so that the package is mutated under the name the tests import it by
(ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy; the filter's likewise). Files keep their
short names (sglang_deploy/restart.py, plugins/filter/sglang_config.py) on the command line and in the record.

    python tools/mutate.py [--files sglang_deploy/known_good.py ...] [--jobs N]
    python tools/mutate.py --ci [--budget SECONDS]

writes docs/bench/mutation.json (per file: killed, survived with each survivor's name, no tests, timeouts, score,
each mutated function's hash, and the run's seconds) and prints the table docs/testing.md carries. Exit 1 when a
core file scores under --floor.

--ci (make test): the core's functions whose code is not the code the record was measured on (mutmut's own hash of
each function), and only those, are mutated and tested, within --budget; exit 1 when a changed function has more
mutants not killed than the record gives it, when one of them could not be tested (mutmut failed, or the budget
ran out: `make mutate` records them), or a core file is gone. A clean clone has no mutmut cache: the record is
what CI compares against.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE = REPO / ".mutate"
OUT = REPO / "docs" / "bench" / "mutation.json"
MUTMUT = Path(sys.executable).parent / "mutmut"  # this virtualenv's (requirements.in)

# The files the issue scopes, by their short names (the record's keys; staged() gives mutmut's path).
SCOPE = [
    *(
        f"sglang_deploy/{name}.py"
        for name in (
            "restart", "recover", "machine", "phases", "operate", "failure", "known_good", "stage", "software", "lock", "gpu",
            "checks", "validate", "router", "rendezvous", "evidence", "boot", "durable", "secret_rule", "worker_urls", "worker_load", "router_actions",
            "evidence_items", "problems", "instance_checks", "host_checks", "sglang_parser", "network", "meeting",
            "procinfo",
        )
    ),
    *(f"driver/{name}.py" for name in ("redact", "exitcodes", "inventory", "interrupts", "ledger")),
    "plugins/filter/sglang_config.py",
]  # fmt: skip
CORE = ["sglang_deploy/restart.py", "sglang_deploy/recover.py", "sglang_deploy/machine.py", "sglang_deploy/phases.py", "sglang_deploy/operate.py",
        "sglang_deploy/failure.py", "sglang_deploy/known_good.py", "sglang_deploy/stage.py",
        "sglang_deploy/gpu.py", "sglang_deploy/checks.py"]  # fmt: skip
# A class of survivors, told apart by the mutant's code (prose_only), not listed by name: the wording of a message.
PROSE = "the wording of a message to a person (a string with a space, wrapped in XX or its case changed)"
# The survivors argued equivalent, each with why (tools/mutation_equivalents.py).
EQUIVALENT = runpy.run_path(str(Path(__file__).with_name("mutation_equivalents.py")))["EQUIVALENT"]
# The collection in the stage (and in mutants/): a link onto collections/ansible_collections, whose sglang/deploy is
# the checkout. mutmut names a mutant after its file's path, and its trampoline runs it only in a module imported
# by that name: the collection's files are mutated by this path, as the tests import them.
COLLECTION = "ansible_collections/sglang/deploy"
SOURCE_DIRS = [f"{COLLECTION}/plugins/module_utils/sglang_deploy", "driver", f"{COLLECTION}/plugins/filter"]


def source(rel: str) -> str:
    """Where the file of short name `rel` is in the checkout (sglang_deploy/x.py: the collection's module_utils)."""
    return f"plugins/module_utils/{rel}" if rel.startswith("sglang_deploy/") else rel


def staged(rel: str) -> str:
    """The path by which mutmut mutates `rel` in the stage: a collection file's through COLLECTION."""
    return f"{COLLECTION}/{source(rel)}" if source(rel).startswith("plugins/") else rel


def module(rel: str) -> str:
    """The module name mutmut gives the mutants of `rel` (ansible_collections.sglang.deploy.plugins...)."""
    return staged(rel).removesuffix(".py").replace("/", ".")


def stage_name(name: str) -> str:
    """A mutant's name or glob as mutmut knows it, from one by a short name (sglang_deploy.stage.x_f__mutmut_*)."""
    head = next((rel for rel in SCOPE if name.startswith(rel.removesuffix(".py").replace("/", ".") + ".")), None)
    return name if head is None else module(head) + name[len(head) - 3 :]


def tracked() -> list[str]:
    # tracked, and new files not ignored (what the next commit may hold)
    argv = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, check=True).stdout
    return [raw.decode() for raw in out.split(b"\0") if raw]


def stage_tree() -> None:
    """The tracked tree copied into STAGE (mutants/ and mutmut's cache kept), ansible_collections/ at the top."""
    STAGE.mkdir(exist_ok=True)
    old = STAGE / "sglang_deploy"  # a stage from before the collection: its mutants and stats are named after it
    if old.is_symlink():  # (mutmut would keep the stats, and find no test for the new names)
        old.unlink()
        shutil.rmtree(STAGE / "mutants", ignore_errors=True)
    for rel in tracked():
        src, dst = REPO / rel, STAGE / rel
        if src.is_symlink():  # playbooks/group_vars
            if not dst.is_symlink():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(os.readlink(src))
        elif src.is_file() and (not dst.exists() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    link_collection(STAGE)
    # mutants/ as the stage: its links made here, since mutmut's copies follow them (collections/ would copy the
    # stage into itself); a link out of the tree (a checkout's .venv) left out.
    mutants = STAGE / "mutants"
    for rel in links():
        target, dst = os.readlink(REPO / rel), mutants / rel
        points = os.path.normpath(os.path.join(os.path.dirname(rel), target))
        if not os.path.isabs(target) and not points.startswith("..") and not dst.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(target)
    link_collection(mutants)
    for rel in copied():  # mutmut copies a file into its folder, and makes none
        (mutants / rel).parent.mkdir(parents=True, exist_ok=True)
    (STAGE / HOOK).parent.mkdir(parents=True, exist_ok=True)
    (STAGE / HOOK).write_text(HOOK_CODE)


# A subprocess the tests start (a module run as Ansible runs it, collections/ on its PYTHONPATH) runs the mutated
# package too. While mutmut maps the tests ("stats"), its trampoline there reads mutmut's setup.cfg from the current
# directory, a test's tmp_path, and raises: this sitecustomize.py, on that PYTHONPATH and on mutmut's, has such a
# process run the original code (what it reached is not recorded from another process anyway).
HOOK = Path("mutants", "collections", "sitecustomize.py")  # in STAGE
HOOK_CODE = """import os

if os.environ.get("MUTANT_UNDER_TEST") == "stats":  # tools/mutate.py: mutmut's stats are the tests' process's
    os.environ["MUTANT_UNDER_TEST"] = ""
"""


def mutmut_env() -> dict[str, str]:
    """mutmut's environment: HOOK's folder first on PYTHONPATH (for the subprocesses of its tests)."""
    path = [str(STAGE / HOOK.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def link_collection(root: Path) -> None:
    """root/ansible_collections -> collections/ansible_collections: the collection (the checkout) by its name."""
    link = root / "ansible_collections"
    if not link.is_symlink():
        link.symlink_to("collections/ansible_collections")


def links() -> list[str]:
    """The tracked links (collections/ansible_collections/sglang/deploy -> ../../.., playbooks/group_vars)."""
    return [rel for rel in tracked() if (REPO / rel).is_symlink()]


def copied() -> list[str]:
    """What mutmut copies into mutants/ beside the source folders (also_copy): each tracked path outside them as its
    highest folder that holds neither one of them nor a link (shutil.copytree follows links)."""
    held = [source(d.removeprefix(f"{COLLECTION}/")) for d in SOURCE_DIRS]
    avoid = [*held, *links()]
    out = set()
    for rel in tracked():
        if rel in avoid or any(rel.startswith(f"{h}/") for h in held):
            continue
        parts = rel.split("/")
        heads = ("/".join(parts[:i]) for i in range(1, len(parts) + 1))
        out.add(next(h for h in heads if not any(a == h or a.startswith(f"{h}/") for a in avoid)))
    return sorted(out)


def fresh_copies(files: list[str]) -> None:
    """mutmut takes a mutants/ copy newer than its source for mutated and unchanged, and stage_tree keeps the
    source's older time: a copy another run left unmutated (its file was not in that run) would be taken for these
    files' mutants. Removed, mutmut makes them again and compares each function's hash with its .meta."""
    for rel in files:
        (STAGE / "mutants" / staged(rel)).unlink(missing_ok=True)


def config(files: list[str]) -> str:
    """mutmut's setup.cfg: every source file outside `files` left unmutated; the unit tests (not the lab's)."""
    mutated = {staged(rel) for rel in files}
    others = sorted(
        str(p.relative_to(STAGE))
        for d in SOURCE_DIRS
        for p in (STAGE / d).glob("*.py")
        if str(p.relative_to(STAGE)) not in mutated
    )
    lines = ["[mutmut]", "source_paths =", *(f"    {d}/" for d in SOURCE_DIRS)]
    lines += ["do_not_mutate =", *(f"    {p}" for p in others)]
    # Everything else tracked, as it is: the tests run playbooks, read docs, roles and the lab's files.
    lines += ["also_copy =", *(f"    {p}" for p in copied())]
    # pytest-randomly off (each mutant's tests in file order); the lab's tests are e2e, never run per mutant.
    # Left out: the tests of this checkout's own .venv (the doctor's, and py-spy found in it), which the copy has not,
    # and the wheel's build (test_packaging), which copies what git tracks: the stage is no checkout (git ignores it);
    # and the sizes of the sources, which mutmut rewrites (each mutant a copy of its function).
    away = [
        "--ignore=tests/test_doctor.py",
        "--ignore=tests/test_packaging.py",
        "--deselect=tests/test_evidence.py::test_real_py_spy_dumps_every_rank",
        "--deselect=tests/test_layout.py::test_no_file_of_the_logic_is_over_600_lines",
        "--deselect=tests/test_layout.py::test_no_function_outside_the_tests_is_over_60_lines_but_the_listed_exceptions",
    ]
    args = ["-p", "no:randomly", "-p", "no:cacheprovider", *away]
    lines += ["pytest_add_cli_args =", *(f"    {a}" for a in args)]
    lines += ["pytest_add_cli_args_test_selection =", *(f"    {a}" for a in ("-m", "not lab", "tests"))]
    return "\n".join(lines) + "\n"


def _functions(rel: str) -> dict[str, ast.FunctionDef]:
    """Every function of mutmut's mutated copy of `rel` (each mutant is one, beside its __mutmut_orig), by name."""
    tree = ast.parse((STAGE / "mutants" / staged(rel)).read_text())
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def prose_only(functions: dict[str, ast.FunctionDef], name: str) -> bool:
    """Whether mutant `name` changes nothing but the wording of a message: one string with a space in it, wrapped
    in XX or changed in case (mutmut's string mutations), every other node and field as it was."""
    orig, mutant = functions.get(name.split("__mutmut_")[0] + "__mutmut_orig"), functions.get(name)
    if orig is None or mutant is None:
        return False
    a, b = list(ast.walk(orig))[1:], list(ast.walk(mutant))[1:]  # [0]: the function itself, named apart
    if len(a) != len(b):
        return False
    changed = []
    for x, y in zip(a, b, strict=True):
        if type(x) is not type(y):
            return False
        fields = [(f, v) for f, v in ast.iter_fields(x) if not isinstance(v, (ast.AST, list))]
        if any(getattr(y, f) != v for f, v in fields):
            changed.append((x, y))
    if len(changed) != 1 or not isinstance(changed[0][0], ast.Constant):
        return False
    if read_by_the_program(orig, changed[0][0]):
        return False
    was, now = changed[0][0].value, changed[0][1].value
    return isinstance(was, str) and isinstance(now, str) and reworded(was, now)


def reworded(was: str, now: str) -> bool:
    """Whether `now` is `was` with one part that has a space in it wrapped in XX or changed in case: the whole
    string, or one part of an implicitly concatenated one ("a b " "c d": Python joins them into one constant,
    mutmut mutates one part)."""
    if len(now) == len(was) + 4:  # one part wrapped in XX: was[i:j]
        for i in (i for i in range(len(was) + 1) if now.startswith(was[:i] + "XX")):
            for j in range(i, len(was) + 1):
                if now == f"{was[:i]}XX{was[i:j]}XX{was[j:]}" and " " in was[i:j].strip():
                    return True
        return False
    if len(now) != len(was) or now == was or now.lower() != was.lower():
        return False
    a = next(k for k in range(len(was)) if was[k] != now[k])  # the changed part's first and last letters
    b = max(k for k in range(len(was)) if was[k] != now[k])
    part = was[a : b + 1]  # at least these; a case change of one part changes every letter of it
    return now in (was[:a] + part.upper() + was[b + 1 :], was[:a] + part.lower() + was[b + 1 :]) and (
        " " in part.strip() or " " in was.strip()
    )


def read_by_the_program(function: ast.FunctionDef, constant: ast.Constant) -> bool:
    """Whether the code itself reads the string: compared (`"couldn't communicate" in text`, `== "auto restart"`),
    a key (`d["a b"]`, `{"a b": ...}`), or an argument of a method that matches or splits (`startswith`, `split`,
    `re.search`...): then a changed wording is a changed behaviour."""
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and constant in (node.left, *node.comparators):
            return True
        if isinstance(node, ast.Subscript) and node.slice is constant:
            return True
        if isinstance(node, ast.Dict) and constant in node.keys:
            return True
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if call and constant in node.args and node.func.attr in MATCHERS:
            return True
    return False


# Methods whose string argument is a pattern or a separator, not a message: str's and re's.
MATCHERS = {
    "startswith", "endswith", "split", "rsplit", "partition", "rpartition", "find", "rfind", "index", "rindex",
    "count", "replace", "strip", "lstrip", "rstrip", "removeprefix", "removesuffix", "get", "search", "match",
    "fullmatch", "findall", "finditer", "sub", "compile",
}  # fmt: skip


def results(files: list[str]) -> dict[str, dict]:
    """Each file's counts from mutmut's own .meta files, by mutmut's own reading of an exit code."""
    os.chdir(STAGE)  # mutmut reads its setup.cfg on import
    from mutmut.stats import status_by_exit_code  # the tool's mapping, not a copy of it

    out = {}
    for rel in files:
        meta = STAGE / "mutants" / f"{staged(rel)}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        by: dict[str, list[str]] = {}
        for key, code in codes.items():
            by.setdefault(status_by_exit_code[code], []).append(key)
        short = {key: key.rsplit(".", 1)[-1] for key in codes}  # the name without its module
        why = EQUIVALENT.get(rel, {})
        functions = _functions(rel) if by.get("survived") else {}
        wording = sorted(short[k] for k in by.get("survived", []) if prose_only(functions, short[k]))
        killed = len(by.get("killed", [])) + len(by.get("timeout", []))  # out of time: the tests caught it too
        survived = sorted(short[k] for k in by.get("survived", []) if short[k] not in why and short[k] not in wording)
        equivalent = {short[k]: why[short[k]] for k in by.get("survived", []) if short[k] in why}
        tested = killed + len(survived) + len(by.get("no tests", []))  # untested is not killed
        out[rel] = {
            "mutants": len(codes),
            "killed": killed,
            "survived": len(survived),
            "equivalent": len(equivalent),
            "wording": len(wording),  # PROSE, each listed under "wordings"
            "no_tests": len(by.get("no tests", [])),
            "other": {k: len(v) for k, v in by.items() if k not in ("killed", "survived", "timeout", "no tests")},
            "score": round(100 * killed / tested, 1) if tested else None,
            "survivors": survived,
            "no_test_names": sorted(short[k] for k in by.get("no tests", [])),
            "equivalents": equivalent,
            "wordings": wording,
            # listed as equivalent, but killed now or gone: look at it again
            "stale_equivalents": sorted(set(why) - set(equivalent)),
            # mutmut's hash of each function it mutated: what --ci compares the code against
            "functions": json.loads(meta.read_text())["hash_by_function_name"] if meta.exists() else {},
            "tree": tree_hash(rel),
        }
    return out


def tree_hash(rel: str) -> str:
    """The hash of a staged file's syntax tree: a comment or a blank line changes no mutant."""
    return hashlib.sha256(ast.dump(ast.parse((STAGE / staged(rel)).read_text())).encode()).hexdigest()[:16]


def changed_functions(rel: str, recorded: dict) -> list[str]:
    """The functions of `rel` (in STAGE) that mutmut mutates and whose code is not the one `recorded` measured."""
    if recorded.get("tree") == tree_hash(rel):
        return []
    from mutmut.mutation.file_mutation import mutate_file_contents  # libcst: seconds a file, only a changed one

    now = mutate_file_contents(staged(rel), (STAGE / staged(rel)).read_text()).hash_by_function_name
    was = recorded.get("functions", {})
    return sorted(f for f, h in now.items() if was.get(f) != h)


def mutant_glob(rel: str, function: str) -> str:
    return f"{module(rel)}.{function}__mutmut_*"


def not_killed(files: list[str]) -> list[str]:
    """The mutants of `files` that survived, that no test reached, or that no run has tested yet."""
    names = []
    for rel in files:
        meta = STAGE / "mutants" / f"{staged(rel)}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        names += [key for key, code in codes.items() if code in (0, 33, None)]
    return names


def from_record(files: list[str], record: dict, also: list[str]) -> tuple[list[str], set[str]]:
    """--retest in a stage without mutmut's results (a fresh clone): the mutants the record holds as not killed, each
    function whose code changed since the record as a whole (its mutants are numbered anew), and `also` (globs).
    Returns mutmut's names and globs to run, and the module-qualified functions run whole."""
    names, whole = [], set()
    for rel in files:
        entry, name = record.get(rel, {}), module(rel)
        changed = set(changed_functions(rel, entry))
        kept = [*entry.get("survivors", []), *entry.get("equivalents", {}), *entry.get("no_test_names", [])]
        kept += entry.get("wordings", [])
        names += [f"{name}.{n}" for n in kept if function_of(n) not in changed]
        names += [mutant_glob(rel, f) for f in sorted(changed)]
        whole |= {f"{name}.{f}" for f in changed}
    return names + also, whole | {g.split("__mutmut_")[0] for g in also}


def carry_killed(got: dict[str, dict], named: list[str], whole: set[str]) -> None:
    """After a run from the record: a mutant neither named nor in a function run whole was killed in the recorded
    run and its function has not changed since (mutmut's own incremental rule): counted killed, and said so."""
    os.chdir(STAGE)
    from mutmut.stats import status_by_exit_code

    wanted = set(named)
    for rel, entry in got.items():
        codes = json.loads((STAGE / "mutants" / f"{staged(rel)}.meta").read_text())["exit_code_by_key"]
        carried = [
            key for key, code in codes.items()
            if status_by_exit_code[code] == "not checked" and key not in wanted and key.split("__mutmut_")[0] not in whole
        ]  # fmt: skip
        if not carried:
            continue
        entry["killed"] += len(carried)
        entry["carried"] = len(carried)  # killed as recorded, not run again
        entry["other"]["not checked"] -= len(carried)
        if not entry["other"]["not checked"]:
            del entry["other"]["not checked"]
        tested = entry["killed"] + entry["survived"] + entry["no_tests"]
        entry["score"] = round(100 * entry["killed"] / tested, 1) if tested else None


def rescore(files: list[str], no_write: bool) -> int:
    """The record of `files` read again from the stage's last run (an equivalent added or removed): a mutant that
    run did not test was carried as killed by it (the record says how many), and is again."""
    doc = json.loads(OUT.read_text())
    got = results(files)
    for rel, entry in got.items():
        carried = entry["other"].pop("not checked", 0)
        if carried and doc["files"].get(rel, {}).get("carried") != carried:
            print(f"{rel}: {carried} not tested, the record carried {doc['files'].get(rel, {}).get('carried')}")
            return 1
        if carried:
            entry["killed"] += carried
            entry["carried"] = carried
            tested = entry["killed"] + entry["survived"] + entry["no_tests"]
            entry["score"] = round(100 * entry["killed"] / tested, 1)
        print(f"{rel}: {entry['score']}% ({entry['survived']} survived, {entry['equivalent']} equivalent)")
    if not no_write:
        doc["files"].update(got)
        OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


def function_of(name: str) -> str:
    """The mangled function of mutant `name` (x_stage__mutmut_12 -> x_stage)."""
    return name.rsplit(".", 1)[-1].split("__mutmut_")[0]


def not_killed_by_function(entry: dict, functions: list[str]) -> list[str]:
    """For each mutant of `functions` a record entry (results()) holds as not killed (a survivor, an equivalent, no
    test), its function: counted per function, since a changed function renumbers its mutants."""
    names = [*entry.get("survivors", []), *entry.get("equivalents", {}), *entry.get("no_test_names", [])]
    return [function_of(n) for n in names if function_of(n) in functions]


def ci(budget: float, jobs: int) -> int:
    """CI's subset: the mutants of the core functions changed since the record, within `budget` seconds. Exit 1 when
    a changed function has more mutants not killed than the record gives it, when one of its mutants was not tested
    (mutmut failed, or the budget ran out), or when a core file is gone; a core file never measured is said, not run
    (make mutate measures it)."""
    record = json.loads(OUT.read_text())["files"] if OUT.exists() else {}
    gone = [rel for rel in CORE if not (REPO / source(rel)).exists()]
    if gone:
        print(
            f"mutation (CI): core file(s) gone: {', '.join(gone)} (tools/mutate.py's CORE names them)", file=sys.stderr
        )
        return 1
    stage_tree()
    (STAGE / "setup.cfg").write_text(config(CORE))
    os.chdir(STAGE)  # mutmut reads its setup.cfg from here
    changed = changed_core(record)
    if not changed:
        return 0
    files = list(changed)
    (STAGE / "setup.cfg").write_text(config(files))
    fresh_copies(files)
    names = [mutant_glob(rel, f) for rel, fs in changed.items() for f in fs]
    code, cut, seconds = run_within_budget(names, jobs, budget)
    if code != 0 and not cut:
        print(f"mutation (CI): mutmut failed (exit {code}): `mutmut run` in .mutate/ says why", file=sys.stderr)
        return 1
    worse, untested = against_record(record, changed, results(files))
    return ci_verdict(worse, untested, files, seconds, budget, cut)


def changed_core(record: dict) -> dict[str, list[str]]:
    """The functions of each core file changed since the record ({} when none did), said; the core files the record
    has no function hashes for are said too, and not gated."""
    unmeasured = [rel for rel in CORE if not record.get(rel, {}).get("functions")]
    for rel in unmeasured:
        why = "its record is from before the gate (no function hashes)" if rel in record else "it has no record"
        print(f"mutation (CI): {rel} not gated: {why}; `make mutate MUTATE_FILES={rel}` measures it")
    changed = {rel: changed_functions(rel, record[rel]) for rel in CORE if rel not in unmeasured}
    changed = {rel: fs for rel, fs in changed.items() if fs}
    if not changed:
        gated = len(CORE) - len(unmeasured)
        print(f"mutation (CI): no function of the {gated} recorded core files changed since {OUT.relative_to(REPO)}")
        return {}
    for rel, fs in changed.items():
        print(f"mutation (CI): {rel}: {len(fs)} function(s) changed since the record: {', '.join(fs)}")
    return changed


def run_within_budget(names: list[str], jobs: int, budget: float) -> tuple[int, bool, float]:
    """`mutmut run` of `names`, interrupted past `budget` seconds: (its exit code, whether it was cut, seconds)."""
    argv = [str(MUTMUT), "run", "--max-children", str(jobs), *names]
    t0 = time.monotonic()
    # Its own process group, SIGINT as by default (a job started with & in a script inherits it ignored).
    proc = subprocess.Popen(
        argv,
        cwd=STAGE,
        env=mutmut_env(),
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    cut = False
    try:
        code = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:  # mutmut saves each result as it comes: what ran counts
        cut = True
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
    return code, cut, round(time.monotonic() - t0, 1)


def against_record(record: dict, changed: dict[str, list[str]], got: dict[str, dict]) -> tuple[list[str], int]:
    """Per changed function, more mutants not killed now than in the record (said per function), and how many of
    the changed functions' mutants were not tested."""
    worse, untested = [], 0
    for rel, fs in changed.items():
        meta = STAGE / "mutants" / f"{staged(rel)}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        untested += sum(c is None for k, c in codes.items() if function_of(k) in fs)
        now, was = not_killed_by_function(got[rel], fs), not_killed_by_function(record[rel], fs)
        worse += [
            f"{rel}: {f}: {now.count(f)} mutant(s) not killed, {was.count(f)} in the record"
            for f in fs
            if now.count(f) > was.count(f)
        ]
    return worse, untested


def ci_verdict(worse: list[str], untested: int, files: list[str], seconds: float, budget: float, cut: bool) -> int:
    """The build's verdict, said: 1 for a new survivor or a mutant not tested, else 0."""
    print(f"mutation (CI): {seconds} s" + (f", stopped at its budget of {budget:.0f} s" if cut else ""))
    if worse:
        print("new survivors in the operations core (kill them, or argue them equivalent in tools/mutate.py; "
              "`mutmut show NAME` in .mutate/ prints each):\n  " + "\n  ".join(worse), file=sys.stderr)  # fmt: skip
        return 1
    if untested:
        print(f"mutation (CI): {untested} mutant(s) of the changed functions not tested within {budget:.0f} s: "
              f'`make mutate MUTATE_FILES="{" ".join(files)}"` measures them, to commit with the change', file=sys.stderr)  # fmt: skip
        return 1
    print(f'mutation (CI): no new survivor; `make mutate MUTATE_FILES="{" ".join(files)}"` records them')
    return 0


def main(argv: list[str] | None = None) -> int:
    ap, args = parse_args(argv)
    if args.ci:
        return ci(args.budget, args.jobs)
    unknown = [f for f in args.files if f not in SCOPE]
    if unknown:
        ap.error(f"--files: {', '.join(unknown)} not in the scope ({', '.join(SCOPE)})")
    if args.rescore:  # the stage's last run of these files, read again (their mutated copies are that run's)
        return rescore(args.files, args.no_write)
    prepare_stage(args.files, args.fresh)
    t0 = time.monotonic()
    record = json.loads(OUT.read_text())["files"] if OUT.exists() else {}
    names, whole, fresh = to_run(args, record)
    argv = [str(MUTMUT), "run", "--max-children", str(args.jobs), *names]
    run = subprocess.run(argv, cwd=STAGE, env=mutmut_env(), check=False)
    seconds = round(time.monotonic() - t0, 1)
    got = results(args.files)
    if fresh:
        carry_killed({f: got[f] for f in fresh if f in record}, names, whole)
    print_table(got)
    print(f"{seconds} s, {args.jobs} at once (mutmut exit {run.returncode})")
    if not args.no_write:
        write_record(got, args.files, seconds, args.jobs)
    low = [f for f in args.files if f in CORE and (got[f]["score"] or 0) < args.floor]
    if low:
        print(f"under {args.floor}%: {', '.join(low)}", file=sys.stderr)
    return 1 if low or run.returncode not in (0,) else 0


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line, --also's globs by mutmut's names; the parser too, for main's check of --files (not --ci's)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="*", default=SCOPE, help="the files to mutate (default: the scope)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    ap.add_argument("--floor", type=float, default=90.0, help="the least score of each core file (percent)")
    ap.add_argument(
        "--fresh", action="store_true", help="test every mutant again (after new tests), not only changed code"
    )
    ap.add_argument(
        "--retest", action="store_true", help="test again only the mutants not killed yet (after new tests: quicker)"
    )
    ap.add_argument(
        "--also", nargs="*", default=[], help="--retest: mutants to test as well (globs, sglang_deploy.x.x_f__mutmut_*)"
    )
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="run nothing: the record of --files again from the stage (equivalents edited)",
    )
    ap.add_argument("--no-write", action="store_true", help=f"print only; leave {OUT.relative_to(REPO)} as it is")
    ap.add_argument("--ci", action="store_true", help="only the core's functions changed since the record (make test)")
    ap.add_argument("--budget", type=float, default=600.0, help="--ci: seconds for the mutants (the rest not run)")
    args = ap.parse_args(argv)
    args.also = [stage_name(g) for g in args.also]
    return ap, args


def prepare_stage(files: list[str], fresh: bool) -> None:
    """The stage brought up to the checkout, mutmut's setup.cfg for `files`; with --fresh, their results forgotten."""
    stage_tree()
    (STAGE / "setup.cfg").write_text(config(files))
    if fresh:  # mutmut re-tests only what changed: its results for these files forgotten
        (STAGE / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)  # which test reaches what, anew
        for rel in files:
            for stale in (staged(rel), f"{staged(rel)}.meta"):  # the mutated copy too: mutmut makes both again
                (STAGE / "mutants" / stale).unlink(missing_ok=True)
    fresh_copies(files)


def to_run(args: argparse.Namespace, record: dict) -> tuple[list[str], set[str], list[str]]:
    """What mutmut is to run: the mutants named (none: mutmut's own incremental choice), the functions run whole,
    and the files taken from the record (--retest)."""
    names, whole, fresh = [], set(), []
    if args.retest:  # named, mutmut tests them again; unnamed, only new ones
        # From the record: a file mutmut has no results for here, or one whose last run was from the record (its
        # untested mutants were carried as killed: mutmut's own list would test them all again).
        fresh = [f for f in args.files if not (STAGE / "mutants" / f"{staged(f)}.meta").exists() or record.get(f, {}).get("carried")]  # fmt: skip
        names = not_killed([f for f in args.files if f not in fresh])
        if fresh:
            os.chdir(STAGE)  # mutmut reads its setup.cfg on import
            more, whole = from_record(fresh, record, args.also)
            names += more
    return names, whole, fresh


def print_table(got: dict[str, dict]) -> None:
    """Per file: mutants, killed, survived, equivalent, wording, no tests, untested and the score (docs/testing.md)."""
    cols = f"{'mutants':>7} {'killed':>6} {'survived':>8} {'equiv.':>6} {'wording':>7} {'no tests':>8} {'untested':>8}"
    print(f"{'file':36} {cols} {'score':>6}")
    for rel, r in got.items():
        score = "-" if r["score"] is None else f"{r['score']}%"
        nums = [r["mutants"], r["killed"], r["survived"], r["equivalent"], r["wording"], r["no_tests"]]
        nums.append(r["other"].get("not checked", 0))  # not run yet (a run stopped before them): not in the score
        print(
            f"{rel:36} "
            + " ".join(f"{n:>{w}}" for n, w in zip(nums, (7, 6, 8, 6, 7, 8, 8), strict=True))
            + f" {score:>6}"
        )


def write_record(got: dict[str, dict], files: list[str], seconds: float, jobs: int) -> None:
    """The record (OUT) updated with these files' results, and the run among the last 10."""
    doc = json.loads(OUT.read_text()) if OUT.exists() else {"files": {}}
    doc["files"].update(got)
    doc["runs"] = [*doc.get("runs", []), {"files": files, "seconds": seconds, "jobs": jobs}][-10:]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
