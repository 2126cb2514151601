"""Known-good generations: what a safe restart started and verified, with the software it ran.

Each generation is one JSON file under <state_dir>/known-good/<instance>/generations/,
root-only (0700 directory, 0600 files): the unit and configuration files as they were at
start (never the secrets file), their hashes, the argv as started (secrets masked), and
the software: the virtualenv the unit runs and its generation.json (SGLang version, lock
hash, patch series hash) and the patch manifest's hash. The newest is the known-good one;
older ones are kept up to `keep`. Because the unit names its virtualenv, putting a
generation's files back also puts its software back, as long as that virtualenv is kept
(the sglang role never prunes one a record names).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator

from . import durable
from .durable import write_atomic
from .instance import Instance, masked

FAILED_DIR = "failed"
REQUIRED = {"argv", "files", "profile", "config_hash"}  # what a rollback needs of a generation


def content_hash(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + files[path].encode() + b"\0")
    return h.hexdigest()[:16]


def argv_hash(argv: list[str]) -> str:
    return hashlib.sha256("\0".join(masked(argv)).encode()).hexdigest()[:16]


def file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def read_files(paths: list[str]) -> dict[str, str]:
    files = {}
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            files[path] = fh.read()
    return files


def record_paths(directory: str) -> list[str]:
    """The generation files in `directory`, oldest first (their names start with a sequence number)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    except FileNotFoundError:
        names = []
    return [os.path.join(directory, n) for n in names]


def whole(record) -> bool:
    """Whether a generation is one a rollback can put back: its fields there, its files path -> text, and its hash
    theirs (a record edited or cut short by hand is not, and must not be restored half)."""
    if not isinstance(record, dict) or not set(record) >= REQUIRED:
        return False
    files = record["files"]
    return (
        isinstance(files, dict)
        and bool(files)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        and record["config_hash"] == content_hash(files)
        and isinstance(record["argv"], list)
        and isinstance(record["profile"], str)
    )


def newest_first(directory: str) -> Iterator[dict]:
    """The whole generations in `directory`, newest first (each with its path under "path"); a damaged one is
    skipped, never fatal."""
    for path in reversed(record_paths(directory)):
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        if whole(record):
            record["path"] = path
            yield record


def latest_in(directory: str) -> dict | None:
    """The newest readable generation in `directory` (its path under "path"); a damaged one is skipped."""
    return next(newest_first(directory), None)


def live_hash(record: dict) -> str | None:
    """The content hash of the files a generation names, as they are on disk now; None if one is unreadable."""
    try:
        return content_hash(read_files(list(record["files"])))
    except (OSError, UnicodeDecodeError):
        return None


def restore_files(kg: str, record: dict) -> dict:
    """Put a generation's files back (the files now live are kept under <kg>/failed/)."""
    failed = os.path.join(kg, FAILED_DIR)
    os.makedirs(failed, mode=0o700, exist_ok=True)
    for path, content in record["files"].items():
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                write_atomic(os.path.join(failed, os.path.basename(path)), fh.read(), 0o600)
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        write_atomic(path, content, 0o600 if path.endswith(".env") else 0o644)
    return {"generation": record.get("generation"), "failed_kept_in": failed}


def software_of(venv: str | None) -> dict:
    """The software a unit runs: its virtualenv's generation.json and patch manifest hash."""
    if not venv:
        return {}
    meta = os.path.join(venv, "sglang-deploy")
    out: dict = {"venv": venv}
    try:
        with open(os.path.join(meta, "generation.json"), encoding="utf-8") as fh:
            out.update(json.load(fh))
    except (OSError, ValueError):
        out["generation"] = None
    out["patch_manifest_sha256"] = file_sha256(os.path.join(meta, "patches.json"))
    return out


class Store:
    """The known-good generations of one instance."""

    def __init__(self, inst: Instance, keep: int = 5):
        self.inst = inst
        self.keep = max(1, keep)
        self.dir = os.path.join(inst.kg_dir, "generations")

    def snapshot(self) -> dict:
        """The live configuration now: files, their hash."""
        files = read_files(self.inst.config_files)
        return {"files": files, "config_hash": content_hash(files)}

    def records(self) -> list[str]:
        return record_paths(self.dir)

    def latest(self) -> dict | None:
        return latest_in(self.dir)

    def rollback_target(self) -> dict | None:
        """What an operator's rollback puts back: the newest generation whose files are not the ones on disk now.
        The newest is what runs after a restart that verified: putting it back would change nothing."""
        return next((r for r in newest_first(self.dir) if live_hash(r) != r["config_hash"]), None)

    def record(self, started: dict, argv: list[str], verify: dict) -> dict:
        """Record what started as a new generation; returns its summary."""
        inst = self.inst
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        os.chmod(inst.kg_dir, 0o700)
        now = time.time()
        record = {
            "instance": inst.name,
            "unit": inst.unit,
            "profile": inst.profile,
            "argv": masked(argv),
            "files": started["files"],
            "config_hash": started["config_hash"],
            "argv_hash": argv_hash(argv),
            "software": software_of(inst.venv),
            "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "tokens_per_s": verify.get("tokens_per_s"),
            "accept_length": verify.get("accept_length"),
            "checks": [{k: c.get(k) for k in ("name", "ok", "severity")} for c in verify.get("checks") or []],
        }
        # Ordered by a sequence number, not the clock: a clock stepped back must not make an older generation newest.
        generation = (
            f"{self.next_sequence():06d}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(now))}-{record['config_hash']}"
        )
        record["generation"] = generation
        write_atomic(os.path.join(self.dir, generation + ".json"), json.dumps(record, indent=1, sort_keys=True), 0o600)
        self.prune()
        legacy = os.path.join(inst.kg_dir, "record.json")  # the one record before generations held secrets inline
        durable.unlink(legacy, missing_ok=True)
        return summary(record)

    def next_sequence(self) -> int:
        numbers = [
            int(n.split("-", 1)[0]) for n in map(os.path.basename, self.records()) if n.split("-", 1)[0].isdigit()
        ]
        return max(numbers, default=0) + 1

    def prune(self) -> list[str]:
        removed = []
        for path in self.records()[: -self.keep]:
            durable.unlink(path)
            removed.append(path)
        return removed

    def restore(self, record: dict) -> dict:
        """Put a generation's files back (the files now live are kept under failed/)."""
        return restore_files(self.inst.kg_dir, record)


def summary(record: dict) -> dict:
    sw = record.get("software") or {}
    return {
        "generation": record.get("generation"),
        "config_hash": record.get("config_hash"),
        "profile": record.get("profile"),
        "recorded_at": record.get("recorded_at"),
        "software": {
            k: sw.get(k)
            for k in (
                "generation",
                "sglang_version",
                "lock_sha256",
                "patch_series_sha256",
                "patch_manifest_sha256",
                "venv",
            )
        },
    }
