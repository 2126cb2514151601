"""Writes that survive a crash: the one atomic write, and renames and removals whose directory is fsync'd.

A rename or an unlink changes the directory, not the file: until the directory itself is fsync'd, a power loss
may bring back the old name (a known-good record gone, a promoted unit still the old one, a removed file back).
Every file the project keeps across a crash is written, renamed or removed through here (issue #30).
"""

from __future__ import annotations

import os
import shutil


def fsync_dir(path: str) -> None:
    """The directory's entries (a rename, a new or removed name in it) on disk."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: str) -> str:
    """write_atomic's temporary file, beside the file it becomes (the pid's: two writers never share one)."""
    return f"{path}.{os.getpid()}.tmp"


def write_atomic(path: str, data: str | bytes, mode: int = 0o600) -> None:
    """A temporary file beside it (exactly `mode`), written and fsync'd, renamed over it, then the directory
    fsync'd: a reader sees the old file or the new one, never half of one, and the new one survives a crash.
    On failure the old file is left whole and the temporary file removed."""
    tmp = tmp_path(path)
    try:
        os.unlink(tmp)  # a dead writer's (pid reused); a link planted there is not followed
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)  # open's mode is cut by the umask; this one is exact
            view = memoryview(data.encode("utf-8") if isinstance(data, str) else data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path))


def rename(src: str, dst: str) -> None:
    """os.replace, then both directories fsync'd (one, when src and dst share it)."""
    os.replace(src, dst)
    parents = {os.path.dirname(os.path.abspath(dst)), os.path.dirname(os.path.abspath(src))}
    for parent in sorted(parents):
        fsync_dir(parent)


def unlink(path: str, missing_ok: bool = False) -> bool:
    """Remove a file and fsync its directory; whether it was there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise
        return False
    fsync_dir(os.path.dirname(path))
    return True


def rmtree(path: str) -> None:
    """shutil.rmtree, then the parent fsync'd: the name is gone for good once this returns."""
    shutil.rmtree(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
