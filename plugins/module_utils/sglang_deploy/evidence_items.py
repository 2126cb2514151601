"""The crash evidence bundle's items (evidence.py packs them): what unit-state, py-spy, journal, failure, config,
patches, gpu-state, nvidia-smi, kernel and pip-freeze each take from the host, in that order (perishable first),
each within its cap (CAPS) and what is left of the collection's budget.

An item that cannot be taken (a missing tool, nothing to dump) raises Skip: its reason is the item's detail, never
the collection's failure. Side effects come through the ports (evidence.EvidencePorts); every text taken is redacted
when the bundle is packed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import gpu
from .instance import Instance
from .secret_rule import Redactor, masked

WRITE_RESERVE_S = 0.5  # of the budget, kept for writing the tar
MIN_ITEM_S = 0.2  # an item with less time than this left is skipped
MAX_ITEM_BYTES = 8 << 20  # one item's output, cut beyond this
JOURNAL_LINES = 20000
KERNEL_LINES = 1000  # the newest Xid/NVRM lines kept
MAX_PROCESSES = 64
PY_SPY_TRY_S = 2.5  # the blocking dump's share; --nonblocking gets what is left of the item
KERNEL_MATCH = re.compile(r"NVRM|Xid")

# Item caps in seconds, in the order they run: the perishable first (processes a rollback stops), the free ones
# early so that a slow tool cannot starve them.
CAPS = {
    "unit-state": 2.0,
    "py-spy": 4.0,
    "journal": 3.0,
    "failure": 0.0,
    "config": 0.0,
    "patches": 0.0,
    "gpu-state": 3.0,
    "nvidia-smi": 3.0,
    "kernel": 2.0,
    "pip-freeze": 3.0,
}
ITEMS = tuple(CAPS)


class Skip(Exception):
    """The item could not be taken (a missing tool, nothing to dump): its reason is the detail."""


def _read(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(MAX_ITEM_BYTES + 1)
    except OSError:
        return None


def _lines(text: str) -> int:
    return len(text.splitlines())


def entries(journal: str) -> int:
    """journalctl's lines less its own remarks ("-- No entries --", "-- Boot ... --", "No journal files ...")."""
    return len([x for x in journal.splitlines() if x.strip() and not x.startswith(("-- ", "No journal files"))])


def py_spy_reason(dump: str) -> str:
    """py-spy's own words on a failed dump ("Error: Failed to find python version ...", "Permission Denied: ...",
    a timeout): the last attempt's first line that says something."""
    last = dump.rsplit("$ py-spy ", 1)[-1].splitlines()
    if last and "timed out" in last[0]:
        return last[0].split("(", 1)[-1].rstrip(")")
    skip = ("Stack backtrace", "Python v", "Process ", "[")
    return next((x.strip() for x in last[1:] if x.strip() and not x.startswith(skip) and not x[:1].isspace()), "")


def _seconds(value: float) -> float:
    return round(max(0.0, value), 3)


