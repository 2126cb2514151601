"""The boot guard: a unit starts only a configuration that verified, unless a restart is verifying it now.

The safe restart promotes the new configuration, then starts and verifies it; a boot (or a crash of the host)
in between would start what never verified, with the unit still enabled. The restart marks that window
in UNVERIFIED_DIR, under /run, which a boot empties (mark/unmark). The unit's first ExecStartPre
(`+sglang-boot-guard`, as root) calls check(): marked, the start goes on. Unmarked, and the files on disk
are not the newest known-good generation's, they are put back (the others kept under failed/), systemd
reloads, and this start fails with PUT_BACK: Restart=on-failure then starts the reloaded, known-good unit.
"""

from __future__ import annotations

import json
import os

from .durable import write_atomic
from .instance import NAME, kg_dir
from .known_good import latest_in, live_hash, record_paths, restore_files

UNVERIFIED_DIR = "/run/sglang-deploy/unverified"
# What the guard put back this boot, per instance: verify counts the restarts it caused as no crash (put_backs).
PUT_BACK_DIR = "/run/sglang-deploy/put-back"
GO, PUT_BACK, FAILED = 0, 75, 1  # PUT_BACK: EX_TEMPFAIL, this start fails and systemd starts it again


def marker(name: str, directory: str = UNVERIFIED_DIR) -> str:
    if not NAME.match(name):
        raise ValueError(f"instance name {name!r}: lowercase letters, digits, '-' and '_' only")
    return os.path.join(directory, name)


def beside(lock_dir: str, directory: str) -> str:
    """`directory` (UNVERIFIED_DIR, PUT_BACK_DIR) beside the lock directory (a test's Ports puts them elsewhere)."""
    return os.path.join(os.path.dirname(lock_dir), os.path.basename(directory))


def put_backs(name: str, directory: str = PUT_BACK_DIR) -> dict:
    """{"count", "generation"}: how many starts the guard refused since the unit was last started by a restart,
    putting back which generation; {"count": 0} when none."""
    try:
        with open(marker(name, directory), encoding="utf-8") as f:
            doc = json.load(f)
        return {"count": int(doc["count"]), "generation": str(doc.get("generation"))}
    except (OSError, ValueError, KeyError, TypeError):
        return {"count": 0}


def forget_put_backs(name: str, directory: str = PUT_BACK_DIR) -> None:
    """A restart starts the unit anew (its restart count back to 0): the guard's earlier put-backs no longer count."""
    try:
        os.unlink(marker(name, directory))
    except FileNotFoundError:
        pass


def mark(name: str, directory: str = UNVERIFIED_DIR) -> None:
    """A restart is about to put an unverified configuration on disk: until unmark, a start is its own."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = marker(name, directory)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(f"{os.getpid()}\n")


def unmark(name: str, directory: str = UNVERIFIED_DIR) -> None:
    try:
        os.unlink(marker(name, directory))
    except FileNotFoundError:
        pass


def check(
    name: str, state_dir: str, reload, directory: str = UNVERIFIED_DIR, put_back_dir: str = PUT_BACK_DIR
) -> tuple[int, str]:
    """(exit status, what the journal is told) for a start of instance `name`. reload() is systemctl
    daemon-reload, called once files were put back."""
    if os.path.exists(marker(name, directory)):
        return GO, f"{name}: a restart is verifying the configuration on disk: it starts"
    kg = kg_dir(state_dir, name)
    generations = os.path.join(kg, "generations")
    record = latest_in(generations)
    if record is None:
        return GO, f"{name}: no known-good generation to hold the configuration to: it starts"
    newest = os.path.basename(record_paths(generations)[-1])
    if os.path.basename(record["path"]) != newest:
        # latest_in skips a damaged record (known_good.whole): never an older generation over what may be the newest
        # verified one.
        return GO, f"{name}: the newest known-good generation ({newest}) is unreadable: not held to an older one"
    if live_hash(record) == record["config_hash"]:
        return GO, f"{name}: the configuration on disk is known-good generation {record.get('generation')}"
    out = restore_files(kg, record)
    reload()
    # The refused start makes systemd count a restart: said, so that verify does not take it for a crash.
    os.makedirs(put_back_dir, mode=0o700, exist_ok=True)
    count = put_backs(name, put_back_dir)["count"] + 1
    write_atomic(marker(name, put_back_dir), json.dumps({"count": count, "generation": out["generation"]}), 0o600)
    return PUT_BACK, (
        f"{name}: the configuration on disk never verified (a restart was cut short, by a boot or a crash): "
        f"known-good generation {out['generation']} put back (the other files kept in {out['failed_kept_in']}); "
        "systemd reloaded, and starts it after this refused start"
    )
