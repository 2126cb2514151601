"""A host's deployed state as one digest, so that a deploy that would change nothing costs one round trip (issue #36).

Two halves, compared in one module call (sglang_state):
- desired, on the controller: the deploy's inputs, hashed - the files of the collection that shape a node (its roles
  and plugins, the patch series) and the host's variables of the deploy's roles (their names' prefixes, DEPLOY_VARS),
  as written, before any templating (a value that names a fact is hashed as written: RUN_SCOPED and the fact's
  change aside, the same text renders the same);
- applied, on the host: the record a complete deploy wrote (RECORD: the desired digest it applied, and a fingerprint
  of what it left - file contents, trees' listings, links, the package database, the OS release), compared with a
  fingerprint taken now.

The host is current when the record's digest is the desired one and nothing it fingerprinted moved; then a deploy
ends the host there (playbooks/deploy.yml). Anything else - no record, another digest, a file edited by hand, a
package upgraded - and the deploy runs every role as before, after the record is set aside (a deploy that fails half
way leaves no record that could vouch for it) and the desired digest kept on the host for the record at the end
(begin, record: the digest, which hashes secret variables among the rest, never travels back to the controller's
logs, and a run records only what it checked itself).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterable, Mapping

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable, gpu

FORMAT = 1
# File names as the OS gives them: bytes that are not UTF-8 come back as they are (os.fsencode's rule).
NAMES = "surrogateescape"
RECORD = "/var/lib/sglang-deploy/deploy-state.json"
# The host's variables a deploy reads: its roles' (gpu_node, cuda, ml_env, sglang, sglang_service) and the fleet's
# settings they are given (sglang_instances, sglang_profiles, ...). Underscored names are the roles' own facts.
# (A value is hashed as the inventory or -e gives it, templated with the host's own variables where that resolves:
# plugins/action/sglang_state.py.)
DEPLOY_VARS = re.compile(r"^(gpu_node|cuda|ml_env|sglang)_")
# Variables of one run, not of the host's state: the driver's cancel file and the evidence directory, this lever's
# own switch, and what a run names for itself (another controller's name must not make every host stale).
RUN_SCOPED = frozenset(
    {
        "sglang_deploy_state",
        "sglang_service_cancel_file",
        "sglang_service_evidence_dir",
        "sglang_service_controller",
        "sglang_service_controller_command",
        "sglang_service_instances_selected",  # the driver's --instance: which instances a restart acts on
    }
)
# Variables of the operations that never shape what a deploy leaves: a rollout's, the monitoring host's.
NOT_DEPLOY = re.compile(r"^sglang_(rollout|monitoring)_")
# What a path of the applied state is fingerprinted by: its content (file), every file's content under it (tree),
# every entry's type, size, mode and mtime under it (listing: a virtualenv or the CUDA toolkit, too large to read
# each time), its own entries' names, types and links (entries: the generations), its own type, mode and owner alone
# (stat: a directory whose contents other operations change), or the files a glob matches (glob). A directory's own
# mode and owner count in every kind.
KINDS = ("file", "tree", "listing", "entries", "stat", "glob")
# Always part of the applied state: the package database (an upgrade), users and groups, the OS release, and the
# GPUs as nvidia-smi lists them (a GPU lost or swapped, another driver, a driver that no longer answers: the deploy's
# own probe and its refusals run again).
GPUS = "gpus"
SYSTEM = (
    {"path": "/var/lib/dpkg/status", "kind": "file"},
    {"path": "/etc/passwd", "kind": "file"},
    {"path": "/etc/group", "kind": "file"},
    {"path": "/etc/os-release", "kind": "file"},
    {"path": "nvidia-smi", "kind": GPUS},
)


class StateError(Exception):
    """A path or record this module cannot read as asked (named in the message)."""


def canonical(value: object) -> object:
    """A variable's value as plain JSON, the same for the same text: mappings sorted, tagged strings as str."""
    if isinstance(value, Mapping):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return str(value)


def deploy_vars(task_vars: Mapping[str, object]) -> dict[str, object]:
    """The host's variables that shape its deploy, by name (DEPLOY_VARS less RUN_SCOPED)."""
    return {
        k: canonical(v)
        for k, v in task_vars.items()
        if DEPLOY_VARS.match(k) and k not in RUN_SCOPED and not NOT_DEPLOY.match(k)
    }


def files_digest(roots: Iterable[str]) -> str:
    """Every file's relative path and content under each root (a file stands for itself), in a stable order;
    caches (__pycache__, *.pyc) left out."""
    h = hashlib.sha256()
    for root in sorted(set(roots)):
        h.update(f"root {root}\n".encode(errors=NAMES))
        for path in _files(root):
            h.update(f"{os.path.relpath(path, root)}\n".encode(errors=NAMES))
            h.update(_sha256(path).encode())
    return h.hexdigest()


