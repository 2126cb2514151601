"""sglang-router 0.3.2's worker API, and draining a worker before it is stopped (docs/rollout.md).

What this relies on, as verified against the pinned release (docs/router.md):
- ``GET /workers`` answers ``{"workers": [{"id": "<uuid>", "url", "is_healthy", ...}], ...}``; a worker is
  listed only once its registration (its /health first) finished, and kept with ``is_healthy: false`` when it
  fails the router's health check.
- ``POST /workers {"url"}`` answers 202 with ``worker_id`` (also for a URL already registered).
- ``DELETE /workers/{uuid}`` takes the UUID from the listing, never the URL; 202, gone ~0.3 s later;
  404 for an unknown id. Removal neither waits for nor cuts the worker's in-flight requests.
- With ``--api-key`` the router requires ``Authorization: Bearer`` on ``/workers``.

Nothing says when a removed worker's requests are done: ``drain`` watches the worker itself, SGLang's
``sglang:num_running_reqs`` gauge on its /metrics (open without the key, SGLang's auth rule), until it is 0.

No Ansible here: library/sglang_router_worker.py is the thin module; tests/test_router_client.py runs this
against a fake router and against the real sglang-router binary, both on loopback. Every wait polls a
condition through injected ``clock``/``sleep`` (tests pass fakes); all HTTP goes through http.py's opener,
which ignores any proxy from the environment.
"""

from __future__ import annotations

import http.client as http_client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from . import http

RUNNING_METRIC = "sglang:num_running_reqs"


class RouterError(RuntimeError):
    pass


def worker_url(host: str, port: int, scheme: str = "http") -> str:
    """A worker's URL as the router role registers it and the rollout names it: scheme://host:port, an IPv6
    address in brackets (the one place this is written; roles reach it through the sglang_worker_url filter)."""
    host = str(host).strip().strip("[]")
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{int(port)}"


def normalize(url: str) -> str:
    """A worker URL as the router lists it: no trailing slash."""
    return str(url).strip().rstrip("/")


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
        raise http.HttpError(f"{method} {url}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}") from exc


class Router:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout: float = 10.0,
        poll: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.url = normalize(url)
        self.api_key = api_key or None
        self.timeout = timeout
        self.poll = poll
        self.clock = clock
        self.sleep = sleep

    # ------------------------------------------------------------------ one request each

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        url = f"{self.url}{path}"
        code, data = request(method, url, body, timeout=self.timeout, api_key=self.api_key)
        if code == 401:
            raise RouterError(f"{method} {url}: HTTP 401: the router requires its API key (sglang_router_api_key)")
        try:
            doc = http.json_of(url, data) if data.strip() else {}
        except http.HttpError:
            doc = {"raw": data[:300].decode(errors="replace")}
        return code, doc

    def workers(self) -> list[dict]:
        """Every worker the router lists: {id, url, healthy} (and the router's own fields)."""
        code, doc = self._call("GET", "/workers")
        if code != 200 or not isinstance(doc.get("workers"), list):
            raise RouterError(f"GET {self.url}/workers: HTTP {code}: {str(doc)[:300]}")
        out = []
        for w in doc["workers"]:
            if isinstance(w, dict) and w.get("url"):
                out.append({**w, "url": normalize(w["url"]), "healthy": bool(w.get("is_healthy"))})
        return out

    def find(self, worker_url: str) -> dict | None:
        """The router's record of this worker (its UUID in ``id``), or None when it is not listed."""
        want = normalize(worker_url)
        return next((w for w in self.workers() if w["url"] == want), None)

    def add(self, worker_url: str) -> str:
        """Queue the worker's addition; its id. A URL already registered answers with the existing id."""
        code, doc = self._call("POST", "/workers", {"url": normalize(worker_url)})
        if code not in (200, 201, 202):
            raise RouterError(f"POST {self.url}/workers {normalize(worker_url)}: HTTP {code}: {str(doc)[:300]}")
        return str(doc.get("worker_id") or "")

    def remove(self, worker_url: str) -> str | None:
        """Queue the worker's removal by its UUID; the id, or None when the router did not list it."""
        found = self.find(worker_url)
        if found is None:
            return None
        wid = str(found.get("id") or "")
        if not wid:
            raise RouterError(f"{self.url}/workers lists {worker_url} without an id: {found}")
        code, doc = self._call("DELETE", f"/workers/{urllib.parse.quote(wid, safe='')}")
        if code == 404:  # removed meanwhile
            return None
        if code not in (200, 202, 204):
            raise RouterError(f"DELETE {self.url}/workers/{wid} ({worker_url}): HTTP {code}: {str(doc)[:300]}")
        return wid

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
        """Until the router lists the worker as healthy."""

        def check() -> tuple[bool, str]:
            w = self.find(worker_url)
            if w is None:
                return False, "not listed"
            return w["healthy"], "listed, healthy" if w["healthy"] else "listed, not healthy"

        return self._until(check, timeout, f"{self.url} does not list {normalize(worker_url)} as healthy")

    def wait_gone(self, worker_url: str, timeout: float) -> float:
        """Until the router no longer lists the worker."""

        def check() -> tuple[bool, str]:
            w = self.find(worker_url)
            return w is None, "gone" if w is None else f"still listed (id {w.get('id')})"

        return self._until(check, timeout, f"{self.url} still lists {normalize(worker_url)}")

    def membership(self) -> list[dict]:
        """What the router lists, for a summary: url, id, healthy."""
        return [{"url": w["url"], "id": w.get("id"), "healthy": w["healthy"]} for w in self.workers()]


