"""module_utils/sglang_deploy/router.py: sglang-router 0.3.2's worker API and draining a worker.

Two kinds of test, both on loopback only:
- against a fake router and fake workers (small HTTP servers in this process), for every branch;
- against the REAL sglang-router 0.3.2 (its own virtualenv, made once from the controller's cached wheel set
  or the package index) in front of two lab stand-ins (lab/standin, its HTTP server run with the stdlib only):
  listing, removal by UUID, a generation in flight through the removed worker completing while drain watches
  it, adding back, the router's health.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sglang_deploy import http
from sglang_deploy import router as rt
from support import REPO, lab_standin


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
    listings later; an added worker is listed unhealthy first; the key is required."""

    def __init__(self, key: str | None = "k"):
        self.key = key
        self.workers: dict[str, dict] = {}
        self.pending: list[list] = []  # [listings left, action, url]
        self.requests: list[tuple[str, str]] = []
        self.next_id = 0

    def add_now(self, url: str, healthy: bool = True) -> str:
        self.next_id += 1
        wid = f"00000000-0000-4000-8000-{self.next_id:012d}"
        self.workers[url] = {"id": wid, "url": url, "is_healthy": healthy, "worker_type": "regular"}
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
                    self.add_now(url, healthy=False)
                elif action == "healthy" and url in self.workers:
                    self.workers[url]["is_healthy"] = True
        return {"workers": list(self.workers.values()), "total": len(self.workers), "stats": {}}


