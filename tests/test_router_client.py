"""plugins/module_utils/sglang_deploy/router.py: the gateways' worker API (sglang-router 0.3.2, smg 1.13.0); and
draining a worker (worker_load.py), its URL's spellings (worker_urls.py), the module's actions (router_actions.py).

Two kinds of test, both on loopback only:
- against a fake router and fake workers (small HTTP servers in this process), for every branch; the fake
  router in either gateway's flavour (smg's: 409 for a URL it has, `status` with `draining`, the key in the body);
- against the REAL sglang-router 0.3.2 (its own virtualenv, made once from the controller's cached wheel set
  or the package index) in front of two lab stand-ins (lab/standin, its HTTP server run with the stdlib only):
  listing, removal by UUID, a generation in flight through the removed worker completing while drain watches
  it, adding back, the router's health, and no in-flight count of its own (neither `load` nor a metric);
- against the REAL smg 1.13.0 (tests/support/smg.py) the same Router operations: listing, adding with the key,
  its 409 taken as "already there", removal (draining, then gone), the drain beside its in-flight count.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router as rt
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router_actions as ra
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_load as wl
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_urls as wu
from support import REPO, lab_standin
from support.smg import STANDIN, WHEELHOUSE, free_port


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


# --------------------------------------------------------------------------- a fake router


class FakeRouterState:
    """sglang-router 0.3.2's /workers as docs/router.md records it: removal and addition take effect a few
    listings later; an added worker is listed unhealthy first; the key is required.

    With smg, smg 1.13.0's (docs/router.md, "The two gateways"): each worker listed with `status` and `load`; a
    URL it has or is adding answers 409; a worker posted without the key is never listed (a keyed worker refuses
    its registration); a removed one is `draining` (unhealthy) for a few listings, then gone."""

    def __init__(self, key: str | None = "k", smg: bool = False):
        self.key = key
        self.smg = smg
        self.workers: dict[str, dict] = {}
        self.pending: list[list] = []  # [listings left, action, url]
        self.requests: list[tuple[str, str]] = []
        self.bodies: list[dict] = []  # every POST's body
        self.adding: set[str] = set()  # (smg) URLs whose addition runs, not listed yet
        self.next_id = 0

    def add_now(self, url: str, healthy: bool = True, load: int = 0) -> str:
        self.next_id += 1
        wid = f"00000000-0000-4000-8000-{self.next_id:012d}"
        self.workers[url] = {"id": wid, "url": url, "is_healthy": healthy, "worker_type": "regular"}
        if self.smg:
            self.workers[url].update(status="ready" if healthy else "not_ready", load=load)
        return wid

    def listing(self) -> dict:
        for p in list(self.pending):
            p[0] -= 1
            if p[0] <= 0:
                self.pending.remove(p)
                _, action, url = p
                if action == "remove":
                    self.workers.pop(url, None)
                elif action == "add":
                    self.adding.discard(url)
                    self.add_now(url, healthy=False)
                elif action == "healthy" and url in self.workers:
                    self.workers[url]["is_healthy"] = True
                    if self.smg:
                        self.workers[url]["status"] = "ready"
        return {"workers": list(self.workers.values()), "total": len(self.workers), "stats": {}}


def serve(handler_cls) -> tuple[ThreadingHTTPServer, str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def fake_router():
    state = FakeRouterState()
    srv, url = serve(fake_router_handler(state))
    yield state, url
    srv.shutdown()


@pytest.fixture
def fake_smg():
    state = FakeRouterState(smg=True)
    srv, url = serve(fake_router_handler(state))
    yield state, url
    srv.shutdown()


def fake_router_handler(state: FakeRouterState):
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, doc):
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def allowed(self):
            state.requests.append((self.command, self.path))
            if state.key and self.headers.get("Authorization") != f"Bearer {state.key}":
                self.reply(401, {"error": "Unauthorized"})
                return False
            return True

        def do_GET(self):
            if self.allowed():
                self.reply(200, state.listing()) if self.path == "/workers" else self.reply(404, {})

        def do_POST(self):
            if not self.allowed():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            state.bodies.append(body)
            if "url" not in body:
                if state.smg:
                    return self.reply(400, {"code": "BAD_REQUEST", "error": "missing field `url`"})
                return self.reply(422, {"error": "missing field url"})
            if body["url"] in state.workers:
                wid = state.workers[body["url"]]["id"]
                if state.smg:
                    return self.reply(409, {"code": "WORKER_ALREADY_EXISTS", "error": f"Worker {wid} already exists"})
                return self.reply(202, {"status": "accepted", "worker_id": wid})
            if state.smg and body["url"] in state.adding:
                return self.reply(409, {"code": "WORKER_CREATE_IN_PROGRESS", "error": "Worker creation in progress"})
            if state.smg:
                state.adding.add(body["url"])
                if state.key and body.get("api_key") != state.key:  # refused by the keyed worker: never listed
                    return self.reply(202, {"status": "accepted", "worker_id": "queued", "url": body["url"]})
            state.pending += [[2, "add", body["url"]], [4, "healthy", body["url"]]]
            self.reply(202, {"status": "accepted", "worker_id": "queued", "url": body["url"]})

        def do_DELETE(self):
            if not self.allowed():
                return
            wid = self.path.rsplit("/", 1)[-1]
            if len(wid) != 36:
                return self.reply(400, {"error": f"Invalid worker_id {wid} (expected UUID)"})
            url = next((u for u, w in state.workers.items() if w["id"] == wid), None)
            if url is None:
                return self.reply(404, {"error": "WORKER_NOT_FOUND"})
            if state.smg:  # out of rotation at once, listed until the settle time ends
                state.workers[url].update(status="draining", is_healthy=False)
                state.pending.append([12, "remove", url])
            else:
                state.pending.append([2, "remove", url])
            self.reply(202, {"status": "accepted", "worker_id": wid})

    return H


def metrics_text(running, queued=0.0) -> str:
    """SGLang's /metrics with its load gauges: running (None: no such series) over two data-parallel ranks (their
    sum is the worker's), queued (None: no such series) with 0.5.23's per-priority part written again."""
    lines = ['sglang:gen_throughput{model_name="m"} 1.0']
    if running is not None:
        lines += [f'sglang:num_running_reqs{{model_name="m",dp="0"}} {running}', 'sglang:num_running_reqs{dp="1"} 0']
    if queued is not None:
        lines += [
            f'sglang:num_queue_reqs{{model_name="m",priority=""}} {queued}',
            f'sglang:num_queue_reqs{{model_name="m",priority="1"}} {queued}',
        ]
    return "\n".join(lines) + "\n"


@pytest.fixture
def fake_worker():
    """A worker whose /metrics answers from a script, one item per scrape (the last repeated):
    a number: that many running, 0 queued; (running, queued): both (None: that series missing); None: no
    sglang:num_running_reqs; ("status", code): that HTTP status; ("slow", s): the answer after s seconds;
    "reset": the connection reset, no answer. /health answers 200."""
    script: list = [0.0]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/health":
                return self.answer(200, b"")
            item = script.pop(0) if len(script) > 1 else script[0]
            if item == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()
                return
            if isinstance(item, tuple) and item[0] == "status":
                return self.answer(item[1], b"{}")
            if isinstance(item, tuple) and item[0] == "slow":
                time.sleep(item[1])
                item = 0.0
            running, queued = item if isinstance(item, tuple) else (item, 0.0)
            self.answer(200, metrics_text(running, queued).encode())

        def answer(self, code, data):
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv, url = serve(H)
    yield script, url
    srv.shutdown()


def closed_port() -> int:
    """A loopback port nothing listens on (a connection to it is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fast(url: str, key: str | None = "k") -> rt.Router:
    return rt.Router(url, api_key=key, poll=0.01)


def test_lists_finds_and_removes_by_uuid_never_by_url(fake_router):
    state, url = fake_router
    wid = state.add_now("http://10.0.0.1:30000")
    state.add_now("http://10.0.0.2:30000")
    r = fast(url)
    assert [w["url"] for w in r.workers()] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert [w["id"] for w in r.find("http://10.0.0.1:30000/")] == [wid]  # a trailing slash is the same worker
    assert r.remove("http://10.0.0.1:30000") == [wid]
    assert ("DELETE", f"/workers/{wid}") in state.requests
    assert r.wait_gone("http://10.0.0.1:30000", timeout=5) >= 0
    assert [w["url"] for w in r.membership()] == ["http://10.0.0.2:30000"]
    assert r.remove("http://10.0.0.1:30000", missing_ok=True) == []  # not listed, and the caller says that is fine


def test_removing_a_worker_the_router_does_not_list_is_an_error_naming_what_it_lists(fake_router):
    """Issue #29 (b): a worker "removed" with nothing removed was drained and restarted while the router still
    sent it requests. The router lists it under no spelling: an error, unless the caller allows it."""
    state, url = fake_router
    state.add_now("http://10.0.0.2:30000")
    r = fast(url)
    deletes = [m for m, _ in state.requests if m == "DELETE"]
    with pytest.raises(rt.RouterError) as err:
        r.remove("http://10.0.0.1:30000")
    assert str(err.value) == (
        f"{url} does not list http://10.0.0.1:30000 under any spelling; it lists: http://10.0.0.2:30000"
    )
    assert r.remove("http://10.0.0.1:30000", missing_ok=True) == []
    assert [m for m, _ in state.requests if m == "DELETE"] == deletes  # nothing was deleted
    state.workers.clear()
    with pytest.raises(rt.RouterError, match="it lists: no worker"):
        r.remove("http://10.0.0.1:30000")


def test_canonical_spelling_of_a_worker_url():
    c = wu.canonical
    assert c("http://gpu-node-01:30000") == "http://gpu-node-01:30000"
    assert c("HTTP://GPU-Node-01:30000/") == "http://gpu-node-01:30000"  # scheme and host lower-cased, no slash
    assert c("http://gpu-node-01.example.internal.:30000/some/path") == "http://gpu-node-01.example.internal:30000"
    assert c("http://gpu-node-01") == c("http://gpu-node-01:80") == "http://gpu-node-01:80"  # default ports
    assert c("https://gpu-node-01") == "https://gpu-node-01:443"
    assert c("http://[::1]:30000") == c("http://[0:0:0:0:0:0:0:1]:30000/") == "http://[::1]:30000"
    assert c("http://[FD00::12]:30001") == "http://[fd00::12]:30001"
    assert c("http://[::ffff:10.0.0.1]:30000") == "http://10.0.0.1:30000"  # an IPv4-mapped address is IPv4
    assert c(wu.worker_url("fd00::12", 30001)) == "http://[fd00::12]:30001"
    for bad in ("gpu-node-01:30000", "http://gpu-node-01:port", "http://:30000", "ftp://gpu-node-01"):
        with pytest.raises(ValueError):
            c(bad)


def fake_dns(table: dict[str, list[str]], calls: list | None = None):
    """A getaddrinfo answering from table (host -> addresses); socket.gaierror for any other name."""

    def getaddrinfo(host, port, *a, **kw):
        if calls is not None:
            calls.append(host)
        try:
            addresses = table[host]
        except KeyError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in addresses]

    return getaddrinfo


