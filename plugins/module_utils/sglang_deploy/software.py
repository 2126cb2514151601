"""Software generations: one virtualenv per software generation, a link to the current one.

    <generations_dir>/<id>/                              a virtualenv (default /opt/ml-env.d/<id>)
    <generations_dir>/<id>/sglang-deploy/generation.json what it holds: RECORD_KEYS
    <generations_dir>/<id>/sglang-deploy/patches.json    the patch manifest of the series applied to it
    <link> -> <generations_dir>/<id>                     the current one (default /opt/ml-env)

The id is the first 16 hex digits of the sha256 of the record's IDENTITY fields as JSON with
sorted keys (generation_id), so a generation.json says how its id was made. The sglang role
computes the same on the controller (roles/sglang/tasks/preflight.yml; a unit test holds the two
equal). A generation is complete once its generation.json exists: the role writes it last, after
the install, the patch series and the parser check.

Pruning (prune) keeps the current generation, whatever the link points at, the newest keep-1
other complete ones, and never one that a unit or a record names: any path under the
generations directory that appears in a file matched by REFERENCES. Incomplete ones (a failed
or interrupted install) are removed unless referenced. A removal renames the directory to a
hidden name first, so an interrupted one never leaves a half generation that looks complete.

migrate turns a real virtualenv directory at the link's path (the layout before generations)
into the generation legacy-<UTC time>, and the path into a link to it.

No Ansible here: plugins/modules/sglang_generations.py is the adapter.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import time

from . import durable

META_DIR = "sglang-deploy"
RECORD = "generation.json"
MANIFEST = "patches.json"
IDENTITY = ("python_version", "sglang_version", "install_profile", "lock_sha256", "patch_series_sha256")
RECORD_KEYS = ("generation", *IDENTITY, "created")
# Files that name the software a unit runs or may run again (units, staged units, known-good records).
REFERENCES = (
    "/etc/systemd/system/sglang-*.service",
    "/etc/systemd/system/sglang-*.service.d/*.conf",
    "/etc/sglang/pending/*",
    "/var/lib/sglang/known-good/**/*.json",
)
REMOVING = ".removing"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class SoftwareError(Exception):
    """Nothing was changed; the message says why."""


def sha256_text(text: str) -> str:
    # surrogateescape: a file read as Ansible's file lookup reads it (bytes not UTF-8 kept) hashes as its bytes.
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def lock_sha256(requirements: list[str]) -> str:
    """The venv's complete lock (ml_env_requirements and SGLang's lock): unique, sorted, as a JSON list."""
    return sha256_text(json.dumps(sorted(set(requirements))))


def patch_series_sha256(patches: list[dict]) -> str:
    """The series as its manifest lists it: [{name, sha256 of content}] in order, as JSON."""
    series = [{"name": p["name"], "sha256": sha256_text(p["content"])} for p in patches]
    return sha256_text(json.dumps(series, sort_keys=True))


def generation_id(identity: dict) -> str:
    return sha256_text(json.dumps({k: identity.get(k) for k in IDENTITY}, sort_keys=True))[:16]


def record_path(venv: str) -> str:
    return os.path.join(venv, META_DIR, RECORD)


def manifest_path(venv: str) -> str:
    return os.path.join(venv, META_DIR, MANIFEST)


def read_record(venv: str) -> dict | None:
    try:
        with open(record_path(venv), encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def stamp(when: float | None = None) -> str:
    return time.strftime(TIME_FORMAT, time.gmtime(time.time() if when is None else when))


def references(gen_dir: str, patterns=REFERENCES) -> tuple[dict[str, list[str]], list[str]]:
    """{generation name: [files naming a path under gen_dir/<name>]}, and the files that could not be read."""
    named = re.compile(re.escape(gen_dir.rstrip("/")) + r"/([^/\s\"'\\;:,=]+)")
    found: dict[str, list[str]] = {}
    errors = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern, recursive=True)):
            if not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError as exc:
                errors.append(f"{path}: {exc.strerror or exc}")
                continue
            for name in sorted(set(named.findall(text))):
                found.setdefault(name, []).append(path)
    return found, errors


def _created(path: str, record: dict | None) -> str:
    created = (record or {}).get("created")
    return created if isinstance(created, str) and created else stamp(os.stat(path).st_mtime)


def _linked(link: str | None, gen_dir: str) -> str | None:
    """The generation the link points at, if it points into gen_dir."""
    if not link or not os.path.islink(link):
        return None
    target = os.path.realpath(link)
    parent, name = os.path.split(target)
    return name if parent == os.path.realpath(gen_dir) else None


def plan(gen_dir: str, current: str, keep: int, refs: dict[str, list[str]], link: str | None = None) -> list[dict]:
    """One decision per entry of gen_dir: {name, path, keep, reason, created, sglang_version}."""
    if keep < 1:
        raise SoftwareError(f"keep must be at least 1 (the current generation), not {keep}")
    linked = _linked(link, gen_dir)
    decisions, complete = [], []
    for name in sorted(os.listdir(gen_dir)):
        path = os.path.join(gen_dir, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        record = read_record(path)
        d = {
            "name": name,
            "path": path,
            "keep": True,
            "reason": "",
            "created": _created(path, record),
            "sglang_version": (record or {}).get("sglang_version"),
        }
        decisions.append(d)
        if name.startswith(".") and name.endswith(REMOVING):
            d.update(keep=False, reason="the rest of an interrupted removal")
        elif name == current:
            d["reason"] = "current: the generation just installed"
        elif name == linked:
            d["reason"] = f"current: {link} points at it"
        elif name in refs:
            d["reason"] = "referenced by " + ", ".join(refs[name])
        elif record is None and not os.path.exists(os.path.join(path, "pyvenv.cfg")):
            d["reason"] = "not a virtualenv (no pyvenv.cfg, no generation.json): left alone"
        elif record is None:
            d.update(
                keep=False, reason=f"incomplete: no {META_DIR}/{RECORD} (an install that failed or was interrupted)"
            )
        else:
            complete.append(d)
    complete.sort(key=lambda d: (d["created"], d["name"]), reverse=True)
    others = "the newest other" if keep == 2 else f"the {keep - 1} newest others"
    rule = f"keep={keep}: the current one and {others}" if keep > 1 else "keep=1: the current one only"
    for i, d in enumerate(complete):
        if i < keep - 1:
            d["reason"] = f"newest but the current one ({rule})"
        else:
            d.update(keep=False, reason=f"older ({rule}), referenced by no unit or record")
    return decisions


def remove(path: str) -> None:
    """Rename to a hidden name first: an interrupted removal never leaves a generation that looks complete."""
    parent, name = os.path.split(path)
    hidden = path if name.startswith(".") and name.endswith(REMOVING) else os.path.join(parent, f".{name}{REMOVING}")
    if hidden != path:
        durable.rename(path, hidden)
    durable.rmtree(hidden)


def settle(gen_dir: str, current: str, link: str | None) -> None:
    """The current generation's record and the link on disk before anything is removed: a crash after a
    removal must not bring back a link to the generation it replaced, or a current one without its record."""
    for d in (os.path.join(gen_dir, current, META_DIR), os.path.join(gen_dir, current), gen_dir):
        if os.path.isdir(d):
            durable.fsync_dir(d)
    if link:
        durable.fsync_dir(os.path.dirname(os.path.abspath(link)))


def prune(
    gen_dir: str, current: str, keep: int = 2, patterns=REFERENCES, link: str | None = None, check_mode: bool = False
) -> dict:
    """Remove what plan() does not keep; {changed, kept, removed, warnings}, each entry with its reason."""
    result: dict = {"changed": False, "kept": [], "removed": [], "warnings": []}
    if not os.path.isdir(gen_dir):
        return result
    refs, errors = references(gen_dir, patterns)
    decisions = plan(gen_dir, current, keep, refs, link)
    if not check_mode and any(not d["keep"] for d in decisions):
        settle(gen_dir, current, link)
    if errors:
        result["warnings"].append("nothing pruned: could not read " + "; ".join(errors))
        for d in decisions:
            d.update(keep=True, reason=d["reason"] if d["keep"] else "not pruned: references unreadable")
    for d in decisions:
        entry = {k: d[k] for k in ("name", "path", "reason", "created", "sglang_version")}
        if d["keep"]:
            result["kept"].append(entry)
            continue
        if not check_mode:
            try:
                remove(d["path"])
            except OSError as exc:
                result["warnings"].append(f"could not remove {d['path']}: {exc}")
                result["kept"].append(dict(entry, reason=f"removal failed: {exc}"))
                continue
        result["removed"].append(entry)
    result["changed"] = bool(result["removed"])
    return result


def _python_version(venv: str) -> str | None:
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition("=")
                if key.strip() in ("version", "version_info"):
                    return ".".join(value.strip().split(".")[:2])
    except OSError:
        pass
    return None


def _installed_version(venv: str, package: str = "sglang") -> str | None:
    for info in sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages", f"{package}-*.dist-info"))):
        return os.path.basename(info)[len(package) + 1 : -len(".dist-info")]
    return None


def migrate(
    link: str, gen_dir: str, manifest: str | None = None, check_mode: bool = False, now: float | None = None
) -> dict:
    """A real virtualenv directory at link becomes gen_dir/legacy-<UTC time>, and link a link to it.

    Its generation.json says what can be read from it (Python and SGLang versions); the patch
    manifest of the old layout, if given and present, is copied in. {changed, generation, msg}.
    """
    if os.path.islink(link) or not os.path.exists(link):
        return {"changed": False, "generation": None, "msg": f"{link} is a link or absent: nothing to migrate"}
    if not os.path.isdir(link):
        raise SoftwareError(f"{link} is neither a directory nor a link: move it away, then run again")
    when = time.time() if now is None else now
    name = "legacy-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(when))
    dest = os.path.join(gen_dir, name)
    msg = f"moved the virtualenv {link} to {dest} and linked {link} to it"
    if check_mode:
        return {"changed": True, "generation": name, "msg": msg}
    if os.path.lexists(dest):
        raise SoftwareError(f"{dest} exists already: nothing was changed")
    os.makedirs(gen_dir, mode=0o755, exist_ok=True)
    try:
        durable.rename(link, dest)
    except OSError as exc:
        raise SoftwareError(
            f"cannot move {link} to {dest} ({exc}): nothing was changed; both must be on one file system"
        ) from exc
    tmp = f"{link}.{os.getpid()}.tmp"
    os.symlink(dest, tmp)
    durable.rename(tmp, link)
    record = {
        "generation": name,
        "python_version": _python_version(dest),
        "sglang_version": _installed_version(dest),
        "install_profile": None,
        "lock_sha256": None,
        "patch_series_sha256": None,
        "created": stamp(when),
        "migrated_from": link,
    }
    os.makedirs(os.path.join(dest, META_DIR), mode=0o755, exist_ok=True)
    if manifest and os.path.isfile(manifest):
        shutil.copy2(manifest, manifest_path(dest))
    durable.write_atomic(record_path(dest), json.dumps(record, indent=2, sort_keys=True) + "\n", 0o644)
    return {"changed": True, "generation": name, "msg": msg}
