"""smg 1.13.0, the Shepherd Model Gateway (PyPI `smg`): the facts docs/router.md's "The two gateways" states,
each checked here against the REAL binary (its own virtualenv, made once like the sglang-router one in
tests/test_router_client.py) on loopback, in front of lab stand-ins (lab/standin, stdlib only; the gateway, the
stand-ins and the readers are tests/support/smg.py's, which router.py's client tests use too):

- its command line as its own parser reads it (defaults of the flags the rollout will set, what it lacks);
- the worker API (`POST /workers` 202, the listing, `GET|DELETE /workers/{id}`, 400/404/409), and the key;
- the Prometheus endpoint and the per-worker series (what they are named, what they carry, when they go);
- removal: `draining` for drain_settle_secs (5 s), then gone, while a generation in flight runs on;
- the discovery file: its format, a change picked up, a bad one ignored, removal and re-admission by it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import urllib.parse
import uuid
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_load as wl
from support import wait_for
from support.smg import (
    KEY,
    MODEL,
    SMG_VERSION,
    TOKENS_PER_S,
    Gateway,
    all_ready,
    call,
    free_port,
    per_worker,
    smg_venv,
)


@pytest.fixture(scope="module")
def venv() -> Path:
    return smg_venv()


@pytest.fixture(scope="module")
def gateway(venv, standins, tmp_path_factory):
    """smg in front of the first two stand-ins, named on its command line (--worker-urls)."""
    w0, w1, _ = standins.urls
    gw = Gateway(venv, tmp_path_factory.mktemp("smg") / "smg.log", "--worker-urls", w0, w1)
    try:
        wait_for(f"smg lists both workers healthy ({gw.log})", lambda: all_ready(gw, w0, w1), timeout=30, interval=0.1)
        yield gw
    finally:
        gw.stop()


# --------------------------------------------------------------------------- the command line


PARSED = r"""
import json, sys
from smg.launch_router import parse_router_args
a = parse_router_args(sys.argv[1:])
print(json.dumps(vars(a)))
"""


def parsed(venv: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", PARSED, *argv], capture_output=True, text=True, env=env, timeout=60
    )


def test_smg_command_line_defaults_as_its_own_parser_reads_them(venv):
    version = subprocess.run([str(venv / "bin" / "smg"), "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"smg {SMG_VERSION}"
    # No variable supplies the key (router_args.py reads none for it): --api-key only, as with 0.3.2.
    env = {**os.environ, "SMG_API_KEY": "x", "SGLANG_ROUTER_API_KEY": "x", "API_KEY": "x", "OPENAI_API_KEY": "x"}
    out = parsed(venv, env=env)
    assert out.returncode == 0, out.stderr
    a = json.loads(out.stdout)
    assert a["api_key"] is None
    assert (a["host"], a["port"], a["prometheus_port"], a["prometheus_host"]) == ("0.0.0.0", 30000, 29000, None)
    assert a["policy"] == "cache_aware"
    assert (a["health_check_interval_secs"], a["health_failure_threshold"], a["health_success_threshold"]) == (60, 3, 2)
    assert (a["health_check_timeout_secs"], a["health_check_endpoint"]) == (5, "/health")
    assert a["remove_unhealthy_workers"] is None  # follows discovery: on with a discovery provider, else off
    assert (a["worker_stall_secs"], a["worker_wedge_secs"], a["worker_stale_secs"]) == (2, 3, 15)
    warmup = ("secs", "share", "blocks", "thin_ratio", "divert_every")
    assert [a[f"worker_warmup_{k}"] for k in warmup] == [60, 0.25, 1024, 0.5, 8]
    assert (a["shutdown_grace_period_secs"], a["request_timeout_secs"], a["worker_startup_timeout_secs"]) == (
        180,
        1800,
        1800,
    )
    assert (a["retry_max_retries"], a["cb_failure_threshold"], a["cb_success_threshold"]) == (5, 10, 3)
    assert (a["enable_mesh"], a["mesh_port"], a["mesh_peer_urls"]) == (False, 39527, [])
    assert (a["discovery_provider"], a["discovery_file"], a["discovery_check_interval_secs"]) == (None, None, None)
    assert a["stream_body_stall_timeout_secs"] == 300

    # The policies --policy takes (argparse names them when refusing one).
    out = parsed(venv, "--policy", "least_loaded")
    assert out.returncode == 2
    choices = re.search(r"choose from (.*)\)", out.stderr).group(1)
    assert [c.strip(" '") for c in choices.split(",")] == [
        "random",
        "round_robin",
        "passthrough",
        "cache_aware",
        "power_of_two",
        "least_load",
        "manual",
        "consistent_hashing",
        "prefix_hash",
    ]
    # The drain settle time is no flag: the launcher leaves the core's 5 s (router_args.py's docstring).
    out = parsed(venv, "--drain-settle-secs", "30")
    assert out.returncode == 2 and "unrecognized arguments: --drain-settle-secs 30" in out.stderr
    out = parsed(venv, "--discovery-provider", "file", "--discovery-file", "/x.json", "--remove-unhealthy-workers")
    a = json.loads(out.stdout)
    assert (a["discovery_provider"], a["discovery_file"], a["remove_unhealthy_workers"]) == ("file", "/x.json", True)
    assert json.loads(parsed(venv, "--no-remove-unhealthy-workers").stdout)["remove_unhealthy_workers"] is False


# --------------------------------------------------------------------------- the worker API and the key


def test_smg_requires_the_key_on_the_worker_api_and_the_data_plane(gateway, standins):
    gw = gateway
    generate = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    for method, path, body in (("GET", "/workers", None), ("POST", "/workers", {"url": standins.urls[2]})):
        code, doc = call(method, gw.url + path, body, key=None)
        assert (code, doc["error"]["code"]) == (401, "invalid_api_key"), doc
    assert call("POST", f"{gw.url}/generate", generate, key=None)[0] == 401
    assert call("POST", f"{gw.url}/generate", generate, key="wrong")[0] == 401
    assert call("POST", f"{gw.url}/generate", generate)[0] == 200
    for path in ("/health", "/liveness", "/readiness", "/v1/models"):  # open without it
        assert call("GET", gw.url + path, key=None)[0] == 200, path
    assert call("GET", f"{gw.url}/readiness", key=None)[1] == {
        "status": "ready",
        "healthy_workers": 2,
        "total_workers": 2,
    }


def test_smg_routes_by_the_requests_model_where_sglang_router_and_sglang_take_any(gateway):
    """An operator's migration hazard (docs/router.md, "The two gateways"): SGLang 0.5.23 serves a request whatever
    its `model` (serving_base.py only splits a LoRA suffix), and so does sglang-router 0.3.2 in front of it; smg
    routes by it: a name no worker serves is 404 model_not_found, and /v1/completions without one is 400. /generate
    without a model goes to any worker."""
    gw = gateway
    completion = {"prompt": "x", "max_tokens": 2}
    code, doc = call("POST", f"{gw.url}/v1/completions", {**completion, "model": "default"})
    assert (code, doc["error"]["code"]) == (404, "model_not_found"), doc
    assert doc["error"]["message"] == "No worker available for model 'default'"
    code, doc = call("POST", f"{gw.url}/v1/completions", completion)
    assert code == 400 and "missing field `model`" in doc["error"]["message"], doc
    assert call("POST", f"{gw.url}/v1/completions", {**completion, "model": MODEL})[0] == 200
    generate = {"text": "x", "sampling_params": {"max_new_tokens": 2}}
    assert call("POST", f"{gw.url}/generate", {**generate, "model": "default"})[0] == 404
    assert call("POST", f"{gw.url}/generate", generate)[0] == 200


def test_smg_lists_workers_by_a_uuid7_with_status_and_health(gateway, standins):
    gw = gateway
    w0, w1, _ = standins.urls
    listed = gw.by_url()
    assert set(listed) == {w0, w1}
    code, doc = call("GET", f"{gw.url}/workers")
    assert set(doc) == {"workers", "total", "stats"} and doc["total"] == 2
    assert doc["stats"] == {"prefill_count": 0, "decode_count": 0, "regular_count": 2}
    w = listed[w0]
    assert uuid.UUID(w["id"]).version == 7 and len(w["id"]) == 36
    assert (w["status"], w["is_healthy"], w["worker_type"], w["connection_mode"], w["model_id"]) == (
        "ready",
        True,
        "regular",
        "http",
        MODEL,
    )
    assert {"load", "priority", "cost", "runtime_type", "labels", "models"} <= set(w) and "api_key" not in w
    code, one = call("GET", f"{gw.url}/workers/{w['id']}")
    assert code == 200 and one["url"] == w0 and one["id"] == w["id"] and one["status"] == "ready"

    code, doc = call("GET", f"{gw.url}/workers/00000000-0000-4000-8000-000000000000")
    assert (code, doc["code"]) == (404, "WORKER_NOT_FOUND")
    code, doc = call("DELETE", f"{gw.url}/workers/00000000-0000-4000-8000-000000000000")
    assert (code, doc["code"]) == (404, "WORKER_NOT_FOUND")
    code, doc = call("DELETE", f"{gw.url}/workers/{urllib.parse.quote(w0, safe='')}")  # by URL: refused
    assert (code, doc["code"]) == (400, "BAD_REQUEST") and "expected UUID" in doc["error"]
    # 0.3.2 answers an existing URL 202 with its id, and a missing url 422: smg 409 and 400.
    code, doc = call("POST", f"{gw.url}/workers", {"url": w1, "api_key": KEY})
    assert (code, doc["code"]) == (409, "WORKER_ALREADY_EXISTS") and listed[w1]["id"] in doc["error"]
    code, doc = call("POST", f"{gw.url}/workers", {})
    assert (code, doc["code"]) == (400, "BAD_REQUEST") and "missing field `url`" in doc["error"]
    for method, path in (("GET", "/list_workers"), ("POST", "/add_worker"), ("POST", "/remove_worker")):
        assert call(method, gw.url + path)[0] == 404, path
    assert set(gw.by_url()) == {w0, w1}  # nothing above changed the list


def test_smg_does_not_lend_its_key_to_a_worker_posted_without_one(gateway, standins):
    """--api-key reaches the workers of --worker-urls and of discovery; a POST /workers without "api_key" gets
    none: its registration is refused 401 by a keyed worker and retried, and it is never listed. A DELETE
    does not stop that registration: 202, then its removal job fails, "not found" (nothing registered)."""
    gw = gateway
    spare = standins.urls[2]
    code, doc = call("POST", f"{gw.url}/workers", {"url": spare})
    assert code == 202, doc
    wid = doc["worker_id"]
    wait_for(
        "the registration refused by the worker",
        lambda: f"{spare}/v1/models returned status 401 Unauthorized" in gw.text(),
        timeout=15,
        interval=0.1,
    )
    assert f"Adding worker {spare} without API key while router has API key configured" in gw.text()
    code, one = call("GET", f"{gw.url}/workers/{wid}")
    assert code == 200 and (one["status"], one["is_healthy"]) == ("pending", False)
    assert one["job_status"]["job_type"] == "AddWorker"
    assert spare not in gw.by_url()  # the listing holds registered workers only
    code, doc = call("POST", f"{gw.url}/workers", {"url": spare, "api_key": KEY})
    assert (code, doc["code"]) == (409, "WORKER_CREATE_IN_PROGRESS"), doc

    code, doc = call("DELETE", f"{gw.url}/workers/{wid}")
    assert code == 202, doc

    def removal_failed():
        job = call("GET", f"{gw.url}/workers/{wid}")[1].get("job_status") or {}
        return job.get("job_type") == "RemoveWorker" and job.get("status") == "failed" and job

    job = wait_for("the removal job's end", removal_failed, timeout=10, interval=0.05)
    assert f"Worker {spare} not found" in job["message"]
    assert call("GET", f"{gw.url}/workers/{wid}")[1]["status"] == "pending" and spare not in gw.by_url()


def test_smg_metrics_per_worker_on_the_prometheus_port(gateway, standins):
    """Per-worker series carry a `worker` label, the worker's URL; a gauge appears once smg has routed to it."""
    gw = gateway
    w0, w1, _ = standins.urls
    before = {w: per_worker(gw.metrics(), w).get("smg_worker_requests_total", 0.0) for w in (w0, w1)}
    http.generate(gw.url, "count me", 2, api_key=KEY)
    http.generate(gw.url, "count me", 2, api_key=KEY)  # round robin: one on each
    text = gw.metrics()
    for w in (w0, w1):
        series = per_worker(text, w)
        assert series["smg_worker_requests_total"] == before[w] + 1, series
        assert (series["smg_worker_requests_active"], series["smg_worker_health"]) == (0.0, 1.0)  # idle, healthy
        assert (series["smg_worker_cb_state"], series["smg_worker_cb_consecutive_failures"]) == (0.0, 0.0)  # closed
        # smg_worker_cb_transitions_total only once the breaker has changed state (present or not, by test order)
        assert "smg_worker_cb_consecutive_successes" in set(series)
    # Retries are counted per worker type and endpoint, not per worker.
    retries = [line for line in text.splitlines() if line.startswith("smg_worker_retries_total{")]
    assert retries and all("worker=" not in line for line in retries)
    assert 'smg_worker_retries_total{worker_type="regular",endpoint="generate"} 0' in text
    assert "smg_worker_stalled" not in text  # named in the binary; no series on a gateway that saw no stall
    assert call("GET", f"{gw.url}/metrics")[0] == 404  # only on --prometheus-port