def test_same_worker_under_any_spelling():
    same = wu.same_worker
    # the machine's own resolver: localhost is 127.0.0.1 (/etc/hosts)
    assert socket.getaddrinfo("localhost", None)[0][4][0] in ("127.0.0.1", "::1")
    assert same("http://localhost:30000", "http://127.0.0.1:30000") or same(
        "http://localhost:30000", "http://[::1]:30000"
    )
    assert same("HTTP://LOCALHOST:30000/", "http://localhost:30000")  # upper case, trailing slash: no resolution
    assert same("http://10.0.0.1", "http://10.0.0.1:80/")  # the default port written out or not
    assert same("http://[::1]:30000", "http://[0:0:0:0:0:0:0:1]:30000")
    assert not same("http://127.0.0.1:30000", "http://127.0.0.2:30000")
    assert not same("http://127.0.0.1:30000", "http://127.0.0.1:30001")  # another port: another worker
    assert not same("http://127.0.0.1:443", "https://127.0.0.1:443")  # another scheme: another URL to the router
    # A name resolved where this runs (the router's host): its addresses against the listed one.
    dns = wu.Resolver(fake_dns({"gpu-node-01": ["10.0.0.1"], "gpu-node-02": ["fd00::12", "10.0.0.2"]}))
    assert dns.same("http://gpu-node-01:30000", "http://10.0.0.1:30000")
    assert dns.same("http://10.0.0.1:30000", "http://GPU-NODE-01:30000/")
    assert dns.same("http://gpu-node-02:30000", "http://[fd00::12]:30000")  # one of its addresses is enough
    assert dns.same("http://gpu-node-02:30000", "http://10.0.0.2:30000")
    assert not dns.same("http://gpu-node-01:30000", "http://10.0.0.2:30000")
    assert not dns.same("http://gpu-node-01:30000", "http://gpu-node-02:30000")
    # A name that does not resolve is compared by its canonical name only.
    assert not dns.same("http://gpu-node-09:30000", "http://10.0.0.9:30000")
    assert dns.same("http://gpu-node-09:30000", "http://Gpu-Node-09:30000")
    # A URL that is not one is compared as written (less the trailing slash).
    assert dns.same("not a url/", "not a url") and not dns.same("not a url", "http://10.0.0.1:30000")


def test_each_name_is_resolved_once_per_decision(fake_router):
    state, url = fake_router
    for i in range(1, 4):
        state.add_now(f"http://10.0.0.{i}:30000")
    calls: list[str] = []
    r = rt.Router(url, api_key="k", poll=0.01, getaddrinfo=fake_dns({"gpu-node-02": ["10.0.0.2"]}, calls))
    assert [w["url"] for w in r.find("http://gpu-node-02:30000")] == ["http://10.0.0.2:30000"]
    assert calls == ["gpu-node-02"]  # once for the three listed (an address is not looked up)
    calls.clear()
    assert r.find("http://gpu-node-02:30000") and calls.count("gpu-node-02") == 1  # a new call resolves again


def test_the_router_finds_and_removes_a_worker_listed_under_another_spelling(fake_router):
    """Issue #29 (b): the router lists an address, the inventory a name (or the other way round)."""
    state, url = fake_router
    dns = fake_dns({"gpu-node-01": ["10.0.0.1"], "gpu-node-02": ["10.0.0.2"]})
    by_ip = state.add_now("http://10.0.0.1:30000")
    by_name = state.add_now("http://GPU-NODE-02:30000/")
    r = rt.Router(url, api_key="k", poll=0.01, getaddrinfo=dns)
    assert [w["id"] for w in r.find("http://gpu-node-01:30000")] == [by_ip]
    assert [w["id"] for w in r.find("http://10.0.0.2:30000")] == [by_name]
    assert [w["id"] for w in r.find("HTTP://gpu-node-01:30000/")] == [by_ip]
    assert r.find("http://gpu-node-01:30001") == [] and r.find("http://gpu-node-03:30000") == []
    assert r.remove("http://gpu-node-01:30000") == [by_ip]
    assert r.wait_gone("http://gpu-node-01:30000", timeout=5) >= 0
    assert r.remove("http://10.0.0.2:30000") == [by_name]
    assert r.wait_gone("http://10.0.0.2:30000", timeout=5) >= 0 and state.workers == {}


def test_a_worker_registered_twice_is_removed_wholly_and_never_added_again(fake_router):
    state, url = fake_router
    dns = fake_dns({"gpu-node-01": ["10.0.0.1"]})
    ids = [state.add_now("http://10.0.0.1:30000"), state.add_now("http://gpu-node-01:30000")]
    other = state.add_now("http://10.0.0.2:30000")
    r = rt.Router(url, api_key="k", poll=0.01, getaddrinfo=dns)
    assert [w["id"] for w in r.find("http://gpu-node-01:30000")] == ids
    assert r.remove("http://gpu-node-01:30000") == ids
    assert r.wait_gone("http://10.0.0.1:30000", timeout=5) >= 0  # gone under both spellings
    assert [w["id"] for w in r.workers()] == [other]
    # add: the worker, listed under one spelling, is not posted again under another
    assert r.add("http://10.0.0.1:30000") == ("queued", True)
    r.wait_healthy("http://gpu-node-01:30000", timeout=5)
    posts = [p for p in state.requests if p[0] == "POST"]
    wid = r.find("http://10.0.0.1:30000")[0]["id"]
    assert r.add("http://gpu-node-01:30000/") == (wid, False)
    assert r.add("HTTP://10.0.0.1:30000") == (wid, False)
    assert [p for p in state.requests if p[0] == "POST"] == posts and len(state.workers) == 2
    # what add posts: the scheme lower-cased, no slash (0.3.2 never lists an upper-case scheme, and lists a
    # trailing slash as one more worker: docs/router.md); the host and port as written (the router role's)
    assert r.add("HTTP://GPU-node-03:30000/") == ("queued", True)
    assert "http://GPU-node-03:30000" in [u for _, _, u in state.pending]
    assert wu.posted("https://[FD00::12]:30001/x") == "https://[FD00::12]:30001"