# ---------------------------------------------------------------------- the worker itself


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of a Prometheus series (one per label set: a data-parallel rank, a model)."""
    samples = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", text, re.M)
    if not samples:
        return None
    total = 0.0
    for s in samples:
        try:
            total += float(s)
        except ValueError:
            return None
    return total


def running_requests(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> float | None:
    """The worker's running requests (sglang:num_running_reqs): None when its /metrics lacks the series
    (SGLang without --enable-metrics). HttpError when the worker does not answer."""
    url = f"{normalize(worker_url)}/metrics"
    code, data = http.request(url, timeout=timeout, api_key=api_key)
    if code != 200:
        raise http.HttpError(f"{url}: HTTP {code}")
    return metric_sum(data.decode(errors="replace"), RUNNING_METRIC)


def drain(
    worker_url: str,
    timeout: float,
    api_key: str | None = None,
    poll: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    settle_s: float = 0.2,
) -> dict:
    """Wait until the worker has no running requests, or the drain timeout; never raises.

    Drained once the reads (``poll`` apart) have said 0 for ``settle_s`` seconds, two reads at least: a request
    the router sent just before the removal took effect may still be on its way to the worker at the first read
    (a LAN's milliseconds). Polling faster finds the first 0 sooner; it does not shorten that window. What no
    short window covers: SGLang updates the gauge when it logs a batch, so a request it has just taken may not
    show yet; the stop that follows covers it (SGLang's SIGTERM handler waits for the requests it has).

    {drained: bool, seconds, running (the last value read), why}. A worker that does not answer has
    nothing left to drain (drained, why "not serving"). One whose /metrics lacks the series cannot be
    watched: it is waited on until the timeout (drained false), since nothing else says when it is done.
    """
    start = clock()
    last: float | None = None
    why = ""
    first_zero: float | None = None  # when the reads started saying 0 (None: the last read did not)
    while True:
        try:
            last = running_requests(worker_url, api_key=api_key)
        except http.HttpError as exc:
            return {
                "drained": True,
                "seconds": round(clock() - start, 3),
                "running": None,
                "why": f"not serving: {exc}",
            }
        now = clock()
        if last is None or last > 0:
            first_zero = None
        elif first_zero is None:
            first_zero = now
        elif now - first_zero >= settle_s - 1e-6:  # (the tolerance: a float clock's sums)
            return {"drained": True, "seconds": round(now - start, 3), "running": 0.0, "why": "no running requests"}
        why = (
            f"{last:g} running requests"
            if last is not None
            else f"its /metrics has no {RUNNING_METRIC} (SGLang's enable_metrics is off)"
        )
        if now - start >= timeout:
            return {
                "drained": False,
                "seconds": round(now - start, 3),
                "running": last,
                "why": f"drain timeout ({timeout:g} s): {why}",
            }
        sleep(poll)


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
