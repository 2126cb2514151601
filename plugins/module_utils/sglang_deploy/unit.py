"""systemd and the journal, for one unit: state, start/stop, and the cause of a failure."""

from __future__ import annotations

import re
import subprocess

UNIT_PROPS = (
    "ActiveState",
    "SubState",
    "MainPID",
    "NRestarts",
    "ExecMainStatus",
    "ExecMainCode",
    "InvocationID",
    "ExecMainExitTimestampMonotonic",
    "UnitFileState",
    "NeedDaemonReload",
)
INT_PROPS = ("MainPID", "NRestarts", "ExecMainStatus", "ExecMainExitTimestampMonotonic")


class UnitError(RuntimeError):
    """systemctl refused or failed."""


def systemctl(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """systemctl, bounded: a hung systemd raises subprocess.TimeoutExpired instead of hanging the module. A stop
    is given what systemd itself may take (stop_bound): SGLang's drain under KillMode=mixed can use most of
    TimeoutStopSec, and the final SIGKILL has a second one."""
    if timeout is None:
        timeout = stop_bound(args[-1]) if len(args) >= 2 and args[0] == "stop" else 300.0
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False, timeout=timeout)


# systemd's time spans as `systemctl show` writes them ("2min 30s", "150ms", "infinity"): seconds per unit.
_SPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_timespan(text: str) -> float | None:
    """Seconds of a systemd time span; None for "infinity", an empty or an unreadable one."""
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(us|ms|min|s|h|d|w)\b", text or "")
    if not parts or re.sub(r"(\d+(?:\.\d+)?)\s*(us|ms|min|s|h|d|w)\b", "", text).strip():
        return None
    return sum(float(n) * _SPAN_UNITS[u] for n, u in parts)


def stop_bound(unit: str, show_timeout: float = 30.0) -> float:
    """How long `systemctl stop` may take: twice the unit's TimeoutStopSec (the SIGTERM's wait, then the final
    SIGKILL's) and 30 s; 300 s when it cannot be read or is infinite."""
    out = subprocess.run(
        ["systemctl", "show", unit, "--property=TimeoutStopUSec", "--value"],
        capture_output=True,
        text=True,
        check=False,
        timeout=show_timeout,
    )
    seconds = parse_timespan(out.stdout.strip()) if out.returncode == 0 else None
    return 300.0 if seconds is None else max(300.0, 2 * seconds + 30.0)


