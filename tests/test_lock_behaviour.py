"""What the per-instance lock leaves on disk and says (issue #31: the behaviours behind the mutants the unit suite
let survive in sglang_deploy/lock.py).

A refusal's message is what the operator reads, and its holder is the failure's `lock` field a restart returns;
status shows peek's view; the lock directory, the lock file and the lease are root's alone (0700, 0600), a link
planted at their names is never followed; the holder names its own command line when its caller gave none, cut to
160 characters; a lease's expiry is kept to the millisecond and is over at its very instant.
"""

from __future__ import annotations

import calendar
import fcntl
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import lock, procinfo
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import (
    LEASE_BEGIN,
    LEASE_CONTINUE,
    InstanceLock,
    Lease,
    LeaseLost,
    Locked,
)

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
TOKEN, OTHER = "mn-20270115T080000Z-00000000000000aa", "mn-20270115T080000Z-00000000000000bb"
SAYS_RETRY = ". Nothing was touched; retry once it ends (python -m driver status shows where it stands)."


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


pytestmark = pytest.mark.usefixtures("usual_umask")


def group(tmp_path, clock, mode: str, token: str = TOKEN, seconds: float = 600, **kw) -> InstanceLock:
    return InstanceLock(
        "mn",
        "restart mn (profile new)",
        kw.pop("controller", "ctl-a"),
        kw.pop("command", "python -m driver restart"),
        str(tmp_path),
        lease=Lease(token, seconds, mode, kw.pop("phase", mode)),
        clock=clock,
    )


def deploy(tmp_path, clock=time.time, **kw) -> InstanceLock:
    return InstanceLock("mn", "deploy mn (stage)", kw.pop("controller", "ctl-b"), "python -m driver deploy",
                        str(tmp_path), clock=clock, **kw)  # fmt: skip


def held_by_hand(path: Path, content: bytes) -> int:
    """A lock file another process holds (its flock on its own open file), with what it wrote."""
    path.write_bytes(content)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def take(taker: InstanceLock) -> dict:
    """Acquired and released: the holder it wrote."""
    holder = taker.acquire()
    taker.release()
    return holder


def refusal(taker: InstanceLock) -> Locked:
    with pytest.raises(Locked) as exc:
        taker.acquire()
    assert taker.fd is None
    return exc.value


def own_cmdline() -> str:
    with open("/proc/self/cmdline", "rb") as fh:
        return " ".join(w.decode(errors="replace") for w in fh.read().split(b"\0") if w)[:160]


# ---------------------------------------------------------------- a running operation's refusal, word for word


def test_a_held_lock_refuses_naming_its_holder_word_for_word(tmp_path):
    first = InstanceLock("mn", "restart mn (profile new)", "ctl-a", "python -m driver restart", str(tmp_path))
    holder = first.acquire()
    try:
        exc = refusal(deploy(tmp_path))
        assert exc.holder == json.loads((tmp_path / "mn.lock").read_text()) == holder
        assert str(exc) == (
            f"mn is locked by another operation: restart mn (profile new) by pid {os.getpid()} "
            f"(python -m driver restart) from controller ctl-a since {holder['since']}{SAYS_RETRY}"
        )
    finally:
        first.release()


@pytest.mark.parametrize(
    "written, says",
    [
        ({"pid": 4242}, "? by pid 4242 (?) from controller ? since ?"),  # a holder with nothing but its pid
        ({"operation": "deploy mn", "controller": ""}, "deploy mn by pid ? (?) from controller ? since ?"),
        ({}, "a holder that has not written its name yet"),
    ],
    ids=["pid-only", "no-pid", "empty"],
)
def test_a_holder_file_lacking_fields_names_each_as_a_question_mark(tmp_path, written, says):
    fd = held_by_hand(tmp_path / "mn.lock", json.dumps(written).encode() if written else b"")
    try:
        exc = refusal(deploy(tmp_path))
    finally:
        os.close(fd)
    assert exc.holder == written
    assert str(exc) == f"mn is locked by another operation: {says}{SAYS_RETRY}"


def test_a_holder_file_is_read_up_to_4096_bytes(tmp_path):
    """A holder's record is read from its first 4096 bytes: one that ends past them is a holder not yet named."""
    for size, named in ((4096, True), (4097, False)):
        doc = {"operation": "deploy mn", "pid": 7, "command": ""}
        doc["command"] = "c" * (size - len(json.dumps(doc)))
        content = json.dumps(doc).encode()
        assert len(content) == size
        fd = held_by_hand(tmp_path / "mn.lock", content)
        try:
            exc = refusal(deploy(tmp_path))
        finally:
            os.close(fd)
        assert (exc.holder == doc) is named and (exc.holder == {}) is not named


