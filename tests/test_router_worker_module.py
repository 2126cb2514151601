"""library/sglang_router_worker.py as Ansible runs it, against a fake sglang-router and fake workers on loopback.

The router client itself (module_utils/sglang_deploy/router.py) is tested in test_router_client.py; this is
the module: each action's result fields, check mode (nothing sent that changes the router), the argument
rules, and every failure as a failed result naming the action and the worker.
"""

from __future__ import annotations

import itertools

import pytest

from support.modules import http_server, run_module

KEY = "router-key-never-shown"


class FakeRouter:
    """sglang-router 0.3.2's /workers (docs/router.md): the key required, removal by UUID, an added worker listed
    unhealthy at first and healthy at the next listing."""

    def __init__(self) -> None:
        self.workers: dict[str, dict] = {}
        self.ids = itertools.count(1)

    def listed(self, url: str, healthy: bool = True) -> str:
        wid = f"00000000-0000-4000-8000-{next(self.ids):012d}"
        self.workers[url] = {"id": wid, "url": url, "is_healthy": healthy}
        return wid

    def __call__(self, method: str, path: str, body: dict, headers: dict) -> tuple[int, object]:
        if headers.get("Authorization") != f"Bearer {KEY}":
            return 401, {"error": "Unauthorized"}
        if method == "GET" and path == "/workers":
            listing = [dict(w) for w in self.workers.values()]
            for w in self.workers.values():
                w["is_healthy"] = True  # health checks pass from the next listing on
            return 200, {"workers": listing, "total": len(listing)}
        if method == "POST" and path == "/workers":
            if body["url"] not in self.workers:
                self.listed(body["url"], healthy=False)
            return 202, {"status": "accepted", "worker_id": self.workers[body["url"]]["id"]}
        if method == "DELETE" and path.startswith("/workers/"):
            wid = path.rsplit("/", 1)[1]
            url = next((u for u, w in self.workers.items() if w["id"] == wid), None)
            if url is None:
                return 404, {"error": "WORKER_NOT_FOUND"}
            del self.workers[url]
            return 202, {"status": "accepted", "worker_id": wid}
        return 404, {}


@pytest.fixture
def router():
    fake = FakeRouter()
    with http_server(fake) as (url, seen):
        yield fake, url, seen


def worker_module(tmp_path, check_mode=False, **args) -> tuple[int, dict]:
    return run_module("sglang_router_worker", args, tmp_path, check_mode=check_mode)


W1, W2 = "http://10.0.0.1:30000", "http://10.0.0.2:30000"


def test_list_returns_what_the_router_lists(tmp_path, router):
    fake, url, _ = router
    wid = fake.listed(W1)
    rc, out = worker_module(tmp_path, action="list", router_url=url, api_key=KEY)
    assert rc == 0 and out["changed"] is False
    assert out["workers"] == [{"url": W1, "id": wid, "healthy": True}]


def test_remove_by_uuid_then_nothing_to_remove(tmp_path, router):
    fake, url, seen = router
    wid = fake.listed(W1)
    fake.listed(W2)
    rc, out = worker_module(tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=W1 + "/", timeout=5)
    assert rc == 0 and out["changed"] is True and out["worker_id"] == wid and out["worker_url"] == W1 + "/"
    assert ("DELETE", f"/workers/{wid}") in seen
    assert [w["url"] for w in out["workers"]] == [W2] and out["seconds"] >= 0
    rc, out = worker_module(tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=W1)
    assert rc == 0 and out["changed"] is False and out["worker_id"] is None


def test_remove_in_check_mode_says_what_it_would_do_and_sends_nothing(tmp_path, router):
    fake, url, seen = router
    wid = fake.listed(W1)
    rc, out = worker_module(tmp_path, check_mode=True, action="remove", router_url=url, api_key=KEY, worker_url=W1)
    assert rc == 0 and out["changed"] is True and out["worker_id"] == wid
    assert [m for m, _ in seen] == ["GET"] and W1 in fake.workers
    rc, out = worker_module(
        tmp_path, check_mode=True, action="remove", router_url=url, api_key=KEY, worker_url=W1, drain=True
    )
    assert rc == 0 and out["drain"] == {"drained": None, "why": "check mode"}
    assert [m for m, _ in seen] == ["GET", "GET"] and W1 in fake.workers


def test_add_waits_until_healthy_and_is_idempotent(tmp_path, router):
    fake, url, seen = router
    rc, out = worker_module(tmp_path, action="add", router_url=url, api_key=KEY, worker_url=W2, timeout=10)
    assert rc == 0 and out["changed"] is True, out
    assert out["worker_id"] == fake.workers[W2]["id"] and out["workers"] == [
        {"url": W2, "id": fake.workers[W2]["id"], "healthy": True}
    ]
    assert ("POST", "/workers") in seen
    posts = seen.count(("POST", "/workers"))
    rc, out = worker_module(tmp_path, action="add", router_url=url, api_key=KEY, worker_url=W2, timeout=10)
    assert rc == 0 and out["changed"] is False and seen.count(("POST", "/workers")) == posts


def test_add_in_check_mode_posts_nothing(tmp_path, router):
    _, url, seen = router
    rc, out = worker_module(tmp_path, check_mode=True, action="add", router_url=url, api_key=KEY, worker_url=W1)
    assert rc == 0 and out["changed"] is True and out["worker_id"] is None
    assert ("POST", "/workers") not in seen