def desired(variables: Mapping[str, object], tree: str) -> str:
    """The desired state's digest: the collection's files' digest and the variables' values."""
    doc = {"format": FORMAT, "tree": tree, "vars": variables}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def fingerprint(paths: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """What is on the host now at each path (SYSTEM's too), as {kind:path: digest}; "absent" where nothing is."""
    out = {f"{GPUS}:nvidia-smi": _gpus()}
    system = [{**sp, "path": os.path.realpath(sp["path"])} for sp in SYSTEM[:-1]]  # /etc/os-release: a link
    for spec in [*system, *paths]:
        kind, path = spec["kind"], spec["path"]
        if kind not in KINDS:
            raise StateError(f"paths: {path}: kind {kind!r} is none of {', '.join(KINDS)}")
        if not os.path.isabs(path):
            raise StateError(f"paths: {path!r} is not absolute")
        out[f"{kind}:{path}"] = _fingerprint(kind, path)
    return out


def check(record_path: str, digest: str, paths: Iterable[Mapping[str, str]] | None = None) -> tuple[bool, list[str]]:
    """Whether the host is current: its record names `digest` and nothing it fingerprinted moved; and why not.
    What is fingerprinted is the record's own list of paths unless `paths` is given."""
    record = read(record_path)
    if record is None:
        return False, ["no record of a complete deploy"]
    why = []
    if record.get("digest") != digest:
        why.append("the desired state changed (the collection's files or the host's variables)")
    then, now = record.get("fingerprint") or {}, fingerprint(record.get("paths") or [] if paths is None else paths)
    for key in sorted(set(then) | set(now)):
        if then.get(key) != now.get(key):
            why.append(f"{key.split(':', 1)[1]} changed since the deploy")
    return not why, why


def read(record_path: str) -> dict | None:
    """The record, or None where there is none or it cannot be read as one (then the host is not current)."""
    try:
        with open(record_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):  # none, or not readable as one
        return None
    return doc if _well_formed(doc) else None


def _well_formed(doc: object) -> bool:
    """A record this module wrote: its format, a digest, a list of {path, kind} and a {key: fingerprint} mapping."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("digest"), str):
        return False
    paths, prints = doc.get("paths"), doc.get("fingerprint")
    return (
        isinstance(paths, list)
        and all(isinstance(p, dict) and isinstance(p.get("path"), str) and p.get("kind") in KINDS for p in paths)
        and isinstance(prints, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in prints.items())
    )


def begin(record_path: str, digest: str) -> str:
    """A deploy is about to run every role: set the record aside (a deploy that stops half way vouches for nothing)
    and keep the desired digest on the host, for the record at its end, under a check id of this run's. The digest
    stays on the host: it never travels back through the controller's logs.

    A digest still pending there is a run's that failed or was stopped (its host left the play before the
    record), or one in flight from another controller: this run's replaces it, and only the last run to begin can
    record (two deploys of one host at once from two controllers with different settings: docs/fleet-scale.md)."""
    check_id = os.urandom(8).hex()
    with _locked(record_path):
        durable.unlink(record_path, missing_ok=True)
        doc = {"digest": digest, "check_id": check_id}
        durable.write_atomic(_pending(record_path), json.dumps(doc) + "\n", mode=0o600)
    return check_id


def record(record_path: str, check_id: str, paths: Iterable[Mapping[str, str]]) -> bool:
    """Write the record of a complete deploy (root's alone, atomic): the digest its check kept and the fingerprint
    taken now. False, and nothing recorded, where another run began or set the record aside since (begin, forget)."""
    paths = [{"path": p["path"], "kind": p["kind"]} for p in paths]
    prints = fingerprint(paths)  # before the lock: seconds for a virtualenv's listing
    with _locked(record_path):
        pending = _read_json(_pending(record_path))
        if not isinstance(pending, dict) or pending.get("check_id") != check_id or not pending.get("digest"):
            return False  # another run's (its record to make), or a tagged run's mark
        durable.unlink(_pending(record_path), missing_ok=True)
        _write(record_path, pending["digest"], paths, prints)
    return True


def forget(record_path: str) -> bool:
    """The record set aside by a run that changes the host without the check (--tags), a run in flight made
    contended (its record would vouch for these changes too); whether there was a record."""
    with _locked(record_path):
        if os.path.exists(_pending(record_path)):
            durable.write_atomic(_pending(record_path), json.dumps({"contended": True}) + "\n", mode=0o600)
        return durable.unlink(record_path, missing_ok=True)


def write(record_path: str, digest: str, paths: Iterable[Mapping[str, str]]) -> None:
    """A record written as things stand (a repair's; a deploy's goes through begin and record)."""
    paths = [{"path": p["path"], "kind": p["kind"]} for p in paths]
    os.makedirs(os.path.dirname(record_path), mode=0o700, exist_ok=True)
    _write(record_path, digest, paths, fingerprint(paths))


def _write(record_path: str, digest: str, paths: list[dict], prints: dict[str, str]) -> None:
    doc = {"format": FORMAT, "digest": digest, "paths": paths, "fingerprint": prints}
    durable.write_atomic(record_path, json.dumps(doc, sort_keys=True, indent=1) + "\n", mode=0o600)


@contextlib.contextmanager
def _locked(record_path: str):
    """The record's lock: begin, record and forget one at a time on a host."""
    os.makedirs(os.path.dirname(record_path), mode=0o700, exist_ok=True)
    fd = os.open(f"{record_path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_json(path: str) -> object | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # there, unreadable: as another run's


def _pending(record_path: str) -> str:
    return f"{record_path}.pending"


def _files(root: str) -> list[str]:
    if os.path.isfile(root):
        return [root]
    out = []
    for d, dirs, names in os.walk(root, followlinks=True):  # a patch series linked into the role is read
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        out += [os.path.join(d, n) for n in sorted(names) if not n.endswith(".pyc")]
    return out


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except FileNotFoundError:
        return "absent"  # gone while read (a restart promoting its pending files)
    except OSError as exc:
        raise StateError(f"{path}: {exc.strerror or exc}") from exc
    return h.hexdigest()


def _fingerprint(kind: str, path: str) -> str:
    if kind == "glob":
        h = hashlib.sha256()
        for p in sorted(glob.glob(path)):
            h.update(f"{p}\n{_link_or_content(p)}\n".encode(errors=NAMES))
        return h.hexdigest()
    if not os.path.lexists(path):
        return "absent"
    if kind == "file":
        return _link_or_content(path)
    h = hashlib.sha256()
    if os.path.islink(path):
        h.update(f"-> {os.readlink(path)}\n".encode(errors=NAMES))
        path = os.path.realpath(path)
    top = _stat(path)
    h.update(f". {top.st_mode:o} {top.st_uid}:{top.st_gid}\n".encode() if top else b". absent\n")  # its own mode
    if kind == "stat" or top is None or not stat.S_ISDIR(top.st_mode):
        return h.hexdigest()
    if kind == "entries":
        for n in sorted(os.listdir(path)):
            p = os.path.join(path, n)
            what = f"-> {os.readlink(p)}" if os.path.islink(p) else ("dir" if os.path.isdir(p) else "file")
            h.update(f"{n} {what}\n".encode(errors=NAMES))
        return h.hexdigest()
    for d, dirs, names in os.walk(path, onerror=_unreadable):
        dirs.sort()
        for n in sorted(dirs + names):
            p = os.path.join(d, n)
            st = _stat(p)
            if st is None:  # gone while read (a restart promoting its pending files): as absent
                continue
            rel = os.path.relpath(p, path)
            if kind == "tree":
                body = "dir" if stat.S_ISDIR(st.st_mode) else _link_or_content(p)
                h.update(f"{rel} {st.st_mode:o} {st.st_uid}:{st.st_gid} {body}\n".encode(errors=NAMES))
            else:
                h.update(f"{rel} {st.st_mode:o} {st.st_size} {st.st_mtime_ns}\n".encode(errors=NAMES))
    return h.hexdigest()


def _unreadable(exc: OSError) -> None:
    raise StateError(f"{exc.filename}: {exc.strerror or exc}")


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _gpus() -> str:
    """The GPUs' indices and UUIDs as nvidia-smi lists them, or how it failed (sglang_deploy.gpu)."""
    try:
        listed = gpu.run_nvidia_smi("--query-gpu=index,uuid,driver_version", "--format=csv,noheader")
        return hashlib.sha256(listed.encode()).hexdigest()
    except gpu.NvidiaSmiError as exc:
        return f"failed: {exc}"


def _link_or_content(path: str) -> str:
    """A link's target; a regular file's mode, owner and content; anything else (a FIFO, a device: never opened,
    never waited on) its type and mode."""
    st = _stat(path)
    if st is None:
        return "absent"
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"-> {os.readlink(path)}"
        except FileNotFoundError:
            return "absent"
    if not stat.S_ISREG(st.st_mode):
        return f"{st.st_mode:o} {st.st_uid}:{st.st_gid} not a file"
    return f"{st.st_mode:o} {st.st_uid}:{st.st_gid} {_sha256(path)}"