def test_add_then_wait_until_listed_and_healthy(fake_router):
    state, url = fake_router
    r = fast(url)
    assert r.add("http://10.0.0.3:30000") == ("queued", True)
    seen = []
    orig = r.find

    def spy(u, resolver=None):
        found = orig(u, resolver)
        seen.append(found[0]["healthy"] if found else None)
        return found

    r.find = spy
    r.wait_healthy("http://10.0.0.3:30000", timeout=5)
    assert seen[0] is None and False in seen and seen[-1] is True  # not listed, listed unhealthy, healthy
    # a worker already registered is not posted again: its id
    posts = state.requests.count(("POST", "/workers"))
    assert r.add("http://10.0.0.3:30000") == (state.workers["http://10.0.0.3:30000"]["id"], False)
    assert state.requests.count(("POST", "/workers")) == posts


def test_wait_healthy_times_out_naming_the_last_state(fake_router):
    state, url = fake_router
    state.add_now("http://10.0.0.4:30000", healthy=False)
    clock = FakeClock()
    r = rt.Router(url, api_key="k", poll=1.0, clock=clock, sleep=clock.sleep)
    with pytest.raises(rt.RouterError, match=r"as healthy after 3 s \(last: listed, not healthy\)"):
        r.wait_healthy("http://10.0.0.4:30000", timeout=3)
    with pytest.raises(rt.RouterError, match=r"still lists http://10.0.0.4:30000 after 2 s"):
        r.wait_gone("http://10.0.0.4:30000", timeout=2)


def test_the_api_key_is_named_when_refused(fake_router):
    _, url = fake_router
    with pytest.raises(rt.RouterError, match="HTTP 401: the router requires its API key"):
        fast(url, key=None).workers()
    with pytest.raises(rt.RouterError, match="HTTP 401"):
        fast(url, key="wrong").add("http://10.0.0.5:30000")


def test_a_router_that_does_not_answer_is_an_http_error():
    with pytest.raises(http.HttpError) as err:
        rt.Router(f"http://127.0.0.1:{closed_port()}", timeout=2).workers()
    assert isinstance(err.value.cause, ConnectionRefusedError)


# --------------------------------------------------------------------------- smg's flavour, the same interface


def smg(url: str, key: str | None = "k", **kw) -> rt.Router:
    return rt.Router(url, api_key=key, poll=0.01, impl="smg", **kw)


def test_the_gateways_differ_in_one_table_only():
    """One source of truth: router.py names smg once, in GATEWAYS; its methods read the Gateway's fields."""
    import inspect

    source = inspect.getsource(rt)
    assert source.count('"smg"') == 1 and "impl ==" not in source and "impl !=" not in source
    assert set(rt.GATEWAYS) == {"sglang-router", "smg"} and rt.DEFAULT_IMPL == "sglang-router"
    assert rt.Router("http://127.0.0.1:1").gateway is rt.GATEWAYS["sglang-router"]  # the default: as before smg
    with pytest.raises(rt.RouterError, match=r"unknown gateway 'sglang-router-0\.4': one of sglang-router, smg"):
        rt.Router("http://127.0.0.1:1", impl="sglang-router-0.4")


def test_smg_add_posts_the_workers_key_in_the_body_and_0_3_2_the_url_only(fake_router, fake_smg):
    """smg gives a worker posted without "api_key" no key: a keyed worker refuses it and it is never listed."""
    state, url = fake_smg
    r = smg(url)
    assert r.add("HTTP://10.0.0.3:30000/") == ("queued", True)
    assert state.bodies == [{"url": "http://10.0.0.3:30000", "api_key": "k"}]  # the spelling add posts, the key
    assert r.wait_healthy("http://10.0.0.3:30000", timeout=5) >= 0
    wid = state.workers["http://10.0.0.3:30000"]["id"]
    assert r.membership() == [{"url": "http://10.0.0.3:30000", "id": wid, "healthy": True, "status": "ready"}]
    # the worker's own key where it differs from the gateway's (and masked in what the client quotes)
    assert smg(url, worker_api_key="wk").add("http://10.0.0.4:30000") == ("queued", True)
    assert state.bodies[-1] == {"url": "http://10.0.0.4:30000", "api_key": "wk"}
    # posted without the key, the fake's keyed worker refuses it: never listed, and wait_healthy says so
    no_key = smg(url)
    no_key.worker_api_key = None
    assert no_key.add("http://10.0.0.5:30000") == ("queued", True) and state.bodies[-1] == {
        "url": "http://10.0.0.5:30000"
    }
    with pytest.raises(rt.RouterError, match=r"as healthy after 0.2 s \(last: not listed\)"):
        r.wait_healthy("http://10.0.0.5:30000", timeout=0.2)
    # 0.3.2 takes the URL only (it sends its own --api-key to every worker)
    state32, url32 = fake_router
    assert fast(url32).add("http://10.0.0.3:30000") == ("queued", True)
    assert state32.bodies == [{"url": "http://10.0.0.3:30000"}]


def test_smg_409_for_a_url_it_has_is_already_there(fake_smg):
    """A race (another client posted it between the listing and the POST): 409 WORKER_ALREADY_EXISTS is "not
    added", its id found again; WORKER_CREATE_IN_PROGRESS, whose id smg does not list yet, is "not added" too."""
    state, url = fake_smg
    wid = state.add_now("http://10.0.0.1:30000")
    r = smg(url)
    real_find = r.find
    calls = []

    def blind_once(u, resolver=None):
        calls.append(u)
        return [] if len(calls) == 1 else real_find(u, resolver)

    r.find = blind_once
    assert r.add("http://10.0.0.1:30000") == (wid, False)
    assert state.requests.count(("POST", "/workers")) == 1 and len(state.workers) == 1
    # not listed again after the 409: the id smg names in its message
    calls.clear()
    r.find = lambda u, resolver=None: []
    assert r.add("http://10.0.0.1:30000") == (wid, False)
    state.adding.add("http://10.0.0.2:30000")
    assert r.add("http://10.0.0.2:30000") == ("", False)
    # no 409 in between: a worker listed is not posted at all (as with 0.3.2)
    r.find = real_find
    posts = state.requests.count(("POST", "/workers"))
    assert r.add("http://10.0.0.1:30000/") == (wid, False) and state.requests.count(("POST", "/workers")) == posts


def test_smg_a_draining_worker_counts_as_removed_and_wait_gone_accepts_it(fake_smg):
    state, url = fake_smg
    wid = state.add_now("http://10.0.0.1:30000", load=2)
    other = state.add_now("http://10.0.0.2:30000")
    r = smg(url)
    assert r.in_flight("http://10.0.0.1:30000") == 2.0
    assert r.remove("http://10.0.0.1:30000/") == [wid]
    # out of rotation at once: wait_gone ends while smg still lists it, draining
    assert r.wait_gone("http://10.0.0.1:30000", timeout=5) >= 0
    [rec] = r.find("http://10.0.0.1:30000")
    assert (rec["status"], rec["healthy"], rec["id"]) == ("draining", False, wid)
    assert r.membership() == [
        {"url": "http://10.0.0.1:30000", "id": wid, "healthy": False, "status": "draining"},
        {"url": "http://10.0.0.2:30000", "id": other, "healthy": True, "status": "ready"},
    ]
    assert r.in_flight("http://10.0.0.1:30000") == 2.0  # its requests still count while it drains
    # already leaving: not removed again, not an error (it is listed), nothing deleted
    deletes = [m for m, _ in state.requests].count("DELETE")
    assert r.remove("http://10.0.0.1:30000") == [] and r.remove("http://10.0.0.1:30000", missing_ok=True) == []
    assert [m for m, _ in state.requests].count("DELETE") == deletes
    # ... nor healthy: wait_healthy names the state
    clock = FakeClock()
    slow = rt.Router(url, api_key="k", poll=1.0, clock=clock, sleep=clock.sleep, impl="smg")
    with pytest.raises(rt.RouterError, match=r"as healthy after 1 s \(last: listed, draining\)"):
        slow.wait_healthy("http://10.0.0.1:30000", timeout=1)
    # until it leaves: draining_ok=False waits for the listing itself
    assert r.wait_gone("http://10.0.0.1:30000", timeout=5, draining_ok=False) >= 0
    assert r.find("http://10.0.0.1:30000") == [] and r.in_flight("http://10.0.0.1:30000") is None
    assert r.remove("http://10.0.0.1:30000", missing_ok=True) == []


