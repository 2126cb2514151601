"""Fakes of both gateways' worker API and of SGLang's worker, on loopback, as unkind as the real binaries
(docs/router.md, "The two gateways"): the key required on /workers, removal by UUID only (400 for anything else,
404 for an unknown id), an addition listed a few listings later and unhealthy at first, a removal that takes effect
a few listings later (smg: `draining` first), smg's 409 for a URL it has. Shared by tests/test_router_behaviour.py
and tests/test_gateways.py."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router as rt

KEY = "rk-" + "q7" * 50  # long, and nothing the secret patterns know: only the client's own masking hides it
W1, W2, W3 = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


def uuid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


# --------------------------------------------------------------------------- loopback servers


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # many reads at once (inspect's) are accepted, never dropped for a retry

    def handle_error(self, request, client_address):
        pass  # a client that gave up (its timeout) before the answer: nothing to report


@contextmanager
def serving(respond: Callable) -> Iterator[str]:
    """An HTTP server on 127.0.0.1: respond(handler, body bytes) -> (status, JSON object, str or bytes), or None
    when it answered (or hung up) itself. Yields its base URL."""

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def answer(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            out = respond(self, raw)
            if out is None:
                return
            code, body = out
            data = (
                body
                if isinstance(body, bytes)
                else body.encode()
                if isinstance(body, str)
                else json.dumps(body).encode()
            )
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_DELETE = answer

    srv = Server(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def hang_up(h: BaseHTTPRequestHandler) -> None:
    """Close the connection without a word (a server that died mid-request)."""
    h.close_connection = True
    h.connection.shutdown(socket.SHUT_RDWR)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def fake_dns(table: dict[str, list[str]], calls: list):
    """getaddrinfo from a table (host -> addresses), each call noted; gaierror for a name it does not have."""

    def getaddrinfo(host, port, *a, **kw):
        calls.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [
            (socket.AF_INET6 if ":" in x else socket.AF_INET, socket.SOCK_STREAM, 6, "", (x, 0)) for x in table[host]
        ]

    return getaddrinfo


# --------------------------------------------------------------------------- a gateway


class Gateway:
    """sglang-router 0.3.2's /workers, or smg 1.13.0's (smg=True), as docs/router.md records them.

    0.3.2: the key required (401); POST {"url"} 202 with the id it will list (its id again for a URL it has), the
    worker listed 2 listings later, unhealthy, healthy 2 listings after that; DELETE /workers/<UUID> 202, gone 2
    listings later; 400 for an id that is no UUID, 404 for an unknown one. smg: the same, and each record with
    `status` and `load`; 409 WORKER_ALREADY_EXISTS (naming the id) for a URL it has, WORKER_CREATE_IN_PROGRESS while
    its addition runs; a worker posted without the key never listed; a removed one `draining` (out of rotation,
    unhealthy) for `settle` listings, then gone.

    A test scripts a gateway's bad day with `at(n, fn)` (fn runs before the n-th listing from now) and
    `on_delete`/`on_post` (wid or body -> an answer, or None for the usual one)."""

    def __init__(self, smg: bool = False, settle: int = 12):
        self.smg, self.settle = smg, settle
        self.workers: dict[str, dict] = {}
        self.adding: set[str] = set()
        self.events: list[list] = []  # [listings left, fn]
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[dict] = []
        self.on_delete: Callable[[str], tuple | None] = lambda wid: None
        self.on_post: Callable[[dict], tuple | None] = lambda body: None
        self.n = 0

    def new_id(self) -> str:
        self.n += 1
        return uuid(self.n)

    def add_now(self, url: str, healthy: bool = True, load: int = 0, wid: str | None = None) -> str:
        wid = wid or self.new_id()
        self.workers[url] = {"id": wid, "url": url, "is_healthy": healthy, "worker_type": "regular"}
        if self.smg:
            self.workers[url].update(status="ready" if healthy else "not_ready", load=load)
        return wid

    def healthy(self, url: str) -> None:
        if url in self.workers:
            self.workers[url]["is_healthy"] = True
            if self.smg:
                self.workers[url]["status"] = "ready"

    def drop(self, url: str, wid: str) -> None:
        if self.workers.get(url, {}).get("id") == wid:
            del self.workers[url]

    def at(self, n: int, fn: Callable[[], None]) -> None:
        self.events.append([n, fn])

    def listing(self) -> dict:
        for e in list(self.events):
            e[0] -= 1
            if e[0] <= 0:
                self.events.remove(e)
                e[1]()
        return {
            "workers": [dict(w) if isinstance(w, dict) else w for w in self.workers.values()],
            "total": len(self.workers),
            "stats": {},
        }

    def respond(self, h: BaseHTTPRequestHandler, raw: bytes):
        self.requests.append((h.command, h.path))
        if h.headers.get("Authorization") != f"Bearer {KEY}":
            return 401, {"error": {"code": "invalid_api_key"}} if self.smg else {"error": "Unauthorized"}
        if h.command == "GET" and h.path == "/workers":
            return 200, self.listing()
        if h.command == "POST" and h.path == "/workers":
            return self.post(json.loads(raw or b"{}"))
        if h.command == "DELETE" and h.path.startswith("/workers/"):
            return self.delete(h.path[len("/workers/") :])
        return 404, {"error": "Not Found"}

    def post(self, body: dict):
        self.bodies.append(body)
        scripted = self.on_post(body)
        if scripted is not None:
            return scripted
        if "url" not in body:
            return (400, {"code": "BAD_REQUEST"}) if self.smg else (422, {"error": "missing field url"})
        url = body["url"]
        if url in self.workers:
            wid = self.workers[url]["id"]
            if self.smg:
                return 409, {"code": "WORKER_ALREADY_EXISTS", "error": f"Worker {wid} already exists"}
            return 202, {"status": "accepted", "worker_id": wid, "url": url}
        if self.smg and url in self.adding:
            return 409, {"code": "WORKER_CREATE_IN_PROGRESS", "error": "Worker creation in progress"}
        wid = self.new_id()
        self.adding.add(url)
        if not self.smg or body.get("api_key") == KEY:  # smg: a keyed worker refuses one posted without its key

            def listed(url=url, wid=wid):
                self.adding.discard(url)
                self.add_now(url, healthy=False, wid=wid)

            self.at(2, listed)
            self.at(4, lambda: self.healthy(url))
        return 202, {"status": "accepted", "worker_id": wid, "url": url, "location": f"/workers/{wid}"}

    def delete(self, segment: str):
        if "/" in segment:
            return 404, {"error": "Not Found"}  # no such route
        wid = urllib.parse.unquote(segment)
        if len(wid) != 36:
            return 400, {"error": f"Invalid worker_id {wid} (expected UUID)"}
        scripted = self.on_delete(wid)
        if scripted is not None:
            return scripted
        url = next((u for u, w in self.workers.items() if w["id"] == wid), None)
        if url is None:
            return 404, {"code": "WORKER_NOT_FOUND", "error": f"Worker {wid} not found"}
        if self.smg:
            self.workers[url].update(status="draining", is_healthy=False)
        self.at(self.settle if self.smg else 2, lambda: self.drop(url, wid))
        return 202, {
            "status": "accepted",
            "worker_id": wid,
            "message": "Worker removal queued for background processing",
        }


def router(url: str, impl: str = "sglang-router", **kw) -> rt.Router:
    return rt.Router(url, api_key=KEY, impl=impl, **kw)


def gets(gw: Gateway) -> int:
    return gw.requests.count(("GET", "/workers"))


def deletes(gw: Gateway) -> list[str]:
    return [p.rsplit("/", 1)[-1] for m, p in gw.requests if m == "DELETE"]


# --------------------------------------------------------------------------- a worker (an SGLang server)


def metrics_text(running, queued) -> str:
    lines = ['sglang:gen_throughput{model_name="m"} 1.0']
    if running is not None:
        lines.append(f'sglang:num_running_reqs{{model_name="m"}} {running}')
    if queued is not None:
        lines.append(f'sglang:num_queue_reqs{{model_name="m",priority=""}} {queued}')
    return "\n".join(lines) + "\n"


class Worker:
    """SGLang 0.5.23 as the drain, the inspection and verify's measure reach it: /health 200 (`health`: another
    status, or ("slow", s)); /metrics from `script`, one item per scrape, the last kept: a number (that many
    running, none queued), (running, queued) (None: that series missing), ("status", code), ("slow", s, item);
    /generate with the key required (SGLang's rule: /health and /metrics are open), a request without a text
    answered 400, `max_new_tokens` tokens generated (no limit given: to the context, 4096)."""

    def __init__(self, *script):
        self.script = list(script) or [0.0]
        self.health: object = 200
        self.scrapes = 0
        self.generated: list[dict] = []

    def item(self, item):
        if isinstance(item, tuple) and item[0] == "slow":
            time.sleep(item[1])
            return self.item(item[2])
        if isinstance(item, tuple) and item[0] == "status":
            return item[1], "not found\n"
        running, queued = item if isinstance(item, tuple) else (item, 0.0)
        return 200, metrics_text(running, queued)

    def respond(self, h: BaseHTTPRequestHandler, raw: bytes):
        if h.path == "/health":
            return self.item(("status", 200) if self.health == 200 else self.health)
        if h.path == "/metrics":
            self.scrapes += 1
            return self.item(self.script.pop(0) if len(self.script) > 1 else self.script[0])
        if h.path == "/generate":
            if h.headers.get("Authorization") != f"Bearer {KEY}":
                return 401, {"detail": "Invalid API Key"}
            body = json.loads(raw)
            self.generated.append(body)
            if not isinstance(body.get("text"), str) or not body["text"]:
                return 400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}
            n = body["sampling_params"].get("max_new_tokens")
            return 200, {"text": " Paris" * 3, "meta_info": {"completion_tokens": 4096 if n is None else n}}
        return 404, {"detail": "Not Found"}


@contextmanager
def worker(*script) -> Iterator[tuple[Worker, str]]:
    w = Worker(*script)
    with serving(w.respond) as url:
        yield w, url


def params(**kw) -> dict:
    """The module's parameters as Ansible hands them to act: every option, at its argument spec's default."""
    return {
        "action": None,
        "impl": "sglang-router",
        "router_url": None,
        "api_key": None,
        "worker_url": None,
        "worker_urls": None,
        "missing_ok": False,
        "fail_on_problems": False,
        "timeout": 60.0,
        "drain_timeout": 120.0,
        "drain": False,
        "prompt": "The capital of France is",
        "requests": 4,
        "max_new_tokens": 64,
        **kw,
    }
