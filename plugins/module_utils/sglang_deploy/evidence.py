"""The crash evidence bundle: what a failed start, generation or verification leaves, taken before a rollback.

One gzipped tar per collection on the host, ``<out_dir>/<instance>/<UTC time>-<invocation|on-demand>.tar.gz``
(file 0600, directories 0700; the newest ``keep`` kept), holding under one top directory:

    manifest.json        instance, unit, host, invocation, time, budget, every item {name, ok, seconds, detail}
    unit-state.txt       systemctl show of the unit (MainPID, ControlGroup, InvocationID, ...)
    py-spy/<pid>.txt     a py-spy dump of every Python process of the unit's cgroup (the launcher and its ranks)
    journal.txt          the unit's journal of the failing invocation (else of its last start)
    failure.json         the failure (cause, journal_tail, traceback, ...) and the failing request and response
    traceback.txt        the failure's traceback, when it has one
    config/              the unit file, the environment file (pending ones under config/pending/), instance.json;
                         never the secrets file
    patches.json         the patch manifest of the unit's virtualenv (generation.json beside it when there)
    gpu-state.json       the GPUs and their compute processes (sglang_deploy.gpu)
    nvidia-smi-q.txt     nvidia-smi -q
    kernel-xid.txt       the kernel log's Xid and NVRM lines (journalctl -k, else dmesg)
    pip-freeze.txt       the virtualenv's pip freeze

Everything written passes through one Redactor (secret_rule.py, the one secret rule, names, patterns and mask
of the driver and the modules too): every value of the secrets file, every secret-named flag's value in the
instance's argv (and the secret-named values of the environment and unit files) in every form they may be logged
in, plus secret-named assignments and flags, bearer tokens and URL credentials anywhere. SGLang logs its
server_args, API key included, so the journal needs it.

Each item has its own timeout and the whole collection its budget (budget_s, default 10 s): an item that
would start after the budget is spent is listed with ok false and detail "skipped: budget". A missing tool
(no nvidia-smi, no py-spy) is an item with ok false and the reason, never an exception. Side effects (commands,
clocks, /proc and the cgroup root, the GPU snapshot) come through EvidencePorts, so the tests use fakes. The items
are evidence_items.py's; this file packs them, redacted, into the tar.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import gpu
from .durable import write_atomic
from .evidence_items import Collection, _read, _seconds
from .instance import Instance, read_env_file
from .secret_rule import MASK, Redactor, argv_secrets, file_secrets, secret_name

BUDGET_S = 10.0
KEEP = 5


# --------------------------------------------------------------------------- ports


def run_command(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A command's output as text; FileNotFoundError when it is missing, TimeoutExpired when it overruns."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        errors="replace",
        check=False,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def bounded_snapshot(timeout: float) -> dict:
    """gpu.snapshot within the evidence budget's share (gpu.snapshot allows 30 s)."""
    return gpu.snapshot(timeout=timeout)


@dataclass
class EvidencePorts:
    """The collection's side effects; the unit tests replace them with fakes."""

    run: Callable[[list[str], float], subprocess.CompletedProcess] = run_command
    which: Callable[[str], str | None] = shutil.which
    snapshot: Callable[[float], dict] = bounded_snapshot
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    hostname: Callable[[], str] = socket.gethostname
    proc_root: str = "/proc"
    cgroup_root: str = "/sys/fs/cgroup"
    workers: int = 8  # py-spy dumps run at once


# --------------------------------------------------------------------------- redaction


def redactor_for(inst: Instance, strong: Iterable[str] = (), texts: Iterable[str] = ()) -> Redactor:
    """The instance's secrets as one Redactor (secret_rule): every value of its secrets file and the values of its
    secret-named flags; the secret-named values of its unit and environment files (and of texts, this run's
    rendered ones), by their name. strong: more values known to be secret (this run's secrets file)."""
    strong = [*inst.secret_values(), *strong]
    for argv in [inst.argv, *inst.profiles_argv.values()]:
        strong += argv_secrets(argv)
    weak = []
    for path in (inst.unit_path, inst.env_path):
        weak += file_secrets(_read(path) or "")
        weak += [v for k, v in read_env_file(path).items() if secret_name(k)]
    for text in texts:
        weak += file_secrets(text or "")
    return Redactor(strong, weak)


# --------------------------------------------------------------------------- the bundle


def bundle_name(wall: float, invocation: str | None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(wall)) + f".{int(wall * 1000) % 1000:03d}Z"
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", invocation)[:64] if invocation else "on-demand"
    return f"{stamp}-{tag}"


def _dir_0700(path: str, created: list[str]) -> None:
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        created.append(path)