def checked(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    out = systemctl(*args, timeout=timeout)
    if out.returncode != 0:
        raise UnitError(f"systemctl {' '.join(args)} failed: {(out.stderr or out.stdout).strip()}")
    return out


def show(unit: str) -> dict:
    out = systemctl("show", unit, "--property=" + ",".join(UNIT_PROPS), timeout=30).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for key in INT_PROPS:
        try:
            props[key] = int(props.get(key) or 0)
        except ValueError:
            props[key] = 0
    props.setdefault("ActiveState", "unknown")
    props.setdefault("SubState", "unknown")
    return props


def state(props: dict) -> str:
    return f"{props.get('ActiveState')}/{props.get('SubState')}"


def has_failed(props: dict) -> bool:
    """The unit's start failed or its process exited (auto-restart counts as failed)."""
    return props.get("ActiveState") in ("failed", "inactive", "deactivating") or props.get("SubState") in (
        "auto-restart",
        "failed",
        "dead",
    )


def journal(unit: str, invocation: str | None = None, lines: int = 80) -> list[str]:
    """The unit's journal, of one invocation: the server's own lines (_SYSTEMD_INVOCATION_ID=) and systemd's about
    it (INVOCATION_ID=: "Main process exited, code=killed, status=31/SYS"), as journalctl --invocation matches."""
    args = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines)]
    args += [f"_SYSTEMD_INVOCATION_ID={invocation}", "+", f"INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    try:
        out = subprocess.run(args, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines()


def journal_since(
    invocation: str, cursor: str | None = None, lines: int = 2000, pid: int | None = None
) -> tuple[list[str], str | None]:
    """The server's journal lines of one invocation after `cursor` (all of them, up to `lines`, without one), and
    the cursor to pass next time: a follower that reads each line once however long the log grows. With `pid`, only
    the lines that process wrote: the main process's (its children write to its stream, under its _PID), not the
    ExecStartPre gate's, which runs under the same invocation."""
    # -a: a tqdm bar's line holds its "\r" redraws, which journalctl otherwise shows as "[blob data]"; split at
    # "\n" only (splitlines() would also cut at each "\r").
    args = ["journalctl", "--no-pager", "-a", "-o", "cat", "--show-cursor", f"_SYSTEMD_INVOCATION_ID={invocation}"]
    args += [f"_PID={pid}"] if pid else []
    args += [f"--after-cursor={cursor}"] if cursor else ["-n", str(lines)]
    out = subprocess.run(args, capture_output=True, text=True, check=False, timeout=10)
    got = out.stdout.rstrip("\n").split("\n") if out.stdout else []
    if got and got[-1].startswith("-- cursor: "):
        return got[:-1], got[-1][len("-- cursor: ") :]
    return [line for line in got if not line.startswith("-- ")], cursor


# A Python exception line: a dotted name ending in Error/Exception/Interrupt/Exit, alone (SGLang's launcher re-raises
# a bare EOFError) or followed by ": message". "Exception raised from checkTimeout at ..." (a c10 stack) is not one.
EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*)?(?:Error|Exception|Interrupt|Exit)(?::(?:\s.*)?)?\s*$"
)
TRACEBACK_HEADER = "Traceback (most recent call last):"
# Python's words between the tracebacks of one chain: the first of the chain is the root.
CHAINED = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# A line inside a traceback, between its header and its exception line: '  File ...', code, '^^^^' markers.
FRAME_LINE = re.compile(r"^(?:\s+\S|[\^~]+\s*$)")
# The header of a crashed SGLang subprocess ("Scheduler hit an exception: Traceback ...", "[... TP3] Traceback ...").
SUBPROCESS_HEADER = re.compile(r"hit an exception|\b(?:TP|DP|PP|EP)\d+\]")
# Tracebacks that only report an earlier failure: SGLang's launcher finding a scheduler dead (engine.py re-raises
# the pipe's EOFError, or raises one of these), and Python's "Exception ignored in: ..." during cleanup.
CONSEQUENCE = re.compile(
    r"^(?:EOFError\s*$|RuntimeError: (?:Initialization failed\. Please see the error messages above"
    r"|Failed to initialize scheduler rank \d+))"
)
# Fatal lines that are no Python traceback: the NCCL watchdog (also inside a c10::DistBackendError's what()), a C++
# exception that terminated the process, the interpreter's own fatal errors; and an exception saying a port is in use
# (ZMQ's, torch.distributed's): printed without its traceback's header, the frames after it would otherwise be taken
# for those of the next exception line, the other ranks' cascade (sgl-project/sglang#29547).
FATAL_LINE = (
    re.compile(r"(?:\[Rank \d+\] )?Watchdog caught collective operation timeout: .*"),
    re.compile(r"(?<=what\(\):  ).*"),
    re.compile(r"Fatal Python error: .*"),
    re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): .*(?:[Aa]ddress already in use|EADDRINUSE).*"),
)
C10_STACK_LINE = re.compile(r"^(?:Exception raised from |frame #\d+: )")


def _blocks(lines: list[str]) -> list[tuple[int, int]]:
    """Each traceback in the log as (first line, exception line). A traceback whose header scrolled out of the
    journal's tail starts at the first of the frame lines before its exception line; one cut off before its
    exception line is no block."""
    blocks, i = [], 0
    while i < len(lines):
        if TRACEBACK_HEADER in lines[i]:
            for k in range(i + 1, len(lines)):
                if TRACEBACK_HEADER in lines[k]:
                    break  # cut off before its exception line: the next one starts here
                if EXCEPTION_LINE.match(lines[k]):
                    blocks.append((i, k))
                    i = k
                    break
        elif EXCEPTION_LINE.match(lines[i]) and i > 0 and FRAME_LINE.match(lines[i - 1]):
            j = i - 1
            while j > 0 and FRAME_LINE.match(lines[j - 1]):
                j -= 1
            if not blocks or j > blocks[-1][1]:
                blocks.append((j, i))
        i += 1
    return blocks