def test_smg_wait_gone_times_out_naming_the_state(fake_smg):
    state, url = fake_smg
    wid = state.add_now("http://10.0.0.1:30000")
    clock = FakeClock()
    r = rt.Router(url, api_key="k", poll=1.0, clock=clock, sleep=clock.sleep, impl="smg")
    with pytest.raises(
        rt.RouterError, match=rf"still lists http://10.0.0.1:30000 after 2 s \(last: still listed \(id {wid} ready\)\)"
    ):
        r.wait_gone("http://10.0.0.1:30000", timeout=2)
    state.workers["http://10.0.0.1:30000"]["status"] = "draining"  # a removal whose settle time never ends
    assert r.wait_gone("http://10.0.0.1:30000", timeout=2) == 0.0
    with pytest.raises(rt.RouterError, match=rf"after 2 s \(last: still listed \(id {wid} draining\)\)"):
        r.wait_gone("http://10.0.0.1:30000", timeout=2, draining_ok=False)


def test_smg_add_waits_out_a_draining_record_before_posting_again(fake_smg):
    """A worker put back at once (a rollout's rescue): smg still lists it draining and would answer 409, then drop
    it with its settle time; add waits until it is gone, then posts, and the worker comes back under a new id."""
    state, url = fake_smg
    old = state.add_now("http://10.0.0.1:30000")
    r = smg(url)
    assert r.remove("http://10.0.0.1:30000") == [old]
    seen = []
    real_workers = r.workers

    def spy():
        listing = real_workers()
        seen.append([w.get("status") for w in listing])
        return listing

    r.workers = spy
    assert r.add("http://10.0.0.1:30000", timeout=5) == ("queued", True)
    assert seen[0] == ["draining"] and seen[-1] == [] and state.requests[-1] == ("POST", "/workers")
    assert r.wait_healthy("http://10.0.0.1:30000", timeout=5) >= 0
    assert state.workers["http://10.0.0.1:30000"]["id"] != old
    # a settle time that never ends: add fails at its timeout, nothing posted
    r.workers = real_workers
    assert r.remove("http://10.0.0.1:30000")
    state.pending.clear()
    posts = state.requests.count(("POST", "/workers"))
    with pytest.raises(rt.RouterError, match=r"still lists http://10.0.0.1:30000 after 0.05 s"):
        r.add("http://10.0.0.1:30000", timeout=0.05)
    assert state.requests.count(("POST", "/workers")) == posts


def test_in_flight_is_the_gateways_own_count_or_none(fake_router, fake_smg):
    """smg's listing `load` (summed over a worker's spellings); 0.3.2 keeps no count: None, whatever `load` says."""
    state, url = fake_smg
    state.add_now("http://127.0.0.1:30000", load=1)
    state.add_now("http://localhost:30000/", load=2)
    r = smg(url)
    assert r.in_flight("http://LOCALHOST:30000") == 3.0
    assert r.in_flight("http://127.0.0.1:30001") is None  # not listed: no count to read
    state.workers["http://127.0.0.1:30000"]["load"] = True  # not a count
    del state.workers["http://localhost:30000/"]["load"]
    assert r.in_flight("http://127.0.0.1:30000") is None
    read = r.reader("http://127.0.0.1:30000")
    state.workers["http://127.0.0.1:30000"]["load"] = 0
    assert read() == 0.0
    state32, url32 = fake_router
    state32.add_now("http://127.0.0.1:30000")
    state32.workers["http://127.0.0.1:30000"]["load"] = 0  # 0.3.2 lists load 0 with requests running
    assert fast(url32).in_flight("http://127.0.0.1:30000") is None
    assert fast(url32).membership() == [
        {"url": "http://127.0.0.1:30000", "id": state32.workers["http://127.0.0.1:30000"]["id"], "healthy": True}
    ]


def test_drain_carries_the_gateways_count_as_evidence_not_as_its_rule(fake_worker):
    """The worker's own gauges decide; the gateway's count, read beside each, is the other side's evidence."""
    script, url = fake_worker
    counts = [3.0, 1.0, 5.0]  # even a gateway that still counts requests does not hold the drain

    def gateway():
        return counts.pop(0) if len(counts) > 1 else counts[0]

    script[:] = [2.0, 0.0, 0.0]
    out = fake_drain(url, timeout=60, gateway_in_flight=gateway)
    assert out == {
        "drained": True,
        "seconds": 1.0,
        "running": 0.0,
        "queued": 0.0,
        "why": "no running or queued requests",
        "gateway_in_flight": 5.0,
    }
    script[:] = [1.0]
    out = fake_drain(url, timeout=1, poll=1.0, gateway_in_flight=lambda: None)
    assert out["drained"] is False and out["gateway_in_flight"] is None

    def down():
        raise rt.RouterError("GET /workers: HTTP 503")

    script[:] = [("status", 404)]
    out = fake_drain(url, timeout=60, gateway_in_flight=down)  # a gateway that does not answer: no count
    assert out["drained"] is False and out["gateway_in_flight"] is None and "--enable-metrics" in out["why"]
    out = wl.drain(f"http://127.0.0.1:{closed_port()}", timeout=30, gateway_in_flight=lambda: 0.0)
    assert out["drained"] is True and out["gateway_in_flight"] == 0.0


def fake_drain(url: str, timeout: float, poll: float = 0.5, **kw) -> dict:
    clock = FakeClock()
    return wl.drain(url, timeout=timeout, poll=poll, clock=clock, sleep=clock.sleep, **kw)


def test_drain_waits_until_no_running_requests(fake_worker):
    script, url = fake_worker
    script[:] = [3.0, 0.0, 2.0, 0.0, 0.0]
    out = fake_drain(url, timeout=60)
    # drained at the second 0 in a row, 0.5 s after the first (a request sent just before the removal may be
    # on its way at the first)
    assert out == {
        "drained": True,
        "seconds": 2.0,
        "running": 0.0,
        "queued": 0.0,
        "why": "no running or queued requests",
    }
    # Polled faster, the zeros must still last settle_s: 0 at 1.0 and 1.1 is not yet drained, at 1.2 it is.
    script[:] = [1.0] * 10 + [0.0]
    out = fake_drain(url, timeout=60, poll=0.1)
    assert out["drained"] is True and out["seconds"] == pytest.approx(1.2), out
    script[:] = [1.0] * 10 + [0.0]
    out = fake_drain(url, timeout=60, poll=0.1, settle_s=0.5)
    assert out["drained"] is True and out["seconds"] == pytest.approx(1.5), out


def test_drain_counts_the_queue_too(fake_worker):
    """Issue #29 (a): running 0 with requests waiting in the queue is not drained; their sum is watched."""
    script, url = fake_worker
    script[:] = [(0.0, 2.0)]
    out = fake_drain(url, timeout=3, poll=1.0)
    assert out["drained"] is False and (out["running"], out["queued"]) == (0.0, 2.0)
    assert out["why"] == "drain timeout (3 s): 0 running, 2 queued"
    # the queue empties into the running batch, which finishes: drained at the second zero of the sum
    script[:] = [(0.0, 2.0), (2.0, 0.0), (1.0, 0.0), (0.0, 0.0)]
    out = fake_drain(url, timeout=60)
    assert out["drained"] is True and out["seconds"] == 2.0, out


