"""smg's discovery file (``--discovery-provider file --discovery-file PATH``): the gateway's workers declared in a
JSON manifest that it watches, the role's alternative to naming them on its command line (docs/router.md,
"Declarative workers").

What smg 1.13.0 does with it, on loopback (tests/test_gateway_smg.py, tests/test_discovery.py):
- ``{"version": 1, "workers": [{"url": ...}, ...]}``; a worker's fields are ``FIELDS``, anything else refused;
- reread as soon as it changes (and every --discovery-check-interval-secs); a manifest it cannot read is logged and
  ignored: the last good one stands (so every write here is validated first, then renamed into place whole);
- a worker dropped from it is drained like a DELETE (``draining`` for drain_settle_secs), then gone; one added is
  registered and health-checked;
- a worker DELETEd through the API while the manifest lists it is registered again within a second of its drain's
  end: with a discovery file, the file is the only way to take a worker out.

So in this mode router.Router (``discovery_file=``) takes a worker out and puts it back by editing the file, under a
lock (the rollout's module and the gateway's sentinel may both edit it); an entry taken out waits in PATH.out, so
that it comes back whole (a prefill worker's type and bootstrap port with it). No Ansible here.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from . import durable

VERSION = 1
FIELDS = ("id", "url", "worker_type", "bootstrap_port", "model_id", "kv_connector", "kv_role", "kv_engine_id")


class DiscoveryError(RuntimeError):
    pass


def problems(doc: object) -> list[str]:
    """What smg would refuse in a manifest (or what would make it two workers), each said; [] for a good one."""
    if not isinstance(doc, dict):
        return [f"a JSON object is wanted, not {type(doc).__name__}"]
    out = []
    if doc.get("version") != VERSION:
        out.append(f"version {doc.get('version')!r}: smg 1.13.0 reads version {VERSION}")
    workers = doc.get("workers")
    if not isinstance(workers, list):
        return [*out, "workers: a list is wanted"]
    urls = []
    for i, w in enumerate(workers):
        if not isinstance(w, dict) or not isinstance(w.get("url"), str) or "://" not in w["url"]:
            out.append(f"workers[{i}]: an object with a url (scheme://host:port) is wanted, not {w!r}")
            continue
        unknown = sorted(set(w) - set(FIELDS))
        if unknown:
            out.append(
                f"workers[{i}] ({w['url']}): unknown field(s) {', '.join(unknown)} (smg reads {', '.join(FIELDS)})"
            )
        urls.append(w["url"])
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        out.append(f"listed twice: {', '.join(twice)}")
    extra = sorted(set(doc) - {"version", "workers"})
    if extra:
        out.append(f"unknown key(s) {', '.join(extra)}")
    return out


def render(workers: list[dict]) -> str:
    return json.dumps({"version": VERSION, "workers": workers}, indent=1) + "\n"


def read(path: str) -> list[dict]:
    """The manifest's workers. DiscoveryError when it is missing, not JSON, or one smg would refuse."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise DiscoveryError(f"{path}: no such discovery file (roles/sglang_router writes it)") from None
    except (OSError, ValueError) as exc:
        raise DiscoveryError(f"{path}: {exc}") from None
    bad = problems(doc)
    if bad:
        raise DiscoveryError(f"{path}: {'; '.join(bad)}")
    return doc["workers"]


def write(path: str, workers: list[dict]) -> None:
    """Checked, then renamed into place whole (durable.write_atomic): smg never reads half a manifest, nor a bad
    one from here. Readable by all (it names URLs, no key)."""
    text = render(workers)
    bad = problems(json.loads(text))
    if bad:
        raise DiscoveryError(f"{path}: not written: {'; '.join(bad)}")
    durable.write_atomic(path, text, mode=0o644)


@contextmanager
def locked(path: str) -> Iterator[None]:
    """One editor at a time (flock on PATH.lock: a read-only descriptor is enough, whoever created the file)."""
    fd = os.open(f"{path}.lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _parked(path: str) -> dict[str, dict]:
    """The entries taken out of the manifest, by URL (PATH.out): what put_back restores, fields and all."""
    try:
        with open(f"{path}.out", encoding="utf-8") as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def _edit(path: str, change: Callable[[list[dict], dict], tuple[list[dict], dict]]) -> tuple[list[dict], list[dict]]:
    """(before, after): the manifest's workers and the parked entries changed together under the lock, each written
    only when it changed. DiscoveryError when the file cannot be read as a manifest (nothing written then)."""
    with locked(path):
        before, parked = read(path), _parked(path)
        after, parked_after = change([dict(w) for w in before], dict(parked))
        if parked_after != parked:
            durable.write_atomic(f"{path}.out", json.dumps(parked_after, indent=1) + "\n", mode=0o644)
        if after != before:
            write(path, after)
        return before, after


def take_out(path: str, match: Callable[[str], bool]) -> tuple[list[dict], list[dict]]:
    """(before, after): every entry whose url matches leaves the manifest, kept in PATH.out (its id, its
    worker_type, its bootstrap_port... come back with it)."""

    def change(ws: list[dict], parked: dict) -> tuple[list[dict], dict]:
        out = {w["url"]: w for w in ws if match(w["url"])}
        return [w for w in ws if not match(w["url"])], {**parked, **out}

    return _edit(path, change)


def put_back(path: str, url: str, match: Callable[[str], bool]) -> tuple[list[dict], list[dict]]:
    """(before, after): the worker into the manifest unless it names it already, as it was taken out (PATH.out)
    or as {"url": url}."""

    def change(ws: list[dict], parked: dict) -> tuple[list[dict], dict]:
        if any(match(w["url"]) for w in ws):
            return ws, parked
        mine = [u for u in parked if match(u)]
        back = [parked[u] for u in mine] or [{"url": url}]
        return [*ws, *back], {u: w for u, w in parked.items() if u not in mine}

    return _edit(path, change)


def check_file(argv: list[str]) -> None:
    """``python -c 'from sglang_deploy import discovery; discovery.check_file(sys.argv[1:])' PATH``: the role's
    validate before the rename. SystemExit naming what is wrong."""
    try:
        read(argv[0])
    except DiscoveryError as exc:
        raise SystemExit(f"discovery file refused: {exc}") from None