def test_smg_removal_drains_for_five_seconds_and_lets_the_request_in_flight_run_on(gateway, standins):
    """DELETE /workers/{id}: the worker is `draining` (out of rotation, is_healthy false) for drain_settle_secs,
    5 s, then gone with its metrics, whatever is still in flight on it; that request completes."""
    gw = gateway
    w0, w1, _ = standins.urls
    wid = gw.by_url()[w0]["id"]
    tokens = 8 * TOKENS_PER_S  # 8 s, past the 5 s settle window
    results = []

    def generate():
        try:
            results.append(http.generate(gw.url, "drain me", tokens, api_key=KEY))
        except http.HttpError as exc:
            results.append(exc)

    threads = [threading.Thread(target=generate) for _ in range(2)]  # round robin: one on each worker
    for t in threads:
        t.start()
    try:
        wait_for("a request running on w0", lambda: wl.running_requests(w0) == 1, timeout=10)
        assert per_worker(gw.metrics(), w0)["smg_worker_requests_active"] == 1.0
        assert gw.by_url()[w0]["load"] == 1  # the listing's load is its in-flight count (0.3.2's stays 0)
        code, doc = call("DELETE", f"{gw.url}/workers/{wid}")
        assert code == 202 and doc == {
            "status": "accepted",
            "worker_id": wid,
            "message": "Worker removal queued for background processing",
        }
        wait_for("w0 draining", lambda: gw.by_url()[w0]["status"] == "draining", timeout=2)
        assert gw.by_url()[w0]["is_healthy"] is False and gw.by_url()[w1]["status"] == "ready"
        series = per_worker(gw.metrics(), w0)
        assert (series["smg_worker_health"], series["smg_worker_requests_active"]) == (0.0, 1.0)
        before = per_worker(gw.metrics(), w1)["smg_worker_requests_total"]
        http.generate(gw.url, "not to w0", 2, api_key=KEY)
        assert per_worker(gw.metrics(), w1)["smg_worker_requests_total"] == before + 1  # w0 is out of rotation

        wait_for("w0 gone from the listing", lambda: w0 not in gw.by_url(), timeout=12, interval=0.05)
        assert wl.running_requests(w0) == 1  # its request still runs: the removal did not wait for it
        assert call("GET", f"{gw.url}/workers/{wid}")[0] == 404
        assert per_worker(gw.metrics(), w0) == {}  # and its series are gone: no in-flight count to read
        for t in threads:
            t.join(30)
        assert [r["completion_tokens"] for r in results] == [tokens, tokens], results
    finally:
        for t in threads:
            t.join(30)
        if w0 not in gw.by_url():
            code, doc = call("POST", f"{gw.url}/workers", {"url": w0, "api_key": KEY})
            assert code == 202 and set(doc) == {"status", "worker_id", "url", "location", "message"}, doc
            assert (doc["status"], doc["url"], doc["location"]) == ("accepted", w0, f"/workers/{doc['worker_id']}")
        wait_for("w0 back, ready", lambda: all_ready(gw, w0, w1), timeout=30, interval=0.1)


