"""A multi-node restart's lease (plugins/module_utils/sglang_deploy/lock.py, issue #29): the instance's lock held between
the group's phases, each of which is a module call of its own. Taken by the group's first phase, let in and renewed
for the same run's token, removed by its last phase; every other taker refused while it is valid, as a held flock
refuses it; an expired lease ignored; a lease that cannot be read counted as expired (never wedging the instance),
except by the group's own later phase, which cannot show that nobody came in between. Written atomically.

The state machine's phases under it (the stop takes it, the record or the rollback's end removes it) are tested in
test_restart_machine.py.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import lock
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import (
    LEASE_BEGIN,
    LEASE_CHECK,
    LEASE_CONTINUE,
    LEASE_RECOVER,
    InstanceLock,
    Lease,
    LeaseLost,
    Locked,
)

T0 = 1_800_000_000.0  # the tests' epoch: 2027-01-15T08:00:00Z
TOKEN, OTHER = "mn-20270115T080000Z-00000000000000aa", "mn-20270115T080000Z-00000000000000bb"


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


def phase(tmp_path, clock, mode: str, token: str = TOKEN, seconds: float = 600, name: str = "mn", **kw):
    """One phase's lock on the node, as take_lock makes it."""
    return InstanceLock(
        name,
        f"restart {name} (profile new)",
        kw.pop("controller", "ctl-a"),
        "python -m driver restart",
        str(tmp_path),
        lease=Lease(token, seconds, mode, kw.pop("phase", mode)),
        clock=clock,
    )


def other(tmp_path, clock, operation: str = "deploy mn (stage profile new)") -> InstanceLock:
    """Any other taker: a deploy's stage, a single restart, an operator's rollback (no token)."""
    return InstanceLock("mn", operation, "ctl-b", "python -m driver deploy", str(tmp_path), clock=clock)


def lease_of(tmp_path, name: str = "mn") -> dict:
    return json.loads((tmp_path / f"{name}.lease").read_text())


def run_phase(tmp_path, clock, mode: str, end_group: bool = False, **kw) -> dict | None:
    held = phase(tmp_path, clock, mode, **kw)
    held.acquire()
    return held.release(end_group=end_group)


# ---------------------------------------------------------------- held between the phases