def _bundle_dir(out_dir: str, instance: str) -> str:
    """<out_dir>/<instance>, both made 0700 where missing (the instance's directory made so whatever it was)."""
    directory = os.path.join(out_dir, instance)
    created: list[str] = []
    _dir_0700(os.path.dirname(directory), created)
    _dir_0700(directory, created)
    os.chmod(directory, 0o700)
    for path in created:
        os.chmod(path, 0o700)
    return directory


def _redacted(files: dict[str, str], redact: Redactor) -> dict[str, bytes]:
    """Every file's text through the redactor, as bytes; a file a secret survives in is withheld, never written."""
    data = {}
    for arcname, text in files.items():
        clean = redact.text(text)
        if redact.leaks(clean):  # never happens unless a pattern is wrong: withheld, not leaked
            clean = "[withheld: a secret survived the redaction]\n"
        data[arcname] = clean.encode()
    return data


def write_bundle(directory: str, name: str, files: dict[str, bytes], wall: float) -> str:
    """The tar.gz, mode 0600, written whole under a temporary name and then renamed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for arcname, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{name}/{arcname}")
            info.size, info.mode, info.mtime = len(data), 0o600, int(wall)
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    path = os.path.join(directory, name + ".tar.gz")
    n = 1
    while os.path.exists(path):  # two collections in the same millisecond
        n += 1
        path = os.path.join(directory, f"{name}-{n}.tar.gz")
    write_atomic(path, buf.getvalue(), 0o600)
    return path


def prune(directory: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` bundles (at least the newest one); the paths deleted."""
    bundles = sorted(n for n in os.listdir(directory) if n.endswith(".tar.gz") and not n.startswith("."))
    gone = []
    for name in bundles[: max(0, len(bundles) - max(1, keep))]:
        try:
            os.unlink(os.path.join(directory, name))
            gone.append(os.path.join(directory, name))
        except OSError:
            pass
    return gone


def collect(
    inst: Instance,
    *,
    invocation: str | None,
    failure: dict | None,
    request: dict | None,
    budget_s: float = BUDGET_S,
    out_dir: str | None = None,
    keep: int = KEEP,
    ports: EvidencePorts | None = None,
) -> dict:
    """Take the evidence of one instance into one tar.gz on this host; its path and what each item gave.

    out_dir defaults to <inst.state_dir>/evidence (/var/lib/sglang/evidence). Returns {path, bytes, items:
    [{name, ok, seconds, detail}], seconds, truncated, pruned, host}; truncated is true when an item was skipped
    for the budget or an output was cut. Raises OSError only when the bundle itself cannot be written."""
    p = ports or EvidencePorts()
    c = Collection(inst, invocation, failure, request, budget_s, p, redactor_for)
    c.run_items()
    wall = p.wall()
    host = p.hostname()
    manifest = {
        "instance": inst.name,
        "unit": inst.unit,
        "host": host,
        "invocation": invocation,
        "on_demand": failure is None,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall)),
        "budget_s": budget_s,
        "items": c.items,
        "truncated": c.truncated,
        "redaction": "every value of the secrets file, secret flags and secret-named settings replaced by " + MASK,
    }
    data = _redacted({**c.files, "manifest.json": json.dumps(manifest, indent=2) + "\n"}, c.redact)
    directory = _bundle_dir(out_dir or os.path.join(inst.state_dir, "evidence"), inst.name)
    path = write_bundle(directory, bundle_name(wall, invocation), data, wall)
    pruned = prune(directory, keep)
    items = c.redact.data(c.items)
    return {
        "path": path,
        "bytes": os.path.getsize(path),
        "items": items,
        "seconds": _seconds(p.clock() - c.t0),
        "truncated": c.truncated,
        "pruned": pruned,
        "host": host,
    }


def for_failure(
    inst: Instance,
    failure: dict | None,
    invocation: str | None,
    ports: EvidencePorts | None = None,
    *,
    request: dict | None = None,
    budget_s: float = BUDGET_S,
    out_dir: str | None = None,
    keep: int = KEEP,
) -> dict:
    """collect() for the restart's failure path: never raises ({"error": ...} instead), within budget_s.

    invocation: the failing start's InvocationID (else the failure's "invocation", else the unit's current one)."""
    if invocation is None and isinstance(failure, dict):
        invocation = failure.get("invocation") or None
    try:
        return collect(
            inst,
            invocation=invocation,
            failure=failure,
            request=request,
            budget_s=budget_s,
            out_dir=out_dir,
            keep=keep,
            ports=ports,
        )
    except (Exception, KeyboardInterrupt) as exc:
        message = f"{type(exc).__name__}: {exc}"
        try:
            message = redactor_for(inst).text(message)
        except Exception:
            message = f"{type(exc).__name__} (its message withheld)"
        return {"error": f"no evidence bundle: {message}"}
