"""The gateways' worker API (sglang-router 0.3.2, smg 1.13.0), and draining a worker before it is stopped
(docs/rollout.md).

One client for both gateways: ``Router(url, impl=...)`` reads what differs between them from ``GATEWAYS`` (one
``Gateway`` each, docs/router.md's "The two gateways"), never from a test of its name. What this relies on, as
verified against sglang-router 0.3.2 (docs/router.md; smg's differences are in ``Gateway``'s fields):
- ``GET /workers`` answers ``{"workers": [{"id": "<uuid>", "url", "is_healthy", ...}], ...}``; a worker is
  listed only once its registration (its /health first) finished, and kept with ``is_healthy: false`` when it
  fails the router's health check.
- ``POST /workers {"url"}`` answers 202 with ``worker_id`` (also for a URL already registered).
- ``DELETE /workers/{uuid}`` takes the UUID from the listing, never the URL; 202, gone ~0.3 s later;
  404 for an unknown id. Removal neither waits for nor cuts the worker's in-flight requests.
- With ``--api-key`` the router requires ``Authorization: Bearer`` on ``/workers``.

Nothing says when a removed worker's requests are done: ``drain`` watches the worker itself, SGLang's
``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` gauges on its /metrics (open without the key, SGLang's
auth rule), until both say 0; only a read that says so (or a refused connection: nothing listens) counts as
drained. SGLang 0.5.23 serves /metrics only with ``--enable-metrics`` (sglang/srt/entrypoints/http_server.py:
``if get_observability().enable_metrics: add_prometheus_middleware(app)``, which mounts ``/metrics``,
sglang/srt/utils/common.py); without it the route is 404 and the worker cannot be drained on evidence.

A worker is one worker whatever the spelling of its URL (``same_worker``): the router may list it under an
address where the inventory names a host, an explicit default port, an upper-case scheme.

No Ansible here: plugins/modules/sglang_router_worker.py is the thin module; tests/test_router_client.py runs this
against a fake router and against the real sglang-router binary, both on loopback. Every wait polls a
condition through injected ``clock``/``sleep`` (tests pass fakes); all HTTP goes through http.py's opener,
which ignores any proxy from the environment.
"""

from __future__ import annotations

import http.client as http_client
import ipaddress
import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import discovery, http, outcomes
from .secret_rule import Redactor, clip

RUNNING_METRIC = "sglang:num_running_reqs"
QUEUE_METRIC = "sglang:num_queue_reqs"
DEFAULT_PORTS = {"http": 80, "https": 443}
# Why a worker's /metrics says nothing: SGLang 0.5.23 mounts the route only with this flag
# (sglang/srt/entrypoints/http_server.py, add_prometheus_middleware in sglang/srt/utils/common.py).
ENABLE_METRICS = "SGLang serves /metrics and its load gauges only with --enable-metrics"


UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


@dataclass(frozen=True)
class Gateway:
    """What differs between the gateways, as checked against their binaries (docs/router.md, "The two
    gateways"). The one place the client learns which gateway it speaks to: its methods read these fields."""

    name: str
    # POST /workers carries the worker's key: smg gives a worker posted without one no key, and a keyed worker
    # refuses its registration (never listed); 0.3.2 sends its own --api-key to every worker.
    key_in_body: bool
    # POST /workers's answers for a URL the gateway already has (smg 409 WORKER_ALREADY_EXISTS, and
    # WORKER_CREATE_IN_PROGRESS while its addition runs): not added, already there. 0.3.2 answers 202 with its id.
    present_codes: frozenset[int]
    # Such an answer's `code` when the gateway has the URL but does not list it yet (its addition runs): the wait
    # that follows sees it listed. A present_codes answer that neither names an id nor says this is an error.
    adding_answers: frozenset[str]
    # The listing's field with a worker's state (None: the gateway has none), and the states of one listed but out
    # of rotation: smg's removal keeps a worker `draining` for drain_settle_secs (5 s), taking no new request.
    status_field: str | None
    leaving: frozenset[str]
    # The listing's field counting the worker's requests in flight through the gateway (None: no such count;
    # 0.3.2's `load` stays 0 with requests running; smg_worker_requests_active{worker=URL} agrees with smg's).
    in_flight_field: str | None
    # Whether it can read its workers from a discovery file (smg's --discovery-provider file; discovery.py).
    discovery: bool = False


GATEWAYS = {
    "sglang-router": Gateway(
        name="sglang-router 0.3.2",
        key_in_body=False,
        present_codes=frozenset(),
        adding_answers=frozenset(),
        status_field=None,
        leaving=frozenset(),
        in_flight_field=None,
    ),
    "smg": Gateway(
        name="smg 1.13.0",
        key_in_body=True,
        present_codes=frozenset({409}),
        adding_answers=frozenset({"WORKER_CREATE_IN_PROGRESS"}),
        status_field="status",
        leaving=frozenset({"draining"}),
        in_flight_field="load",
        discovery=True,
    ),
}
DEFAULT_IMPL = "sglang-router"  # what the playbooks ran before smg: the module's default