def test_the_first_phase_writes_the_lease_beside_the_lock_and_it_outlives_the_flock(tmp_path, clock):
    held = phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    holder = held.acquire()
    assert holder["group"] == TOKEN and holder["group_lease"]["expires"] == T0 + 600
    assert holder["group_lease"]["expires_at"] == "2027-01-15T08:10:00Z"
    path = tmp_path / "mn.lease"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    doc = lease_of(tmp_path)
    assert doc == {
        "token": TOKEN,
        "operation": "restart mn (profile new)",
        "controller": "ctl-a",
        "command": "python -m driver restart",
        "since": "2027-01-15T08:00:00Z",
        "expires": T0 + 600,
        "phase": "stop",
    }
    clock.t += 30
    said = held.release()  # the phase ends: renewed for the gap to the next one
    assert said == {"token": TOKEN, "expires": T0 + 630, "expires_at": "2027-01-15T08:10:30Z"}
    assert lease_of(tmp_path)["expires"] == T0 + 630 and lease_of(tmp_path)["since"] == "2027-01-15T08:00:00Z"
    assert (tmp_path / "mn.lock").read_text() == "", "the flock is released: the lease holds the instance"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_while_the_lease_is_valid_every_other_taker_is_refused_naming_it(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    clock.t += 100
    for taker in (
        other(tmp_path, clock),  # a deploy's sglang_stage
        other(tmp_path, clock, "restart mn (profile new)"),  # a single restart of the same instance name
        other(tmp_path, clock, "rollback mn (profile good)"),  # the operator's rollback
        phase(tmp_path, clock, LEASE_BEGIN, token=OTHER, controller="ctl-b"),  # another controller's group
        phase(tmp_path, clock, LEASE_CONTINUE, token=OTHER, controller="ctl-b"),
        phase(tmp_path, clock, LEASE_RECOVER, token=OTHER, controller="ctl-b"),
        phase(tmp_path, clock, LEASE_CHECK, token=OTHER, controller="ctl-b"),  # even in check mode
    ):
        with pytest.raises(Locked) as exc:
            taker.acquire()
        assert not isinstance(exc.value, LeaseLost)
        msg = str(exc.value)
        assert msg.startswith("mn is locked by another operation: a multi-node restart's group lease (run ")
        assert TOKEN in msg and "from controller ctl-a" in msg and "until 2027-01-15T08:10:00Z (in 500.0 s" in msg
        assert str(tmp_path / "mn.lease") in msg and msg.endswith("python -m driver status shows where it stands).")
        holder = exc.value.holder
        assert holder["controller"] == "ctl-a" and holder["command"] == "python -m driver restart"
        assert holder["pid"] == "none (a group lease until 2027-01-15T08:10:00Z)"  # the driver's "held by pid ..."
        assert holder["group_lease"]["token"] == TOKEN and holder["group_lease"]["expires"] == T0 + 600
        assert taker.fd is None
    assert (tmp_path / "mn.lock").read_text() == "", "refused before its flock: nobody wrote a holder"
    assert lease_of(tmp_path)["token"] == TOKEN and lease_of(tmp_path)["expires"] == T0 + 600


def test_the_same_runs_later_phases_are_let_in_and_renew_it(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    for name, mode in (("start", LEASE_CONTINUE), ("confirm", LEASE_CONTINUE), ("rollback_stop", LEASE_RECOVER)):
        clock.t += 500  # under the 600 s of the lease each time
        held = phase(tmp_path, clock, mode, phase=name)
        assert held.acquire()["group_lease"]["expires"] == clock.t + 600
        assert lease_of(tmp_path)["phase"] == name
        clock.t += 200  # a long phase: the flock holds the instance meanwhile, the lease is renewed at its end
        assert held.release()["expires"] == clock.t + 600
        assert lease_of(tmp_path)["since"] == "2027-01-15T08:00:00Z", "the group's first phase, kept"


def test_the_groups_last_phase_removes_it_and_the_instance_is_free(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    said = run_phase(tmp_path, clock, LEASE_CONTINUE, end_group=True, phase="record")
    assert said == {"token": TOKEN, "ended": True}
    assert not (tmp_path / "mn.lease").exists()
    holder = other(tmp_path, clock).acquire()
    assert "ignored_lease" not in holder


def test_a_failed_groups_last_rollback_phase_removes_it_too(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    run_phase(tmp_path, clock, LEASE_RECOVER, phase="rollback_stop")
    assert run_phase(tmp_path, clock, LEASE_RECOVER, end_group=True, phase="rollback_confirm")["ended"] is True
    assert not (tmp_path / "mn.lease").exists()


def test_the_end_removes_only_its_own_runs_lease(tmp_path, clock):
    held = phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    held.acquire()
    lock.write_atomic(str(tmp_path / "mn.lease"), json.dumps({"token": OTHER, "expires": T0 + 900}).encode())
    assert held.release(end_group=True) == {"token": TOKEN, "ended": True}
    assert lease_of(tmp_path)["token"] == OTHER


def test_a_lock_without_a_lease_never_touches_one(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    clock.t += 601
    plain = other(tmp_path, clock)
    plain.acquire()
    assert plain.release() is None
    assert lease_of(tmp_path)["expires"] == T0 + 600, "an expired lease is left as it is, ignored"


# ---------------------------------------------------------------- expired


def test_an_expired_lease_is_ignored_by_every_other_taker_and_said(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    clock.t += 601  # the controller died mid-group: it blocked the instance for the lease's lifetime, no longer
    holder = other(tmp_path, clock).acquire()
    assert holder["ignored_lease"] == f"{tmp_path / 'mn.lease'} (run {TOKEN}) expired at 2027-01-15T08:10:00Z, 1 s ago"


def test_another_controllers_group_replaces_an_expired_lease(tmp_path, clock):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    clock.t += 700
    run_phase(tmp_path, clock, LEASE_BEGIN, token=OTHER, controller="ctl-b", phase="stop")
    doc = lease_of(tmp_path)
    assert doc["token"] == OTHER and doc["controller"] == "ctl-b" and doc["since"] == "2027-01-15T08:11:40Z"
    # The first run's later phase now finds another run's lease: refused, naming it.
    with pytest.raises(Locked, match="run mn-20270115T080000Z-00000000000000bb"):
        phase(tmp_path, clock, LEASE_CONTINUE, phase="start").acquire()


def test_a_later_phase_whose_own_lease_expired_does_not_go_on(tmp_path, clock):
    """Somebody may have come in after the expiry (and gone): the group does not go forward, restart.yml rolls it
    back, and the rollback's phases take the lease again."""
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    clock.t += 660
    with pytest.raises(LeaseLost) as exc:
        phase(tmp_path, clock, LEASE_CONTINUE, phase="start").acquire()
    assert str(exc.value) == (
        f"mn: this multi-node restart's lease on this node expired at 2027-01-15T08:10:00Z, 60 s before this phase "
        f"({tmp_path / 'mn.lease'}), so another operation may have run here since its last phase: this phase does not "
        "go on. Nothing was touched (restart.yml rolls the group back)."
    )
    assert exc.value.holder == {}
    assert (tmp_path / "mn.lock").read_text() == "", "released at once"
    held = phase(tmp_path, clock, LEASE_RECOVER, phase="rollback_stop")
    assert held.acquire()["group_lease"]["expires"] == clock.t + 600
    assert lease_of(tmp_path)["since"] == "2027-01-15T08:00:00Z"
    held.release()


def test_a_later_phase_without_any_lease_does_not_go_on_and_the_rollback_takes_one(tmp_path, clock):
    with pytest.raises(LeaseLost, match=r"lease on this node is gone \(.*mn.lease does not exist"):
        phase(tmp_path, clock, LEASE_CONTINUE, phase="confirm").acquire()
    assert run_phase(tmp_path, clock, LEASE_RECOVER, phase="rollback_stop")["expires"] == T0 + 600


# ---------------------------------------------------------------- unreadable


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: p.write_text('{"token": "mn-1", "expi'), "is not JSON"),  # torn (never by this code: renamed whole)
        (lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "is not JSON"),
        (lambda p: p.write_text('{"token": "mn-1"}'), "has no token or expiry"),
        (lambda p: p.write_text('{"token": 7, "expires": 1e12}'), "has no token or expiry"),
        (lambda p: p.write_text('{"token": "mn-1", "expires": true}'), "has no token or expiry"),
        (lambda p: p.write_text("[]"), "has no token or expiry"),
        (lambda p: p.mkdir(), "cannot be read"),
        (lambda p: os.mkfifo(p), "is not JSON"),  # opened without blocking, read empty
        (lambda p: p.symlink_to("/etc/hostname"), "cannot be opened"),
    ],
    ids=["torn", "binary", "no-expiry", "token-not-str", "expires-bool", "not-a-dict", "directory", "fifo", "symlink"],
)
def test_a_lease_that_cannot_be_read_counts_as_expired_for_others_and_stops_the_groups_later_phase(
    tmp_path, clock, make, why
):
    """Decided: counted as expired. The lease is only ever replaced whole (rename), so such a file was never a lease
    in force; refusing on it would wedge the instance until someone found and deleted it. The group's own later
    phase still does not go on: it cannot show the file is its lease."""
    path = tmp_path / "mn.lease"
    make(path)
    holder = other(tmp_path, clock).acquire()  # a deploy's stage, a single restart: not wedged
    assert holder["ignored_lease"].startswith(f"{path} {why}") and holder["ignored_lease"].endswith(
        "counted as expired"
    )
    with pytest.raises(LeaseLost, match=f"cannot be shown to be its own .*{why}"):
        phase(tmp_path, clock, LEASE_CONTINUE, phase="start").acquire()
    view = lock.peek("mn", str(tmp_path), now=clock.t)
    assert view["group_lease"]["expired"] is True and why in view["group_lease"]["note"]


def test_a_groups_first_phase_replaces_a_garbled_lease(tmp_path, clock):
    (tmp_path / "mn.lease").write_text("garbage")
    assert run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")["expires"] == T0 + 600
    assert lease_of(tmp_path)["token"] == TOKEN


# ---------------------------------------------------------------- check mode, status, arguments


def test_check_mode_reads_the_lease_and_writes_none(tmp_path, clock):
    held = phase(tmp_path, clock, LEASE_CHECK, phase="stop")
    assert "group_lease" not in held.acquire() and held.release() is None
    assert not (tmp_path / "mn.lease").exists()
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    held = phase(tmp_path, clock, LEASE_CHECK, phase="start")  # its own run's lease: let in, left as it is
    held.acquire()
    clock.t += 5
    assert held.release() is None and lease_of(tmp_path)["expires"] == T0 + 600


def test_status_shows_the_lease_valid_or_expired(tmp_path, clock):
    assert lock.peek("mn", str(tmp_path)) is None
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    view = lock.peek("mn", str(tmp_path), now=T0 + 60)
    assert view["controller"] == "ctl-a" and view["operation"] == "restart mn (profile new)"
    assert view["group_lease"]["token"] == TOKEN and view["group_lease"]["expired"] is False
    assert view["group_lease"]["expires_at"] == "2027-01-15T08:10:00Z" and view["group_lease"]["expires_in_s"] == 540
    assert "a multi-node restart's group lease" in lock.describe(view)
    view = lock.peek("mn", str(tmp_path), now=T0 + 601)
    assert set(view) == {"group_lease"} and view["group_lease"]["expired"] is True
    assert view["group_lease"]["note"].startswith("expired: ignored by every operation")
    held = phase(tmp_path, clock, LEASE_CONTINUE, phase="start")
    held.acquire()  # a phase running: its live process, and the lease
    try:
        view = lock.peek("mn", str(tmp_path), now=T0 + 1)
        assert view["pid"] == os.getpid() and view["group"] == TOKEN and view["group_lease"]["expired"] is False
        assert lock.describe(view).startswith("restart mn (profile new) by pid ")
    finally:
        held.release()


@pytest.mark.parametrize("token, seconds", [("", 600), (TOKEN, 0), (TOKEN, -1)])
def test_a_lease_needs_a_token_and_a_lifetime(token, seconds):
    with pytest.raises(ValueError, match="a group lease needs a token and seconds above 0"):
        Lease(token, seconds)


# ---------------------------------------------------------------- written atomically


def test_the_lease_is_written_to_a_temporary_file_fsynced_renamed_then_the_directory_fsynced(
    tmp_path, clock, monkeypatch
):
    seen: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        seen.append(("fsync", Path(target).name, Path(target).read_text() if Path(target).is_file() else "<dir>"))
        real_fsync(fd)

    def replace(src, dst):
        seen.append(("rename", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(lock.os, "fsync", fsync)
    monkeypatch.setattr(lock.os, "replace", replace)
    lock.write_atomic(str(tmp_path / "mn.lease"), b'{"token": "x", "expires": 1}')
    tmp = f"mn.lease.{os.getpid()}.tmp"
    assert seen == [
        ("fsync", tmp, '{"token": "x", "expires": 1}'),  # the whole content on disk before the rename
        ("rename", tmp, "mn.lease"),
        ("fsync", tmp_path.name, "<dir>"),  # the rename itself on disk
    ]
    assert stat.S_IMODE((tmp_path / "mn.lease").stat().st_mode) == 0o600


def test_a_write_that_fails_leaves_the_old_lease_whole_and_no_temporary_file(tmp_path, clock, monkeypatch):
    run_phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    before = (tmp_path / "mn.lease").read_text()

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lock.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        phase(tmp_path, clock, LEASE_CONTINUE, phase="start").acquire()
    assert (tmp_path / "mn.lease").read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["mn.lease", "mn.lock"]
    monkeypatch.undo()
    held = phase(tmp_path, clock, LEASE_CONTINUE, phase="start")
    held.acquire()  # the flock was let go: the same phase goes on once the disk takes the write
    held.release()


def test_a_renewal_or_removal_that_fails_is_said_not_raised(tmp_path, clock, monkeypatch):
    held = phase(tmp_path, clock, LEASE_BEGIN, phase="stop")
    held.acquire()
    monkeypatch.setattr(lock, "write_atomic", lambda path, data: (_ for _ in ()).throw(OSError(30, "Read-only")))
    said = held.release()
    assert said["token"] == TOKEN and said["error"].endswith("could not be renewed: [Errno 30] Read-only")
    assert held.fd is None
    monkeypatch.undo()
    held = phase(tmp_path, clock, LEASE_CONTINUE, phase="record")
    held.acquire()
    monkeypatch.setattr(lock.os, "unlink", lambda p: (_ for _ in ()).throw(OSError(16, "Busy")))
    said = held.release(end_group=True)
    assert said["error"].endswith("could not be removed: [Errno 16] Busy") and held.fd is None
