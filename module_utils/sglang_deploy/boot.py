"""The boot guard: a unit starts only a configuration that verified, unless a restart is verifying it now.

The safe restart promotes the new configuration, then starts and verifies it; a boot (or a crash of the host)
in between would start what never verified, with the unit still enabled. The restart marks that window
in UNVERIFIED_DIR, under /run, which a boot empties (mark/unmark). The unit's first ExecStartPre
(`+sglang-boot-guard`, as root) calls check(): marked, the start goes on. Unmarked, and the files on disk
are not the newest known-good generation's, they are put back (the others kept under failed/), systemd
reloads, and this start fails with PUT_BACK: Restart=on-failure then starts the reloaded, known-good unit.
"""

from __future__ import annotations

import os

from .instance import NAME, kg_dir
from .known_good import latest_in, live_hash, restore_files

UNVERIFIED_DIR = "/run/sglang-deploy/unverified"
GO, PUT_BACK, FAILED = 0, 75, 1  # PUT_BACK: EX_TEMPFAIL, this start fails and systemd starts it again


def marker(name: str, directory: str = UNVERIFIED_DIR) -> str:
    if not NAME.match(name):
        raise ValueError(f"instance name {name!r}: lowercase letters, digits, '-' and '_' only")
    return os.path.join(directory, name)


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


def check(name: str, state_dir: str, reload, directory: str = UNVERIFIED_DIR) -> tuple[int, str]:
    """(exit status, what the journal is told) for a start of instance `name`. reload() is systemctl
    daemon-reload, called once files were put back."""
    if os.path.exists(marker(name, directory)):
        return GO, f"{name}: a restart is verifying the configuration on disk: it starts"
    kg = kg_dir(state_dir, name)
    record = latest_in(os.path.join(kg, "generations"))
    if record is None:
        return GO, f"{name}: no known-good generation to hold the configuration to: it starts"
    if live_hash(record) == record["config_hash"]:
        return GO, f"{name}: the configuration on disk is known-good generation {record.get('generation')}"
    out = restore_files(kg, record)
    reload()
    return PUT_BACK, (
        f"{name}: the configuration on disk never verified (a restart was cut short, by a boot or a crash): "
        f"known-good generation {out['generation']} put back (the other files kept in {out['failed_kept_in']}); "
        "systemd reloaded, and starts it after this refused start"
    )