# Said with a worker the gateway does not list: the sentinel (sentinel.py) may have taken it out.
SENTINEL_HINT = (
    "; a worker the gateway's hung-worker sentinel took out is listed again once it generates: "
    "journalctl -u sglang-router-sentinel"
)
# How often remove lists the worker again after a DELETE answered 404 (the id gone: the gateway may list it anew).
REMOVE_ROUNDS = 3


class RouterError(RuntimeError):
    pass


class ActionFailed(RouterError):
    """An action of plugins/modules/sglang_router_worker.py that fails with a result (its failed result carries it)."""

    def __init__(self, msg: str, result: dict):
        super().__init__(msg)
        self.result = result


def worker_url(host: str, port: int, scheme: str = "http") -> str:
    """A worker's URL as the router role registers it and the rollout names it: scheme://host:port, an IPv6
    address in brackets (the one place this is written; roles reach it through the sglang_worker_url filter)."""
    host = str(host).strip().strip("[]")
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{int(port)}"


def normalize(url: str) -> str:
    """A worker URL as the router lists it: no trailing slash."""
    return str(url).strip().rstrip("/")


def canonical(url: str) -> str:
    """A worker URL in one spelling: scheme and host lower-cased, the port explicit (http 80, https 443), an IPv6
    address in brackets and compressed (an IPv4-mapped one as IPv4), no trailing dot, slash or path.
    ValueError when it is not a URL with a host (a port that is not a number, no scheme)."""
    text = str(url).strip()
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")  # urlsplit lower-cases it and takes the brackets off
    if not scheme or "://" not in text or not host:
        raise ValueError(f"not a worker URL (scheme://host:port): {url!r}")
    port = parts.port  # ValueError for a port that is not a number or out of range
    if port is None:
        if scheme not in DEFAULT_PORTS:
            raise ValueError(f"no port, and no default port for {scheme}: {url!r}")
        port = DEFAULT_PORTS[scheme]
    host = _address(host) or host
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def posted(url: str) -> str:
    """The spelling ``add`` posts: the scheme lower-cased, no trailing slash or path, the host and port as written
    (the router role's spelling). sglang-router 0.3.2 takes an upper-case scheme for none (it asked
    ``http://http//LOCALHOST:P//health`` of ``HTTP://LOCALHOST:P/`` and never listed it) and lists a trailing
    slash as one more worker (docs/router.md)."""
    parts = urllib.parse.urlsplit(str(url).strip())
    if not parts.scheme or not parts.netloc:
        return normalize(url)
    return f"{parts.scheme.lower()}://{parts.netloc}"


def _address(text: str) -> str | None:
    """An IP address in one spelling (IPv6 compressed, an IPv4-mapped one as IPv4), or None for a name."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


class Resolver:
    """Whether two worker URLs name one worker (``same``): the same canonical URL, or the same scheme and port
    on hosts that resolve to a common address (socket.getaddrinfo where this runs, the router's host: the
    addresses the router connects to). Each host is resolved once per Resolver (make one per decision); a host
    that does not resolve is compared by its canonical name only."""

    def __init__(self, getaddrinfo: Callable = socket.getaddrinfo):
        self.getaddrinfo = getaddrinfo
        self.cache: dict[str, frozenset[str] | None] = {}

    def addresses(self, host: str) -> frozenset[str] | None:
        """The host's addresses (an address: itself), None when it does not resolve."""
        literal = _address(host)
        if literal:
            return frozenset([literal])
        if host not in self.cache:
            try:
                infos = self.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
                found = frozenset(a for a in (_address(str(i[4][0]).split("%", 1)[0]) for i in infos) if a)
            except (OSError, UnicodeError, ValueError):  # socket.gaierror is an OSError
                found = None
            self.cache[host] = found or None
        return self.cache[host]

    def same(self, a: str, b: str) -> bool:
        try:
            ca, cb = canonical(a), canonical(b)
        except ValueError:
            return normalize(a) == normalize(b)
        if ca == cb:
            return True
        pa, pb = urllib.parse.urlsplit(ca), urllib.parse.urlsplit(cb)
        if pa.scheme != pb.scheme or pa.port != pb.port:
            return False
        ra, rb = self.addresses(pa.hostname or ""), self.addresses(pb.hostname or "")
        return bool(ra and rb and ra & rb)


def same_worker(a: str, b: str, resolver: Resolver | None = None) -> bool:
    """Whether the URLs a and b name one worker (Resolver.same)."""
    return (resolver or Resolver()).same(a, b)


