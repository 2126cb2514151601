"""What the crash-safe writes guarantee beyond their order of fsyncs (issue #31: the behaviours behind the mutants
tests/test_durable.py let survive in sglang_deploy/durable.py).

A name written relative to the working directory has that directory fsync'd; fsync_dir takes only a directory (a
file's fsync would not put a name on disk); the temporary file is never more open than its mode, not even before
its fchmod (a descriptor opened in that instant would read what is written after); a name planted at the temporary
file between the stale one's removal and its creation is refused, never written through; unlink says whether the
file was there, and raises for a missing one unless told it may be.
"""

from __future__ import annotations

import os
import stat

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable

pytestmark = pytest.mark.usefixtures("usual_umask")


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The paths fsync'd, in order (each descriptor's path, as the kernel names it)."""
    seen: list[str] = []
    real_fsync = os.fsync

    def fsync(fd):
        real_fsync(fd)
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_name_relative_to_the_working_directory_has_that_directory_fsynced(tmp_path, monkeypatch, fsynced):
    monkeypatch.chdir(tmp_path)
    durable.write_atomic("state.json", "{}")
    assert (tmp_path / "state.json").read_text() == "{}"
    assert fsynced[-1] == str(tmp_path)
    fsynced.clear()
    assert durable.unlink("state.json") is True
    assert fsynced == [str(tmp_path)]


def test_fsync_dir_takes_only_a_directory(tmp_path, fsynced):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        durable.fsync_dir(str(tmp_path / "f"))
    assert fsynced == []
    durable.fsync_dir(str(tmp_path))
    assert fsynced == [str(tmp_path)]


def test_unlink_says_whether_the_file_was_there(tmp_path, fsynced):
    (tmp_path / "f").write_text("x")
    assert durable.unlink(str(tmp_path / "f")) is True
    assert not (tmp_path / "f").exists() and fsynced == [str(tmp_path)]
    fsynced.clear()
    assert durable.unlink(str(tmp_path / "f"), missing_ok=True) is False
    with pytest.raises(FileNotFoundError):
        durable.unlink(str(tmp_path / "f"))
    assert fsynced == [], "nothing removed: nothing to fsync"


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
def test_the_temporary_file_is_never_more_open_than_its_mode(tmp_path, monkeypatch, mode):
    """Not even between its creation and its fchmod: a descriptor opened then keeps reading what is written after."""
    seen = []
    real_fchmod = os.fchmod

    def fchmod(fd, m):
        seen.append(stat.S_IMODE(os.fstat(fd).st_mode))  # as open made it
        real_fchmod(fd, m)

    monkeypatch.setattr(os, "fchmod", fchmod)
    durable.write_atomic(str(tmp_path / "secrets.env"), "K=v\n", mode)
    assert seen == [mode & ~0o022]
    assert stat.S_IMODE((tmp_path / "secrets.env").stat().st_mode) == mode


def test_a_name_planted_at_the_temporary_file_is_refused_never_written_through(tmp_path, monkeypatch):
    """Between the stale temporary file's removal and its creation, another writer links a file of its choosing
    there: the write fails, that file and the old one are left as they were."""
    victim, path = tmp_path / "victim", tmp_path / "unit.service"
    victim.write_text("someone else's\n")
    path.write_text("old\n")
    tmp = durable.tmp_path(str(path))
    real_unlink = os.unlink

    def unlink(p, *a, **kw):
        try:
            real_unlink(p, *a, **kw)
        finally:
            if p == tmp:
                os.link(victim, tmp)  # planted right after

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(FileExistsError):
        durable.write_atomic(str(path), "new\n")
    monkeypatch.undo()
    assert victim.read_text() == "someone else's\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert path.read_text() == "old\n"