def test_drain_stops_at_its_timeout_with_requests_still_running(fake_worker):
    script, url = fake_worker
    script[:] = [2.0]
    out = fake_drain(url, timeout=3, poll=1.0)
    assert out["drained"] is False and out["running"] == 2.0 and out["queued"] == 0.0
    assert out["why"] == "drain timeout (3 s): 2 running, 0 queued" and out["seconds"] == 3.0


def test_drain_without_metrics_ends_at_once_not_drained_naming_enable_metrics(fake_worker):
    """Issue #29 (a): SGLang mounts /metrics only with --enable-metrics (404 without): that is no evidence that
    nothing runs, and no later read will be either."""
    script, url = fake_worker
    script[:] = [("status", 404)]
    out = fake_drain(url, timeout=60)
    assert out["drained"] is False and out["seconds"] == 0.0 and out["running"] is None
    assert out["why"] == (
        f"cannot be drained on evidence: {url}/metrics answered HTTP 404 "
        "(SGLang serves /metrics and its load gauges only with --enable-metrics)"
    )
    for item, missing in (
        (None, "sglang:num_running_reqs"),
        ((0.0, None), "sglang:num_queue_reqs"),
        ((None, None), "sglang:num_running_reqs nor sglang:num_queue_reqs"),
    ):
        script[:] = [item]
        out = fake_drain(url, timeout=60)
        assert out["drained"] is False and out["seconds"] == 0.0, item
        assert f"/metrics has no {missing} (SGLang serves /metrics" in out["why"] and "--enable-metrics" in out["why"]


def test_a_503_is_no_evidence_the_zeros_after_it_are(fake_worker):
    """A server busy under load (or shutting down) may answer 503: polled on, drained only after the zeros."""
    script, url = fake_worker
    script[:] = [("status", 503), ("status", 503), 0.0, ("status", 503), 0.0, 0.0]
    out = fake_drain(url, timeout=60)
    # the 503 between the first zeros starts the window again: zeros at 2.0 and 2.5
    assert out["drained"] is True and out["seconds"] == 2.5, out
    script[:] = [("status", 503)]
    out = fake_drain(url, timeout=2, poll=1.0)
    assert out["drained"] is False and out["seconds"] == 2.0 and out["running"] is None
    assert out["why"] == f"drain timeout (2 s): last read: {url}/metrics answered HTTP 503"
    script[:] = [1.0, ("status", 500)]
    out = fake_drain(url, timeout=2, poll=1.0)
    assert out["drained"] is False and out["running"] == 1.0 and "HTTP 500" in out["why"]  # the last load read


def test_read_timeouts_and_resets_are_no_evidence(fake_worker):
    script, url = fake_worker
    script[:] = [("slow", 0.5)]
    out = fake_drain(url, timeout=2, poll=1.0, read_timeout=0.1)
    assert out["drained"] is False and out["seconds"] == 2.0
    assert out["why"].startswith("drain timeout (2 s): last read: no answer in time"), out
    script[:] = ["reset"]
    out = fake_drain(url, timeout=2, poll=1.0)
    assert out["drained"] is False and out["why"].startswith("drain timeout (2 s): last read:"), out
    assert "refused" not in out["why"]
    script[:] = ["reset", ("slow", 0.2), 0.0, 0.0]
    out = fake_drain(url, timeout=60, read_timeout=0.1)
    assert out["drained"] is True and out["seconds"] == 1.5, out  # after them, the zeros


def test_a_refused_connection_is_drained_nothing_listens():
    """Nothing listens on the worker's port (its server process is gone): nothing runs there."""
    out = wl.drain(f"http://127.0.0.1:{closed_port()}", timeout=30)
    assert out == {
        "drained": True,
        "seconds": out["seconds"],
        "running": None,
        "queued": None,
        "why": "not serving: connection refused",
    }
    assert out["seconds"] < 5


def test_read_load_says_what_kind_of_answer():
    with pytest.raises(http.HttpError) as err:
        http.request(f"http://127.0.0.1:{closed_port()}/metrics", timeout=2)
    assert wl.refused(err.value)
    assert not wl.refused(http.HttpError("x")) and not wl.refused(http.HttpError("x", cause=TimeoutError()))
    assert wl.read_load(f"http://127.0.0.1:{closed_port()}")["state"] == "nothing_listens"


def test_metric_sum_adds_every_label_set():
    text = 'x{a="1"} 2\nx{a="2"} 3.5\nx_total 9\n# x 4\n'
    assert wl.metric_sum(text, "x") == 5.5
    assert wl.metric_sum(text, "y") is None
    # 0.5.23's queue gauges: the total under priority="", each priority's part again under its own
    text = 'q{m="a",priority=""} 3\nq{m="a",priority="1"} 2\nq{m="a",priority="2"} 1\nq{m="b"} 1\n'
    assert wl.metric_sum(text, "q") == 4.0


def test_inspect_reads_the_router_and_each_worker(fake_router, fake_worker):
    state, url = fake_router
    script, good = fake_worker
    script[:] = [(1.0, 2.0)]

    def handler(code):
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return serve(H)

    no_metrics_srv, no_metrics = handler(200)  # /health 200, /metrics 200 without the gauges
    busy_srv, busy = handler(503)
    gone = f"http://127.0.0.1:{closed_port()}"
    try:
        wid = state.add_now(good.replace("127.0.0.1", "localhost"))  # listed under another spelling
        dup = [state.add_now(no_metrics), state.add_now(no_metrics + "/")]
        state.add_now(gone, healthy=False)
        out = ra.inspect(fast(url), [good, no_metrics, busy, gone], timeout=2, retry_s=0)  # one read each
    finally:
        no_metrics_srv.shutdown()
        busy_srv.shutdown()
    w = {x["url"]: x for x in out["workers"]}
    assert [x["url"] for x in out["workers"]] == [good, no_metrics, busy, gone]
    assert w[good] == {
        "url": good,
        "listed": True,
        "ids": [wid],
        "healthy_in_router": True,
        "serving": True,
        "drainable": True,
        "why": "",
    }
    assert w[no_metrics]["ids"] == dup and w[no_metrics]["serving"] is True and w[no_metrics]["drainable"] is False
    assert w[no_metrics]["why"].startswith(f"not drainable: {no_metrics}/metrics has no sglang:num_running_reqs")
    assert w[busy]["listed"] is False and w[busy]["healthy_in_router"] is None and w[busy]["ids"] == []
    assert (w[busy]["serving"], w[busy]["drainable"]) == (False, False)
    assert (
        w[busy]["why"]
        == f"not serving: {busy}/health answered HTTP 503; not drainable: {busy}/metrics answered HTTP 503"
    )
    assert w[gone]["listed"] is True and w[gone]["healthy_in_router"] is False
    # Down already: refused, as a replica out before the rollout begins would put it past --max-unavailable.
    assert w[gone]["drainable"] is False
    assert w[gone]["why"] == "not serving: connection refused; not drainable: connection refused"
    lists = ", ".join(x["url"] for x in fast(url).workers())
    assert out["problems"] == [
        f"{no_metrics}: cannot be drained on evidence: {no_metrics}/metrics has no sglang:num_running_reqs nor "
        "sglang:num_queue_reqs (SGLang serves /metrics and its load gauges only with --enable-metrics)",
        f"{busy}: not listed by the router {url} (it lists: {lists}{ra.SENTINEL_HINT})",
        f"{busy}: cannot be drained on evidence: {busy}/metrics answered HTTP 503",
        f"{gone}: cannot be drained on evidence: connection refused",
    ]
    assert [m for m, _ in state.requests] == ["GET", "GET"]  # it only read the router


