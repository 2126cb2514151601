"""The per-instance operation lock: one restart, rollback or configuration write at a time.

An exclusive, non-blocking flock on /run/sglang-deploy/locks/<instance>.lock, held by the
module's process for the whole operation. The holder writes who it is (pid, command,
controller, since) into the file; a second operation is refused at once with that. The
kernel drops the lock when its holder dies, however it dies: a dead holder never blocks.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time

LOCK_DIR = "/run/sglang-deploy/locks"


class Locked(RuntimeError):
    def __init__(self, name: str, holder: dict):
        self.holder = holder
        super().__init__(
            f"{name} is locked by another operation: {describe(holder)}. Nothing was touched; "
            "retry once it ends (python -m driver status shows where it stands)."
        )


def describe(holder: dict) -> str:
    if not holder:
        return "a holder that has not written its name yet"
    return (
        f"{holder.get('operation', '?')} by pid {holder.get('pid', '?')} ({holder.get('command', '?')}) "
        f"from controller {holder.get('controller') or '?'} since {holder.get('since', '?')}"
    )


class InstanceLock:
    """with InstanceLock(name, operation, controller): ... -- raises Locked when held."""

    def __init__(self, name: str, operation: str, controller: str = "", command: str = "", lock_dir: str = LOCK_DIR):
        self.name, self.operation, self.controller, self.command = name, operation, controller, command
        self.path = os.path.join(lock_dir, f"{name}.lock")
        self.fd: int | None = None

    def acquire(self) -> dict:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        os.chmod(os.path.dirname(self.path), 0o700)
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
            holder = {
                "operation": self.operation,
                "pid": os.getpid(),
                "command": self.command or command_of(os.getpid()),
                "controller": self.controller,
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return holder

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)
            finally:
                os.close(self.fd)  # closing drops the flock
                self.fd = None

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


def peek(name: str, lock_dir: str = LOCK_DIR) -> dict | None:
    """The holder of an instance's lock, if its process is alive (status shows it). Takes no lock itself,
    so it can never make a real operation's acquire fail."""
    try:
        fd = os.open(os.path.join(lock_dir, f"{name}.lock"), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        holder = read_holder(fd)
    finally:
        os.close(fd)
    pid = holder.get("pid")
    return holder if isinstance(pid, int) and pid > 0 and os.path.exists(f"/proc/{pid}") else None


def command_of(pid: int) -> str:
    """The holder's own command line, when the caller did not say what it runs for."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            words = [w.decode(errors="replace") for w in fh.read().split(b"\0") if w]
        return " ".join(words)[:160] or "?"
    except OSError:
        return "?"