def request(
    method: str, url: str, body: dict | None = None, timeout: float = 10.0, api_key: str | None = None
) -> tuple[int, bytes]:
    """http.request with a method (DELETE): through http.OPENER, which ignores any proxy; HttpError when the
    router does not answer."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with http.OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        except (OSError, http_client.HTTPException):
            return exc.code, b""
    except (urllib.error.URLError, OSError, http_client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", None)
        raise http.HttpError(
            f"{method} {url}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}",
            cause=reason if isinstance(reason, BaseException) else exc,
        ) from exc


class Router:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 10.0,
        poll: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        getaddrinfo: Callable = socket.getaddrinfo,
        impl: str = DEFAULT_IMPL,
        worker_api_key: str | None = None,
        discovery_file: str | None = None,
    ):
        if impl not in GATEWAYS:
            raise RouterError(f"unknown gateway {impl!r}: one of {', '.join(GATEWAYS)}")
        self.impl = impl
        self.gateway = GATEWAYS[impl]
        self.url = normalize(url)
        self.api_key = api_key or None
        # The key a posted worker is registered with (smg only): the workers' key, which the role makes the
        # gateway's own by default (sglang_router_api_key).
        self.worker_api_key = worker_api_key or self.api_key
        # A router may echo the key it was sent: its answers are masked with it known before they are cut.
        self.redact = Redactor([self.api_key, self.worker_api_key]).text
        self.timeout = timeout
        self.poll = poll
        self.clock = clock
        self.sleep = sleep
        self.getaddrinfo = getaddrinfo
        # smg reading its workers from this manifest (discovery.py): a worker is taken out and put back there, not
        # through DELETE/POST /workers (smg registers a DELETEd worker again while the file lists it).
        if discovery_file and not self.gateway.discovery:
            raise RouterError(
                f"discovery_file={discovery_file}: {self.gateway.name} reads no discovery file (smg does)"
            )
        self.discovery_file = discovery_file or None

    # ------------------------------------------------------------------ one request each

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        url = f"{self.url}{path}"
        code, data = request(method, url, body, timeout=self.timeout, api_key=self.api_key)
        if code == 401:
            raise RouterError(f"{method} {url}: HTTP 401: the router requires its API key (sglang_router_api_key)")
        try:
            doc = http.json_of(url, data, self.redact) if data.strip() else {}
        except http.HttpError:
            doc = {"raw": clip(data.decode(errors="replace"), 300, self.redact)}
        return code, doc

    def workers(self) -> list[dict]:
        """Every worker the router lists: {id, url, healthy} (and the router's own fields). ``healthy``: in
        rotation, so never a worker the gateway is letting go (``leaving``)."""
        code, doc = self._call("GET", "/workers")
        if code != 200 or not isinstance(doc.get("workers"), list):
            raise RouterError(f"GET {self.url}/workers: HTTP {code}: {clip(str(doc), 300, self.redact)}")
        out = []
        for w in doc["workers"]:
            if isinstance(w, dict) and w.get("url"):
                self.same_gateway(w)
                healthy = bool(w.get("is_healthy")) and not self.leaving(w)
                out.append({**w, "url": normalize(w["url"]), "healthy": healthy})
        return out

    def same_gateway(self, worker: dict) -> None:
        """RouterError when a listed record is another gateway's than impl names (docs/router.md: smg lists every
        worker with ``status``, 0.3.2 none): read as the other's, its answers mislead (a worker posted to smg without
        its key is never listed, and its registration runs on; 0.3.2's ``load`` is no in-flight count)."""
        own = self.gateway.status_field
        foreign = sorted(({g.status_field for g in GATEWAYS.values()} - {own, None}) & set(worker))
        if own and own not in worker:
            why = f"without `{own}`, which {self.gateway.name} lists every worker with"
        elif foreign:
            why = f"with `{foreign[0]}`, which {self.gateway.name} never lists"
        else:
            return
        raise RouterError(
            f"{self.url}/workers lists {normalize(str(worker.get('url')))} {why}: is the gateway another one than "
            f"impl {self.impl} names?"
        )

    def leaving(self, worker: dict) -> bool:
        """Whether the gateway lists this record but is letting it go (smg's ``draining``): out of rotation, as
        good as removed for the rollout, though listed until the gateway's own settle time ends."""
        field = self.gateway.status_field
        state = worker.get(field) if field else None
        return isinstance(state, str) and state in self.gateway.leaving

    def status(self, worker: dict) -> dict:
        """The record's state where the gateway has one ({"status": ...}), for a summary; {} for 0.3.2."""
        field = self.gateway.status_field
        return {"status": worker.get(field)} if field else {}

    def resolver(self) -> Resolver:
        return Resolver(self.getaddrinfo)

    def matches(self, worker_url: str, listing: list[dict], resolver: Resolver | None = None) -> list[dict]:
        """The workers of ``listing`` that are ``worker_url`` under any spelling (same_worker)."""
        resolver = resolver or self.resolver()
        return [w for w in listing if resolver.same(worker_url, w["url"])]

    def find(self, worker_url: str, resolver: Resolver | None = None) -> list[dict]:
        """The router's records of this worker under any spelling (each with its UUID in ``id``): [] when it is
        not listed, more than one when it is registered twice (an address and a host name, say). Names are
        resolved once per call, or once per ``resolver`` (a wait passes one for all its polls)."""
        return self.matches(worker_url, self.workers(), resolver)

    def add(self, worker_url: str, timeout: float = 60.0) -> tuple[str, bool]:
        """(its id, whether it was added): a worker the router lists under any spelling is not added again (the
        router would register a second spelling as a second worker); else its addition is queued. A worker listed
        only as leaving (smg's ``draining``) is waited out first, up to ``timeout``: smg refuses a URL it still
        lists (409), and its record goes at the end of the settle time, taking an addition made meanwhile along
        (a record in rotation that appears meanwhile, the gateway restarted or re-registered it: "not added").
        An answer that the gateway has it already (smg's 409, a race with another client) is "not added"."""
        listed = self.find(worker_url)
        staying = [w for w in listed if not self.leaving(w)]
        if self.discovery_file:
            return self._declare(worker_url, staying)
        if staying:
            return str(staying[0].get("id") or ""), False
        if listed:
            self.wait_left(worker_url, timeout)
            staying = [w for w in self.find(worker_url) if not self.leaving(w)]
            if staying:  # listed again meanwhile, in rotation (the gateway restarted, or re-registered it)
                return str(staying[0].get("id") or ""), False
        url = posted(worker_url)
        body = {"url": url}
        if self.gateway.key_in_body and self.worker_api_key:
            body["api_key"] = self.worker_api_key
        code, doc = self._call("POST", "/workers", body)
        if code in self.gateway.present_codes:
            again = [w for w in self.find(worker_url) if not self.leaving(w)]
            named = UUID.search(str(doc.get("error") or doc.get("message") or ""))  # smg names its id there
            if again or named or doc.get("code") in self.gateway.adding_answers:
                return str(again[0].get("id") or "") if again else (named.group(0) if named else ""), False
        if code not in (200, 201, 202) or code in self.gateway.present_codes:  # (one that says nothing is there)
            raise RouterError(f"POST {self.url}/workers {url}: HTTP {code}: {clip(str(doc), 300, self.redact)}")
        return str(doc.get("worker_id") or ""), True

    def _declare(self, worker_url: str, staying: list[dict]) -> tuple[str, bool]:
        """add with a discovery file: the worker into the manifest (posted's spelling) unless it names it already;
        smg registers it (or keeps it) from there. Added: whether the manifest changed."""
        resolver = self.resolver()
        url = posted(worker_url)
        try:
            before, after = discovery.put_back(self.discovery_file, url, lambda u: resolver.same(url, u))
        except (discovery.DiscoveryError, OSError) as exc:
            raise RouterError(f"adding {url} to {self.discovery_file}: {exc}") from None
        return (str(staying[0].get("id") or "") if staying else ""), after != before

    def _undeclare(self, worker_url: str, listing: list[dict], missing_ok: bool) -> list[str]:
        """remove with a discovery file: every spelling of the worker out of the manifest; the ids of its records in
        rotation, which smg now drains. A worker the manifest does not name but the gateway lists (posted through
        the API) is DELETEd as without a file."""
        resolver = self.resolver()
        found = self.matches(worker_url, listing, resolver)
        try:
            before, after = discovery.take_out(self.discovery_file, lambda u: resolver.same(worker_url, u))
        except (discovery.DiscoveryError, OSError) as exc:
            raise RouterError(f"taking {normalize(worker_url)} out of {self.discovery_file}: {exc}") from None
        if after == before:
            if not found and not missing_ok:
                declared = ", ".join(w["url"] for w in before) or "no worker"
                raise RouterError(
                    f"{self.discovery_file} does not name {normalize(worker_url)} under any spelling, nor does "
                    f"{self.url} list it; the file names: {declared}"
                )
            return self._delete(worker_url, found) if found else []
        return [str(w.get("id") or "") for w in found if not self.leaving(w)]

    def not_listed(self, worker_url: str, listing: list[dict]) -> RouterError:
        """The error of a worker the router lists under no spelling, naming what it lists."""
        lists = ", ".join(w["url"] for w in listing) or "no worker"
        return RouterError(f"{self.url} does not list {normalize(worker_url)} under any spelling; it lists: {lists}")

    def remove(self, worker_url: str, missing_ok: bool = False) -> list[str]:
        """Queue the removal of every record of the worker (any spelling, a duplicate too) by its UUID; their
        ids. RouterError when the router lists it under no spelling, naming what it lists (a worker named wrong
        would otherwise be drained and restarted while the router still sends it requests), unless missing_ok
        ([] then). A record the gateway is letting go already (smg's ``draining``) is out of rotation: not
        removed again, and not among the ids ([] when it is the only one). A DELETE answered 404 (the id gone) is
        checked against the listing, never assumed: a record of the worker in rotation under a new id (the gateway
        restarted, or re-registered it) is removed too; RouterError when it still is after REMOVE_ROUNDS listings.
        With a discovery file, the worker leaves the file instead (_undeclare)."""
        listing = self.workers()
        if self.discovery_file:
            return self._undeclare(worker_url, listing, missing_ok)
        found = self.matches(worker_url, listing)
        if not found:
            if missing_ok:
                return []
            raise self.not_listed(worker_url, listing)
        return self._delete(worker_url, found)

    def _delete(self, worker_url: str, found: list[dict]) -> list[str]:
        """DELETE /workers/{id} of each record in ``found`` (remove's loop, 404s checked against the listing)."""
        ids: list[str] = []
        tried: set[str] = set()
        for _ in range(REMOVE_ROUNDS):
            unknown = False  # a 404: the id is gone, though the worker may be listed again under a new one
            for w in found:
                if self.leaving(w):
                    continue
                wid = str(w.get("id") or "")
                if not wid:
                    raise RouterError(f"{self.url}/workers lists {w['url']} without an id: {w}")
                if wid in tried:
                    continue
                tried.add(wid)
                code, doc = self._call("DELETE", f"/workers/{urllib.parse.quote(wid, safe='')}")
                if code == 404:  # removed meanwhile, or the gateway restarted and lists it under a new id
                    unknown = True
                    continue
                if code not in (200, 202, 204):
                    raise RouterError(
                        f"DELETE {self.url}/workers/{wid} ({w['url']}): HTTP {code}: {clip(str(doc), 300, self.redact)}"
                    )
                ids.append(wid)
            if not unknown:
                return ids
            found = self.find(worker_url)  # checked, never assumed: a record in rotation under a new id is removed
            if not [w for w in found if not self.leaving(w) and str(w.get("id") or "") not in tried]:
                return ids
        raise RouterError(
            f"{self.url} still lists {normalize(worker_url)} under a new id after {REMOVE_ROUNDS} removals answered "
            f"404 (ids tried: {', '.join(sorted(tried))})"
        )

    # ------------------------------------------------------------------ waits: poll a condition

    def _until(self, what: Callable[[], tuple[bool, str]], timeout: float, failure: str) -> float:
        """Poll ``what`` until it holds; the seconds it took. RouterError at the timeout, with the last state."""
        start = self.clock()
        last = ""
        while True:
            try:
                done, last = what()
            except (RouterError, http.HttpError) as exc:
                done, last = False, str(exc)
            if done:
                return round(self.clock() - start, 3)
            if self.clock() - start >= timeout:
                raise RouterError(f"{failure} after {timeout:g} s (last: {last})")
            self.sleep(self.poll)

    def wait_healthy(self, worker_url: str, timeout: float) -> float:
        """Until the router lists the worker as healthy (one of its records, when it is registered twice)."""
        resolver = self.resolver()

        def check() -> tuple[bool, str]:
            found = self.find(worker_url, resolver)
            if not found:
                return False, "not listed"
            if all(self.leaving(w) for w in found):
                return False, f"listed, {'/'.join(sorted({str(self.status(w)['status']) for w in found}))}"
            healthy = any(w["healthy"] for w in found)
            return healthy, "listed, healthy" if healthy else "listed, not healthy"

        return self._until(check, timeout, f"{self.url} does not list {normalize(worker_url)} as healthy")

    def ids_of(self, records: list[dict]) -> str:
        """The records' ids, each with its state where the gateway has one (a wait's last word)."""
        return ", ".join(str(w.get("id")) + "".join(f" {v}" for v in self.status(w).values()) for w in records)

    def wait_gone(self, worker_url: str, timeout: float, draining_ok: bool = True) -> float:
        """Until the router no longer has the worker in rotation: listed under no spelling, or only as leaving
        (smg's ``draining``, listed until its fixed settle time ends whatever still runs there: the drain that
        follows watches the worker itself). With ``draining_ok`` False, until it is listed under no spelling."""
        resolver = self.resolver()

        def check() -> tuple[bool, str]:
            found = self.find(worker_url, resolver)
            left = [w for w in found if not (draining_ok and self.leaving(w))]
            ids = self.ids_of(left)
            return not left, f"still listed (id {ids})" if left else "draining" if found else "gone"

        return self._until(check, timeout, f"{self.url} still lists {normalize(worker_url)}")

    def wait_left(self, worker_url: str, timeout: float) -> float:
        """Until the worker has no leaving record (smg's ``draining``) or is listed in rotation again (a new record:
        the gateway restarted, or re-registered it), for ``add`` to post it or find it there."""
        resolver = self.resolver()

        def check() -> tuple[bool, str]:
            found = self.find(worker_url, resolver)
            leaving = [w for w in found if self.leaving(w)]
            ids = self.ids_of(found)
            return not leaving or len(leaving) < len(found), f"still listed (id {ids})" if found else "gone"

        return self._until(check, timeout, f"{self.url} still lists {normalize(worker_url)}")

    def membership(self) -> list[dict]:
        """What the router lists, for a summary: url, id, healthy (and status, where the gateway has one)."""
        return [{"url": w["url"], "id": w.get("id"), "healthy": w["healthy"], **self.status(w)} for w in self.workers()]

    def reader(self, worker_url: str) -> Callable[[], float | None]:
        """in_flight for this worker, one resolver for all the reads (drain's gateway_in_flight)."""
        resolver = self.resolver()
        return lambda: self.in_flight(worker_url, resolver=resolver)

    def in_flight(
        self, worker_url: str, listing: list[dict] | None = None, resolver: Resolver | None = None
    ) -> float | None:
        """The gateway's own count of the worker's requests in flight (smg's ``load``, summed over its records,
        a draining one included): None where the gateway keeps none (0.3.2) or no longer lists the worker (smg
        drops it, and its count, at the end of the settle time, whatever still runs there)."""
        field = self.gateway.in_flight_field
        if not field:
            return None
        counts = [
            w[field]
            for w in self.matches(worker_url, self.workers() if listing is None else listing, resolver)
            if isinstance(w.get(field), (int, float)) and not isinstance(w.get(field), bool)
        ]
        return float(sum(counts)) if counts else None


