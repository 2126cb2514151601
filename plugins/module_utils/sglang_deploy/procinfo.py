"""A process's command line, user and systemd unit, read from /proc; and who listens on a TCP port.

One helper for every place that names a process: the GPU wait and the unit's gate
(who holds a GPU), verify and status (whose processes are on the instance's GPUs),
validation's port check and the rendezvous's rank 0 (who holds a port).
Every reader answers "not known" (empty, None, False) instead of raising: a process
can exit between nvidia-smi listing it and /proc being read, and a unit with
``ProtectProc=invisible`` (the gate runs in one) cannot see other users' processes.
"""

from __future__ import annotations

import os
import pwd
import re
import select
import time

from .secret_rule import masked

CMDLINE_CHARS = 400  # enough to tell a server from a stray script, short enough for one journal line


def read_proc(pid: int, name: str) -> str:
    """/proc/<pid>/<name> as text, "" when the process is gone or hidden."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When the process started (field 22 of /proc/<pid>/stat, clock ticks after boot): with the pid, who it is,
    as a pid alone is not (pids are reused). None when it is gone, hidden or a zombie (it has let go of its files)."""
    fields = read_proc(pid, "stat").rsplit(")", 1)[-1].split()  # the command, in parentheses, may hold spaces
    try:
        return None if fields[0] == "Z" else int(fields[19])
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    """This boot's id: a start time counts from this boot only."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


# The launcher (launch.py) passes the API key from this variable, so no command line should hold one; any
# that does (a server started by hand) is masked wherever a command line is compared, recorded or reported
# (secret_rule.masked: every secret-named flag).
API_KEY_VAR = "SGLANG_API_KEY"


def cmdline(pid: int) -> list[str]:
    """The process's argv as a list; [] when it is gone, hidden or a kernel thread."""
    raw = read_proc(pid, "cmdline")
    if not raw:
        return []
    args = raw.split("\0")
    # The kernel ends every argument with NUL: the last split is the empty tail.
    return args[:-1] if args[-1] == "" else args


def user_of(pid: int) -> str | None:
    """The name of the process's owner (its uid where no name maps to it), None when not visible."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def unit_of(pid: int) -> str | None:
    """The systemd unit (service or scope) whose cgroup holds pid; None outside any unit or when not visible."""
    for line in read_proc(pid, "cgroup").splitlines():
        path = line.split(":", 2)[-1]
        for part in reversed(path.split("/")):
            if part.endswith((".service", ".scope")):
                return part
    return None


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no GPU memory).

    Where /proc hides the process (ProtectProc=invisible) signal 0 still tells
    whether it exists: EPERM means it does.
    """
    stat = read_proc(pid, "stat")
    if stat:
        parts = stat.rsplit(")", 1)
        return len(parts) == 2 and parts[1].split()[:1] != ["Z"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` s for process `pid` to exit; True as soon as it has (or is not there).

    A pidfd wakes the caller the moment the process exits, where a sleep would add up to its whole length to
    the detection (the restart's start phase: a server dying at start is reported within milliseconds). Without
    pidfds (kernel before 5.3, or not permitted) it sleeps the timeout out and answers from /proc.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):
        time.sleep(timeout)
        return not alive(pid)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    finally:
        os.close(fd)


def describe(pid: int) -> dict:
    """{user, unit, cmdline, alive} of a process, None where it cannot be seen.

    cmdline is joined on one line (whitespace runs, newlines of `python -c` scripts
    included, become one space) and cut to CMDLINE_CHARS, for messages and journals.
    """
    joined = " ".join(" ".join(masked(cmdline(pid))).split())[:CMDLINE_CHARS]
    return {"user": user_of(pid), "unit": unit_of(pid), "cmdline": joined or None, "alive": alive(pid)}


def listening_inodes(port):
    """Socket inodes listening on TCP `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f[9])
        except OSError:
            continue
    return inodes


# Not unit_of: on a hybrid host the v1 lines of /proc/<pid>/cgroup name other units; the unified line, last, is its own.
def socket_holders(inodes):
    """{pid: (unit, command line)} of the processes holding any of the socket inodes."""
    wanted = {f"socket:[{i}]" for i in inodes}
    holders = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                continue
            with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
                cgroup = fh.read()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        units = re.findall(r"/([^/\n]+\.(?:service|scope))", cgroup)
        holders[int(pid)] = (units[-1] if units else "?", cmd)
    return holders