def test_wait_healthy_fails_at_its_timeout_naming_the_last_state(tmp_path, router):
    fake, url, _ = router
    rc, out = worker_module(tmp_path, action="wait_healthy", router_url=url, api_key=KEY, worker_url=W1, timeout=0.3)
    assert rc == 1 and out["failed"] is True
    assert out["msg"].startswith(f"wait_healthy {W1}: {url} does not list {W1} as healthy after 0.3 s")
    assert out["msg"].endswith("(last: not listed)")
    fake.listed(W1)
    rc, out = worker_module(tmp_path, action="wait_healthy", router_url=url, api_key=KEY, worker_url=W1)
    assert rc == 0 and out["workers"][0]["healthy"] is True and out["seconds"] >= 0


def test_a_refused_key_fails_and_the_key_is_never_in_the_result(tmp_path, router):
    fake, url, _ = router
    fake.listed(W1)
    rc, out = worker_module(tmp_path, action="list", router_url=url, api_key="wrong-" + KEY)
    assert rc == 1 and "HTTP 401: the router requires its API key" in out["msg"]
    assert KEY not in str(out)


def test_the_router_url_and_worker_url_are_required_by_action(tmp_path):
    rc, out = worker_module(tmp_path, action="remove", worker_url=W1)
    assert rc == 1 and "router_url" in out["msg"]
    rc, out = worker_module(tmp_path, action="drain")
    assert rc == 1 and "worker_url" in out["msg"]


def running_worker(script: list):
    """A worker whose /metrics says sglang:num_running_reqs from script (one value per scrape, the last kept)."""

    def handle(method, path, body, headers):
        value = script.pop(0) if len(script) > 1 else script[0]
        return 200, f'sglang:num_running_reqs{{model_name="m"}} {value}\n'

    return http_server(handle)


def test_drain_waits_for_running_requests_and_never_fails(tmp_path):
    with running_worker([2.0, 0.0, 0.0, 0.0]) as (url, seen):
        rc, out = worker_module(tmp_path, action="drain", worker_url=url, drain_timeout=10)
    assert rc == 0 and out["changed"] is False and out["worker_url"] == url
    assert out["drain"]["drained"] is True and out["drain"]["why"] == "no running requests"
    # 2 running, then 0 for 0.2 s (two reads at least; more, 0.1 s apart, as the module's timing allows)
    assert out["seconds"] == out["drain"]["seconds"] >= 0.2 and len(seen) >= 3
    with running_worker([1.0]) as (url, _):
        rc, out = worker_module(tmp_path, action="drain", worker_url=url, drain_timeout=0.3)
    assert rc == 0 and out["drain"]["drained"] is False
    assert out["drain"]["why"] == "drain timeout (0.3 s): 1 running requests"


def test_remove_with_drain_takes_it_out_then_drains_it_in_one_call(tmp_path, router):
    fake, url, seen = router
    with running_worker([1.0, 0.0, 0.0, 0.0]) as (worker, scraped):
        wid = fake.listed(worker)
        rc, out = worker_module(
            tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=worker, drain=True, drain_timeout=10
        )
        assert rc == 0 and out["changed"] is True and out["worker_id"] == wid, out
        assert ("DELETE", f"/workers/{wid}") in seen and worker not in fake.workers
        assert out["drain"]["drained"] is True and out["drain"]["why"] == "no running requests"
        assert len(scraped) >= 3  # drained after the removal: 1 running, then 0 for 0.2 s (two reads at least)
        # Not listed (already out): nothing removed, still drained; without drain, no scrape.
        rc, out = worker_module(
            tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=worker, drain=True, drain_timeout=10
        )
        assert rc == 0 and out["changed"] is False and out["drain"]["drained"] is True
        n = len(scraped)
        rc, out = worker_module(tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=worker)
        assert rc == 0 and "drain" not in out and len(scraped) == n


def test_drain_in_check_mode_reads_nothing(tmp_path):
    with running_worker([1.0]) as (url, seen):
        rc, out = worker_module(tmp_path, check_mode=True, action="drain", worker_url=url)
    assert rc == 0 and out["drain"] == {"drained": None, "why": "check mode"} and seen == []


def test_measure_reports_tokens_per_second_and_fails_with_the_workers_answer(tmp_path):
    def handle(method, path, body, headers):
        if headers.get("Authorization") != f"Bearer {KEY}":
            return 401, {"error": "Unauthorized"}
        n = body["sampling_params"]["max_new_tokens"]
        return 200, {"text": " Paris", "meta_info": {"completion_tokens": n}}

    with http_server(handle) as (url, seen):
        rc, out = worker_module(tmp_path, action="measure", worker_url=url, api_key=KEY, requests=3, max_new_tokens=8)
        assert rc == 0 and out["requests"] == 3 and out["tokens_per_s"] > 0 and out["worker_url"] == url
        assert seen == [("POST", "/generate")] * 3
        rc, out = worker_module(tmp_path, action="measure", worker_url=url, requests=1)
    assert rc == 1 and out["msg"].startswith(f"measure {url}: {url}/generate: HTTP 401")