def test_a_lock_taken_without_a_controller_or_command_names_the_process(tmp_path):
    taken = InstanceLock("mn", "deploy mn", lock_dir=str(tmp_path))
    holder = taken.acquire()
    try:
        assert holder["controller"] == "" and holder["command"] == own_cmdline()
        assert "from controller ? since " in str(refusal(deploy(tmp_path)))
    finally:
        taken.release()


@pytest.fixture
def far_from_utc(monkeypatch):
    """A host whose local time is 5 h 30 min ahead of UTC (a POSIX TZ: no tzdata needed)."""
    monkeypatch.setenv("TZ", "XST-05:30")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_holder_says_since_when_in_utc_on_a_host_whose_local_time_is_not(tmp_path, far_from_utc):
    before = int(time.time())
    taken = deploy(tmp_path)
    since = taken.acquire()["since"]
    after = int(time.time())
    taken.release()
    assert len(since) == 20 and since[4] == since[7] == "-" and since[10] == "T" and since.endswith("Z")
    assert before <= calendar.timegm(time.strptime(since, "%Y-%m-%dT%H:%M:%SZ")) <= after


# ---------------------------------------------------------------- modes and links


def test_the_lock_directory_is_made_0700_and_never_open_to_others_meanwhile(tmp_path, monkeypatch):
    locks = tmp_path / "run" / "locks"
    seen = []
    real_chmod = os.chmod

    def chmod(path, mode, *a, **kw):
        seen.append((str(path), stat.S_IMODE(os.stat(path).st_mode)))  # as makedirs left it
        real_chmod(path, mode, *a, **kw)

    monkeypatch.setattr(os, "chmod", chmod)
    take(deploy(locks))
    assert seen == [(str(locks), 0o700)]
    assert stat.S_IMODE(locks.stat().st_mode) == 0o700


