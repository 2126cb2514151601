"""The gateways' worker API (sglang-router 0.3.2, smg 1.13.0): a client that lists a gateway's workers, adds and
removes one, and waits until the gateway lists it healthy or no longer has it in rotation (docs/rollout.md).

One client for both gateways: ``Router(url, impl=...)`` reads what differs between them from ``GATEWAYS`` (one
``Gateway`` each, docs/router.md's "The two gateways"), never from a test of its name. What this relies on, as
verified against sglang-router 0.3.2 (docs/router.md; smg's differences are in ``Gateway``'s fields):
- ``GET /workers`` answers ``{"workers": [{"id": "<uuid>", "url", "is_healthy", ...}], ...}``; a worker is
  listed only once its registration (its /health first) finished, and kept with ``is_healthy: false`` when it
  fails the router's health check.
- ``POST /workers {"url"}`` answers 202 with ``worker_id`` (also for a URL already registered).
- ``DELETE /workers/{uuid}`` takes the UUID from the listing, never the URL; 202, gone ~0.3 s later;
  404 for an unknown id. Removal neither waits for nor cuts the worker's in-flight requests: the worker itself
  says when they are done (worker_load.py's drain).

A worker is one worker whatever the spelling of its URL: the client finds it under any spelling (worker_urls.py).

No Ansible here: plugins/modules/sglang_router_worker.py is the thin module (router_actions.py its actions);
tests/test_router_client.py runs this against a fake router and against the real sglang-router binary, both on
loopback. Every wait polls a condition through injected ``clock``/``sleep`` (tests pass fakes); all HTTP goes
through http.py's opener, which ignores any proxy from the environment.
"""

from __future__ import annotations

import http.client as http_client
import json
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from . import discovery, http
from .secret_rule import Redactor, clip
from .worker_urls import Resolver, normalize, posted

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

# How often remove lists the worker again after a DELETE answered 404 (the id gone: the gateway may list it anew).
REMOVE_ROUNDS = 3


class RouterError(RuntimeError):
    pass


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