def test_inspect_reads_a_metrics_that_says_nothing_again_before_calling_it_undrainable(fake_router, fake_worker):
    """A 503 or a timeout under load is read again for retry_s: a busy moment is not a refusal, a /metrics that
    never answers is; a 404 (no --enable-metrics) is refused on its first read, never read again."""
    state, url = fake_router
    script, worker = fake_worker
    state.add_now(worker)
    script[:] = [("status", 503), ("slow", 0.3), (2.0, 1.0)]  # busy twice (the second past the read timeout)
    out = ra.inspect(fast(url), [worker], timeout=0.1, retry_s=5, poll=0.01)
    assert out["problems"] == [] and out["workers"][0]["drainable"] is True, out
    script[:] = [("status", 503)]
    out = ra.inspect(fast(url), [worker], timeout=0.1, retry_s=0.2, poll=0.01)
    assert out["problems"] == [f"{worker}: cannot be drained on evidence: {worker}/metrics answered HTTP 503"]
    script[:] = [("status", 404), (0.0, 0.0)]
    out = ra.inspect(fast(url), [worker], timeout=0.1, retry_s=5, poll=0.01)
    assert out["workers"][0]["drainable"] is False and "HTTP 404" in out["problems"][0]


# --------------------------------------------------------------------------- a gateway's bad day (review)


@pytest.mark.parametrize("impl", ["sglang-router", "smg"])
def test_a_delete_answered_404_is_checked_against_the_listing_not_taken_as_removed(impl):
    """The gateway restarts between remove's listing and its DELETE (or re-registers the worker: smg's discovery
    lists one that came back under a new id): the DELETE of the listed id is 404, while the gateway lists the
    worker again, in rotation, under a new id. "Removed meanwhile" must be checked, never assumed: else the
    module says nothing was removed, skips wait_gone, drains, and the rollout stops a worker the gateway still
    routes to."""
    state = FakeRouterState(smg=impl == "smg")
    srv, url = serve(fake_router_handler(state))
    try:
        old = state.add_now("http://10.0.0.1:30000")
        r = rt.Router(url, api_key="k", poll=0.01, impl=impl)
        real = r.workers
        renamed = []

        def restarted_after_the_first_listing():
            listing = real()
            if not renamed:  # the restart: every worker registered again, under a new id
                state.workers.clear()
                renamed.append(state.add_now("http://10.0.0.1:30000"))
            return listing

        r.workers = restarted_after_the_first_listing
        ids = r.remove("http://10.0.0.1:30000")
        assert ("DELETE", f"/workers/{old}") in state.requests  # the 404
        assert ids == renamed  # the record in rotation now is removed, not left there
        r.workers = real
        assert r.wait_gone("http://10.0.0.1:30000", timeout=5) >= 0
    finally:
        srv.shutdown()


def test_smg_add_waiting_out_a_draining_record_takes_the_worker_listed_again_as_there(fake_smg):
    """add waits out a `draining` record before posting; meanwhile the gateway may list the worker again, in
    rotation under a new id (smg restarted and registered its --worker-urls, or its discovery re-added it). That
    is "already there", at once: waiting until the worker is listed under no spelling never ends, and the put-back
    fails at its timeout with the worker serving."""
    state, url = fake_smg
    old = state.add_now("http://10.0.0.1:30000")
    r = smg(url)
    assert r.remove("http://10.0.0.1:30000") == [old]
    state.pending[:] = [[2, "add", "http://10.0.0.1:30000"], [3, "healthy", "http://10.0.0.1:30000"]]
    posts = state.requests.count(("POST", "/workers"))
    wid, added = r.add("http://10.0.0.1:30000", timeout=2)
    new = state.workers["http://10.0.0.1:30000"]["id"]
    assert (wid, added) == (new, False) and new != old
    assert state.requests.count(("POST", "/workers")) == posts  # nothing posted: smg would answer 409


def test_a_gateway_other_than_impl_names_is_refused_not_misread(fake_router, fake_smg):
    """impl names one gateway, another runs (the playbooks pass no impl: the default, sglang-router). Their
    listings tell them apart (docs/router.md: smg lists every worker with `status`, 0.3.2 none): read as the other's,
    smg's answers mislead. With the default against smg, add posts the worker without its key: smg registers it
    keyless, a keyed worker refuses it, it is never listed, and that registration runs on (smg answers the next
    POST 409 WORKER_CREATE_IN_PROGRESS): the worker stays out. With impl=smg against 0.3.2, 0.3.2's `load` (0 with
    requests running) is reported as the gateway's in-flight count."""
    state, url = fake_smg
    state.add_now("http://10.0.0.1:30000", load=2)
    wrong = rt.Router(url, api_key="k", poll=0.01)  # the default impl, smg running
    with pytest.raises(rt.RouterError, match=r"status.*sglang-router 0\.3\.2.*impl"):
        wrong.workers()
    with pytest.raises(rt.RouterError, match="impl"):
        wrong.add("http://10.0.0.2:30000")
    assert ("POST", "/workers") not in state.requests  # nothing posted without the key
    state32, url32 = fake_router
    state32.add_now("http://127.0.0.1:30000")
    state32.workers["http://127.0.0.1:30000"]["load"] = 0  # 0.3.2's load: 0 with requests running
    with pytest.raises(rt.RouterError, match=r"status.*smg 1\.13\.0.*impl"):
        smg(url32).workers()
    assert wl._gateway_count(smg(url32).reader("http://127.0.0.1:30000")) is None  # no count, not 0


def test_a_gateway_count_that_cannot_be_read_never_kills_the_drain(fake_smg, fake_worker):
    """The gateway's count is evidence only ("never a failure"): a listing the count cannot be read from (a `status`
    that is no string, a `load` beyond a float) gives no count; the drain goes on, on the worker's own gauges. And
    a record whose `status` is no string is not taken for a leaving one, nor does it crash the listing."""
    state, url = fake_smg
    _, worker = fake_worker
    state.add_now(worker, load=1)
    r = smg(url)
    state.workers[worker]["status"] = {"state": "draining"}  # not smg 1.13.0's string
    assert [w["healthy"] for w in r.workers()] == [True]
    out = fake_drain(worker, timeout=60, gateway_in_flight=r.reader(worker))
    assert out["drained"] is True and out["gateway_in_flight"] == 1.0
    state.workers[worker].update(status="ready", load=10**400)  # a JSON integer no float holds
    out = fake_drain(worker, timeout=60, gateway_in_flight=r.reader(worker))
    assert out["drained"] is True and out["gateway_in_flight"] is None


def test_smg_a_409_that_names_nothing_listed_is_an_error_carrying_its_message(fake_smg):
    """A 409 is "already there" when the gateway lists the worker again, names its id, or says its addition runs
    (WORKER_CREATE_IN_PROGRESS: the wait that follows sees it listed). One that does none of these (a body that
    cannot be parsed, another code) is no evidence the worker is there: "not added" hid it, and the add failed a
    whole timeout later, "not listed", the gateway's answer lost."""
    state, url = fake_smg
    r = smg(url)
    real_call = r._call

    def conflict(method, path, body=None):
        if method == "POST":
            state.requests.append((method, path))
            return 409, {"raw": "<html>409 Conflict: upstream admission said no</html>"}
        return real_call(method, path, body)

    r._call = conflict
    with pytest.raises(rt.RouterError, match=r"HTTP 409: .*upstream admission said no"):
        r.add("http://10.0.0.9:30000")
    state.adding.add("http://10.0.0.2:30000")  # an addition that runs: still "not added", no error
    assert smg(url).add("http://10.0.0.2:30000") == ("", False)


# --------------------------------------------------------------------------- the real sglang-router

ROUTER_VERSION = "0.3.2"


def router_python() -> Path:
    """The pinned router's interpreter: $SGD_ROUTER_VENV, else a virtualenv made once under the controller's
    cache, from the wheel set the router role fetched (no index), else from the package index."""
    if os.environ.get("SGD_ROUTER_VENV"):
        return Path(os.environ["SGD_ROUTER_VENV"]) / "bin" / "python"
    sets = sorted(WHEELHOUSE.glob(f"sglang-router-{ROUTER_VERSION}-*/wheels"))
    key = hashlib.sha256(str(sets[-1] if sets else "index").encode()).hexdigest()[:12]
    venv = Path.home() / ".cache" / "sglang-deploy" / f"test-router-{ROUTER_VERSION}-{key}"
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        src = ["--no-index", "--find-links", str(sets[-1])] if sets else []
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *src, f"sglang-router=={ROUTER_VERSION}"],
            check=True,
            capture_output=True,
        )
        (venv / ".complete").touch()
    return python


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