# ---------------------------------------------------------------------- the worker itself


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of a Prometheus series (one per label set: a data-parallel rank, a model), None
    when it has none. SGLang 0.5.23 writes a queue gauge's total under ``priority=""`` and, with priority
    scheduling, each priority's part again under ``priority="<n>"`` (metrics_collector._log_gauge_queue_count):
    those parts are left out, so that they are not counted twice."""
    samples = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})?\s+(\S+)", text, re.M)
    if not samples:
        return None
    total = 0.0
    for labels, s in samples:
        if re.search(r'(?:^|,)\s*priority="[^"]+"', labels):
            continue
        try:
            total += float(s)
        except ValueError:
            return None
    return total


def refused(exc: http.HttpError) -> bool:
    """Whether the worker refused the connection: nothing listens on its port (its server process is gone)."""
    return isinstance(getattr(exc, "cause", None), ConnectionRefusedError)


def _failure(exc: http.HttpError) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, TimeoutError):  # socket.timeout is TimeoutError
        return f"no answer in time ({exc})"
    return str(exc)


def running_requests(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> float | None:
    """The worker's running requests (sglang:num_running_reqs): None when its /metrics lacks the series.
    HttpError when the worker does not answer 200."""
    url = f"{normalize(worker_url)}/metrics"
    code, data = http.request(url, timeout=timeout, api_key=api_key)
    if code != 200:
        raise http.HttpError(f"{url}: HTTP {code}")
    return metric_sum(data.decode(errors="replace"), RUNNING_METRIC)


def read_load(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> dict:
    """One read of the worker's load on its /metrics; never raises. {state, running, queued, why}, state:

    - ``load``: both series read (``running``, ``queued``: each summed over its label sets);
    - ``no_metrics``: /metrics answered 404, or 200 without one of the series: SGLang without --enable-metrics
      (0.5.23 mounts /metrics only with it: sglang/srt/entrypoints/http_server.py); no later read will say more;
    - ``nothing_listens``: the connection was refused: nothing listens on the port (the server process is gone);
    - ``error``: anything else (a 503, another status, a read timeout, a reset connection): no evidence either way.
    """
    url = f"{normalize(worker_url)}/metrics"
    out: dict = {"state": "error", "running": None, "queued": None, "why": ""}
    try:
        code, data = http.request(url, timeout=timeout, api_key=api_key)
    except http.HttpError as exc:
        return {**out, "state": "nothing_listens" if refused(exc) else "error", "why": _failure(exc)}
    if code == 404:
        return {**out, "state": "no_metrics", "why": f"{url} answered HTTP 404 ({ENABLE_METRICS})"}
    if code != 200:
        return {**out, "why": f"{url} answered HTTP {code}"}
    text = data.decode(errors="replace")
    running, queued = metric_sum(text, RUNNING_METRIC), metric_sum(text, QUEUE_METRIC)
    missing = [name for name, v in ((RUNNING_METRIC, running), (QUEUE_METRIC, queued)) if v is None]
    if missing:
        why = f"{url} has no {' nor '.join(missing)} ({ENABLE_METRICS})"
        return {**out, "state": "no_metrics", "running": running, "queued": queued, "why": why}
    return {"state": "load", "running": running, "queued": queued, "why": f"{running:g} running, {queued:g} queued"}


def drain(
    worker_url: str,
    timeout: float,
    api_key: str | None = None,
    poll: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    settle_s: float = 0.2,
    read_timeout: float = 5.0,
    gateway_in_flight: Callable[[], float | None] | None = None,
) -> dict:
    """Wait until the worker has no running nor queued request, on evidence, or the drain timeout; never raises.

    Drained only from positive evidence: reads (``poll`` apart) of both ``sglang:num_running_reqs`` and
    ``sglang:num_queue_reqs`` whose sum said 0 for ``settle_s`` seconds, two reads at least (a request the router
    sent just before the removal took effect may still be on its way to the worker at the first read: a LAN's
    milliseconds), every read between them successful; or a refused connection (nothing listens: the server is
    gone, nothing runs there). Polling faster finds the first 0 sooner; it does not shorten that window. What no
    short window covers: SGLang updates the gauges when it logs a batch, so a request it has just taken may not
    show yet; the stop that follows covers it (SGLang's SIGTERM handler waits for the requests it has).

    Not evidence, so never drained: a read that fails otherwise (a 503, another status, a read timeout, a reset
    connection: a server busy under load answers so), waited through until the timeout; and a /metrics that
    cannot say (404, or without either series: SGLang without --enable-metrics), which ends the drain at once.

    {drained: bool, seconds, running, queued (the last values read, None when not read), why}; with
    ``gateway_in_flight`` (Router.in_flight for this worker, read beside each load), also ``gateway_in_flight``:
    the gateway's own count at the last read, the other side's evidence only: it decides nothing (smg drops it
    with the worker after its settle time, while a request may still run there).
    """
    start = clock()
    last: dict = {"running": None, "queued": None}
    first_zero: float | None = None  # when the reads started saying 0 (None: the last read did not)
    gateway: dict = {}
    while True:
        read = read_load(worker_url, timeout=read_timeout, api_key=api_key)
        if gateway_in_flight is not None:
            gateway = {"gateway_in_flight": _gateway_count(gateway_in_flight)}
        now = clock()
        seconds = round(now - start, 3)
        if read["state"] == "nothing_listens":
            return {"drained": True, "seconds": seconds, **last, "why": "not serving: connection refused", **gateway}
        if read["state"] == "no_metrics":
            return {
                "drained": False,
                "seconds": seconds,
                "running": read["running"],
                "queued": read["queued"],
                "why": f"cannot be drained on evidence: {read['why']}",
                **gateway,
            }
        if read["state"] == "load":
            last = {"running": read["running"], "queued": read["queued"]}
        if read["state"] != "load" or read["running"] + read["queued"] > 0:
            first_zero = None
        elif first_zero is None:
            first_zero = now
        elif now - first_zero >= settle_s - 1e-6:  # (the tolerance: a float clock's sums)
            return {"drained": True, "seconds": seconds, **last, "why": "no running or queued requests", **gateway}
        if now - start >= timeout:
            why = read["why"] if read["state"] == "load" else f"last read: {read['why']}"
            return {
                "drained": False,
                "seconds": seconds,
                **last,
                "why": f"drain timeout ({timeout:g} s): {why}",
                **gateway,
            }
        sleep(poll)


def _gateway_count(read: Callable[[], float | None]) -> float | None:
    """One read of the gateway's count; None when the gateway does not answer, or answers what no count can be read
    from (evidence only: never a failure, whatever the gateway says)."""
    try:
        return read()
    except Exception:  # RouterError, HttpError; a listing no count comes from (OverflowError, TypeError)
        return None


def serving(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[bool, str]:
    """(whether the worker's own GET /health answered 200 within timeout, why not)."""
    url = f"{normalize(worker_url)}/health"
    try:
        code, _ = http.request(url, timeout=timeout, api_key=api_key)
    except http.HttpError as exc:
        return False, _failure(exc)
    return (True, "") if code == 200 else (False, f"{url} answered HTTP {code}")


INSPECT_RETRY_S = 10.0  # how long a rollout's plan reads a /metrics that says nothing again before refusing it


def inspect(
    router: Router,
    worker_urls: list[str],
    timeout: float = 5.0,
    retry_s: float = INSPECT_RETRY_S,
    poll: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """What the router and each worker say, over HTTP only (reads nothing else, changes nothing):
    {workers: [{url, listed, ids, healthy_in_router, serving, drainable, why}], problems: [str]}.

    ``listed``/``ids``: the router's records of the worker under any spelling (same_worker); ``healthy_in_router``:
    whether one of them is healthy (None when not listed); ``serving``: its own /health answered 200 within
    ``timeout``; ``drainable``: its /metrics answered 200 with both load gauges (read_load), so that a drain can
    end on evidence (a port nothing listens on is no more: a replica already down would leave the fleet a replica
    short while another is out for its turn, beyond --max-unavailable, so it refuses the rollout). A read that says
    nothing either way (a 503, a timeout: a server busy under load answers so) is read again, ``poll`` apart, for
    up to ``retry_s``: one busy moment does not refuse a rollout, a /metrics unreadable all along does.
    ``problems``: each worker not listed, or not drainable."""
    listing = router.workers()
    resolver = router.resolver()
    matched = [router.matches(u, listing, resolver) for u in worker_urls]

    with ThreadPoolExecutor(max_workers=max(1, min(16, 2 * len(worker_urls)))) as pool:  # the reads in parallel
        ups = [pool.submit(serving, u, timeout) for u in worker_urls]
        loads = [pool.submit(read_load, u, timeout) for u in worker_urls]
        probes = [(up.result(), load.result()) for up, load in zip(ups, loads, strict=True)]
        deadline = clock() + retry_s
        while any(load["state"] == "error" for _, load in probes) and clock() + poll <= deadline:
            sleep(poll)
            again = {
                i: pool.submit(read_load, u, timeout)
                for i, u in enumerate(worker_urls)
                if probes[i][1]["state"] == "error"
            }
            for i, load in again.items():
                probes[i] = (probes[i][0], load.result())
    workers, problems = [], []
    lists = ", ".join(w["url"] for w in listing) or "no worker"
    for url, found, ((up, up_why), load) in zip(worker_urls, matched, probes, strict=True):
        drainable = load["state"] == "load"
        why = [f"not serving: {up_why}"] if not up else []
        why += [] if drainable else [f"not drainable: {load['why']}"]
        workers.append(
            {
                "url": url,
                "listed": bool(found),
                "ids": [w.get("id") for w in found],
                "healthy_in_router": any(w["healthy"] for w in found) if found else None,
                "serving": up,
                "drainable": drainable,
                "why": "; ".join(why),
            }
        )
        if not found:
            problems.append(f"{url}: not listed by the router {router.url} (it lists: {lists}{SENTINEL_HINT})")
        if not drainable:
            problems.append(f"{url}: cannot be drained on evidence: {load['why']}")
    return {"workers": workers, "problems": problems}


def measure(
    worker_url: str, prompt: str, requests: int, max_new_tokens: int, api_key: str | None = None, timeout: float = 120.0
) -> dict:
    """The worker's output tok/s as the safe restart's verify measures it (checks.load_checks): ``requests``
    generations of ``max_new_tokens`` one after another, their tokens over their seconds. HttpError when one fails."""
    runs = [
        http.generate(worker_url, prompt, max_new_tokens, timeout=timeout, api_key=api_key) for _ in range(requests)
    ]
    seconds = sum(r["seconds"] for r in runs) or 1e-9
    tokens = sum(r["completion_tokens"] for r in runs)
    return {"tokens_per_s": round(tokens / seconds, 1), "requests": len(runs), "seconds": round(seconds, 3)}


# ---------------------------------------------------------------------- the module's actions


def check_waits(p: dict) -> None:
    """RouterError before any request for a wait that would never end (Ansible's float takes nan and inf)."""
    for name in ("timeout", "drain_timeout"):
        if name in p and not 0 <= p[name] < float("inf"):
            raise RouterError(f"{name}={p[name]!r}: a number of seconds, 0 or more, is wanted")


def act(p: dict, check_mode: bool = False) -> dict:
    """plugins/modules/sglang_router_worker.py's action ``p["action"]`` with its parameters; its result. ActionFailed
    (with a result) or RouterError/HttpError when it fails."""
    url, action = p.get("worker_url"), p["action"]
    check_waits(p)
    if action == "measure":
        out = measure(url, p["prompt"], p["requests"], p["max_new_tokens"], api_key=p["api_key"])
        return {"changed": False, "worker_url": url, **out}
    if action == "drain":
        if check_mode:
            return {"changed": False, "worker_url": url, "drain": {"drained": None, "why": "check mode"}}
        # The gateway's count beside the worker's, where a gateway is named and keeps one (evidence, not a rule).
        gateway = Router(p["router_url"], api_key=p["api_key"], impl=_impl(p)) if p.get("router_url") else None
        counted = {"gateway_in_flight": gateway.reader(url)} if gateway and gateway.gateway.in_flight_field else {}
        out = drain(url, p["drain_timeout"], **counted)
        result = {"changed": False, "worker_url": url, "drain": out, "seconds": out["seconds"]}
        if not out["drained"]:
            raise ActionFailed(f"not drained: {out['why']}", result)
        return result
    router = Router(p["router_url"], api_key=p["api_key"], impl=_impl(p), discovery_file=p.get("discovery_file"))
    if action == "list":
        return {"changed": False, "workers": router.membership()}
    if action == "inspect":  # reads only: the same in check mode
        # A plan's check reads an unanswered /metrics again before refusing; the other reads answer at once.
        retry_s = INSPECT_RETRY_S if p["fail_on_problems"] else 0.0
        out = {"changed": False, **inspect(router, p["worker_urls"], timeout=p["timeout"], retry_s=retry_s)}
        if p["fail_on_problems"] and out["problems"]:  # a rollout's plan: refused, nothing touched (exit 3)
            raise ActionFailed("; ".join(out["problems"]), {**out, "outcome": outcomes.INVALID_CONFIG})
        return out
    if action == "wait_healthy":
        seconds = router.wait_healthy(url, p["timeout"])
        return {"changed": False, "worker_url": url, "seconds": seconds, "workers": router.membership()}
    if action == "remove":
        return _remove(router, p, check_mode)
    if action != "add":
        raise RouterError(f"unknown action {action!r}")
    if check_mode:
        listed = [w for w in router.find(url) if not router.leaving(w)]  # a leaving record would be added again
        return {"changed": not listed, "worker_url": url, "worker_id": listed[0].get("id") if listed else None}
    wid, added = router.add(url, timeout=p["timeout"])
    seconds = router.wait_healthy(url, p["timeout"])
    listed_now = router.find(url)
    return {
        "changed": added,
        "worker_url": url,
        "worker_id": (listed_now[0].get("id") if listed_now else None) or wid,
        "seconds": seconds,
        "workers": router.membership(),
    }


def _impl(p: dict) -> str:
    """The module's gateway (its impl option; a caller without one, the playbooks' sglang-router)."""
    return p.get("impl") or DEFAULT_IMPL


def _remove(router: Router, p: dict, check_mode: bool) -> dict:
    url = p["worker_url"]
    if check_mode:  # nothing removed, nothing read but the router's list (as action=drain in check mode)
        listing = router.workers()
        found = router.matches(url, listing)
        ids = [w.get("id") for w in found if not router.leaving(w)]  # as remove: a leaving one is not removed again
        if not found and not p["missing_ok"]:
            raise router.not_listed(url, listing)
        out = {"changed": bool(ids), "worker_url": url, "worker_id": ids[0] if ids else None, "worker_ids": ids}
        return {**out, "drain": {"drained": None, "why": "check mode"}} if p["drain"] else out
    ids = router.remove(url, missing_ok=p["missing_ok"])
    out = {"changed": bool(ids), "worker_url": url, "worker_id": ids[0] if ids else None, "worker_ids": ids}
    if ids:
        out["seconds"] = router.wait_gone(url, p["timeout"])
        out["workers"] = router.membership()
    if p["drain"]:  # the worker's /metrics: api_key is the router's here, not the worker's (and /metrics is open)
        counted = {"gateway_in_flight": router.reader(url)} if router.gateway.in_flight_field else {}
        out["drain"] = drain(url, p["drain_timeout"], **counted)
        if not out["drain"]["drained"]:
            raise ActionFailed(f"not drained: {out['drain']['why']}", out)
    return out