class Collection:
    """One collection's items, taken in ITEMS' order within the budget: the files they give, what each said."""

    def __init__(
        self,
        inst: Instance,
        invocation: str | None,
        failure,
        request,
        budget_s: float,
        ports,
        redactor: Callable[[Instance], Redactor],
    ):
        self.inst, self.invocation, self.failure, self.request = inst, invocation, failure, request
        self.p = ports
        self.budget_s = budget_s
        self.t0 = ports.clock()
        self.deadline = self.t0 + max(0.0, budget_s - min(WRITE_RESERVE_S, budget_s * 0.1))
        self.files: dict[str, str] = {}
        self.items: list[dict] = []
        self.truncated = False
        self.props: dict[str, str] = {}
        self.redact = redactor(inst)  # evidence.redactor_for: passed in, as evidence.py imports this file

    def left(self) -> float:
        return self.deadline - self.p.clock()

    def sh(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        """A command within timeout; Skip with the reason when it is missing, cannot run or overruns."""
        try:
            return self.p.run(argv, max(0.05, timeout))
        except FileNotFoundError:
            raise Skip(f"{argv[0]} not found on this host") from None
        except subprocess.TimeoutExpired:
            raise Skip(f"{' '.join(argv[:3])} timed out after {timeout:.1f}s") from None
        except OSError as exc:
            raise Skip(f"{argv[0]} could not be run: {exc}") from None

    def put(self, name: str, text: str) -> None:
        if len(text) > MAX_ITEM_BYTES:
            text = text[-MAX_ITEM_BYTES:] + "\n[cut: only the last part kept]\n"
            self.truncated = True
        self.files[name] = text

    def run_items(self) -> None:
        for name in ITEMS:
            left = self.left()
            if left < MIN_ITEM_S:
                self.items.append({"name": name, "ok": False, "seconds": 0.0, "detail": "skipped: budget"})
                self.truncated = True
                continue
            timeout = min(CAPS[name], left) if CAPS[name] else left
            t0 = self.p.clock()
            try:
                ok, detail = getattr(self, "item_" + name.replace("-", "_"))(timeout)
            except Skip as exc:
                ok, detail = False, str(exc)
            except Exception as exc:  # a bug or an odd host: this item fails, the others are still taken
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            self.items.append({"name": name, "ok": ok, "seconds": _seconds(self.p.clock() - t0), "detail": detail})

    # ------------------------------------------------------------------ items

    def item_unit_state(self, timeout: float) -> tuple[bool, str]:
        out = self.sh(["systemctl", "show", self.inst.unit, "--no-pager"], timeout)
        self.props = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
        self.put("unit-state.txt", out.stdout + out.stderr)
        if out.returncode != 0:
            return False, f"systemctl show exited {out.returncode}: {out.stderr.strip()[:200]}"
        p = self.props
        return True, (
            f"{p.get('ActiveState', '?')}/{p.get('SubState', '?')}, main pid {p.get('MainPID', '?')}, "
            f"invocation {p.get('InvocationID') or 'none'}"
        )

    def item_py_spy(self, timeout: float) -> tuple[bool, str]:
        deadline = self.p.clock() + timeout
        venv = self.inst.venv
        own = os.path.join(venv, "bin", "py-spy") if venv else None
        spy = own if own and os.path.isfile(own) and os.access(own, os.X_OK) else self.p.which("py-spy")
        if not spy:
            raise Skip(f"py-spy not found ({own or 'no virtualenv'} is missing and none is on PATH)")
        pids = self.processes()
        if not pids:
            raise Skip(f"no process to dump: the unit runs none (main pid {self.props.get('MainPID', '?')})")
        python = [pid for pid in pids if self.is_python(pid)]
        others = sorted(set(pids) - set(python))
        if not python:
            raise Skip(f"none of the unit's processes {pids} is a Python process")
        with ThreadPoolExecutor(max_workers=max(1, min(self.p.workers, len(python)))) as pool:
            results = list(pool.map(lambda pid: self.dump(spy, pid, deadline), python))
        dumped = [pid for pid, ok in zip(python, results, strict=True) if ok]
        failed = [(pid, ok) for pid, ok in zip(python, results, strict=True) if not ok]
        detail = f"dumped {len(dumped)} of {len(python)} Python processes {python} with {spy}"
        if failed:
            detail += "; failed: " + ", ".join(str(pid) for pid, _ in failed) + " (see py-spy/<pid>.txt)"
            reason = py_spy_reason(self.files.get(f"py-spy/{failed[0][0]}.txt", ""))
            if reason:
                detail += f": {reason[:200]}"
        if others:
            detail += f"; not Python, not dumped: {others}"
        return bool(dumped) and not failed, detail

    def dump(self, spy: str, pid: int, deadline: float) -> bool:
        """py-spy dump of one process: blocking (consistent stacks) first, --nonblocking when that fails."""
        parts = []
        for extra in ([], ["--nonblocking"]):
            left = deadline - self.p.clock()
            if left < MIN_ITEM_S / 2:
                parts.append("[no time left for another attempt]\n")
                break
            argv = [spy, "dump", *extra, "--pid", str(pid)]
            timeout = min(PY_SPY_TRY_S, left * 0.6) if not extra else left
            t0 = self.p.clock()
            try:
                out = self.sh(argv, timeout)
            except Skip as exc:
                parts.append(f"$ py-spy {' '.join(argv[1:])}  ({exc})\n")
                continue
            seconds = self.p.clock() - t0
            parts.append(
                f"$ py-spy {' '.join(argv[1:])}  (rc {out.returncode}, {seconds:.2f} s)\n{out.stdout}{out.stderr}\n"
            )
            if out.returncode == 0 and out.stdout.strip():
                self.put(f"py-spy/{pid}.txt", "".join(parts))
                return True
        self.put(f"py-spy/{pid}.txt", "".join(parts))
        return False

    def processes(self) -> list[int]:
        """The unit's processes: its cgroup's (every sub-cgroup's) cgroup.procs, and the main pid's descendants."""
        pids: set[int] = set()
        group = (self.props.get("ControlGroup") or "").strip("/")
        if group:
            root = self.p.cgroup_root
            for base in (root, os.path.join(root, "unified"), os.path.join(root, "systemd")):
                top = os.path.join(base, group)
                for dirpath, _dirs, files in os.walk(top):
                    if "cgroup.procs" in files:
                        for line in (_read(os.path.join(dirpath, "cgroup.procs")) or "").split():
                            if line.isdigit():
                                pids.add(int(line))
                if pids:
                    break
        try:
            main = int(self.props.get("MainPID") or 0)
        except ValueError:
            main = 0
        if main:
            pids |= {main, *self.descendants(main)}
        return ([main] if main in pids else []) + sorted(pids - {main})[: MAX_PROCESSES - 1]

    def descendants(self, root: int) -> set[int]:
        children: dict[int, list[int]] = {}
        try:
            names = os.listdir(self.p.proc_root)
        except OSError:
            return set()
        for name in names:
            if not name.isdigit():
                continue
            stat = _read(os.path.join(self.p.proc_root, name, "stat")) or ""
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) >= 2 and fields[1].isdigit():
                children.setdefault(int(fields[1]), []).append(int(name))
        out, todo = set(), [root]
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in out:
                    out.add(child)
                    todo.append(child)
        return out

    def is_python(self, pid: int) -> bool:
        """A process py-spy can read: its executable or argv[0] is a python (unknown counts as one)."""
        base = os.path.join(self.p.proc_root, str(pid))
        try:
            exe = os.readlink(os.path.join(base, "exe"))
        except OSError:
            exe = ""
        argv0 = (_read(os.path.join(base, "cmdline")) or "").split("\0")[0]
        if not exe and not argv0:
            return True
        return any("python" in os.path.basename(x) for x in (exe, argv0) if x)

    def item_journal(self, timeout: float) -> tuple[bool, str]:
        unit_name = self.inst.unit
        invocation = self.invocation or self.props.get("InvocationID") or None
        base = ["journalctl", "--no-pager", "-o", "short-iso", "-n", str(JOURNAL_LINES)]
        deadline = self.p.clock() + timeout
        if invocation:
            # The unit's own lines, and systemd's about that invocation ("Main process exited, ...").
            either = [f"_SYSTEMD_INVOCATION_ID={invocation}", "+", f"INVOCATION_ID={invocation}"]
            for match in (either, [f"_SYSTEMD_INVOCATION_ID={invocation}"]):
                out = self.sh(base + match, deadline - self.p.clock())
                if out.returncode == 0 and entries(out.stdout):
                    self.put("journal.txt", out.stdout)
                    return True, f"{entries(out.stdout)} lines of invocation {invocation}"
        out = self.sh([*base, "-u", unit_name], deadline - self.p.clock())
        self.put("journal.txt", out.stdout + out.stderr)
        if out.returncode != 0:
            return False, f"journalctl exited {out.returncode}: {out.stderr.strip()[:200]}"
        if not entries(out.stdout):
            return False, f"no journal entries for {unit_name}: {' '.join(out.stdout.split())[:200]}"
        why = f"no lines for invocation {invocation}: " if invocation else "no invocation known: "
        return True, f"{why}the last {entries(out.stdout)} lines of {unit_name}"

    def item_failure(self, timeout: float) -> tuple[bool, str]:
        failure = self.failure or {}
        response = failure.get("response") if isinstance(failure, dict) else None
        record = self.redact.data({"failure": self.failure, "request": self.request, "response": response})
        self.put("failure.json", json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
        tb = failure.get("traceback") if isinstance(failure, dict) else None
        if tb:
            self.put("traceback.txt", "\n".join(tb if isinstance(tb, list) else [str(tb)]) + "\n")
        if not self.failure:
            return True, "on demand: no failure given" + (", a request" if self.request else "")
        return True, f"{failure.get('phase', '?')}: {str(failure.get('cause', '?'))[:200]}"

    def item_config(self, timeout: float) -> tuple[bool, str]:
        i = self.inst
        secrets = os.path.realpath(i.secrets_path) if i.secrets_path else None
        taken, missing = [], []
        for live in i.config_files:
            sources = [(live, f"config/{os.path.basename(live)}")]
            pending = i.pending_path(live)
            sources.append((pending, f"config/pending/{os.path.basename(live)}"))
            for path, arcname in sources:
                if secrets and os.path.realpath(path) == secrets:
                    continue  # never the secrets file, whatever a record says
                text = _read(path)
                if text is not None:
                    self.put(arcname, text)
                    taken.append(arcname)
                elif path == live:
                    missing.append(live)
        record = dataclasses.asdict(i)
        record["argv"] = masked(i.argv)
        record["profiles_argv"] = {k: masked(v) for k, v in i.profiles_argv.items()}
        self.put("config/instance.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
        detail = ", ".join(taken) or "no file"
        return not missing, detail + (f"; missing: {', '.join(missing)}" if missing else "")

    def item_patches(self, timeout: float) -> tuple[bool, str]:
        venv = self.inst.venv
        if not venv:
            raise Skip(f"argv[0] {self.inst.argv[:1]} is no <venv>/bin/python: no virtualenv to read")
        meta = os.path.join(venv, "sglang-deploy")
        manifest = _read(os.path.join(meta, "patches.json"))
        generation = _read(os.path.join(meta, "generation.json"))
        if generation is not None:
            self.put("generation.json", generation)
        if manifest is None:
            raise Skip(f"no patch manifest at {meta}/patches.json")
        self.put("patches.json", manifest)
        return True, f"{meta}/patches.json" + (" and generation.json" if generation is not None else "")

    def item_gpu_state(self, timeout: float) -> tuple[bool, str]:
        try:
            snap = self.p.snapshot(timeout)
        except gpu.NvidiaSmiError as exc:
            raise Skip(str(exc)) from None
        self.put("gpu-state.json", json.dumps(snap, indent=2, sort_keys=True, default=str) + "\n")
        mine = [p for p in snap.get("processes", []) if p.get("gpu") in self.inst.gpus]
        return True, f"{len(snap.get('gpus', []))} GPUs, {len(mine)} processes on the instance's GPUs {self.inst.gpus}"

    def item_nvidia_smi(self, timeout: float) -> tuple[bool, str]:
        out = self.sh(["nvidia-smi", "-q"], timeout)
        self.put("nvidia-smi-q.txt", out.stdout + out.stderr)
        if out.returncode != 0:
            return False, f"nvidia-smi -q exited {out.returncode}: {' '.join((out.stdout + out.stderr).split())[:200]}"
        return True, f"{_lines(out.stdout)} lines"

    def item_kernel(self, timeout: float) -> tuple[bool, str]:
        deadline = self.p.clock() + timeout
        tried = []
        for argv in (
            ["journalctl", "-k", "-b", "--no-pager", "-o", "short-iso", "-n", "50000"],
            ["dmesg", "--ctime"],
            ["dmesg"],
        ):
            if deadline - self.p.clock() < MIN_ITEM_S / 2:
                break
            try:
                out = self.sh(argv, deadline - self.p.clock())
            except Skip as exc:
                tried.append(str(exc))
                continue
            text = out.stdout
            if out.returncode != 0 or not text.strip() or text.strip() == "-- No entries --":
                tried.append(f"{' '.join(argv[:2])}: {(out.stderr.strip() or 'no kernel lines')[:120]}")
                continue
            lines = text.splitlines()
            matched = [line for line in lines if KERNEL_MATCH.search(line)][-KERNEL_LINES:]
            self.put("kernel-xid.txt", f"# {' '.join(argv)}: Xid/NVRM lines\n" + "".join(x + "\n" for x in matched))
            return True, f"{len(matched)} Xid/NVRM lines of {len(lines)} kernel lines ({argv[0]})"
        self.put("kernel-xid.txt", "# the kernel log could not be read:\n" + "\n".join(tried) + "\n")
        return False, "kernel log not readable: " + "; ".join(tried)

    def item_pip_freeze(self, timeout: float) -> tuple[bool, str]:
        venv = self.inst.venv
        if not venv:
            raise Skip(f"argv[0] {self.inst.argv[:1]} is no <venv>/bin/python: no virtualenv to read")
        python = os.path.join(venv, "bin", "python")
        try:
            out = self.sh([python, "-m", "pip", "freeze"], timeout)
            if out.returncode == 0:
                self.put("pip-freeze.txt", out.stdout)
                return True, f"{_lines(out.stdout)} packages ({python} -m pip freeze)"
            why = " ".join(out.stderr.split())[:160]
        except Skip as exc:
            why = str(exc)
        # A virtualenv without pip (made by uv): its dist-info directories say the same.
        found = sorted(self.dist_infos(venv))
        if not found:
            raise Skip(f"pip freeze failed ({why}) and no dist-info under {venv}/lib")
        self.put("pip-freeze.txt", f"# from the dist-info directories (pip freeze failed: {why})\n" + "\n".join(found))
        return True, f"{len(found)} packages from dist-info (pip freeze failed: {why})"

    @staticmethod
    def dist_infos(venv: str) -> list[str]:
        out = []
        lib = os.path.join(venv, "lib")
        for py in os.listdir(lib) if os.path.isdir(lib) else []:
            site = os.path.join(lib, py, "site-packages")
            for name in os.listdir(site) if os.path.isdir(site) else []:
                if name.endswith(".dist-info") and "-" in name:
                    out.append("==".join(name[: -len(".dist-info")].split("-", 1)))
        return out
