"""The crash evidence bundle as the restart and the operator read it (issue #31: the behaviours behind the mutants
tests/test_evidence.py let survive in sglang_deploy/evidence.py).

What is read: each item's ok and detail (the restart's result and sglang_collect's msg print them), the files of
the bundle (the operator opens them: exact text, JSON indented with sorted keys), the manifest and the result's
fields, the names and modes of bundles and what pruning removes. The fake host is as unkind as a real one: its
systemctl, journalctl, dmesg, nvidia-smi, py-spy and pip refuse an option they do not know, journalctl filters by
its matches and -u, systemctl show shows every unit it is given (one it does not know as not found), a command that overruns its time limit raises TimeoutExpired after that limit, a program given
by path must exist and be executable, and /proc lists its non-process entries before the processes, as Linux does.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import (
    evidence,
    evidence_items,
    gpu,
    secret_rule,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance

MASK = secret_rule.MASK
UNIT = "sglang-main.service"
INVOCATION = "0123456789abcdef0123456789abcdef"
OLD_INVOCATION = "fedcba9876543210fedcba9876543210"
MAIN, RANK0, RANK1 = 4100, 4101, 4102
API_KEY = "sk-BEHAVIOUR-0a1b2c3d4e5f"
PY_SPY = "/usr/bin/py-spy"
WALL = 1_764_547_200.0  # 2025-12-01T00:00:00Z


# --------------------------------------------------------------------------- the fake host


class Proc:
    """One process as /proc shows it: exe None is a link that cannot be read (another user's, a zombie's),
    cmdline None is no cmdline file, stat False a process gone between the listing and the read."""

    def __init__(
        self,
        pid,
        ppid,
        exe="/usr/bin/python3.11",
        cmdline=b"/opt/ml-env/bin/python\0-m\0sglang\0",
        comm="python3",
        stat=True,
    ):
        self.pid, self.ppid, self.exe, self.cmdline, self.comm, self.stat = pid, ppid, exe, cmdline, comm, stat


def dump_text(pid: int) -> str:
    return f'Process {pid}: /opt/ml-env/bin/python -m sglang\nPython v3.11.7 (/usr/bin/python3.11)\n\nThread {pid} (idle): "MainThread"\n    event_loop (scheduler.py:120)\n'


class Host:
    """A host's commands, clocks, /proc and cgroup tree. Each answer takes `delays[key]` fake seconds (keys:
    systemctl, journalctl, kernel for journalctl -k, dmesg, nvidia-smi, gpu-state, py-spy, py-spy --nonblocking,
    pip); an answer longer than the time limit given raises TimeoutExpired after that limit."""

    def __init__(
        self,
        tmp_path: Path,
        procs: list[Proc] | None = None,
        cgroup: dict[str, list[int]] | None = None,
        layout: str = "",
        group: str = f"/system.slice/{UNIT}",
    ):
        self.now = 1000.0
        self.wall_now = WALL
        self.calls: list[tuple[list[str], float]] = []
        self.delays = {"systemctl": 0.1, "journalctl": 0.2, "kernel": 0.2, "dmesg": 0.1, "nvidia-smi": 0.3}
        self.delays |= {"gpu-state": 0.3, "py-spy": 0.1, "py-spy --nonblocking": 0.1, "pip": 0.5}
        self.installed = {"systemctl", "journalctl", "dmesg", "nvidia-smi", "py-spy"}
        self.show: dict[str, str] | None = {
            "Type": "simple",
            "MainPID": str(MAIN),
            "ControlGroup": group,
            "InvocationID": INVOCATION,
            "ActiveState": "active",
            "SubState": "running",
        }
        self.show_failure: tuple[int, str] | None = None
        self.journal = [
            entry(OLD_INVOCATION, MAIN - 100, "an older start's line"),
            entry(INVOCATION, MAIN, "server_args=ServerArgs(max_total_tokens=4096)"),
            entry(INVOCATION, RANK0, "Scheduler hit an exception: Traceback (most recent call last):"),
            entry(INVOCATION, RANK0, "AttributeError: 'NoneType' object has no attribute 'hidden_states'"),
            {
                "INVOCATION_ID": INVOCATION,
                "UNIT": UNIT,
                "_SYSTEMD_UNIT": "init.scope",
                "ident": "systemd",
                "pid": 1,
                "msg": f"{UNIT}: Main process exited, code=exited, status=1/FAILURE",
            },
        ]
        self.journal_failure: tuple[int, str] | None = None
        self.kernel = "2026-12-01T00:00:00+0000 node kernel: Linux version 6.8.0\n2026-12-01T00:00:04+0000 node kernel: NVRM: Xid (PCI:0000:1b:00): 79, pid=4101, GPU has fallen off the bus.\n"
        self.kernel_answer: tuple[int, str, str] | None = None  # journalctl -k's own (rc, stdout, stderr)
        self.dmesg_denied = False
        self.smi_q = (0, "==============NVSMI LOG==============\nDriver Version : 570.86.15\nAttached GPUs : 2\n", "")
        self.snap = {"gpus": [{"index": 0, "uuid": "GPU-0"}], "processes": [{"pid": RANK0, "gpu": 0}]}
        self.snapshot_error: Exception | None = None
        self.spy: dict[tuple[int, bool], tuple[int, str, str]] = {}  # (pid, nonblocking): its answer
        self.pip = (0, "sglang==0.5.23\ntorch==2.8.0\n", "")
        self.on_spy = None  # called as each dump starts (concurrency tests)
        self.proc = tmp_path / "proc"
        self.cgroup = tmp_path / "cgroup"
        for name in ("self", "sys", "cpuinfo"):  # /proc's own entries, listed before the processes
            (self.proc / name).mkdir(parents=True)
        if procs is None:
            procs = [Proc(MAIN, 1), Proc(RANK0, MAIN), Proc(RANK1, MAIN)]
        procs = [*procs, Proc(999, 1, exe="/usr/bin/bash", cmdline=b"-bash\0", comm="bash")]  # not the unit's
        for p in procs:
            d = self.proc / str(p.pid)
            d.mkdir()
            if p.stat:
                (d / "stat").write_text(
                    f"{p.pid} ({p.comm}) S {p.ppid} {p.pid} {p.pid} 0 -1 4194560 1200 0 0 0 5 2 0 0 20 0 1 0"
                )
            if p.cmdline is not None:
                (d / "cmdline").write_bytes(p.cmdline)
            if p.exe is not None:
                (d / "exe").symlink_to(p.exe)
        if cgroup is None:
            cgroup = {"": [p.pid for p in procs if p.pid != 999]}
        group = self.cgroup / layout / self.show["ControlGroup"].strip("/")
        for sub, pids in cgroup.items():
            (group / sub).mkdir(parents=True, exist_ok=True)
            (group / sub / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))

    # ------------------------------------------------------------------ ports

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_now

    def which(self, name: str) -> str | None:
        return f"/usr/bin/{name}" if name in self.installed else None

    def snapshot(self, timeout: float) -> dict:
        self.spend("gpu-state", timeout, ["nvidia-smi"])
        if self.snapshot_error:
            raise self.snapshot_error
        return self.snap

    def ports(self, **kw) -> evidence.EvidencePorts:
        ports = evidence.EvidencePorts(
            run=self.run,
            which=self.which,
            snapshot=self.snapshot,
            clock=self.clock,
            wall=self.wall,
            hostname=lambda: "gpu-node-01",
            proc_root=str(self.proc),
            cgroup_root=str(self.cgroup),
            workers=1,  # the fake clock is one for all threads: one dump at a time keeps its arithmetic exact
        )
        for k, v in kw.items():
            setattr(ports, k, v)
        return ports

    def spend(self, key: str, timeout: float, argv: list[str]) -> None:
        delay = self.delays.get(key, 0.1)
        if delay > timeout:
            self.now += timeout
            raise subprocess.TimeoutExpired(argv, timeout)
        self.now += delay

    def run(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        self.calls.append((list(argv), timeout))
        prog = argv[0]
        if "/" in prog:  # exec: the file must be there and executable
            if not os.path.isfile(prog) and prog != PY_SPY:
                raise FileNotFoundError(2, "No such file or directory", prog)
            if prog != PY_SPY and not os.access(prog, os.X_OK):
                raise PermissionError(13, "Permission denied", prog)
            name = os.path.basename(prog)
        elif prog in self.installed:
            name = prog
        else:
            raise FileNotFoundError(2, "No such file or directory", prog)
        handler = {"systemctl": self.systemctl, "journalctl": self.journalctl, "dmesg": self.dmesg}
        handler |= {"nvidia-smi": self.nvidia_smi, "py-spy": self.py_spy, "python": self.python}
        key, rc, out, err = handler[name](argv[1:])
        self.spend(key, timeout, argv)
        return subprocess.CompletedProcess(argv, rc, out, err)

    # ------------------------------------------------------------------ commands

    def systemctl(self, args):
        verbs = [a for a in args if not a.startswith("-")]
        for a in args:
            if a.startswith("-") and a != "--no-pager":
                return "systemctl", 1, "", f"systemctl: unrecognized option '{a}'\n"
        if not verbs or verbs[0] != "show":
            return "systemctl", 1, "", f"Unknown command verb '{verbs[0] if verbs else ''}'.\n"
        if self.show_failure:
            return "systemctl", self.show_failure[0], "", self.show_failure[1]
        # One block of properties per unit named, a blank line between them; a unit systemd does not know (a
        # name without a suffix is a .service) is shown too, as not found, inactive, with no main pid.
        blocks = [self.show if u == UNIT else not_found(u) for u in verbs[1:]]
        return "systemctl", 0, "\n".join("".join(f"{k}={v}\n" for k, v in b.items()) for b in blocks), ""

    def journalctl(self, args):
        opts: dict[str, str | bool] = {}
        groups: list[list[str]] = [[]]
        i = 0
        while i < len(args):
            a = args[i]
            if a in ("-k", "-b", "--no-pager"):
                opts[a] = True
            elif a in ("-o", "-n", "-u"):
                if i + 1 == len(args):
                    return "journalctl", 1, "", f"journalctl: option requires an argument -- '{a}'\n"
                opts[a] = args[i + 1]
                i += 1
            elif a.startswith("-"):
                return "journalctl", 1, "", f"journalctl: unrecognized option '{a}'\n"
            elif a == "+":
                groups.append([])
            elif "=" in a:
                groups[-1].append(a)
            else:
                return "journalctl", 1, "", f"Failed to add match '{a}': Invalid argument\n"
            i += 1
        if opts.get("-o", "short") not in ("short", "short-iso", "short-precise", "cat", "json", "verbose"):
            return "journalctl", 1, "", f"Unknown output format '{opts['-o']}'.\n"
        lines = opts.get("-n")
        if lines is not None and not str(lines).isdigit():
            return "journalctl", 1, "", f"Failed to parse lines '{lines}'\n"
        if "-k" in opts:
            if self.kernel_answer:
                return ("kernel", *self.kernel_answer)
            text = self.kernel.splitlines(keepends=True)
            return "kernel", 0, "".join(text[-int(lines or 10**9) :]) or "-- No entries --\n", ""
        if self.journal_failure:
            return "journalctl", self.journal_failure[0], "", self.journal_failure[1]

        def matches(e: dict) -> bool:
            if "-u" in opts and opts["-u"] not in (e.get("_SYSTEMD_UNIT"), e.get("UNIT")):
                return False
            if not any(groups):
                return True
            for group in groups:
                fields: dict[str, set[str]] = {}
                for m in group:
                    k, v = m.split("=", 1)
                    fields.setdefault(k, set()).add(v)
                if group and all(e.get(k) in vs for k, vs in fields.items()):
                    return True
            return False

        found = [e for e in self.journal if matches(e)][-int(lines or 10**9) :]
        out = "".join(
            f"2026-12-01T00:00:0{n % 10}+0000 node {e['ident']}[{e['pid']}]: {e['msg']}\n" for n, e in enumerate(found)
        )
        return "journalctl", 0, out or "-- No entries --\n", ""

    def dmesg(self, args):
        if args not in ([], ["--ctime"]):
            return "dmesg", 1, "", f"dmesg: unrecognized option '{args[0]}'\n"
        if self.dmesg_denied:
            return "dmesg", 1, "", "dmesg: read kernel buffer failed: Operation not permitted\n"
        prefix = "[Tue Dec  1 00:00:04 2026] " if args else "[  104.000000] "
        return "dmesg", 0, "".join(prefix + line.split(": ", 1)[-1] + "\n" for line in self.kernel.splitlines()), ""

    def nvidia_smi(self, args):
        if args != ["-q"]:
            return "nvidia-smi", 2, "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n", ""
        return ("nvidia-smi", *self.smi_q)

    def py_spy(self, args):
        nonblocking = "--nonblocking" in args
        if [a for a in args if a != "--nonblocking"][:-1] != ["dump", "--pid"] or not args[-1].isdigit():
            return "py-spy", 2, "", f"error: unexpected arguments {args}\n"
        pid = int(args[-1])
        if self.on_spy:
            self.on_spy(pid)
        key = "py-spy --nonblocking" if nonblocking else "py-spy"
        return (key, *self.spy.get((pid, nonblocking), (0, dump_text(pid), "")))

    def python(self, args):
        if args[:1] != ["-m"]:
            return "pip", 2, "", f"unknown option {args[0]}\n"
        if args[1:2] != ["pip"]:
            return "pip", 1, "", f"/usr/bin/python: No module named {args[1]}\n"
        if args[2:] != ["freeze"]:
            return "pip", 1, "", f'ERROR: unknown command "{args[2]}"\n'
        return ("pip", *self.pip)


def not_found(unit: str) -> dict[str, str]:
    """What systemctl show prints of a unit it does not know."""
    name = unit if "." in unit else f"{unit}.service"
    return {
        "Type": "simple",
        "MainPID": "0",
        "ControlGroup": "",
        "InvocationID": "",
        "Id": name,
        "LoadState": "not-found",
        "ActiveState": "inactive",
        "SubState": "dead",
    }


def entry(invocation: str, pid: int, msg: str) -> dict:
    return {
        "_SYSTEMD_INVOCATION_ID": invocation,
        "_SYSTEMD_UNIT": UNIT,
        "ident": "sglang-launch",
        "pid": pid,
        "msg": msg,
    }


@pytest.fixture(autouse=True)
def proc_order(monkeypatch):
    """/proc as Linux lists it: its own entries (self, sys, cpuinfo, ...) first, then the processes by pid."""
    listdir = os.listdir

    def ordered(path="."):
        names = listdir(path)
        if str(path).endswith(f"{os.sep}proc"):
            return sorted(n for n in names if not n.isdigit()) + sorted((n for n in names if n.isdigit()), key=int)
        return names

    monkeypatch.setattr(os, "listdir", ordered)


def make_instance(tmp_path: Path, argv: list[str] | None = None, venv: bool = True, **files) -> Instance:
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True, exist_ok=True)
    python = v / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    meta = v / "sglang-deploy"
    meta.mkdir(exist_ok=True)
    (meta / "patches.json").write_text('{"series": "0.5.23"}\n')
    etc = tmp_path / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "main.secrets").write_text(files.get("secrets", f'SGLANG_API_KEY="{API_KEY}"\n'))
    (etc / "main.env").write_text(files.get("env", 'CUDA_VISIBLE_DEVICES="0,1"\n'))
    (etc / UNIT).write_text(files.get("unit", f"[Service]\nExecStart={python} -m sglang.launch_server\n"))
    if argv is None:
        argv = [str(python) if venv else "/usr/bin/python3", "-m", "sglang.launch_server", "--port", "30000"]
    return Instance(
        name="main",
        unit=UNIT,
        unit_path=str(etc / UNIT),
        env_path=str(etc / "main.env"),
        secrets_path=str(etc / "main.secrets"),
        pending_dir=str(tmp_path / "pending"),
        port=30000,
        gpus=[0, 1],
        argv=argv,
        profile="eagle3",
        profiles_argv={"eagle3": argv},
        state_dir=str(tmp_path / "state"),
    )


FAILURE = {"phase": "generate", "cause": "AttributeError: 'NoneType' object has no attribute 'hidden_states'"}


def collect(tmp_path: Path, host: Host, inst: Instance | None = None, ports=None, **kw) -> dict:
    args = {"invocation": INVOCATION, "failure": FAILURE, "request": None, "ports": ports or host.ports()}
    return evidence.collect(inst or make_instance(tmp_path), **{**args, **kw})


def members(path: str) -> dict[str, str]:
    with tarfile.open(path) as tar:
        return {m.name.partition("/")[2]: tar.extractfile(m).read().decode() for m in tar.getmembers()}


def items(res: dict) -> dict[str, dict]:
    return {i["name"]: i for i in res["items"]}


def detail(res: dict, name: str) -> str:
    return items(res)[name]["detail"]


# --------------------------------------------------------------------------- the unit's state


def test_unit_state_names_its_state_main_pid_and_invocation(tmp_path):
    host = Host(tmp_path)
    res = collect(tmp_path, host)
    assert items(res)["unit-state"] == {
        "name": "unit-state",
        "ok": True,
        "seconds": 0.1,
        "detail": f"active/running, main pid {MAIN}, invocation {INVOCATION}",
    }
    assert members(res["path"])["unit-state.txt"] == (
        f"Type=simple\nMainPID={MAIN}\nControlGroup=/system.slice/{UNIT}\nInvocationID={INVOCATION}\n"
        "ActiveState=active\nSubState=running\n"
    )


def test_unit_state_a_property_not_printed_reads_as_unknown(tmp_path):
    """An older or a container's systemd that prints only some properties: the others are '?', a unit that has
    never started has no invocation ('none')."""
    host = Host(tmp_path)
    host.show = {"Type": "simple", "InvocationID": ""}
    res = collect(tmp_path, host)
    assert detail(res, "unit-state") == "?/?, main pid ?, invocation none"


def test_unit_state_systemctl_failing(tmp_path):
    host = Host(tmp_path)
    complaint = "Failed to connect to bus: No such file or directory " + "(the system bus is not running) " * 8
    host.show_failure = (1, complaint + "\n")
    res = collect(tmp_path, host)
    assert items(res)["unit-state"]["ok"] is False
    assert detail(res, "unit-state") == f"systemctl show exited 1: {complaint.strip()[:200]}"
    # Nothing known of the unit: no main pid to start from (not pid 1, whose descendants are the whole host).
    assert detail(res, "py-spy") == "no process to dump: the unit runs none (main pid ?)"


def test_unit_state_without_systemctl(tmp_path):
    host = Host(tmp_path)
    host.installed.discard("systemctl")
    res = collect(tmp_path, host)
    assert detail(res, "unit-state") == "systemctl not found on this host"
    assert detail(res, "py-spy") == "no process to dump: the unit runs none (main pid ?)"
    assert items(res)["journal"]["ok"] is True  # the failing invocation was given


# --------------------------------------------------------------------------- the unit's processes


def spied(host: Host) -> list[int]:
    return [
        int(argv[-1]) for argv, _ in host.calls if os.path.basename(argv[0]) == "py-spy" and "--nonblocking" not in argv
    ]


@pytest.mark.parametrize(
    ("layout", "group"),
    [("", f"/system.slice/{UNIT}"), ("unified", f"/system.slice/{UNIT}"), ("systemd", f"/XPU.slice/{UNIT}")],
)
def test_the_cgroup_names_processes_the_main_pid_did_not_start(tmp_path, layout, group):
    """cgroup v2, v1 with the unified hierarchy, v1 with systemd's named one; a rank re-parented to init (its
    parent gone) is still the unit's, in a sub-cgroup; the host's other processes are not, those of another
    instance's unit in the same slice (a Python one) and of another service neither."""
    orphan, neighbour = 4200, 4600
    procs = [Proc(MAIN, 1), Proc(RANK0, MAIN), Proc(orphan, 1), Proc(neighbour, 1)]
    host = Host(tmp_path, procs=procs, cgroup={"": [MAIN, RANK0], "payload": [orphan]}, layout=layout, group=group)
    slice_ = host.cgroup / layout / os.path.dirname(group.strip("/"))
    for unit, pids in (("sglang-other.service", [neighbour]), ("ssh.service", [999])):
        (slice_ / unit).mkdir()
        (slice_ / unit / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
    res = collect(tmp_path, host)
    assert spied(host) == [MAIN, RANK0, orphan]
    assert detail(res, "py-spy") == f"dumped 3 of 3 Python processes [{MAIN}, {RANK0}, {orphan}] with {PY_SPY}"


def test_without_a_cgroup_the_main_pids_descendants_are_found_in_proc(tmp_path):
    """No cgroup tree to read (a container without /sys/fs/cgroup): the main pid's children and theirs, through
    /proc/<pid>/stat; a rank whose name holds ') ' is read from its last ')'; a process gone between /proc's
    listing and the read of its stat is passed over."""
    grandchild, gone = 4300, 4400
    procs = [
        Proc(MAIN, 1),
        Proc(RANK0, MAIN),
        Proc(RANK1, MAIN, comm="rank) 1"),
        Proc(grandchild, RANK0),
        Proc(gone, MAIN, stat=False),
    ]
    host = Host(tmp_path, procs=procs, cgroup={})
    host.show["ControlGroup"] = ""
    res = collect(tmp_path, host)
    assert spied(host) == [MAIN, RANK0, RANK1, grandchild]
    assert items(res)["py-spy"]["ok"] is True


@pytest.mark.parametrize(("main_pid", "shown"), [("0", "0"), ("[not set]", "[not set]")])
def test_no_main_pid_and_no_cgroup_is_no_process(tmp_path, main_pid, shown):
    """A unit that runs nothing (MainPID=0), or a MainPID that is no number: nothing is dumped, least of all pid 1
    and the host's processes under it."""
    host = Host(tmp_path, cgroup={})
    host.show["MainPID"] = main_pid
    host.show["ControlGroup"] = ""
    res = collect(tmp_path, host)
    assert spied(host) == []
    assert detail(res, "py-spy") == f"no process to dump: the unit runs none (main pid {shown})"


def test_at_most_64_processes_the_main_one_first(tmp_path):
    children = list(range(5000, 5070))
    procs = [Proc(MAIN, 1), *(Proc(pid, MAIN) for pid in children)]
    host = Host(tmp_path, procs=procs)
    host.delays["py-spy"] = 0.01
    res = collect(tmp_path, host)
    assert spied(host) == [MAIN, *children[:63]]
    assert detail(res, "py-spy").startswith(f"dumped 64 of 64 Python processes [{MAIN}, 5000, 5001, ")


# --------------------------------------------------------------------------- which processes py-spy is given


def test_python_processes_by_their_executable_or_argv0(tmp_path):
    """py-spy is given what it can read: a python by its executable (a rank that retitled itself), by argv[0]
    when the executable cannot be read (another user's), and a process nothing is known of (a zombie: no
    executable, no command line); not a shell wrapper, even one that names a python further on its line."""
    retitled, others_python, zombie, wrapper, odd_bytes = 4501, 4502, 4503, 4504, 4505
    wrapper_line = b"/bin/sh\0/usr/local/libexec/sglang-launch\0/opt/ml-env/bin/python\0"
    procs = [
        Proc(MAIN, 1),
        Proc(retitled, MAIN, cmdline=b"sglang::scheduler_TP0\0\0\0"),
        Proc(others_python, MAIN, exe=None, cmdline=b"/opt/ml-env/bin/python3\0-m\0sglang\0"),
        Proc(zombie, MAIN, exe=None, cmdline=b""),
        Proc(wrapper, MAIN, exe=None, cmdline=wrapper_line),
        Proc(odd_bytes, MAIN, cmdline=b"/opt/ml-env/bin/python\0--prompt-file\0/data/caf\xe9.txt\0"),
    ]
    host = Host(tmp_path, procs=procs)
    res = collect(tmp_path, host)
    python = [MAIN, retitled, others_python, zombie, odd_bytes]
    assert spied(host) == python
    assert detail(res, "py-spy") == (
        f"dumped 5 of 5 Python processes {python} with {PY_SPY}; not Python, not dumped: [{wrapper}]"
    )


def test_a_wrapper_with_a_readable_executable_is_no_python(tmp_path):
    procs = [Proc(MAIN, 1, exe="/usr/bin/bash", cmdline=b"/bin/bash\0/usr/local/libexec/sglang-launch\0")]
    host = Host(tmp_path, procs=procs)
    res = collect(tmp_path, host)
    assert spied(host) == []
    assert detail(res, "py-spy") == f"none of the unit's processes [{MAIN}] is a Python process"


# --------------------------------------------------------------------------- py-spy


def test_py_spy_from_path_when_the_unit_has_no_virtualenv(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path, venv=False)
    res = collect(tmp_path, host, inst=inst)
    assert detail(res, "py-spy") == f"dumped 3 of 3 Python processes [{MAIN}, {RANK0}, {RANK1}] with {PY_SPY}"


def test_the_virtualenvs_own_py_spy_first(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    own = Path(inst.venv) / "bin" / "py-spy"
    own.write_text("#!/bin/sh\n")
    own.chmod(0o755)
    res = collect(tmp_path, host, inst=inst)
    assert detail(res, "py-spy").endswith(f"with {own}")


@pytest.mark.parametrize("venv", [True, False])
def test_no_py_spy_anywhere(tmp_path, venv):
    host = Host(tmp_path)
    host.installed.discard("py-spy")
    inst = make_instance(tmp_path, venv=venv)
    res = collect(tmp_path, host, inst=inst)
    where = f"{inst.venv}/bin/py-spy" if venv else "no virtualenv"
    assert items(res)["py-spy"]["ok"] is False
    assert detail(res, "py-spy") == f"py-spy not found ({where} is missing and none is on PATH)"


def test_one_failed_dump_fails_the_item_and_names_py_spys_reason(tmp_path):
    host = Host(tmp_path)
    why = "Error: Failed to find python version from target process"
    for nonblocking in (False, True):
        host.spy[(RANK1, nonblocking)] = (1, f"Process {RANK1}: /opt/ml-env/bin/python\n", why + "\n")
    res = collect(tmp_path, host)
    assert items(res)["py-spy"]["ok"] is False
    assert detail(res, "py-spy") == (
        f"dumped 2 of 3 Python processes [{MAIN}, {RANK0}, {RANK1}] with {PY_SPY}; "
        f"failed: {RANK1} (see py-spy/<pid>.txt): {why}"
    )


def test_every_failed_dump_is_named_and_a_long_reason_cut(tmp_path):
    host = Host(tmp_path)
    why = "Error: " + "x" * 300
    for pid in (RANK0, RANK1):
        for nonblocking in (False, True):
            host.spy[(pid, nonblocking)] = (1, "", why + "\n")
    res = collect(tmp_path, host)
    assert detail(res, "py-spy") == (
        f"dumped 1 of 3 Python processes [{MAIN}, {RANK0}, {RANK1}] with {PY_SPY}; "
        f"failed: {RANK0}, {RANK1} (see py-spy/<pid>.txt): {why[:200]}"
    )


def test_a_dump_with_no_time_left_gives_no_reason(tmp_path):
    """The main process's blocking dump hangs and its nonblocking one takes the rest of the item's 4 s: the rank
    is not tried, and there is no reason of py-spy's to show for it."""
    host = Host(tmp_path, procs=[Proc(MAIN, 1), Proc(RANK0, MAIN)])
    host.delays["py-spy"] = 60.0
    host.delays["py-spy --nonblocking"] = 1.55
    res = collect(tmp_path, host)
    assert members(res["path"])[f"py-spy/{RANK0}.txt"] == "[no time left for another attempt]\n"
    assert detail(res, "py-spy") == (
        f"dumped 1 of 2 Python processes [{MAIN}, {RANK0}] with {PY_SPY}; failed: {RANK0} (see py-spy/<pid>.txt)"
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_at_most_workers_dumps_at_once(tmp_path, workers):
    """EvidencePorts.workers bounds how many processes py-spy stops at once: one more never joins them (each
    dump waits a moment at a barrier for one more than allowed; none ever comes)."""
    host = Host(tmp_path)
    crowd = threading.Barrier(workers + 1, timeout=0.3)
    crowded: list[int] = []

    def arrive(pid: int) -> None:
        try:
            crowd.wait()
            crowded.append(pid)
        except threading.BrokenBarrierError:
            pass

    host.on_spy = arrive
    res = collect(tmp_path, host, ports=host.ports(workers=workers))
    assert crowded == []
    assert items(res)["py-spy"]["ok"] is True


def test_a_hung_blocking_dump_leaves_the_nonblocking_one_the_rest(tmp_path):
    """The blocking dump gets 60 % of the item's 4 s (2.4 s); hung, the nonblocking one is tried with the rest.
    The file says what each attempt gave, in order, with its time."""
    host = Host(tmp_path, procs=[Proc(MAIN, 1)])
    host.delays["py-spy"] = 60.0
    host.delays["py-spy --nonblocking"] = 0.25
    res = collect(tmp_path, host)
    assert members(res["path"])[f"py-spy/{MAIN}.txt"] == (
        f"$ py-spy dump --pid {MAIN}  ({PY_SPY} dump --pid timed out after 2.4s)\n"
        f"$ py-spy dump --nonblocking --pid {MAIN}  (rc 0, 0.25 s)\n{dump_text(MAIN)}\n"
    )
    assert items(res)["py-spy"]["ok"] is True


def test_a_blocking_dump_py_spy_fails_is_tried_without_blocking(tmp_path):
    """py-spy exits 1 having printed the process's header: no stacks, so the nonblocking dump is tried."""
    host = Host(tmp_path, procs=[Proc(MAIN, 1)])
    header = f"Process {MAIN}: /opt/ml-env/bin/python -m sglang\nPython v3.11.7 (/usr/bin/python3.11)\n"
    host.spy[(MAIN, False)] = (1, header, "Error: Failed to suspend process\n")
    res = collect(tmp_path, host)
    assert members(res["path"])[f"py-spy/{MAIN}.txt"] == (
        f"$ py-spy dump --pid {MAIN}  (rc 1, 0.10 s)\n{header}Error: Failed to suspend process\n\n"
        f"$ py-spy dump --nonblocking --pid {MAIN}  (rc 0, 0.10 s)\n{dump_text(MAIN)}\n"
    )
    assert items(res)["py-spy"]["ok"] is True


@pytest.mark.parametrize(
    ("unit_state_s", "ok", "second"),
    [
        # 0.8 s left for py-spy: the blocking dump 0.48 s, the nonblocking one the 0.32 s left.
        (1.0, True, f"$ py-spy dump --nonblocking --pid {MAIN}  (rc 0, 0.05 s)\n{dump_text(MAIN)}\n"),
        # 0.22 s left: the blocking dump 0.132 s; 0.088 s is too little for another attempt.
        (1.58, False, "[no time left for another attempt]\n"),
    ],
)
def test_the_nonblocking_dump_with_little_time_left(tmp_path, unit_state_s, ok, second):
    host = Host(tmp_path, procs=[Proc(MAIN, 1)])
    host.delays |= {"systemctl": unit_state_s, "py-spy": 60.0, "py-spy --nonblocking": 0.05}
    res = collect(tmp_path, host, budget_s=2.0)  # 1.8 s for the items, 0.2 s kept for the tar
    first = f"{0.6 * (1.8 - unit_state_s):.1f}"
    assert members(res["path"])[f"py-spy/{MAIN}.txt"] == (
        f"$ py-spy dump --pid {MAIN}  ({PY_SPY} dump --pid timed out after {first}s)\n{second}"
    )
    assert items(res)["py-spy"]["ok"] is ok


@pytest.mark.parametrize(
    ("dump", "reason"),
    [
        # Both attempts timed out: the last one's words.
        (
            f"$ py-spy dump --pid 7  ({PY_SPY} dump --pid timed out after 2.4s)\n"
            f"$ py-spy dump --nonblocking --pid 7  ({PY_SPY} dump --nonblocking timed out after 1.6s)\n",
            f"{PY_SPY} dump --nonblocking timed out after 1.6s",
        ),
        # A py-spy under a path with parentheses: sh's message whole.
        (
            "$ py-spy dump --pid 7  (/opt/sglang (old)/bin/py-spy dump --pid timed out after 2.4s)\n",
            "/opt/sglang (old)/bin/py-spy dump --pid timed out after 2.4s",
        ),
        # py-spy's header, a blank line, its backtrace: the first line that says something.
        (
            "$ py-spy dump --pid 7  (rc 1, 0.05 s)\nProcess 7: /usr/bin/python3\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
            "Stack backtrace:\n    0: py_spy::main\nError: Failed to suspend process\n",
            "Error: Failed to suspend process",
        ),
        # Nothing said before the time ran out.
        (
            "$ py-spy dump --pid 7  (rc 1, 0.05 s)\nProcess 7: /usr/bin/python3\n[no time left for another attempt]\n",
            "",
        ),
        ("[no time left for another attempt]\n", ""),
    ],
)
def test_py_spys_reason(dump, reason):
    assert evidence_items.py_spy_reason(dump) == reason


# --------------------------------------------------------------------------- the journal

NEWER = "aaaabbbbccccddddaaaabbbbccccdddd"  # the unit's current invocation: a start after the failing one


def journal_messages(res: dict) -> list[str]:
    return [line.split("]: ", 1)[1] for line in members(res["path"])["journal.txt"].splitlines()]


def test_the_journal_of_the_failing_invocation_not_the_units_current_one(tmp_path):
    host = Host(tmp_path)
    host.show["InvocationID"] = NEWER
    host.journal.append(entry(NEWER, MAIN + 1000, "the next start's line"))
    res = collect(tmp_path, host, invocation=INVOCATION)
    assert journal_messages(res) == [
        "server_args=ServerArgs(max_total_tokens=4096)",
        "Scheduler hit an exception: Traceback (most recent call last):",
        "AttributeError: 'NoneType' object has no attribute 'hidden_states'",
        f"{UNIT}: Main process exited, code=exited, status=1/FAILURE",  # systemd's, about that invocation
    ]
    assert items(res)["journal"] == {
        "name": "journal",
        "ok": True,
        "seconds": 0.2,
        "detail": f"4 lines of invocation {INVOCATION}",
    }


def test_the_journal_falls_back_to_the_units_last_lines(tmp_path):
    host = Host(tmp_path)
    res = collect(tmp_path, host, invocation="deadbeef" * 4)
    assert journal_messages(res)[0] == "an older start's line" and len(journal_messages(res)) == 5
    assert items(res)["journal"]["ok"] is True
    assert detail(res, "journal") == f"no lines for invocation {'deadbeef' * 4}: the last 5 lines of {UNIT}"


def test_the_journal_of_a_unit_never_started(tmp_path):
    host = Host(tmp_path)
    host.show["InvocationID"] = ""
    res = collect(tmp_path, host, invocation=None, failure=None)
    assert detail(res, "journal") == f"no invocation known: the last 5 lines of {UNIT}"
    assert [argv[-2:] for argv, _ in host.calls if argv[0] == "journalctl" and "-k" not in argv] == [["-u", UNIT]]


def test_the_journal_unreadable(tmp_path):
    host = Host(tmp_path)
    complaint = "Failed to open journal directory /var/log/journal: Permission denied. " * 4
    host.journal_failure = (1, complaint + "\n")
    res = collect(tmp_path, host)
    assert items(res)["journal"]["ok"] is False
    assert detail(res, "journal") == f"journalctl exited 1: {complaint.strip()[:200]}"


def test_no_journal_entries_for_the_unit(tmp_path):
    host = Host(tmp_path)
    host.journal = []
    res = collect(tmp_path, host)
    assert items(res)["journal"]["ok"] is False
    assert detail(res, "journal") == f"no journal entries for {UNIT}: -- No entries --"


@pytest.mark.parametrize("invocation", [INVOCATION, None])
def test_a_hung_journalctl_is_given_up_at_the_items_cap(tmp_path, invocation):
    host = Host(tmp_path)
    host.show["InvocationID"] = ""
    host.delays["journalctl"] = 60.0
    res = collect(tmp_path, host, invocation=invocation)
    assert items(res)["journal"] == {
        "name": "journal",
        "ok": False,
        "seconds": 3.0,
        "detail": "journalctl --no-pager -o timed out after 3.0s",
    }


# --------------------------------------------------------------------------- the failure


def test_the_failure_as_written_and_named(tmp_path):
    host = Host(tmp_path)
    unit_file = tmp_path / "etc" / UNIT
    cause = "AttributeError: " + "hidden_states " * 30
    tb = 'Traceback (most recent call last):\n  File "eagle_worker.py", line 1\nAttributeError: hidden_states'
    failure = {
        "phase": "generate",
        "cause": cause,
        "unit_file": unit_file,
        "traceback": tb,
        "response": {"status": 500},
    }
    request = {"text": "Hi", "max_new_tokens": 8}
    res = collect(tmp_path, host, failure=failure, request=request)
    files = members(res["path"])
    record = {"failure": {**failure, "unit_file": str(unit_file)}, "request": request, "response": {"status": 500}}
    assert files["failure.json"] == json.dumps(record, indent=2, sort_keys=True) + "\n"  # by hand: diffable
    assert files["traceback.txt"] == tb + "\n"
    assert items(res)["failure"] == {
        "name": "failure",
        "ok": True,
        "seconds": 0.0,
        "detail": f"generate: {cause[:200]}",
    }


def test_a_traceback_as_lines(tmp_path):
    lines = ["Traceback (most recent call last):", "AttributeError: hidden_states"]
    res = collect(tmp_path, Host(tmp_path), failure={"phase": "start", "cause": "exit 1", "traceback": lines})
    assert (
        members(res["path"])["traceback.txt"] == "Traceback (most recent call last):\nAttributeError: hidden_states\n"
    )
    assert detail(res, "failure") == "start: exit 1"


def test_a_failure_without_phase_or_cause(tmp_path):
    res = collect(tmp_path, Host(tmp_path), failure={"journal_tail": ["x"]})
    assert detail(res, "failure") == "?: ?"


@pytest.mark.parametrize(
    ("request_", "said"),
    [({"text": "Hi"}, "on demand: no failure given, a request"), (None, "on demand: no failure given")],
)
def test_on_demand(tmp_path, request_, said):
    res = collect(tmp_path, Host(tmp_path), failure=None, request=request_)
    assert items(res)["failure"]["ok"] is True and detail(res, "failure") == said
    assert json.loads(members(res["path"])["failure.json"]) == {"failure": None, "request": request_, "response": None}


def test_a_failure_that_is_no_mapping_is_still_written(tmp_path):
    res = collect(tmp_path, Host(tmp_path), failure="the server died")
    assert json.loads(members(res["path"])["failure.json"]) == {
        "failure": "the server died",
        "request": None,
        "response": None,
    }


# --------------------------------------------------------------------------- the configuration


def test_the_configuration_files_and_the_record(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    debug = [*inst.argv, "--api-key", API_KEY]
    inst.profiles_argv = {"eagle3": inst.argv, "debug": debug}
    res = collect(tmp_path, host, inst=inst)
    files = members(res["path"])
    assert items(res)["config"] == {
        "name": "config",
        "ok": True,
        "seconds": 0.0,
        "detail": f"config/{UNIT}, config/main.env",
    }
    record = {f: getattr(inst, f) for f in inst.__dataclass_fields__}
    record["profiles_argv"] = {"eagle3": inst.argv, "debug": [*inst.argv, "--api-key", MASK]}
    assert files["config/instance.json"] == json.dumps(record, indent=2, sort_keys=True) + "\n"


def test_the_pending_configuration_beside_the_live_one(tmp_path):
    inst = make_instance(tmp_path)
    pending = Path(inst.pending_dir)
    pending.mkdir()
    (pending / UNIT).write_text("[Service]\nExecStart=/opt/new\n")
    (pending / "main.env").write_text('A="1"\n')
    res = collect(tmp_path, Host(tmp_path), inst=inst)
    assert detail(res, "config") == f"config/{UNIT}, config/pending/{UNIT}, config/main.env, config/pending/main.env"
    assert members(res["path"])[f"config/pending/{UNIT}"] == "[Service]\nExecStart=/opt/new\n"


def test_missing_configuration_files(tmp_path):
    inst = make_instance(tmp_path)
    os.unlink(inst.env_path)
    res = collect(tmp_path, Host(tmp_path), inst=inst)
    assert items(res)["config"]["ok"] is False
    assert detail(res, "config") == f"config/{UNIT}; missing: {inst.env_path}"
    os.unlink(inst.unit_path)
    res = collect(tmp_path, Host(tmp_path / "2"), inst=inst)
    assert detail(res, "config") == f"no file; missing: {inst.unit_path}, {inst.env_path}"


def test_a_record_naming_the_secrets_file_as_its_environment(tmp_path):
    """Never the secrets file; the pending file of that name beside the pending set is a staged environment."""
    inst = make_instance(tmp_path)
    inst.env_path = inst.secrets_path
    Path(inst.pending_dir).mkdir()
    Path(inst.pending_path(inst.env_path)).write_text('NCCL_DEBUG="WARN"\n')
    res = collect(tmp_path, Host(tmp_path), inst=inst)
    assert detail(res, "config") == f"config/{UNIT}, config/pending/main.secrets"
    assert "config/main.secrets" not in members(res["path"])


# --------------------------------------------------------------------------- patches, GPUs, nvidia-smi


NO_VENV = "argv[0] ['/usr/bin/python3'] is no <venv>/bin/python: no virtualenv to read"


def test_no_virtualenv_no_patches_nor_packages(tmp_path):
    res = collect(tmp_path, Host(tmp_path), inst=make_instance(tmp_path, venv=False))
    for name in ("patches", "pip-freeze"):
        assert items(res)[name]["ok"] is False and detail(res, name) == NO_VENV


def test_the_patch_manifest_and_the_generation(tmp_path):
    inst = make_instance(tmp_path)
    meta = f"{inst.venv}/sglang-deploy"
    res = collect(tmp_path, Host(tmp_path), inst=inst)
    assert items(res)["patches"]["ok"] is True and detail(res, "patches") == f"{meta}/patches.json"
    assert "generation.json" not in members(res["path"])
    Path(meta, "generation.json").write_text('{"id": "gen-1"}\n')
    res = collect(tmp_path, Host(tmp_path / "2"), inst=inst)
    assert detail(res, "patches") == f"{meta}/patches.json and generation.json"
    assert members(res["path"])["generation.json"] == '{"id": "gen-1"}\n'
    os.unlink(f"{meta}/patches.json")
    res = collect(tmp_path, Host(tmp_path / "3"), inst=inst)
    assert items(res)["patches"]["ok"] is False
    assert detail(res, "patches") == f"no patch manifest at {meta}/patches.json"


def test_the_gpu_state_and_the_instances_processes(tmp_path):
    host = Host(tmp_path)
    host.snap = {
        "processes": [{"pid": RANK0, "gpu": 0}, {"pid": RANK1, "gpu": 1}, {"pid": 77, "gpu": 5}],
        "gpus": [{"uuid": "GPU-0", "index": 0}, {"uuid": "GPU-1", "index": 1}],
    }
    res = collect(tmp_path, host)
    assert members(res["path"])["gpu-state.json"] == json.dumps(host.snap, indent=2, sort_keys=True) + "\n"
    assert detail(res, "gpu-state") == "2 GPUs, 2 processes on the instance's GPUs [0, 1]"


def test_nvidia_smi_q(tmp_path):
    host = Host(tmp_path)
    res = collect(tmp_path, host)
    assert items(res)["nvidia-smi"] == {"name": "nvidia-smi", "ok": True, "seconds": 0.3, "detail": "3 lines"}
    assert members(res["path"])["nvidia-smi-q.txt"] == host.smi_q[1]


def test_nvidia_smi_failing(tmp_path):
    host = Host(tmp_path)
    out = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\n"
    err = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 570.86\n"
    host.smi_q = (9, out, err)
    res = collect(tmp_path, host)
    assert items(res)["nvidia-smi"]["ok"] is False
    assert detail(res, "nvidia-smi") == f"nvidia-smi -q exited 9: {' '.join((out + err).split())[:200]}"
    assert members(res["path"])["nvidia-smi-q.txt"] == out + err


# --------------------------------------------------------------------------- the kernel log

XID = "NVRM: Xid (PCI:0000:1b:00): 79, pid=4101, GPU has fallen off the bus."
NO_JOURNAL = "No journal files were found."
DENIED = "dmesg: read kernel buffer failed: Operation not permitted"


def test_the_kernels_xid_lines_from_the_journal(tmp_path):
    res = collect(tmp_path, Host(tmp_path))
    assert members(res["path"])["kernel-xid.txt"] == (
        "# journalctl -k -b --no-pager -o short-iso -n 50000: Xid/NVRM lines\n"
        f"2026-12-01T00:00:04+0000 node kernel: {XID}\n"
    )
    assert items(res)["kernel"] == {
        "name": "kernel",
        "ok": True,
        "seconds": 0.2,
        "detail": "1 Xid/NVRM lines of 2 kernel lines (journalctl)",
    }


@pytest.mark.parametrize(
    "journal",
    [
        (1, "", NO_JOURNAL + "\n"),  # a container: no journal
        (0, "-- No entries --\n", ""),  # journald keeps no kernel lines
        (
            1,
            f"2026-12-01T00:00:04+0000 node kernel: {XID}\n",
            "Error was encountered while opening journal files: Input/output error\n",
        ),
        None,  # no journalctl at all
    ],
)
def test_the_kernel_log_from_dmesg_when_the_journal_has_none(tmp_path, journal):
    host = Host(tmp_path)
    if journal is None:
        host.installed.discard("journalctl")
    else:
        host.kernel_answer = journal
    res = collect(tmp_path, host)
    assert (
        members(res["path"])["kernel-xid.txt"] == f"# dmesg --ctime: Xid/NVRM lines\n[Tue Dec  1 00:00:04 2026] {XID}\n"
    )
    assert items(res)["kernel"]["ok"] is True
    assert detail(res, "kernel") == "1 Xid/NVRM lines of 2 kernel lines (dmesg)"


def test_the_kernel_log_not_readable(tmp_path):
    host = Host(tmp_path)
    host.kernel_answer = (0, "-- No entries --\n", "")
    host.dmesg_denied = True
    res = collect(tmp_path, host)
    tried = ["journalctl -k: no kernel lines", f"dmesg --ctime: {DENIED}", f"dmesg: {DENIED}"]
    assert members(res["path"])["kernel-xid.txt"] == "# the kernel log could not be read:\n" + "\n".join(tried) + "\n"
    assert items(res)["kernel"]["ok"] is False
    assert detail(res, "kernel") == "kernel log not readable: " + "; ".join(tried)


def test_a_long_complaint_is_cut(tmp_path):
    host = Host(tmp_path)
    complaint = "Failed to open journal files: " + "Permission denied " * 10
    host.kernel_answer = (1, "", complaint + "\n")
    host.dmesg_denied = True
    res = collect(tmp_path, host)
    assert detail(res, "kernel").startswith(
        f"kernel log not readable: journalctl -k: {complaint.strip()[:120]}; dmesg --ctime: "
    )


@pytest.mark.parametrize(
    ("journal_s", "readable"),
    [
        (60.0, False),  # hung: the item's 2 s are spent, nothing else is tried
        (1.7, True),  # a slow failure leaves 0.3 s: dmesg is tried
        (1.92, False),  # 0.08 s left: too little to try dmesg
    ],
)
def test_the_kernel_items_time(tmp_path, journal_s, readable):
    host = Host(tmp_path)
    host.kernel_answer = (1, "", NO_JOURNAL + "\n")
    host.delays |= {"kernel": journal_s, "dmesg": 0.05}
    res = collect(tmp_path, host)
    assert items(res)["kernel"]["ok"] is readable
    if journal_s == 60.0:
        assert detail(res, "kernel") == "kernel log not readable: journalctl -k -b timed out after 2.0s"
        assert items(res)["kernel"]["seconds"] == 2.0
    elif not readable:
        assert detail(res, "kernel") == f"kernel log not readable: journalctl -k: {NO_JOURNAL}"


# --------------------------------------------------------------------------- pip freeze


def site_packages(inst: Instance) -> Path:
    lib = Path(inst.venv) / "lib"
    site = lib / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for name in ("sglang-0.5.23.dist-info", "torch-2.8.0.dist-info", "nvidia_nccl_cu12-2.27.3.dist-info", "sglang"):
        (site / name).mkdir()
    (site / "distutils-precedence.pth").write_text("import os\n")
    (lib / "python3.10").mkdir()  # an older interpreter's, without site-packages
    (lib / "README").write_text("not a directory\n")
    return site


DIST_INFOS = "nvidia_nccl_cu12==2.27.3\nsglang==0.5.23\ntorch==2.8.0"


def test_pip_freeze(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    res = collect(tmp_path, host, inst=inst)
    assert members(res["path"])["pip-freeze.txt"] == "sglang==0.5.23\ntorch==2.8.0\n"
    assert items(res)["pip-freeze"] == {
        "name": "pip-freeze",
        "ok": True,
        "seconds": 0.5,
        "detail": f"2 packages ({inst.venv}/bin/python -m pip freeze)",
    }


def test_a_virtualenv_without_pip_lists_its_dist_info(tmp_path):
    """A virtualenv made by uv has no pip: its dist-info directories name the same packages."""
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    site_packages(inst)
    why = f"{inst.venv}/bin/python: No module named pip"
    host.pip = (1, "", why + "\n")
    res = collect(tmp_path, host, inst=inst)
    assert (
        members(res["path"])["pip-freeze.txt"]
        == f"# from the dist-info directories (pip freeze failed: {why})\n{DIST_INFOS}"
    )
    assert items(res)["pip-freeze"]["ok"] is True
    assert detail(res, "pip-freeze") == f"3 packages from dist-info (pip freeze failed: {why})"


@pytest.mark.parametrize("python", ["hung", "not executable"])
def test_pip_that_cannot_run_names_why(tmp_path, python):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    site_packages(inst)
    exe = f"{inst.venv}/bin/python"
    if python == "hung":
        host.delays["pip"] = 60.0
        why = f"{exe} -m pip timed out after 3.0s"
    else:
        os.chmod(exe, 0o644)
        why = f"{exe} could not be run: [Errno 13] Permission denied: '{exe}'"
    res = collect(tmp_path, host, inst=inst)
    assert detail(res, "pip-freeze") == f"3 packages from dist-info (pip freeze failed: {why})"


def test_pip_failing_and_no_dist_info(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    traceback = "Traceback (most recent call last):\n" + '  File "pip/_internal/cli/main.py", line 79, in main\n' * 5
    host.pip = (2, "", traceback + "ImportError: cannot import name 'main'\n")
    res = collect(tmp_path, host, inst=inst)
    why = " ".join(host.pip[2].split())[:160]
    assert items(res)["pip-freeze"]["ok"] is False
    assert detail(res, "pip-freeze") == f"pip freeze failed ({why}) and no dist-info under {inst.venv}/lib"
    assert "pip-freeze.txt" not in members(res["path"])


# --------------------------------------------------------------------------- the collection and its bundle


def test_the_manifest_and_the_result(tmp_path):
    host = Host(tmp_path)
    res = collect(tmp_path, host, budget_s=9.0)
    manifest = {
        "instance": "main",
        "unit": UNIT,
        "host": "gpu-node-01",
        "invocation": INVOCATION,
        "on_demand": False,
        "created_utc": "2025-12-01T00:00:00Z",
        "budget_s": 9.0,
        "items": res["items"],
        "truncated": False,
        "redaction": f"every value of the secrets file, secret flags and secret-named settings replaced by {MASK}",
    }
    assert members(res["path"])["manifest.json"] == json.dumps(manifest, indent=2) + "\n"
    assert res == {
        "path": res["path"],
        "bytes": os.path.getsize(res["path"]),
        "items": res["items"],
        "seconds": 1.9,  # systemctl 0.1, three dumps 0.3, journalctl 0.2, GPUs 0.3 and 0.3, kernel 0.2, pip 0.5
        "truncated": False,
        "pruned": [],
        "host": "gpu-node-01",
    }


@pytest.mark.parametrize(
    ("budget_s", "systemctl_s", "skipped"),
    [
        # 1.8 s for the items (0.2 s, a tenth, kept for the tar): py-spy starts with 0.25 s left, then 0.15 s.
        (2.0, 1.55, ["journal", "failure", "config", "patches", "gpu-state", "nvidia-smi", "kernel", "pip-freeze"]),
        # 0.45 s: after systemctl, 0.15 s is less than an item needs.
        (
            0.5,
            0.3,
            ["py-spy", "journal", "failure", "config", "patches", "gpu-state", "nvidia-smi", "kernel", "pip-freeze"],
        ),
    ],
)
def test_a_small_budget(tmp_path, budget_s, systemctl_s, skipped):
    host = Host(tmp_path, procs=[Proc(MAIN, 1)])
    host.delays |= {"systemctl": systemctl_s, "py-spy": 0.1}
    res = collect(tmp_path, host, budget_s=budget_s)
    assert [i["name"] for i in res["items"] if i["detail"] == "skipped: budget"] == skipped
    assert res["truncated"] is True


def test_an_item_that_breaks_is_named_by_its_exception(tmp_path):
    host = Host(tmp_path)
    res = collect(tmp_path, host, ports=host.ports(snapshot=None))
    assert items(res)["gpu-state"]["ok"] is False
    assert detail(res, "gpu-state") == "TypeError: 'NoneType' object is not callable"


def test_a_secret_the_redaction_cannot_hide_withholds_the_file(tmp_path):
    """A secrets file value the mask itself holds ("secret" in "<secret>"): what still holds it after the
    redaction is withheld, not written."""
    inst = make_instance(tmp_path, secrets='DB_PASS="secret"\n')
    res = collect(tmp_path, Host(tmp_path), inst=inst)
    files = members(res["path"])
    assert files["manifest.json"] == "[withheld: a secret survived the redaction]\n"
    assert files["nvidia-smi-q.txt"].startswith("==============NVSMI LOG")


def test_the_bundles_name_from_an_odd_invocation(tmp_path):
    host = Host(tmp_path)
    host.wall_now = WALL + 0.25
    invocation = "Inv/ID:7 " + "a" * 70
    res = collect(tmp_path, host, invocation=invocation)
    assert os.path.basename(res["path"]) == f"20251201T000000.250Z-{('Inv_ID_7_' + 'a' * 70)[:64]}.tar.gz"


def test_bundles_of_the_same_millisecond_and_their_members(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    base = os.path.join(inst.state_dir, "evidence", "main", f"20251201T000000.000Z-{INVOCATION}")
    paths = [f"{base}.tar.gz", f"{base}-2.tar.gz", f"{base}-3.tar.gz"]
    for path in paths:  # one at a time: none overwritten, numbered on
        assert collect(tmp_path, host, inst=inst, keep=10)["path"] == path
    with tarfile.open(paths[0]) as tar:
        owners = {(m.uname, m.gname, m.mode, m.mtime) for m in tar.getmembers()}
    assert owners == {("root", "root", 0o600, int(WALL))}


def test_pruning_keeps_the_newest_bundles_only(tmp_path):
    """Only bundles are pruned: not another file in the directory, not a hidden one (another writer's)."""
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    directory = Path(inst.state_dir) / "evidence" / "main"
    directory.mkdir(parents=True)
    (directory / "notes.txt").write_text("the operator's\n")
    (directory / ".20200101T000000.000Z-x.tar.gz").write_text("partial\n")
    paths = []
    for n in range(3):
        host.wall_now = WALL + 60 * n
        res = collect(tmp_path, host, inst=inst, keep=1)
        paths.append(res["path"])
        assert res["pruned"] == paths[-2:-1]
    assert sorted(os.listdir(directory)) == [".20200101T000000.000Z-x.tar.gz", os.path.basename(paths[-1]), "notes.txt"]


def test_the_directories_are_the_owners_alone(tmp_path):
    out = tmp_path / "out"
    old = os.umask(0o022)
    try:
        res = collect(tmp_path, Host(tmp_path), out_dir=str(out))
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(out / "main").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(res["path"]).st_mode) == 0o600
        # The instance's directory made by an older release or by hand, open to others: made the owner's again.
        os.chmod(out / "main", 0o755)
        collect(tmp_path, Host(tmp_path / "2"), out_dir=str(out))
        assert stat.S_IMODE(os.stat(out / "main").st_mode) == 0o700
    finally:
        os.umask(old)


def test_an_oversized_file_is_cut_and_said_so(tmp_path):
    """At most 8 MiB of any item's text: a file is read no further than one character past the cap (memory stays
    bounded), what is kept ends with a note of the cut, and the bundle says it is truncated."""
    inst = make_instance(tmp_path)
    manifest = Path(inst.venv) / "sglang-deploy" / "patches.json"
    manifest.write_text("a" * evidence_items.MAX_ITEM_BYTES)
    res = collect(tmp_path, Host(tmp_path), inst=inst)
    assert members(res["path"])["patches.json"] == "a" * evidence_items.MAX_ITEM_BYTES  # at the cap: whole
    assert res["truncated"] is False
    manifest.write_text("a" * (evidence_items.MAX_ITEM_BYTES + 1) + "Z" + "b" * 10)
    res = collect(tmp_path, Host(tmp_path / "2"), inst=inst)
    assert (
        members(res["path"])["patches.json"]
        == "a" * evidence_items.MAX_ITEM_BYTES + "\n[cut: only the last part kept]\n"
    )
    assert res["truncated"] is True


# --------------------------------------------------------------------------- for_failure, the restart's entry


def test_for_failure_passes_everything_on(tmp_path):
    host = Host(tmp_path)
    inst = make_instance(tmp_path)
    out = tmp_path / "out"
    request = {"text": "Hi", "max_new_tokens": 8}
    args = {"request": request, "budget_s": 9.0, "keep": 1, "out_dir": str(out)}
    first = evidence.for_failure(inst, FAILURE, INVOCATION, host.ports(), **args)
    host.wall_now += 60
    second = evidence.for_failure(inst, FAILURE, INVOCATION, host.ports(), **args)
    assert second["pruned"] == [first["path"]] and os.path.dirname(second["path"]) == str(out / "main")
    assert second["host"] == "gpu-node-01"
    files = members(second["path"])
    assert json.loads(files["failure.json"]) == {"failure": FAILURE, "request": request, "response": None}
    manifest = json.loads(files["manifest.json"])
    assert (manifest["budget_s"], manifest["on_demand"], manifest["invocation"]) == (9.0, False, INVOCATION)


def test_for_failure_names_the_exception_with_its_secrets_masked(tmp_path):
    host = Host(tmp_path)

    def hostname() -> str:
        raise RuntimeError(f"the resolver said {API_KEY}")

    out = evidence.for_failure(make_instance(tmp_path), FAILURE, INVOCATION, host.ports(hostname=hostname))
    assert out == {"error": f"no evidence bundle: RuntimeError: the resolver said {MASK}"}


def test_for_failure_withholds_a_message_it_cannot_redact(tmp_path, monkeypatch):
    def no_redactor(inst, *args, **kw):
        raise ValueError(f"secrets file unreadable near {API_KEY}")

    monkeypatch.setattr(evidence, "redactor_for", no_redactor)
    out = evidence.for_failure(make_instance(tmp_path), FAILURE, INVOCATION, Host(tmp_path).ports())
    assert out == {"error": "no evidence bundle: ValueError (its message withheld)"}


# --------------------------------------------------------------------------- the instance's secrets


def env_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def test_the_redactor_knows_every_secret_of_the_instance(tmp_path):
    """The secrets file's values; a secret-named setting of the unit file and of the environment file (its value
    unescaped as systemd reads it); one of this run's rendered texts: each masked where it is logged bare."""
    in_unit = "wandb-unit-only-value-123"
    in_env = 'hf_env"quoted$value'
    rendered = "rendered-new-token-456"
    inst = make_instance(
        tmp_path,
        unit=f'[Service]\nEnvironment="WANDB_API_KEY={in_unit}"\n',
        env=f"HF_TOKEN={env_quoted(in_env)}\n",
    )
    redactor = evidence.redactor_for(inst, texts=[f'Environment="HF_TOKEN={rendered}"\n', None])
    for value in (API_KEY, in_unit, in_env, rendered):
        assert redactor.text(f"logged bare: {value} .") == f"logged bare: {MASK} ."


# --------------------------------------------------------------------------- the real ports


def test_run_command_gives_text_and_the_exit_status():
    """stdout and stderr apart, as text (a byte that is no UTF-8 replaced), the exit status returned, not raised."""
    code = "import sys; sys.stdout.buffer.write(b'caf\\xe9\\n'); sys.stderr.write('warn\\n'); sys.exit(3)"
    out = evidence.run_command([sys.executable, "-c", code], 30)
    assert (out.returncode, out.stdout, out.stderr) == (3, "caf\ufffd\n", "warn\n")


def test_run_command_never_reads_the_callers_input():
    """A tool that reads its input gets none (not the operator's terminal, nor what the caller was given)."""
    r, w = os.pipe()
    os.write(w, b"typed by the operator\n")
    os.close(w)
    saved = os.dup(0)
    os.dup2(r, 0)
    try:
        out = evidence.run_command([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"], 30)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(r)
    assert out.stdout == "''\n"


def test_run_command_gives_up_at_its_time_limit():
    with pytest.raises(subprocess.TimeoutExpired):
        evidence.run_command([sys.executable, "-c", "import time; time.sleep(10)"], 0.5)


def test_the_snapshot_within_the_items_time(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 30\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    with pytest.raises(gpu.NvidiaSmiError, match=r"did not answer within 0\.3s"):
        evidence.bounded_snapshot(0.3)