def test_an_existing_lock_directory_open_to_others_is_made_0700(tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir(mode=0o755)
    take(deploy(locks))
    assert stat.S_IMODE(locks.stat().st_mode) == 0o700
    assert stat.S_IMODE((locks / "mn.lock").stat().st_mode) == 0o600


def test_a_link_planted_at_the_lock_file_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    (tmp_path / "locks").mkdir(mode=0o700)
    (tmp_path / "locks" / "mn.lock").symlink_to(victim)
    with pytest.raises(OSError) as exc:
        deploy(tmp_path / "locks").acquire()
    assert not isinstance(exc.value, Locked)
    assert victim.read_text() == "root's own\n"


def test_status_ignores_a_link_planted_at_the_lock_file(tmp_path):
    """Even one pointing at a file that names a live holder (this process): status reads only the lock file."""
    live = {"operation": "restart mn", "pid": os.getpid(), "start_time": procinfo.start_time(os.getpid()),
            "boot_id": procinfo.boot_id()}  # fmt: skip
    assert lock.holder_alive(live)
    (tmp_path / "elsewhere").write_text(json.dumps(live))
    (tmp_path / "mn.lock").symlink_to(tmp_path / "elsewhere")
    assert lock.peek("mn", str(tmp_path)) is None


def test_pid_1_is_a_holder_like_any_other():
    """init runs on every host: a record naming it, with its start time in this boot, names a live process."""
    one = {"pid": 1, "start_time": procinfo.start_time(1), "boot_id": procinfo.boot_id()}
    assert one["start_time"] is not None
    assert lock.holder_alive(one) is True
    assert lock.holder_alive({"pid": 1}) is True  # an older version's record: by the pid alone
    assert lock.holder_alive({**one, "start_time": one["start_time"] + 1}) is False


# ---------------------------------------------------------------- the command line a holder names


SCRIPT = "import sys; print('up', flush=True); sys.stdin.read()"


@pytest.fixture
def child():
    """A process with a command line of our choosing: a byte that is not UTF-8, and 200 characters more."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, b"k\xff\xfey", "x" * 200], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout.readline() == b"up\n"  # running its own command line
    yield proc
    proc.stdin.close()
    proc.wait(timeout=10)
    proc.stdout.close()


def test_the_command_line_is_its_words_joined_by_spaces_cut_at_160(child):
    text = lock.command_of(child.pid)
    words = [sys.executable, "-c", SCRIPT, "k\ufffd\ufffdy", "x" * 200]
    assert text == " ".join(words)[:160] and len(text) == 160


def test_the_command_line_of_a_process_gone_or_without_one_is_a_question_mark(tmp_path, monkeypatch):
    assert lock.command_of(2**22 + 1) == "?"  # above any pid_max: no such process
    empty = tmp_path / "cmdline"
    empty.write_bytes(b"")  # a kernel thread's, or a zombie's
    real_open = open
    monkeypatch.setattr(lock, "open", lambda path, *a, **kw: real_open(empty, *a, **kw), raising=False)
    assert lock.command_of(12345) == "?"


# ---------------------------------------------------------------- a lease as the holder a refusal names


def write_lease(tmp_path, doc: dict) -> Path:
    path = tmp_path / "mn.lease"
    path.write_text(json.dumps(doc))
    return path


def test_a_group_lease_refuses_naming_it_word_for_word(tmp_path, clock):
    taken = group(tmp_path, clock, LEASE_BEGIN, phase="stop")
    taken.acquire()
    taken.release()
    clock.t = T0 + 100.25
    exc = refusal(deploy(tmp_path, clock))
    path = str(tmp_path / "mn.lease")
    assert exc.holder == {
        "operation": "restart mn (profile new)",
        "pid": "none (a group lease until 2027-01-15T08:10:00Z)",
        "command": "python -m driver restart",
        "controller": "ctl-a",
        "since": "2027-01-15T08:00:00Z",
        "group_lease": {
            "token": TOKEN,
            "expires": T0 + 600,
            "expires_at": "2027-01-15T08:10:00Z",
            "expires_in_s": 499.8,  # to a tenth of a second
            "phase": "stop",
            "path": path,
        },
    }
    assert str(exc) == (
        f"mn is locked by another operation: a multi-node restart's group lease (run {TOKEN}, between its phases): "
        "restart mn (profile new) (python -m driver restart) from controller ctl-a since 2027-01-15T08:00:00Z, until "
        "2027-01-15T08:10:00Z (in 499.8 s; it is renewed at each phase, removed at the group's end, and ignored once "
        f"expired: {path}){SAYS_RETRY}"
    )


def test_a_lease_with_only_a_token_and_an_expiry_refuses_naming_what_it_lacks(tmp_path, clock):
    """Another writer's lease (an older version's, one written by hand): what it does not say is said as unknown."""
    path = write_lease(tmp_path, {"token": OTHER, "expires": T0 + 60})
    exc = refusal(deploy(tmp_path, clock))
    assert exc.holder == {
        "operation": "?",
        "pid": "none (a group lease until 2027-01-15T08:01:00Z)",
        "command": "?",
        "controller": "",
        "since": "?",
        "group_lease": {
            "token": OTHER,
            "expires": T0 + 60,
            "expires_at": "2027-01-15T08:01:00Z",
            "expires_in_s": 60.0,
            "phase": "",
            "path": str(path),
        },
    }
    assert str(exc) == (
        f"mn is locked by another operation: a multi-node restart's group lease (run {OTHER}, between its phases): "
        "? (?) from controller ? since ?, until 2027-01-15T08:01:00Z (in 60.0 s; it is renewed at each phase, "
        f"removed at the group's end, and ignored once expired: {path}){SAYS_RETRY}"
    )


def test_describe_names_what_a_group_lease_lacks_as_a_question_mark(tmp_path):
    """Status's view of an unreadable lease (no token, no expiry): described whole, every unknown as '?'."""
    (tmp_path / "mn.lease").write_text("garbage")
    view = lock.peek("mn", str(tmp_path), now=T0)
    path = str(tmp_path / "mn.lease")
    assert view == {"group_lease": {"path": path, "expired": True, "note": f"{path} is not JSON: counted as expired"}}
    assert lock.describe(view) == (
        "a multi-node restart's group lease (run ?, between its phases): ? (?) from controller ? since ?, until ? "
        f"(in ? s; it is renewed at each phase, removed at the group's end, and ignored once expired: {path})"
    )
    assert lock.describe({"group_lease": {"token": TOKEN}}).endswith(
        "ignored once expired: the .lease file beside the lock)"
    )


def test_a_later_phase_finding_another_runs_expired_lease_does_not_go_on_naming_it(tmp_path, clock):
    taken = group(tmp_path, clock, LEASE_BEGIN, token=OTHER, controller="ctl-b", phase="stop")
    taken.acquire()
    taken.release()
    clock.t = T0 + 700
    with pytest.raises(LeaseLost) as exc:
        group(tmp_path, clock, LEASE_CONTINUE, phase="start").acquire()
    assert str(exc.value).startswith(
        f"mn: this multi-node restart's lease on this node was replaced by run {OTHER}'s, expired at "
        f"2027-01-15T08:10:00Z ({tmp_path / 'mn.lease'}), so another operation may have run here"
    )


