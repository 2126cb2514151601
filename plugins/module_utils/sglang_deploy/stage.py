"""Staged configuration: a deploy writes a changed unit and environment as pending.

What systemd starts after a crash or at boot stays the unit's live files, the
configuration the last safe restart verified, until the safe restart promotes the
pending files (outcomes.PROMOTE). While no configuration of the instance has ever been
verified (no known-good generation), there is nothing to protect: the files are written
live; the unit is enabled only once a restart has verified it.
Secrets are not staged: the secrets file always holds the current values (a rotated key
takes effect at the next start of any configuration, a rolled-back one included).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

from . import durable, outcomes
from .durable import write_atomic
from .instance import Instance
from .known_good import Store, content_hash
from .unit import checked

UNIT_MODE, ENV_MODE = 0o644, 0o600


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def manifest_path(inst: Instance) -> str:
    """Written last by a deploy: a pending set without it (or not matching it) is incomplete."""
    return os.path.join(inst.pending_dir, f"{inst.name}.staged")


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def stage_complete(inst: Instance) -> bool:
    try:
        with open(manifest_path(inst), encoding="utf-8") as fh:
            manifest = json.load(fh)
        pending = set(inst.pending_files.values())
        return set(manifest) == pending and all(digest(read_text(path)) == v for path, v in manifest.items())
    except (OSError, ValueError, AttributeError):
        return False


def read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def verify_unit(path: str, unit: str) -> None:
    """systemd-analyze verify on the file as it will be named (the kubespray way)."""
    try:
        out = subprocess.run(
            ["systemd-analyze", "verify", f"{path}:{unit}"], capture_output=True, text=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"systemd-analyze verify {unit} could not run: {exc}") from exc
    if out.returncode != 0:
        raise ValueError(f"systemd-analyze verify refuses the rendered {unit}: {(out.stderr or out.stdout).strip()}")


def mode_of(path: str) -> int:
    return ENV_MODE if path.endswith(".env") else UNIT_MODE


def stage(inst: Instance, rendered: dict[str, str], secrets: str | None, check_mode: bool = False) -> dict:
    """rendered: {live path: content} for the unit and the environment file. Hold the instance's lock."""
    live = {path: read(path) for path in rendered}
    res: dict = {
        "instance": inst.name,
        "changed": False,
        "pending": False,
        "wrote": [],
        "config_hash": content_hash(rendered),
    }  # what a restart of this run must find staged
    if all(live[p] == rendered[p] for p in rendered):
        res["outcome"] = outcomes.UNCHANGED
        stale = list(inst.pending_files.values()) + [m for m in [manifest_path(inst)] if os.path.exists(m)]
        if stale and not check_mode:
            for path in stale:
                durable.unlink(path)
        res.update(changed=bool(stale), wrote=[], removed_pending=stale)
        targets = {}
    elif Store(inst).latest() is None:
        res["outcome"] = outcomes.STAGED
        res["first"] = True
        res["detail"] = "written as the unit's: no configuration of it was ever verified, so none to protect"
        targets = {p: c for p, c in rendered.items() if live[p] != c}
    else:
        res["outcome"] = outcomes.STAGED
        res["pending"] = True
        res["detail"] = "pending: the safe restart promotes it; until then a crash or a boot starts the verified one"
        # Every file is staged, one equal to the live one too, so the pending set is complete.
        targets = {inst.pending_path(p): rendered[p] for p in rendered if read(inst.pending_path(p)) != rendered[p]}
        if not targets and not stage_complete(inst):
            targets = {inst.pending_path(p): rendered[p] for p in rendered}
    if targets:
        res["changed"] = True
        if not check_mode:
            for path in targets:
                os.makedirs(
                    os.path.dirname(path), mode=0o700 if path.startswith(inst.pending_dir) else 0o755, exist_ok=True
                )
            unit_file = next((p for p in targets if os.path.basename(p) == os.path.basename(inst.unit_path)), None)
            if unit_file:  # checked before anything is written: a refused unit leaves no file behind
                probe = os.path.join(os.path.dirname(unit_file), f".{inst.unit}.verify")
                write_atomic(probe, targets[unit_file], UNIT_MODE)
                try:
                    verify_unit(probe, inst.unit)
                finally:
                    durable.unlink(probe)
            # incomplete until the manifest, written last, says what the set is
            if res["pending"]:
                durable.unlink(manifest_path(inst), missing_ok=True)
            for path, content in targets.items():
                write_atomic(path, content, mode_of(path))
            if res["pending"]:
                manifest = {inst.pending_path(p): digest(c) for p, c in rendered.items()}
                write_atomic(manifest_path(inst), json.dumps(manifest, sort_keys=True), ENV_MODE)
            if res.get("first"):
                checked("daemon-reload")
        res["wrote"] = sorted(targets)
    if secrets is not None and read(inst.secrets_path) != secrets:
        res["changed"] = True
        res["secrets_changed"] = True
        if not check_mode:
            os.makedirs(os.path.dirname(inst.secrets_path), mode=0o700, exist_ok=True)
            write_atomic(inst.secrets_path, secrets, ENV_MODE)
    return res


def promote(inst: Instance, reload=lambda: checked("daemon-reload")) -> dict:
    """The pending files become the unit's (called by the safe restart, under the lock, after the stop)."""
    pending = inst.pending_files
    if pending and not stage_complete(inst):
        raise ValueError(
            f"the pending configuration of {inst.name} is incomplete (a deploy was interrupted?): deploy again"
        )
    for live, path in pending.items():
        with open(path, encoding="utf-8") as fh:
            write_atomic(live, fh.read(), mode_of(live))
    for path in [*pending.values(), manifest_path(inst)]:
        durable.unlink(path, missing_ok=True)
    if pending:
        reload()
    return {"promoted": sorted(pending)}