# --------------------------------------------------------------------------- the discovery file


def manifest(path: Path, workers: list[dict], version: int = 1) -> None:
    """Written whole and renamed into place, as the role will (smg reads it on the change)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": version, "workers": workers}))
    os.replace(tmp, path)


def test_smg_discovery_file(venv, standins, tmp_path):
    w0, w1, spare = standins.urls
    path = tmp_path / "workers.json"
    manifest(path, [{"url": w0}])
    flags = ["--discovery-provider", "file", "--discovery-file", str(path), "--discovery-check-interval-secs", "2"]
    gw = Gateway(venv, tmp_path / "smg.log", *flags, "--health-failure-threshold", "2")
    try:
        wait_for(f"smg lists w0 from the file ({gw.log})", lambda: all_ready(gw, w0), timeout=30, interval=0.1)
        # Its workers get the gateway's key (the stand-ins require it on /v1/models), and a label.
        assert gw.by_url()[w0]["labels"]["smg.ai/discovery-provider"] == "file"
        # A discovery provider turns IGW (multi-model) mode on: /generate must name the model.
        code, doc = call("POST", f"{gw.url}/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
        assert (code, doc["error"]["code"]) == (400, "missing_model"), doc
        body = {"text": "x", "model": MODEL, "sampling_params": {"max_new_tokens": 2}}
        assert call("POST", f"{gw.url}/generate", body)[0] == 200

        manifest(path, [{"url": w0}, {"url": w1}])
        wait_for("w1 added from the file", lambda: all_ready(gw, w0, w1), timeout=10, interval=0.05)

        # A manifest smg cannot read is logged and ignored: the last good one stands.
        keys = "`id`, `url`, `worker_type`, `bootstrap_port`, `model_id`, `kv_connector`, `kv_role`, `kv_engine_id`"
        manifest(path, [{"url": w0, "weight": 1}])
        refused = f"unknown field `weight`, expected one of {keys}"
        wait_for("the unknown field refused", lambda: refused in gw.text(), timeout=10)
        manifest(path, [{"url": w0}], version=2)
        refused = "unsupported version 2; this gateway reads version 1"
        wait_for("version 2 refused", lambda: refused in gw.text(), timeout=10)
        assert "keeping the last good manifest" in gw.text() and set(gw.by_url()) == {w0, w1}

        # Dropped from the file: drained like a DELETE, then gone.
        manifest(path, [{"url": w0}])
        wait_for("w1 draining", lambda: gw.by_url().get(w1, {}).get("status") == "draining", timeout=5, interval=0.05)
        wait_for("w1 gone", lambda: set(gw.by_url()) == {w0}, timeout=12, interval=0.1)

        # Under discovery remove_unhealthy_workers is on: a dead worker goes; back, it is re-added (a new id).
        manifest(path, [{"url": w0}, {"url": spare}])
        wait_for("spare added", lambda: all_ready(gw, w0, spare), timeout=10, interval=0.05)
        old = gw.by_url()[spare]["id"]
        standins.kill(2)
        wait_for("spare not ready", lambda: gw.by_url().get(spare, {}).get("status") == "not_ready", timeout=10)
        wait_for("spare removed", lambda: spare not in gw.by_url(), timeout=20, interval=0.1)
        standins.restart(2)
        wait_for("spare re-added by the file", lambda: all_ready(gw, w0, spare), timeout=15, interval=0.1)
        assert gw.by_url()[spare]["id"] != old
    finally:
        gw.stop()
        if standins.procs[2].poll() is not None:
            standins.restart(2)


# --------------------------------------------------------------------------- shutdown


def test_smg_sigterm_reports_not_ready_keeps_serving_five_seconds_then_drains(venv, standins, tmp_path):
    """On SIGTERM: /readiness 503 at once, new requests still served for the settle window (half the grace
    period, at most 5 s), then the listener closes and in-flight requests are waited for; exit 0."""
    w0 = standins.urls[0]
    gw = Gateway(venv, tmp_path / "smg.log", "--worker-urls", w0)
    try:
        wait_for(f"smg lists w0 ({gw.log})", lambda: all_ready(gw, w0), timeout=30, interval=0.1)
        results = []
        tokens = 7 * TOKENS_PER_S  # 7 s: outlasts the settle window
        t = threading.Thread(target=lambda: results.append(http.generate(gw.url, "finish me", tokens, api_key=KEY)))
        t.start()
        wait_for("a request running on w0", lambda: wl.running_requests(w0) == 1, timeout=10)
        gw.proc.terminate()
        wait_for("readiness 503", lambda: call("GET", f"{gw.url}/readiness", key=None)[0] == 503, timeout=3)
        assert http.generate(gw.url, "still served", 2, api_key=KEY)["completion_tokens"] == 2
        assert gw.proc.poll() is None
        wait_for("the listener closed", lambda: not http.healthy(gw.url, timeout=0.5), timeout=10, interval=0.05)
        assert "settle_secs=5" in gw.text() and gw.proc.poll() is None  # closed, still waiting for the request
        assert t.is_alive() and not results  # the request outlasts the settle window
        assert gw.proc.wait(timeout=20) == 0
        t.join(10)
        assert results and results[0]["completion_tokens"] == tokens  # waited for, not cut
    finally:
        gw.stop()


def test_smg_keeps_routing_to_a_worker_whose_generations_hang_while_health_answers(venv, standins, tmp_path):
    """sglang#22779's failure (LAB_STANDIN_HANG_AFTER=0: every generation hangs, /health and /v1/loads answer) is not
    taken out of rotation by smg 1.13.0's hung-worker checks (--worker-wedge-secs 3, its default): well past the
    wedge time, new requests still reach the hung worker, its health stays 1 and its breaker closed (a request that never ends is no failure). The rollout's own generations must catch it
    (docs/router.md, "Hung workers")."""
    w0 = standins.urls[0]
    hung = f"http://127.0.0.1:{free_port()}"
    proc = standins.start(hung, hang_after="0")
    gw = None
    try:
        wait_for(f"{hung} healthy", lambda: http.healthy(hung), timeout=20)
        gw = Gateway(venv, tmp_path / "smg.log", "--worker-urls", w0, hung)  # round_robin
        wait_for(f"smg lists both ({gw.log})", lambda: all_ready(gw, w0, hung), timeout=30, interval=0.1)
        t0 = time.monotonic()
        outcomes = []  # (seconds after the first request, answered)

        def one() -> None:
            sent = time.monotonic() - t0
            try:
                http.generate(gw.url, "anyone there", 4, timeout=3, api_key=KEY)  # 0.1 s when served
                outcomes.append((sent, True))
            except (OSError, http.HttpError):
                outcomes.append((sent, False))

        threads = []
        while time.monotonic() - t0 < 9:  # three wedge times
            threads.append(threading.Thread(target=one))
            threads[-1].start()
            time.sleep(0.25)
        for t in threads:
            t.join(10)
        late = [ok for sent, ok in outcomes if sent > 6]  # twice the wedge time after the first hung request
        assert len(outcomes) == len(threads) and late
        assert late.count(False) >= 2, outcomes  # still routed to the hung worker
        assert late.count(True) >= 2, outcomes  # and to the other: smg itself still routes
        seen = per_worker(gw.metrics(), hung)
        assert seen["smg_worker_health"] == 1.0 and seen["smg_worker_cb_state"] == 0.0  # healthy, breaker closed
        assert gw.by_url()[hung]["is_healthy"] is True
    finally:
        if gw:
            gw.stop()
        proc.kill()
        proc.wait()