def serve(handler_cls) -> tuple[ThreadingHTTPServer, str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def fake_router():
    state = FakeRouterState()

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
            if "url" not in body:
                return self.reply(422, {"error": "missing field url"})
            if body["url"] in state.workers:
                return self.reply(202, {"status": "accepted", "worker_id": state.workers[body["url"]]["id"]})
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
            state.pending.append([2, "remove", url])
            self.reply(202, {"status": "accepted", "worker_id": wid})

    srv, url = serve(H)
    yield state, url
    srv.shutdown()


@pytest.fixture
def fake_worker():
    """A worker whose /metrics reports sglang:num_running_reqs from a script (one value per scrape, the last
    repeated); None in the script: the series is missing."""
    script: list = [0.0]

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            value = script.pop(0) if len(script) > 1 else script[0]
            lines = ['sglang:gen_throughput{model_name="m"} 1.0']
            if value is not None:
                # two data-parallel ranks: their sum is the worker's
                lines += [
                    f'sglang:num_running_reqs{{model_name="m",dp="0"}} {value}',
                    'sglang:num_running_reqs{dp="1"} 0',
                ]
            data = ("\n".join(lines) + "\n").encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv, url = serve(H)
    yield script, url
    srv.shutdown()


def fast(url: str, key: str | None = "k") -> rt.Router:
    return rt.Router(url, api_key=key, poll=0.01)


def test_lists_finds_and_removes_by_uuid_never_by_url(fake_router):
    state, url = fake_router
    wid = state.add_now("http://10.0.0.1:30000")
    state.add_now("http://10.0.0.2:30000")
    r = fast(url)
    assert [w["url"] for w in r.workers()] == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert r.find("http://10.0.0.1:30000/")["id"] == wid  # a trailing slash is the same worker
    assert r.remove("http://10.0.0.1:30000") == wid
    assert ("DELETE", f"/workers/{wid}") in state.requests
    assert r.wait_gone("http://10.0.0.1:30000", timeout=5) >= 0
    assert [w["url"] for w in r.membership()] == ["http://10.0.0.2:30000"]
    assert r.remove("http://10.0.0.1:30000") is None  # not listed: nothing to do


def test_add_then_wait_until_listed_and_healthy(fake_router):
    state, url = fake_router
    r = fast(url)
    assert r.add("http://10.0.0.3:30000") == "queued"
    seen = []
    orig = r.find

    def spy(u):
        w = orig(u)
        seen.append(None if w is None else w["healthy"])
        return w

    r.find = spy
    r.wait_healthy("http://10.0.0.3:30000", timeout=5)
    assert seen[0] is None and False in seen and seen[-1] is True  # not listed, listed unhealthy, healthy
    # a URL already registered answers with its id
    assert r.add("http://10.0.0.3:30000") == state.workers["http://10.0.0.3:30000"]["id"]


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(http.HttpError):
        rt.Router(f"http://127.0.0.1:{port}", timeout=2).workers()


def test_drain_waits_until_no_running_requests(fake_worker):
    script, url = fake_worker
    script[:] = [3.0, 0.0, 2.0, 0.0, 0.0]
    clock = FakeClock()
    out = rt.drain(url, timeout=60, poll=0.5, clock=clock, sleep=clock.sleep)
    # drained at the second 0 in a row, 0.5 s after the first (a request sent just before the removal may be
    # on its way at the first)
    assert out == {"drained": True, "seconds": 2.0, "running": 0.0, "why": "no running requests"}
    # Polled faster, the zeros must still last settle_s: 0 at 1.0 and 1.1 is not yet drained, at 1.2 it is.
    script[:] = [1.0] * 10 + [0.0]
    clock = FakeClock()
    out = rt.drain(url, timeout=60, poll=0.1, clock=clock, sleep=clock.sleep)
    assert out["drained"] is True and out["seconds"] == pytest.approx(1.2), out
    script[:] = [1.0] * 10 + [0.0]
    clock = FakeClock()
    out = rt.drain(url, timeout=60, poll=0.1, clock=clock, sleep=clock.sleep, settle_s=0.5)
    assert out["drained"] is True and out["seconds"] == pytest.approx(1.5), out


def test_drain_stops_at_its_timeout_with_requests_still_running(fake_worker):
    script, url = fake_worker
    script[:] = [2.0]
    clock = FakeClock()
    out = rt.drain(url, timeout=3, poll=1.0, clock=clock, sleep=clock.sleep)
    assert out["drained"] is False and out["running"] == 2.0
    assert out["why"] == "drain timeout (3 s): 2 running requests" and out["seconds"] == 3.0


def test_drain_without_the_metric_waits_out_the_timeout(fake_worker):
    script, url = fake_worker
    script[:] = [None]
    clock = FakeClock()
    out = rt.drain(url, timeout=2, poll=1.0, clock=clock, sleep=clock.sleep)
    assert out["drained"] is False and out["running"] is None
    assert "has no sglang:num_running_reqs (SGLang's enable_metrics is off)" in out["why"]


def test_drain_of_a_worker_that_does_not_answer_is_immediate():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = rt.drain(f"http://127.0.0.1:{port}", timeout=30)
    assert out["drained"] is True and out["why"].startswith("not serving")


def test_metric_sum_adds_every_label_set():
    text = 'x{a="1"} 2\nx{a="2"} 3.5\nx_total 9\n# x 4\n'
    assert rt.metric_sum(text, "x") == 5.5
    assert rt.metric_sum(text, "y") is None


# --------------------------------------------------------------------------- the real sglang-router

ROUTER_VERSION = "0.3.2"
WHEELHOUSE = Path.home() / ".cache" / "sglang-deploy" / "wheelhouse"

# The lab stand-in's HTTP server (lab/standin/lab_sglang_standin.py: State, Handler) on a loopback port, stdlib
# only (no SGLang parser, no simulated GPUs): it counts its running requests into sglang:num_running_reqs and
# streams as SGLang does.
STANDIN = r"""
import argparse, sys
from http.server import ThreadingHTTPServer
import lab_sglang_standin as s

port, key, tps = int(sys.argv[1]), sys.argv[2], sys.argv[3]
args = argparse.Namespace(model_path="/srv/models/lab-target", served_model_name=None, api_key=key,
                          speculative_algorithm=None)
state = s.State(args, [], s.Knobs({"LAB_STANDIN_TOKENS_PER_S": tps}, args))
state.ready = True
srv = ThreadingHTTPServer(("127.0.0.1", port), type("H", (s.Handler,), {"state": state}))
srv.daemon_threads = True
print("serving", flush=True)
srv.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        cmd += ["--policy", "round_robin", "--health-check-interval-secs", "1", "--api-key", key]
        cmd += ["--worker-urls", *workers]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        r = rt.Router(f"http://127.0.0.1:{port}", api_key=key, poll=0.05)

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
    wait_until(lambda: rt.running_requests(w1) == 1, 10, "a request running on w1")

    wid = r.remove(w1)
    assert wid and r.wait_gone(w1, timeout=5) < 5
    assert {w["url"] for w in r.membership()} == {w2}
    assert rt.running_requests(w1) == 1  # removal neither waited for nor cut the request in flight

    out = rt.drain(w1, timeout=30, poll=0.1)
    assert out["drained"] and out["running"] == 0.0 and out["seconds"] >= 1.0, out
    for t in threads:
        t.join(30)
    assert len(results) == 2 and all(isinstance(x, dict) and x["completion_tokens"] == 60 for x in results), results

    # While out: requests go to w2 only.
    before = rt.running_requests(w1)
    assert http.generate(r.url, "only w2", 4, api_key=key)["completion_tokens"] == 4
    assert before == 0 and r.remove(w1) is None

    r.add(w1)
    assert r.wait_healthy(w1, timeout=30) < 30
    assert {w["url"]: w["healthy"] for w in r.membership()} == {w1: True, w2: True}


def test_real_router_refuses_the_client_without_its_key(real_router):
    r, _, _ = real_router
    with pytest.raises(rt.RouterError, match="HTTP 401"):
        rt.Router(r.url).workers()


def test_measure_is_the_verify_load_against_one_worker(real_router):
    _, (w1, _), key = real_router
    out = rt.measure(w1, "The capital of France is", 2, 10, api_key=key)  # the stand-in decodes 20 tok/s here
    assert out["requests"] == 2 and 10 <= out["tokens_per_s"] <= 20.5, out
    with pytest.raises(http.HttpError, match="HTTP 401"):
        rt.measure(w1, "x", 1, 1)  # the worker's key is needed


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
    args = type("A", (), {"model_path": "m", "served_model_name": None, "api_key": None})()
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
        wait_until(lambda: rt.running_requests(url) == 1, 10, "one running request in the metrics")
        state.draining = True
        with pytest.raises(http.HttpError, match="503"):
            http.generate(url, "new", 1)
        t.join(10)
        assert results and results[0]["completion_tokens"] == 20
        assert rt.running_requests(url) == 0
    finally:
        srv.shutdown()


def test_worker_url_is_written_once_for_the_router_role_and_the_rollout():
    from filter_plugins.sglang_config import FilterModule

    assert rt.worker_url("gpu-node-01.example.internal", 30000) == "http://gpu-node-01.example.internal:30000"
    assert rt.worker_url("fd00::12", "30001", "https") == "https://[fd00::12]:30001"
    assert rt.worker_url("[fd00::12]", 30001) == "http://[fd00::12]:30001"  # already bracketed: not twice
    assert FilterModule().filters()["sglang_worker_url"] is rt.worker_url