# ---------------------------------------------------------------- expiry: at its instant, kept to the millisecond


def test_a_lease_is_over_at_the_very_instant_it_expires(tmp_path, clock):
    taken = group(tmp_path, clock, LEASE_BEGIN, phase="stop")
    taken.acquire()
    taken.release()
    clock.t = T0 + 599.999
    refusal(deploy(tmp_path, clock))
    view = lock.peek("mn", str(tmp_path), now=T0 + 599.999)
    assert view["group_lease"]["expired"] is False and view["controller"] == "ctl-a"
    clock.t = T0 + 600
    view = lock.peek("mn", str(tmp_path), now=T0 + 600)
    path = str(tmp_path / "mn.lease")
    assert view == {
        "group_lease": {
            "token": TOKEN,
            "expires": T0 + 600,
            "expires_at": "2027-01-15T08:10:00Z",
            "expires_in_s": 0.0,
            "phase": "stop",
            "path": path,
            "expired": True,
            "note": "expired: ignored by every operation (a new group's first phase replaces it)",
        }
    }
    holder = take(deploy(tmp_path, clock))
    assert holder["ignored_lease"] == f"{path} (run {TOKEN}) expired at 2027-01-15T08:10:00Z, 0 s ago"


def test_status_shows_a_valid_lease_between_phases_with_its_path(tmp_path, clock):
    taken = group(tmp_path, clock, LEASE_BEGIN, phase="stop")
    taken.acquire()
    taken.release()
    view = lock.peek("mn", str(tmp_path), now=T0 + 10)
    lease = {
        "token": TOKEN,
        "expires": T0 + 600,
        "expires_at": "2027-01-15T08:10:00Z",
        "expires_in_s": 590.0,
        "phase": "stop",
        "path": str(tmp_path / "mn.lease"),
    }
    assert view == {
        "operation": "restart mn (profile new)",
        "pid": "none (a group lease until 2027-01-15T08:10:00Z)",
        "command": "python -m driver restart",
        "controller": "ctl-a",
        "since": "2027-01-15T08:00:00Z",
        "group_lease": {**lease, "expired": False},
    }


def test_the_expiry_is_kept_to_the_millisecond(tmp_path):
    clock = Clock(T0 + 0.12345)
    taken = group(tmp_path, clock, LEASE_BEGIN, phase="stop")
    assert taken.acquire()["group_lease"]["expires"] == 1_800_000_600.123
    taken.release()
    assert json.loads((tmp_path / "mn.lease").read_text())["expires"] == 1_800_000_600.123


def test_a_lease_of_under_a_second_is_a_lease(tmp_path, clock):
    taken = group(tmp_path, clock, LEASE_BEGIN, seconds=0.5, phase="stop")
    assert taken.acquire()["group_lease"]["expires"] == T0 + 0.5
    taken.release()


def test_a_lease_taken_without_a_command_names_the_process(tmp_path, clock):
    taken = group(tmp_path, clock, LEASE_BEGIN, command="", phase="stop")
    taken.acquire()
    taken.release()
    assert json.loads((tmp_path / "mn.lease").read_text())["command"] == own_cmdline()


# ---------------------------------------------------------------- a lease file that cannot be read


def test_a_lease_file_is_read_up_to_64_kib(tmp_path, clock):
    """Read from its first 65536 bytes: one that ends past them is not JSON, and counted as expired."""
    for size, refused in ((65536, True), (65537, False)):
        doc = {"token": OTHER, "expires": T0 + 60, "phase": ""}
        doc["phase"] = "p" * (size - len(json.dumps(doc)))
        path = write_lease(tmp_path, doc)
        assert path.stat().st_size == size
        if refused:
            refusal(deploy(tmp_path, clock))
        else:
            assert take(deploy(tmp_path, clock))["ignored_lease"] == f"{path} is not JSON: counted as expired"


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda p: p.symlink_to(p.parent / "elsewhere"), "cannot be opened (Too many levels of symbolic links)"),
        (lambda p: p.mkdir(), "cannot be read (Is a directory)"),
    ],
    ids=["symlink", "directory"],
)
def test_a_lease_that_cannot_be_opened_or_read_says_why_in_the_systems_words(tmp_path, clock, make, why):
    (tmp_path / "elsewhere").write_text(json.dumps({"token": OTHER, "expires": T0 + 60}))
    path = tmp_path / "mn.lease"
    make(path)
    holder = take(deploy(tmp_path, clock))
    assert holder["ignored_lease"] == f"{path} {why}: counted as expired"
