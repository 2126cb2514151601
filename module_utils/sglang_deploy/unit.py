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


def systemctl(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    """systemctl, bounded: a hung systemd raises subprocess.TimeoutExpired instead of hanging the module."""
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False, timeout=timeout)


def checked(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
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
    args = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines)]
    args += [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    try:
        out = subprocess.run(args, capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.splitlines()


EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(?:Error|Exception|Interrupt)\b:?.*$")


def traceback_of(lines: list[str]) -> list[str]:
    """The last traceback in the log, from its first line to the exception line."""
    start = None
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            start = i
    if start is None:
        return []
    out = []
    for line in lines[start:]:
        out.append(line)
        if len(out) > 1 and EXCEPTION_LINE.match(line):
            break
    return out


def cause_of(lines: list[str]) -> str | None:
    """The line that says why: a traceback's last line, SGLang's argparse error, the GPU gate's refusal."""
    tb = traceback_of(lines)
    if len(tb) > 1 and EXCEPTION_LINE.match(tb[-1]):
        return tb[-1].strip()
    for line in reversed(lines):
        m = re.search(r"Main process exited, code=\w+, status=\d+/(\w+)", line)
        if m and m.group(1) == "SYS":
            return m.group(0) + " (a system call the unit's SystemCallFilter denies)"
    for pattern in (
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
