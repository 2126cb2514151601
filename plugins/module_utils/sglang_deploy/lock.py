"""The per-instance operation lock: one restart, rollback or configuration write at a time.

An exclusive, non-blocking flock on /run/sglang-deploy/locks/<instance>.lock, held by the
module's process for the whole operation. The holder writes who it is (pid, its start time and the
boot id, command, controller, since) into the file; a second operation is refused at once with that. The
kernel drops the lock when its holder dies, however it dies: a dead holder never blocks.
Status alone reads the file without the flock (peek): it names the holder only while that process runs, its pid
started at the recorded time in this boot (holder_alive: a pid reused since is not the holder). A file written before
the start time was recorded is judged by the pid alone, as it was then.

A multi-node restart is one module call per phase on every node (restart_multinode.yml), so its flock ends with
each phase. Between its phases the group holds a lease instead (issue #29): <instance>.lease beside the lock (0600,
written atomically: a temporary file, fsync, rename, the directory fsync'd), naming its run's token, who runs it
and until when (`expires`, epoch seconds). The group's first phase on a node writes it under the flock; every later
phase of the same run (the same token) is let in and renews it; the group's last phase (the record, or the end of
its rollback) removes it. Every other taker (a single restart, a rollback, a deploy's stage, another controller's
group) is refused with Locked naming the lease while it is valid, as a held flock refuses it. An expired lease is
ignored: a controller that died mid-group blocks the instance for at most the lease's lifetime.

A lease file that cannot be read or parsed counts as expired (ignored, and the taker says so): the lease is only
ever replaced whole by a rename, so a torn or foreign file was never a group's lease in force, and refusing on it
would wedge the instance until someone deleted it by hand. A group's later phase, which goes on only under its own
lease, refuses it all the same: it cannot show that nobody came in between.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import durable, procinfo
from .durable import write_atomic

LOCK_DIR = "/run/sglang-deploy/locks"

# How a group's phase takes the lease (Lease.mode).
LEASE_BEGIN = "begin"  # the group's first phase (stop): writes this run's lease (an expired or unreadable one replaced)
LEASE_CONTINUE = "continue"  # start, confirm, record: only under this run's own lease, still valid; renews it
LEASE_RECOVER = "recover"  # the group's rollback: this run's lease, or one taken anew when none is valid
LEASE_CHECK = "check"  # check mode: refused by another run's valid lease, writes nothing


@dataclass(frozen=True)
class Lease:
    """A multi-node restart's hold on an instance between its phases: its run's token (the same on every node)."""

    token: str
    seconds: float
    mode: str = LEASE_BEGIN
    phase: str = ""

    def __post_init__(self) -> None:
        if not self.token or not self.seconds > 0:
            raise ValueError(f"a group lease needs a token and seconds above 0 (got {self.token!r}, {self.seconds})")


class Locked(RuntimeError):
    def __init__(self, name: str, holder: dict):
        self.holder = holder
        super().__init__(
            f"{name} is locked by another operation: {describe(holder)}. Nothing was touched; "
            "retry once it ends (python -m driver status shows where it stands)."
        )


class LeaseLost(Locked):
    """A group's later phase without its own valid lease on this node: somebody may have come in between."""

    def __init__(self, name: str, why: str):
        self.holder = {}
        RuntimeError.__init__(
            self,
            f"{name}: this multi-node restart's lease on this node {why}, so another operation may have run here "
            "since its last phase: this phase does not go on. Nothing was touched (restart.yml rolls the group back).",
        )


def describe(holder: dict) -> str:
    if not holder:
        return "a holder that has not written its name yet"
    lease = holder.get("group_lease")
    if lease and not isinstance(holder.get("pid"), int):  # no process holds it: the group is between two phases
        return (
            f"a multi-node restart's group lease (run {lease.get('token', '?')}, between its phases): "
            f"{holder.get('operation', '?')} ({holder.get('command', '?')}) from controller "
            f"{holder.get('controller') or '?'} since {holder.get('since', '?')}, until {lease.get('expires_at', '?')} "
            f"(in {lease.get('expires_in_s', '?')} s; it is renewed at each phase, removed at the group's end, and "
            f"ignored once expired: {lease.get('path', 'the .lease file beside the lock')})"
        )
    return (
        f"{holder.get('operation', '?')} by pid {holder.get('pid', '?')} ({holder.get('command', '?')}) "
        f"from controller {holder.get('controller') or '?'} since {holder.get('since', '?')}"
    )


def utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


class InstanceLock:
    """with InstanceLock(name, operation, controller): ... -- raises Locked when held.

    lease: a multi-node restart's phase (Lease); release() then renews the lease, or with end_group removes it."""

    def __init__(
        self,
        name: str,
        operation: str,
        controller: str = "",
        command: str = "",
        lock_dir: str = LOCK_DIR,
        *,
        lease: Lease | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.name, self.operation, self.controller, self.command = name, operation, controller, command
        self.path = os.path.join(lock_dir, f"{name}.lock")
        self.lease_path = os.path.join(lock_dir, f"{name}.lease")
        self.lease, self.clock = lease, clock
        self.fd: int | None = None
        self.since: str | None = None  # this run's lease's first phase, kept across renewals
        self.ignored = ""  # an expired or unreadable lease this taker went past

    def acquire(self) -> dict:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(self.path), 0o700)
        self.check_lease()  # a group's lease refuses at once, the flock untouched (its own phases find it free)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = read_holder(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise Locked(self.name, holder) from None
            raise
        try:  # interrupted here (SIGTERM, a full /run), the lock must not stay held for the process's life
            self.check_lease()  # again, under the flock: a group's first phase may have written it since
            holder = {
                "operation": self.operation,
                "pid": os.getpid(),
                # with the pid, who holds it: status never takes a process that reused the pid for the holder
                "start_time": procinfo.start_time(os.getpid()),
                "boot_id": procinfo.boot_id(),
                "command": self.command or command_of(os.getpid()),
                "controller": self.controller,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            if self.lease is not None:
                holder["group"] = self.lease.token
            if self.ignored:
                holder["ignored_lease"] = self.ignored
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            if self.lease is not None and self.lease.mode != LEASE_CHECK:
                holder["group_lease"] = self.write_lease()
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return holder

    def check_lease(self) -> None:
        """Refuse while another run's lease is valid; a group's later phase also without its own valid one."""
        found = read_lease(self.lease_path)
        now = self.clock()
        readable = found is not None and "unreadable" not in found
        valid = readable and found["expires"] > now
        mine = readable and self.lease is not None and found["token"] == self.lease.token
        if valid and not mine:
            raise Locked(self.name, lease_holder(found, now, self.lease_path))
        self.since = found.get("since") if mine else None
        if self.lease is not None and self.lease.mode == LEASE_CONTINUE and not (valid and mine):
            raise LeaseLost(self.name, lost(found, now, mine, self.lease_path))
        self.ignored = "" if found is None or valid else ignored(found, now, self.lease_path)

    def write_lease(self) -> dict:
        """This run's lease, valid for its seconds from now (its first phase's `since` kept)."""
        assert self.lease is not None
        now = self.clock()
        doc = {
            "token": self.lease.token,
            "operation": self.operation,
            "controller": self.controller,
            "command": self.command or command_of(os.getpid()),
            "since": self.since or utc(now),
            "expires": round(now + self.lease.seconds, 3),
            "phase": self.lease.phase,
        }
        write_atomic(self.lease_path, json.dumps(doc).encode())
        self.since = doc["since"]
        return {"token": doc["token"], "expires": doc["expires"], "expires_at": utc(doc["expires"])}

    def end_lease(self) -> dict:
        """The group's end on this node: its lease removed (only its own)."""
        assert self.lease is not None
        found = read_lease(self.lease_path)
        if found is not None and found.get("token") == self.lease.token:
            durable.unlink(self.lease_path)
        return {"token": self.lease.token, "ended": True}

    def release(self, end_group: bool = False) -> dict | None:
        """Drop the flock; a group's phase first renews its lease (end_group: removes it). Returns what it did to the
        lease (an error writing it is said, never raised: the phase's outcome stands)."""
        if self.fd is None:
            return None
        out = None
        try:
            if self.lease is not None and self.lease.mode != LEASE_CHECK:
                try:
                    out = self.end_lease() if end_group else self.write_lease()
                except OSError as exc:
                    what = "could not be removed" if end_group else "could not be renewed"
                    out = {"token": self.lease.token, "error": f"{self.lease_path} {what}: {exc}"}
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None
        return out

    def __enter__(self) -> InstanceLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


def read_lease(path: str) -> dict | None:
    """The lease as written; None when there is none; {"unreadable": why} when it cannot be read or parsed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not hang it
    except FileNotFoundError:
        return None
    except OSError as exc:
        return {"unreadable": f"cannot be opened ({exc.strerror or exc})"}
    try:
        data = os.read(fd, 65536)
    except OSError as exc:
        return {"unreadable": f"cannot be read ({exc.strerror or exc})"}
    finally:
        os.close(fd)
    try:
        doc = json.loads(data)
    except ValueError:
        return {"unreadable": "is not JSON"}
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("token"), str)
        or not isinstance(doc.get("expires"), (int, float))
        or isinstance(doc.get("expires"), bool)
    ):
        return {"unreadable": "has no token or expiry"}
    return doc


def lease_holder(lease: dict, now: float, path: str) -> dict:
    """A valid lease as the holder a refusal names (no process holds it between two phases)."""
    return {
        "operation": lease.get("operation", "?"),
        "pid": f"none (a group lease until {utc(lease['expires'])})",  # the driver's line says "held by pid ..."
        "command": lease.get("command", "?"),
        "controller": lease.get("controller", ""),
        "since": lease.get("since", "?"),
        "group_lease": {
            "token": lease["token"],
            "expires": lease["expires"],
            "expires_at": utc(lease["expires"]),
            "expires_in_s": round(lease["expires"] - now, 1),
            "phase": lease.get("phase", ""),
            "path": path,
        },
    }


def ignored(found: dict, now: float, path: str) -> str:
    if "unreadable" in found:
        return f"{path} {found['unreadable']}: counted as expired"
    return f"{path} (run {found['token']}) expired at {utc(found['expires'])}, {round(now - found['expires'])} s ago"


def lost(found: dict | None, now: float, mine: bool, path: str) -> str:
    if found is None:
        return f"is gone ({path} does not exist: never taken here, or removed)"
    if "unreadable" in found:
        return f"cannot be shown to be its own ({path} {found['unreadable']})"
    if not mine:
        return f"was replaced by run {found['token']}'s, expired at {utc(found['expires'])} ({path})"
    return f"expired at {utc(found['expires'])}, {round(now - found['expires'])} s before this phase ({path})"


def peek(name: str, lock_dir: str = LOCK_DIR, now: float | None = None) -> dict | None:
    """The holder of an instance's lock, if its process is alive, else a multi-node group's lease, valid or
    expired (status shows it). Takes no lock itself, so it can never make a real operation's acquire fail."""
    holder = None
    try:
        fd = os.open(os.path.join(lock_dir, f"{name}.lock"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        fd = None
    if fd is not None:
        try:
            holder = read_holder(fd)
        finally:
            os.close(fd)
        holder = holder if holder_alive(holder) else None
    path = os.path.join(lock_dir, f"{name}.lease")
    found = read_lease(path)
    if found is None:
        return holder
    now = time.time() if now is None else now
    if "unreadable" in found:
        lease = {"path": path, "expired": True, "note": ignored(found, now, path)}
    else:
        lease = {**lease_holder(found, now, path)["group_lease"], "expired": found["expires"] <= now}
        if lease["expired"]:
            lease["note"] = "expired: ignored by every operation (a new group's first phase replaces it)"
    if holder is not None:
        return {**holder, "group_lease": lease}
    if lease["expired"]:
        return {"group_lease": lease}
    return {**lease_holder(found, now, path), "group_lease": lease}


def holder_alive(holder: dict) -> bool:
    """Whether the process a lock file names still runs: its pid, started at the recorded time in this boot. A pid
    reused by another process, or a holder from another boot, is not it. A file an older version wrote (no
    start_time) is judged as it was then, by the pid alone."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if "start_time" not in holder:
        return os.path.exists(f"/proc/{pid}")
    if holder.get("boot_id") and holder["boot_id"] != procinfo.boot_id():
        return False
    started = procinfo.start_time(pid)
    return started is not None and started == holder["start_time"]


def command_of(pid: int) -> str:
    """The holder's own command line, when the caller did not say what it runs for."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = [w.decode(errors="replace") for w in fh.read().split(b"\0") if w]
        return " ".join(words)[:160] or "?"
    except OSError:
        return "?"