@pytest.fixture(scope="module")
def real_router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    key = "router-test-key"
    procs = []
    workers = []
    try:
        for _ in range(2):
            port = free_port()
            env = {**os.environ, "PYTHONPATH": str(REPO / "lab" / "standin")}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", STANDIN, str(port), key, "20"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                )
            )
            workers.append(f"http://127.0.0.1:{port}")
        for w in workers:
            wait_until(lambda w=w: http.healthy(w), 20, f"{w} healthy")
        port = free_port()
        log = open(tmp / "router.log", "w")  # noqa: SIM115 (closed with the process)
        cmd = [str(router_python()), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
        metrics_port = free_port()
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        cmd += ["--policy", "round_robin", "--health-check-interval-secs", "1", "--api-key", key]
        cmd += ["--worker-urls", *workers]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        r = rt.Router(f"http://127.0.0.1:{port}", api_key=key, poll=0.05)
        r.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # (the tests of the gateway's own series)

        def listed():
            try:
                return len([w for w in r.workers() if w["healthy"]]) == 2
            except (rt.RouterError, http.HttpError):
                return False

        wait_until(listed, 60, f"the router lists both workers healthy ({tmp / 'router.log'})")
        yield r, workers, key
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


def test_real_router_remove_drain_add(real_router):
    r, (w1, w2), key = real_router
    assert {w["url"] for w in r.membership()} == {w1, w2}
    assert all(len(w["id"]) == 36 for w in r.membership())  # UUIDs

    # A 3 s generation (60 tokens at 20 tok/s) on each worker through the router (round robin), then w1 out.
    results = []

    def generate():
        try:
            results.append(http.generate(r.url, "drain me", 60, api_key=key))
        except http.HttpError as exc:
            results.append(exc)

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: wl.running_requests(w1) == 1, 10, "a request running on w1")

    ids = r.remove(w1)
    assert len(ids) == 1 and r.wait_gone(w1, timeout=5) < 5
    assert {w["url"] for w in r.membership()} == {w2}
    assert wl.running_requests(w1) == 1  # removal neither waited for nor cut the request in flight

    out = wl.drain(w1, timeout=30, poll=0.1)
    assert out["drained"] and out["running"] == 0.0 and out["queued"] == 0.0 and out["seconds"] >= 1.0, out
    for t in threads:
        t.join(30)
    assert len(results) == 2 and all(isinstance(x, dict) and x["completion_tokens"] == 60 for x in results), results

    # While out: requests go to w2 only.
    before = wl.running_requests(w1)
    assert http.generate(r.url, "only w2", 4, api_key=key)["completion_tokens"] == 4
    assert before == 0 and r.remove(w1, missing_ok=True) == []
    with pytest.raises(rt.RouterError, match=f"does not list {w1} under any spelling; it lists: {w2}"):
        r.remove(w1)

    assert r.add(w1)[1] is True
    assert r.wait_healthy(w1, timeout=30) < 30
    assert {w["url"]: w["healthy"] for w in r.membership()} == {w1: True, w2: True}


def test_real_router_a_worker_registered_by_address_is_found_and_removed_by_name(real_router):
    """Issue #29 (b) against the real router: registered as 127.0.0.1, named localhost (or LOCALHOST, with a
    slash); posted a second time under the name, the router lists it twice, and both are removed."""
    r, (w1, w2), _ = real_router
    assert socket.getaddrinfo("localhost", None, proto=socket.IPPROTO_TCP)[0][4][0] == "127.0.0.1"  # /etc/hosts
    by_name = w1.replace("127.0.0.1", "localhost")
    [listed] = r.find(by_name)
    assert listed["url"] == w1 and r.find(w1.replace("http://127.0.0.1", "HTTP://LOCALHOST") + "/") == [listed]
    try:
        assert r.remove(by_name) == [listed["id"]]
        assert r.wait_gone(by_name, timeout=5) < 5 and {w["url"] for w in r.membership()} == {w2}

        # The router itself takes a second spelling as a second worker: the client's add does not post it ...
        assert r.add(w1)[1] is True and r.wait_healthy(w1, timeout=30) < 30
        assert r.add(by_name) == (r.find(w1)[0]["id"], False)
        # ... but one posted behind its back is listed twice (a duplicate registration): both are removed.
        code, doc = r._call("POST", "/workers", {"url": by_name})
        assert code == 202, doc
        wait_until(lambda: len(r.find(w1)) == 2, 10, f"the router lists {w1} twice")
        assert {w["url"] for w in r.membership()} == {w1, by_name, w2}
        assert len(r.remove(w1)) == 2 and r.wait_gone(by_name, timeout=5) < 5
        assert {w["url"] for w in r.membership()} == {w2}
    finally:
        if not r.find(w1):
            r.add(w1)
        r.wait_healthy(w1, timeout=30)
        for w in r.workers():
            if w["url"] == by_name:  # (an assertion above failed with the duplicate listed)
                r._call("DELETE", f"/workers/{w['id']}")
    wait_until(lambda: {w["url"]: w["healthy"] for w in r.membership()} == {w1: True, w2: True}, 10, "as before")


def test_real_router_shows_no_in_flight_count_for_a_worker(real_router):
    """docs/router.md "The two gateways": with a generation running on each worker (round_robin), 0.3.2's
    GET /workers `load` stays 0, and so does its smg_worker_requests_active where the series exists at all (it
    is set, to 0, when a worker is removed): per worker it keeps health and circuit state. smg 1.13.0 counts
    both (tests/test_gateway_smg.py)."""
    r, (w1, w2), key = real_router
    results = []

    def generate():
        results.append(http.generate(r.url, "load", 40, api_key=key))  # 2 s at 20 tok/s

    threads = [threading.Thread(target=generate) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: wl.running_requests(w1) == 1 and wl.running_requests(w2) == 1, 10, "one on each worker")
        assert {w["url"]: w["load"] for w in r.workers()} == {w1: 0, w2: 0}
        code, data = http.request(r.metrics_url)
        text = data.decode()
        assert code == 200 and "smg_worker_retries_total" not in text  # no series before a retry
        for w in (w1, w2):
            series = {
                line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if f'{{worker="{w}"}}' in line
            }
            assert (series["smg_worker_health"], series["smg_worker_cb_state"]) == (1.0, 0.0), series
            assert series.get("smg_worker_requests_active", 0.0) == 0.0, series
    finally:
        for t in threads:
            t.join(30)
    assert [x["completion_tokens"] for x in results] == [40, 40]


def test_real_router_refuses_the_client_without_its_key(real_router):
    r, _, _ = real_router
    with pytest.raises(rt.RouterError, match="HTTP 401"):
        rt.Router(r.url).workers()


def test_measure_is_the_verify_load_against_one_worker(real_router):
    _, (w1, _), key = real_router
    out = wl.measure(w1, "The capital of France is", 2, 10, api_key=key)  # the stand-in decodes 20 tok/s here
    assert out["requests"] == 2 and 10 <= out["tokens_per_s"] <= 20.5, out
    with pytest.raises(http.HttpError, match="HTTP 401"):
        wl.measure(w1, "x", 1, 1)  # the worker's key is needed


def test_streams_pass_whole_through_the_real_router_and_loadgen_judges_them(real_router):
    """The stand-in streams as SGLang does (SSE, [DONE]); the router passes it on; loadgen counts it whole."""
    from bench import loadgen

    r, _, key = real_router
    for kind in loadgen.KINDS:
        assert loadgen.one(r.url, key, kind, True, 12, 1, 30) == ("ok", ""), kind
        assert loadgen.one(r.url, key, kind, False, 12, 1, 30) == ("ok", ""), kind
    assert loadgen.one(r.url, None, "generate", True, 4, 1, 30)[0] == "failed"  # the router's key is needed


def test_loadgen_counts_a_stream_cut_short_as_truncated():
    from bench import loadgen

    class Cut(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"text": "lab", "meta_info": {"completion_tokens": 1}}\n\n')

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Cut)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        verdict, why = loadgen.one(f"http://127.0.0.1:{srv.server_port}", None, "generate", True, 8, 1, 10)
    finally:
        srv.shutdown()
    assert verdict == "truncated" and "without [DONE] after 1 chunks" in why