def _chains(lines: list[str], blocks: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The blocks grouped as Python chains them ("During handling of the above exception ...")."""
    chains: list[list[tuple[int, int]]] = []
    for block in blocks:
        before = [line.strip() for line in lines[chains[-1][-1][1] + 1 : block[0]] if line.strip()] if chains else []
        if before and before[-1] in CHAINED:  # the words right above this traceback's header
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains


def _consequence(lines: list[str], chain: list[tuple[int, int]]) -> bool:
    start, end = chain[0][0], chain[-1][1]
    ignored = start > 0 and lines[start - 1].startswith("Exception ignored in")
    return ignored or bool(CONSEQUENCE.match(lines[end]))


def _root(lines: list[str]) -> tuple[str, list[str]] | None:
    """The root failure in the log, as (cause, the lines that show it).

    SGLang's processes share the journal: a scheduler that dies prints its traceback, the launcher then says
    "Received sigquit from a child process" and may print its own traceback (the pipe's EOFError, "Initialization
    failed"), other ranks print theirs, cleanup may raise more. The root is the first traceback of a crashed
    subprocess (SGLang's "... hit an exception:" or a rank tag on its header), else the first traceback that is
    no consequence of another; within a chain, the first exception. An NCCL watchdog timeout, an uncaught C++
    exception or a fatal interpreter error printed before that traceback is the root instead: the tracebacks
    printed after one are the ranks being torn down."""
    chains = [c for c in _chains(lines, _blocks(lines)) if not _consequence(lines, c)]
    marked = [c for c in chains if SUBPROCESS_HEADER.search(lines[c[0][0]])]
    chain = (marked or chains or [None])[0]
    for i, line in enumerate(lines[: chain[0][0] if chain else len(lines)]):
        for pattern in FATAL_LINE:
            m = pattern.search(line)
            if m:
                shown = [line]
                for more in lines[i + 1 :]:
                    if not C10_STACK_LINE.match(more):
                        break
                    shown.append(more)
                return m.group(0).strip(), shown
    if chain:
        start, end = chain[0]
        return lines[end].strip(), lines[start : end + 1]
    return None


def traceback_of(lines: list[str]) -> list[str]:
    """The lines that show the root failure (see _root): a traceback from its first line to its exception line,
    or a fatal line with the C++ stack that follows it. With none, the last traceback header to the end."""
    root = _root(lines)
    if root:
        return root[1]
    starts = [i for i, line in enumerate(lines) if TRACEBACK_HEADER in line]
    return lines[starts[-1] :] if starts else []


def cause_of(lines: list[str]) -> str | None:
    """The line that says why: the root failure's exception (see _root), SGLang's argparse error, the GPU gate's
    refusal, a port already in use, a scheduler that died without a traceback (killed: its exit code)."""
    root = _root(lines)
    if root:
        return root[0]
    for line in reversed(lines):
        m = re.search(r"Main process exited, code=\w+, status=\d+/(\w+)", line)
        if m and m.group(1) == "SYS":
            return m.group(0) + " (a system call the unit's SystemCallFilter denies)"
    for i, line in enumerate(lines):  # killed (the OOM killer's -9): no traceback of its own, the launcher says so
        m = re.search(r"Rank \d+ scheduler is dead\..*", line)
        if m:
            code = next((c for c in (re.search(r"Exit code: (-?\d+)", x) for x in lines[i + 1 : i + 3]) if c), None)
            return m.group(0).strip() + (f" (exit code {code.group(1)})" if code else "")
    for pattern in (
        r"\[Errno 98\] .*",  # uvicorn's "ERROR:    [Errno 98] error while attempting to bind on address ..."
        r"error: .*",
        r"sglang-gpu-gate: .*refusing.*",
        r"sglang-gpu-gate: (?!GPUs \[[\d, ]*\] clean).*",
        r"Main process exited, code=\w+, status=.*",
    ):
        for line in reversed(lines):
            m = re.search(pattern, line)
            if m:
                return m.group(0).strip()
    return None
