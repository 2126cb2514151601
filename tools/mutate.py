"""`make mutate`: mutation testing of the operations core with mutmut (issue #31); docs/testing.md says why mutmut.

mutmut copies the code under test into mutants/ and names each mutant after its file's path. The unit tests import
the host package as `sglang_deploy` (pytest.ini's pythonpath: module_utils), so the run happens in a copy of the
tracked tree (.mutate/, kept between runs: mutmut re-tests only the functions that changed) where sglang_deploy/ is
the package at the top. Code the tests reach through another name (`module_utils.sglang_deploy` from the driver,
`ansible.module_utils.sglang_deploy` in a module run as Ansible runs it) runs unmutated: a mutant only those reach
counts as "no tests", never as killed.

    python tools/mutate.py [--files sglang_deploy/known_good.py ...] [--jobs N]

writes docs/bench/mutation.json (per file: killed, survived with each survivor's name, no tests, timeouts, score,
and the run's seconds) and prints the table docs/testing.md carries. Exit 1 when a file in --floor-files (the
operations core) scores under --floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE = REPO / ".mutate"
OUT = REPO / "docs" / "bench" / "mutation.json"
MUTMUT = Path(sys.executable).parent / "mutmut"  # this virtualenv's (requirements.in)

# The files the issue scopes, as mutmut sees them in the stage (sglang_deploy/ at the top).
SCOPE = [
    *(
        f"sglang_deploy/{name}.py"
        for name in (
            "restart", "known_good", "stage", "software", "lock", "gpu", "checks", "validate", "router",
            "rendezvous", "evidence", "boot", "durable", "secret_rule",
        )
    ),
    *(f"driver/{name}.py" for name in ("redact", "exitcodes", "inventory", "interrupts", "ledger")),
    "filter_plugins/sglang_config.py",
]  # fmt: skip
CORE = ["sglang_deploy/restart.py", "sglang_deploy/known_good.py", "sglang_deploy/stage.py",
        "sglang_deploy/gpu.py", "sglang_deploy/checks.py"]  # fmt: skip
# Survivors no test can kill, each with why (mutmut's name; `mutmut show NAME` in .mutate/ prints its change).
# Names follow a function's mutants in order: a changed function renumbers them, and a listed name that no longer
# survives is reported, to be looked at again.
_SPLIT = "n.split('-', k)[0] is the same first field for any k >= 1 (or none)"
_UTF8 = "'UTF-8' and 'utf-8' name one codec"
_NOW = "time.gmtime(None) is time.gmtime(time.time()): the same UTC time, a microsecond on"
_LOCALE = "encoding left to the locale: UTF-8 on every host this runs on (Debian's C.UTF-8, PEP 538/540)"
EQUIVALENT = {
    "sglang_deploy/known_good.py": {
        "xǁStoreǁnext_sequence__mutmut_6": _SPLIT,
        "xǁStoreǁnext_sequence__mutmut_9": _SPLIT,
        "xǁStoreǁnext_sequence__mutmut_18": _SPLIT,
        "xǁStoreǁnext_sequence__mutmut_21": _SPLIT,
        "x_newest_first__mutmut_8": _UTF8,
        "x_restore_files__mutmut_22": _UTF8,
        "x_newest_first__mutmut_4": _LOCALE,
        "x_newest_first__mutmut_6": _LOCALE,
        "x_restore_files__mutmut_18": _LOCALE,
        "x_restore_files__mutmut_20": _LOCALE,
        "xǁStoreǁrecord__mutmut_15": _NOW,
        "xǁStoreǁrecord__mutmut_49": _NOW,
        "xǁStoreǁrecord__mutmut_81": _NOW,
        "x_read_files__mutmut_3": _LOCALE,
        "x_read_files__mutmut_5": _LOCALE,
        "x_read_files__mutmut_7": _UTF8,
        "x_software_of__mutmut_13": _LOCALE,
        "x_software_of__mutmut_15": _LOCALE,
        "x_software_of__mutmut_23": _UTF8,
    },
}
SOURCE_DIRS = ["sglang_deploy", "driver", "filter_plugins"]


def tracked() -> list[str]:
    # tracked, and new files not ignored (what the next commit may hold)
    argv = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    out = subprocess.run(argv, cwd=REPO, capture_output=True, check=True).stdout
    return [raw.decode() for raw in out.split(b"\0") if raw]


def stage_tree() -> None:
    """The tracked tree copied into STAGE (mutants/ and mutmut's cache kept), sglang_deploy/ at the top."""
    STAGE.mkdir(exist_ok=True)
    for rel in tracked():
        src, dst = REPO / rel, STAGE / rel
        if src.is_symlink():  # playbooks/group_vars
            if not dst.is_symlink():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(os.readlink(src))
        elif src.is_file() and (not dst.exists() or dst.read_bytes() != src.read_bytes()):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    link = STAGE / "sglang_deploy"
    if not link.is_symlink():
        link.symlink_to("module_utils/sglang_deploy")


def config(files: list[str]) -> str:
    """mutmut's setup.cfg: every source file outside `files` left unmutated; the unit tests (not the lab's)."""
    others = sorted(
        str(p.relative_to(STAGE))
        for d in SOURCE_DIRS
        for p in (STAGE / d).glob("*.py")
        if str(p.relative_to(STAGE)) not in files
    )
    lines = ["[mutmut]", "source_paths =", *(f"    {d}/" for d in SOURCE_DIRS)]
    lines += ["do_not_mutate =", *(f"    {p}" for p in others)]
    # Everything else tracked, as it is: the tests run playbooks, read docs, roles and the lab's files.
    tops = sorted({p.split("/", 1)[0] for p in tracked()} - set(SOURCE_DIRS))
    lines += ["also_copy =", *(f"    {p}" for p in tops)]
    # pytest-randomly off (each mutant's tests in file order); the lab's tests are e2e, never run per mutant.
    # Left out: the tests of this checkout's own .venv (the doctor's, and py-spy found in it), which the copy has not.
    away = ["--ignore=tests/test_doctor.py", "--deselect=tests/test_evidence.py::test_real_py_spy_dumps_every_rank"]
    args = ["-p", "no:randomly", "-p", "no:cacheprovider", *away]
    lines += ["pytest_add_cli_args =", *(f"    {a}" for a in args)]
    lines += ["pytest_add_cli_args_test_selection =", *(f"    {a}" for a in ("-m", "not lab", "tests"))]
    return "\n".join(lines) + "\n"


def results(files: list[str]) -> dict[str, dict]:
    """Each file's counts from mutmut's own .meta files, by mutmut's own reading of an exit code."""
    os.chdir(STAGE)  # mutmut reads its setup.cfg on import
    from mutmut.stats import status_by_exit_code  # the tool's mapping, not a copy of it

    out = {}
    for rel in files:
        meta = STAGE / "mutants" / f"{rel}.meta"
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        by: dict[str, list[str]] = {}
        for key, code in codes.items():
            by.setdefault(status_by_exit_code[code], []).append(key)
        short = {key: key.rsplit(".", 1)[-1] for key in codes}  # the name without its module
        why = EQUIVALENT.get(rel, {})
        killed = len(by.get("killed", [])) + len(by.get("timeout", []))  # out of time: the tests caught it too
        survived = sorted(short[k] for k in by.get("survived", []) if short[k] not in why)
        equivalent = {short[k]: why[short[k]] for k in by.get("survived", []) if short[k] in why}
        tested = killed + len(survived) + len(by.get("no tests", []))  # untested is not killed
        out[rel] = {
            "mutants": len(codes),
            "killed": killed,
            "survived": len(survived),
            "equivalent": len(equivalent),
            "no_tests": len(by.get("no tests", [])),
            "other": {k: len(v) for k, v in by.items() if k not in ("killed", "survived", "timeout", "no tests")},
            "score": round(100 * killed / tested, 1) if tested else None,
            "survivors": survived,
            "equivalents": equivalent,
            # listed as equivalent, but killed now or gone: look at it again
            "stale_equivalents": sorted(set(why) - set(equivalent)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="*", default=SCOPE, help="the files to mutate (default: the scope)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants tested at once")
    ap.add_argument("--floor", type=float, default=90.0, help="the least score of each core file (percent)")
    ap.add_argument(
        "--fresh", action="store_true", help="test every mutant again (after new tests), not only changed code"
    )
    ap.add_argument("--no-write", action="store_true", help=f"print only; leave {OUT.relative_to(REPO)} as it is")
    args = ap.parse_args(argv)
    unknown = [f for f in args.files if f not in SCOPE]
    if unknown:
        ap.error(f"--files: {', '.join(unknown)} not in the scope ({', '.join(SCOPE)})")
    stage_tree()
    (STAGE / "setup.cfg").write_text(config(args.files))
    if args.fresh:  # mutmut re-tests only what changed: its results for these files forgotten
        (STAGE / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)  # which test reaches what, anew
        for rel in args.files:
            for stale in (rel, f"{rel}.meta"):  # the mutated copy too: mutmut makes both again
                (STAGE / "mutants" / stale).unlink(missing_ok=True)
    t0 = time.monotonic()
    run = subprocess.run([str(MUTMUT), "run", "--max-children", str(args.jobs)], cwd=STAGE, check=False)
    seconds = round(time.monotonic() - t0, 1)
    got = results(args.files)
    print(f"{'file':36} {'mutants':>7} {'killed':>6} {'survived':>8} {'equiv.':>6} {'no tests':>8} {'score':>6}")
    for rel, r in got.items():
        score = "-" if r["score"] is None else f"{r['score']}%"
        print(
            f"{rel:36} {r['mutants']:7} {r['killed']:6} {r['survived']:8} {r['equivalent']:6} {r['no_tests']:8} {score:>6}"
        )
    print(f"{seconds} s, {args.jobs} at once (mutmut exit {run.returncode})")
    if not args.no_write:
        doc = json.loads(OUT.read_text()) if OUT.exists() else {"files": {}}
        doc["files"].update(got)
        doc["runs"] = [*doc.get("runs", []), {"files": args.files, "seconds": seconds, "jobs": args.jobs}][-10:]
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    low = [f for f in args.files if f in CORE and (got[f]["score"] or 0) < args.floor]
    if low:
        print(f"under {args.floor}%: {', '.join(low)}", file=sys.stderr)
    return 1 if low or run.returncode not in (0,) else 0


if __name__ == "__main__":
    sys.exit(main())