def test_the_standin_drains_on_sigterm_and_refuses_new_requests(tmp_path):
    """SGLang's SIGTERM handler (what the stand-in does): no new requests (503), the running ones finish."""
    s = lab_standin()
    args = type("A", (), {"model_path": "m", "served_model_name": None, "api_key": None, "enable_metrics": True})()
    args.speculative_algorithm = None
    state = s.State(args, [], s.Knobs({"LAB_STANDIN_TOKENS_PER_S": "20"}, args))
    state.ready = True
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (s.Handler,), {"state": state}))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        results = []
        t = threading.Thread(target=lambda: results.append(http.generate(url, "long", 20)))  # 1 s
        t.start()
        wait_until(lambda: wl.running_requests(url) == 1, 10, "one running request in the metrics")
        state.draining = True
        with pytest.raises(http.HttpError, match="503"):
            http.generate(url, "new", 1)
        t.join(10)
        assert results and results[0]["completion_tokens"] == 20
        assert wl.running_requests(url) == 0
    finally:
        srv.shutdown()


def test_worker_url_is_written_once_for_the_router_role_and_the_rollout():
    from ansible_collections.sglang.deploy.plugins.filter.sglang_config import FilterModule

    assert wu.worker_url("gpu-node-01.example.internal", 30000) == "http://gpu-node-01.example.internal:30000"
    assert wu.worker_url("fd00::12", "30001", "https") == "https://[fd00::12]:30001"
    assert wu.worker_url("[fd00::12]", 30001) == "http://[fd00::12]:30001"  # already bracketed: not twice
    assert FilterModule().filters()["sglang_worker_url"] is wu.worker_url


# --------------------------------------------------------------------------- the real smg 1.13.0


@pytest.fixture(scope="module")
def real_smg(tmp_path_factory):
    """smg in front of two stand-ins (--worker-urls), a third spare; every stand-in requires the key."""
    from support import smg as s

    venv = s.smg_venv()
    standins = s.Standins()
    gw = None
    try:
        w0, w1, _ = standins.urls
        gw = s.Gateway(venv, tmp_path_factory.mktemp("smg") / "smg.log", "--worker-urls", w0, w1)
        wait_until(lambda: s.all_ready(gw, w0, w1), 30, f"smg lists both workers ready ({gw.log})")
        yield rt.Router(gw.url, api_key=s.KEY, poll=0.05, impl="smg"), gw, standins
    finally:
        if gw is not None:  # killed: its SIGTERM keeps serving 5 s (docs/router.md), nothing to wait for here
            gw.proc.kill()
            gw.proc.wait()
        standins.stop()


def test_real_smg_lists_adds_with_the_key_and_takes_its_409_as_there(real_smg):
    r, _, standins = real_smg
    w0, w1, spare = standins.urls
    listed = r.membership()
    assert {w["url"]: (w["healthy"], w["status"]) for w in listed} == {w0: (True, "ready"), w1: (True, "ready")}
    assert all(len(w["id"]) == 36 for w in listed)

    posts = []
    real_call = r._call

    def spy(method, path, body=None):
        code, doc = real_call(method, path, body)
        if method == "POST":
            posts.append((sorted(body), code, doc.get("code")))
        return code, doc

    r._call = spy
    # The spare requires the key: listed healthy only because add posted it (smg lends a posted worker none).
    wid, added = r.add(spare)
    assert added and len(wid) == 36 and posts == [(["api_key", "url"], 202, None)]
    assert r.wait_healthy(spare, timeout=30) >= 0
    assert r.find(spare)[0]["id"] == wid and r.find(spare)[0]["status"] == "ready"
    assert r.add(spare) == (wid, False) and len(posts) == 1  # listed: not posted again

    # A race (listed by another client between the listing and the POST): smg's 409 is "already there".
    real_find = r.find
    calls = []

    def find_once_blind(u, resolver=None):
        calls.append(u)
        return [] if len(calls) == 1 else real_find(u, resolver)

    r.find = find_once_blind
    assert r.add(spare) == (wid, False)
    assert posts[-1] == (["api_key", "url"], 409, "WORKER_ALREADY_EXISTS")
    r.find = real_find
    assert r.in_flight(spare) == 0.0 and r.in_flight(f"http://127.0.0.1:{free_port()}") is None
    # out again for the next test (draining, out of rotation at once: round robin over w0 and w1 only)
    assert r.remove(spare) == [wid] and r.wait_gone(spare, timeout=5) >= 0


def test_real_smg_remove_draining_then_gone_drain_beside_its_count_add_back(real_smg):
    from support.smg import KEY, TOKENS_PER_S, per_worker

    r, gw, standins = real_smg
    w0, w1, _ = standins.urls
    tokens = int(1.5 * TOKENS_PER_S)  # 1.5 s: ends well inside smg's 5 s settle window
    results = []

    def generate():
        results.append(http.generate(r.url, "drain me", tokens, api_key=KEY))

    threads = [threading.Thread(target=generate) for _ in range(2)]  # round robin: one on each
    for t in threads:
        t.start()
    try:
        wait_until(lambda: wl.running_requests(w0) == 1, 10, "a request running on w0")
        # The gateway's own count, in its listing and (the table's series) in its metrics.
        assert r.in_flight(w0) == 1.0
        assert per_worker(gw.metrics(), w0)["smg_worker_requests_active"] == 1.0
        [old] = r.remove(w0)
        assert r.wait_gone(w0, timeout=5) >= 0  # out of rotation: draining is enough
        [rec] = r.find(w0)
        assert (rec["id"], rec["status"], rec["healthy"]) == (old, "draining", False)
        assert r.remove(w0) == []  # already leaving: no second DELETE
        assert r.in_flight(w0) == 1.0  # its request runs on, still counted
        out = wl.drain(w0, timeout=30, poll=0.1, gateway_in_flight=r.reader(w0))
        assert out["drained"] and (out["running"], out["queued"]) == (0.0, 0.0), out
        assert out["gateway_in_flight"] in (0.0, None), out  # 0 while draining, None once smg dropped it
        for t in threads:
            t.join(30)
        assert [x["completion_tokens"] for x in results] == [tokens, tokens]

        # Until it leaves the listing (the settle time), then no count to read.
        states = []
        real_workers = r.workers

        def spy():
            listing = real_workers()
            states.append([w["status"] for w in r.matches(w0, listing)])
            return listing

        r.workers = spy
        assert r.wait_gone(w0, timeout=15, draining_ok=False) >= 0
        r.workers = real_workers
        assert states[-1] == [] and all(s == ["draining"] for s in states[:-1]), states
        assert r.in_flight(w0) is None and wl.running_requests(w0) == 0
        wid, added = r.add(w0)
        assert added and wid != old
        assert r.wait_healthy(w0, timeout=30) >= 0
    finally:
        for t in threads:
            t.join(30)
    wait_until(lambda: {w["url"]: w["status"] for w in r.membership()} == {w0: "ready", w1: "ready"}, 15, "as before")


def test_real_smg_add_waits_out_a_worker_still_draining(real_smg):
    """A worker put back at once (a rollout's rescue): smg lists it draining and refuses its URL (409) until its
    settle time ends; add lets it go first, then posts, and it comes back under a new id."""
    from support.smg import KEY

    r, _, standins = real_smg
    w0, w1, _ = standins.urls
    [old] = r.remove(w1)
    assert r.wait_gone(w1, timeout=5) >= 0 and r.find(w1)[0]["status"] == "draining"
    code, doc = r._call("POST", "/workers", {"url": w1, "api_key": KEY})  # what a post at once would get
    assert (code, doc.get("code")) == (409, "WORKER_ALREADY_EXISTS") and old in doc["error"], doc
    events = []
    real_call = r._call

    def spy(method, path, body=None):
        code, doc = real_call(method, path, body)
        if method == "GET":
            events.append(tuple(w["status"] for w in doc.get("workers", []) if w.get("url") == w1))
        else:
            events.append((method, code))
        return code, doc

    r._call = spy
    wid, added = r.add(w1, timeout=15)
    r._call = real_call
    assert added and wid != old
    assert events[0] == ("draining",) and events[-2:] == [(), ("POST", 202)], events  # draining, gone, posted
    assert r.wait_healthy(w1, timeout=30) >= 0
    assert {w["url"]: w["status"] for w in r.membership()} == {w0: "ready", w1: "ready"}
