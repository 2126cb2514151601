"""plugins/modules/sglang_router_worker.py as Ansible runs it, against a fake sglang-router and fake workers on loopback.

The router client itself (plugins/module_utils/sglang_deploy/router.py) is tested in test_router_client.py; this is
the module: each action's result fields, check mode (nothing sent that changes the router), the argument
rules, and every failure as a failed result naming the action and the worker.
"""

from __future__ import annotations

import itertools
import json

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router_actions as ra
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import MASK
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


class FakeSmg(FakeRouter):
    """smg 1.13.0's /workers (docs/router.md, "The two gateways"): `status` and `load` listed, 409 for a URL it
    has, a removed worker `draining` for two listings, then gone; every POST's body kept."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict] = []
        self.leaving: dict[str, int] = {}  # URL: listings left while draining

    def listed(self, url: str, healthy: bool = True, load: int = 0) -> str:
        wid = super().listed(url, healthy)
        self.workers[url].update(status="ready" if healthy else "not_ready", load=load)
        return wid

    def __call__(self, method: str, path: str, body: dict, headers: dict) -> tuple[int, object]:
        if headers.get("Authorization") != f"Bearer {KEY}":
            return 401, {"error": {"code": "invalid_api_key"}}
        if method == "GET" and path == "/workers":
            for url, left in list(self.leaving.items()):
                self.leaving[url] = left - 1
                if left <= 0:
                    del self.workers[url], self.leaving[url]
            listing = [dict(w) for w in self.workers.values()]
            for w in self.workers.values():
                if w["status"] == "not_ready":
                    w.update(is_healthy=True, status="ready")
            return 200, {"workers": listing, "total": len(listing)}
        if method == "POST" and path == "/workers":
            self.bodies.append(body)
            if body["url"] in self.workers:
                wid = self.workers[body["url"]]["id"]
                return 409, {"code": "WORKER_ALREADY_EXISTS", "error": f"Worker {wid} already exists"}
            return 202, {"status": "accepted", "worker_id": self.listed(body["url"], healthy=False)}
        if method == "DELETE" and path.startswith("/workers/"):
            url = next((u for u, w in self.workers.items() if w["id"] == path.rsplit("/", 1)[1]), None)
            if url is None:
                return 404, {"code": "WORKER_NOT_FOUND"}
            self.workers[url].update(status="draining", is_healthy=False)
            self.leaving[url] = 2
            return 202, {"status": "accepted", "worker_id": self.workers[url]["id"]}
        return 404, {}


@pytest.fixture
def smg_router():
    fake = FakeSmg()
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
    assert out["worker_ids"] == [wid] and ("DELETE", f"/workers/{wid}") in seen
    assert [w["url"] for w in out["workers"]] == [W2] and out["seconds"] >= 0
    rc, out = worker_module(tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=W1, missing_ok=True)
    assert rc == 0 and out["changed"] is False and out["worker_id"] is None and out["worker_ids"] == []


def test_remove_of_a_worker_the_router_does_not_list_fails_unless_missing_ok(tmp_path, router):
    """Issue #29 (b): nothing removed must not pass for removed (the drain and restart would follow while the
    router still sends the worker requests)."""
    fake, url, seen = router
    fake.listed(W2)
    for check_mode in (False, True):
        rc, out = worker_module(
            tmp_path, check_mode=check_mode, action="remove", router_url=url, api_key=KEY, worker_url=W1, drain=True
        )
        assert rc == 1 and out["failed"] is True, out
        assert out["msg"] == f"remove {W1}: {url} does not list {W1} under any spelling; it lists: {W2}"
        assert "drain" not in out
    assert {m for m, _ in seen} == {"GET"}  # nothing deleted, nothing drained
    rc, out = worker_module(
        tmp_path, check_mode=True, action="remove", router_url=url, api_key=KEY, worker_url=W1, missing_ok=True
    )
    assert rc == 0 and out["changed"] is False and out["worker_ids"] == []


def test_a_worker_listed_under_another_spelling_or_twice_is_removed_wholly(tmp_path, router):
    """The router lists 127.0.0.1 (and, registered twice, localhost too); the inventory says LOCALHOST."""
    fake, url, seen = router
    port = 30000
    ids = [fake.listed(f"http://127.0.0.1:{port}"), fake.listed(f"http://localhost:{port}/")]
    other = fake.listed(W2)
    name = f"HTTP://LOCALHOST:{port}/"
    rc, out = worker_module(tmp_path, check_mode=True, action="remove", router_url=url, api_key=KEY, worker_url=name)
    assert rc == 0 and out["changed"] is True and out["worker_ids"] == ids and out["worker_id"] == ids[0]
    rc, out = worker_module(tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=name, timeout=5)
    assert rc == 0 and out["changed"] is True and out["worker_ids"] == ids, out
    assert [p for p in seen if p[0] == "DELETE"] == [("DELETE", f"/workers/{i}") for i in ids]
    assert out["workers"] == [{"url": W2, "id": other, "healthy": True}]
    # add: not posted again under another spelling once listed under one
    rc, out = worker_module(tmp_path, action="add", router_url=url, api_key=KEY, worker_url=f"http://localhost:{port}")
    assert rc == 0 and out["changed"] is True
    posts = seen.count(("POST", "/workers"))
    rc, out = worker_module(tmp_path, action="add", router_url=url, api_key=KEY, worker_url=name)
    assert rc == 0 and out["changed"] is False and out["worker_id"] == fake.workers[f"http://localhost:{port}"]["id"]
    rc, out = worker_module(
        tmp_path, check_mode=True, action="add", router_url=url, api_key=KEY, worker_url=f"http://127.0.0.1:{port}"
    )
    assert rc == 0 and out["changed"] is False
    assert seen.count(("POST", "/workers")) == posts and len(fake.workers) == 2


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


def test_a_key_the_router_echoes_is_stripped_in_the_form_the_result_carries_it(tmp_path):
    """#30: the client quotes a failed answer as Python prints it (a repr: a backslash doubled), which Ansible's
    no_log, looking for the literal key, misses: the one secret rule strips it in every form."""
    key = 'rk-Zq9\\back"slash'

    def echo(method, path, body, headers):
        return 500, {"error": f"rejected {headers.get('Authorization')}"}

    with http_server(echo) as (url, _):
        rc, out = worker_module(tmp_path, action="list", router_url=url, api_key=key)
    assert rc == 1 and "HTTP 500" in out["msg"] and f"rejected Bearer {MASK}" in out["msg"], out["msg"]
    assert "Zq9" not in json.dumps(out)


def test_the_router_url_and_worker_url_are_required_by_action(tmp_path):
    rc, out = worker_module(tmp_path, action="remove", worker_url=W1)
    assert rc == 1 and "router_url" in out["msg"]
    rc, out = worker_module(tmp_path, action="drain")
    assert rc == 1 and "worker_url" in out["msg"]


def running_worker(script: list):
    """A worker whose /metrics says sglang:num_running_reqs and sglang:num_queue_reqs from script (one item per
    scrape, the last kept): a number (that many running, none queued), (running, queued), or an HTTP status
    ("status", code) for /metrics; its /health answers 200."""

    def handle(method, path, body, headers):
        if path == "/health":
            return 200, ""
        item = script.pop(0) if len(script) > 1 else script[0]
        if isinstance(item, tuple) and item[0] == "status":
            return item[1], "not found\n"
        running, queued = item if isinstance(item, tuple) else (item, 0.0)
        return 200, (
            f'sglang:num_running_reqs{{model_name="m"}} {running}\nsglang:num_queue_reqs{{model_name="m"}} {queued}\n'
        )

    return http_server(handle)


def test_drain_waits_for_running_and_queued_requests_and_fails_when_not_drained(tmp_path):
    with running_worker([2.0, (0.0, 1.0), 0.0, 0.0, 0.0]) as (url, seen):
        rc, out = worker_module(tmp_path, action="drain", worker_url=url, drain_timeout=10)
    assert rc == 0 and out["changed"] is False and out["worker_url"] == url
    assert out["drain"]["drained"] is True and out["drain"]["why"] == "no running or queued requests"
    # 2 running, 1 queued, then 0 for 0.2 s (two reads at least; more, 0.1 s apart, as the module's timing allows)
    assert out["seconds"] == out["drain"]["seconds"] >= 0.2 and len(seen) >= 4
    with running_worker([(0.0, 1.0)]) as (url, _):
        rc, out = worker_module(tmp_path, action="drain", worker_url=url, drain_timeout=0.3)
    assert rc == 1 and out["failed"] is True and out["changed"] is False
    assert out["drain"]["drained"] is False and out["drain"]["why"] == "drain timeout (0.3 s): 0 running, 1 queued"
    assert out["msg"] == f"drain {url}: not drained: drain timeout (0.3 s): 0 running, 1 queued"


def test_drain_of_a_worker_without_enable_metrics_fails_at_once(tmp_path):
    with running_worker([("status", 404)]) as (url, seen):
        rc, out = worker_module(tmp_path, action="drain", worker_url=url, drain_timeout=60)
    assert rc == 1 and out["failed"] is True and len(seen) == 1
    assert out["drain"]["drained"] is False and out["drain"]["seconds"] < 5
    assert out["msg"].startswith(f"drain {url}: not drained: cannot be drained on evidence: {url}/metrics answered")
    assert "--enable-metrics" in out["msg"]


def test_remove_with_drain_takes_it_out_then_drains_it_in_one_call(tmp_path, router):
    fake, url, seen = router
    with running_worker([1.0, 0.0, 0.0, 0.0]) as (worker, scraped):
        wid = fake.listed(worker)
        rc, out = worker_module(
            tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=worker, drain=True, drain_timeout=10
        )
        assert rc == 0 and out["changed"] is True and out["worker_id"] == wid, out
        assert ("DELETE", f"/workers/{wid}") in seen and worker not in fake.workers
        assert out["drain"]["drained"] is True and out["drain"]["why"] == "no running or queued requests"
        assert len(scraped) >= 3  # drained after the removal: 1 running, then 0 for 0.2 s (two reads at least)
        # Not listed (already out), and the caller says that is fine: nothing removed, still drained; without
        # drain, no scrape.
        rc, out = worker_module(
            tmp_path,
            action="remove",
            router_url=url,
            api_key=KEY,
            worker_url=worker,
            drain=True,
            drain_timeout=10,
            missing_ok=True,
        )
        assert rc == 0 and out["changed"] is False and out["drain"]["drained"] is True
        n = len(scraped)
        rc, out = worker_module(
            tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=worker, missing_ok=True
        )
        assert rc == 0 and "drain" not in out and len(scraped) == n


def test_remove_with_a_drain_that_cannot_end_on_evidence_fails_after_the_removal(tmp_path, router):
    """The rollout's rescue then puts the worker back: the result says it was removed, and the drain."""
    fake, url, _ = router
    with running_worker([("status", 404)]) as (worker, _):
        wid = fake.listed(worker)
        rc, out = worker_module(
            tmp_path, action="remove", router_url=url, api_key=KEY, worker_url=worker, drain=True, drain_timeout=60
        )
    assert rc == 1 and out["failed"] is True and out["changed"] is True and out["worker_id"] == wid
    assert worker not in fake.workers and out["drain"]["drained"] is False
    assert out["msg"].startswith(f"remove {worker}: not drained: cannot be drained on evidence") and (
        "--enable-metrics" in out["msg"]
    )


def test_drain_in_check_mode_reads_nothing(tmp_path):
    with running_worker([1.0]) as (url, seen):
        rc, out = worker_module(tmp_path, check_mode=True, action="drain", worker_url=url)
    assert rc == 0 and out["drain"] == {"drained": None, "why": "check mode"} and seen == []


def test_inspect_says_for_each_worker_listed_serving_drainable(tmp_path, router):
    fake, url, seen = router
    with running_worker([(1.0, 0.0)]) as (good, _), running_worker([("status", 404)]) as (no_metrics, _):
        wid = fake.listed(good.replace("127.0.0.1", "localhost"))
        fake.listed(W2)
        for check_mode in (False, True):  # it only reads: the same in check mode
            rc, out = worker_module(
                tmp_path,
                check_mode=check_mode,
                action="inspect",
                router_url=url,
                api_key=KEY,
                worker_urls=[good, no_metrics],
                timeout=2,
            )
            assert rc == 0 and out["changed"] is False, out
            assert out["workers"][0] == {
                "url": good,
                "listed": True,
                "ids": [wid],
                "healthy_in_router": True,
                "serving": True,
                "drainable": True,
                "why": "",
            }
            bad = out["workers"][1]
            assert (bad["url"], bad["listed"], bad["ids"], bad["healthy_in_router"]) == (no_metrics, False, [], None)
            assert bad["serving"] is True and bad["drainable"] is False
            assert bad["why"].startswith(f"not drainable: {no_metrics}/metrics answered HTTP 404")
            assert out["problems"] == [
                f"{no_metrics}: not listed by the router {url} (it lists: {fake_urls(fake)}{ra.SENTINEL_HINT})",
                f"{no_metrics}: cannot be drained on evidence: {no_metrics}/metrics answered HTTP 404 "
                "(SGLang serves /metrics and its load gauges only with --enable-metrics)",
            ]
        rc, out = worker_module(
            tmp_path,
            action="inspect",
            router_url=url,
            api_key=KEY,
            worker_urls=[good, no_metrics],
            fail_on_problems=True,
        )
        assert rc == 1 and out["failed"] is True and out["msg"] == "inspect: " + "; ".join(out["problems"])
        assert len(out["workers"]) == 2
        assert out["outcome"] == "invalid_config", "a rollout refused on it exits 3: nothing was touched"
        rc, out = worker_module(
            tmp_path, action="inspect", router_url=url, api_key=KEY, worker_urls=[good], fail_on_problems=True
        )
        assert rc == 0 and out["problems"] == []
    assert {m for m, _ in seen} == {"GET"}
    rc, out = worker_module(tmp_path, action="inspect", router_url=url, api_key=KEY)
    assert rc == 1 and "worker_urls" in out["msg"]


def fake_urls(fake: FakeRouter) -> str:
    return ", ".join(fake.workers)


def test_the_documentation_describes_every_option_as_the_argument_spec_has_it():
    """validate-modules' rules, as far as they go here: each option documented with its description, type,
    default, choices and elements as the argument spec says; RETURN and EXAMPLES-free YAML that parses."""
    import json
    import os
    import subprocess
    import sys

    import yaml

    from support import COLLECTIONS, env_with_pythonpath
    from support.modules import LIBRARY

    # the module's globals as Ansible would import them (the package from collections/), in a child
    code = (
        "import json, runpy, sys; "
        "g = runpy.run_path(sys.argv[1], run_name='doc'); "
        "print(json.dumps({k: g[k] for k in ('DOCUMENTATION', 'RETURN', 'ARGUMENT_SPEC')}))"
    )
    run = [sys.executable, "-c", code, str(LIBRARY / "sglang_router_worker.py")]
    env = env_with_pythonpath(dict(os.environ), COLLECTIONS)
    mod = json.loads(subprocess.run(run, check=True, capture_output=True, text=True, env=env).stdout)
    doc = yaml.safe_load(mod["DOCUMENTATION"])
    spec = mod["ARGUMENT_SPEC"]
    assert set(doc["options"]) == set(spec)
    for name, arg in spec.items():
        d = doc["options"][name]
        assert d.get("description"), name
        assert d["type"] == arg["type"], name
        assert d.get("default") == arg.get("default"), name
        assert d.get("choices") == arg.get("choices"), name
        assert d.get("elements") == arg.get("elements"), name
        assert bool(d.get("required")) == bool(arg.get("required")), name
    ret = yaml.safe_load(mod["RETURN"])
    for key in ("worker_ids", "drain", "workers", "problems"):
        assert ret[key]["description"] and ret[key]["returned"], key
    assert set(ret["workers"]["contains"]) >= {"listed", "ids", "healthy_in_router", "serving", "drainable", "why"}
    assert set(ret["drain"]["contains"]) == {"drained", "seconds", "running", "queued", "why", "gateway_in_flight"}
    assert doc["options"]["impl"]["default"] == "sglang-router"  # the playbooks, which name none, as before smg


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


def test_impl_smg_remove_counts_draining_as_out_and_the_drain_shows_the_gateways_count(tmp_path, smg_router):
    fake, url, seen = smg_router
    with running_worker([1.0, 0.0, 0.0, 0.0]) as (worker, _):
        wid = fake.listed(worker, load=1)
        other = fake.listed(W2)
        smg = dict(impl="smg", router_url=url, api_key=KEY, worker_url=worker)
        rc, out = worker_module(tmp_path, action="list", **smg)
        assert rc == 0 and out["workers"][0] == {"url": worker, "id": wid, "healthy": True, "status": "ready"}
        rc, out = worker_module(tmp_path, action="remove", drain=True, drain_timeout=10, **smg)
        assert rc == 0 and out["changed"] is True and out["worker_ids"] == [wid], out
        # gone from rotation when draining: the wait ends there (smg lists it until its settle time ends)
        assert out["workers"] == [
            {"url": worker, "id": wid, "healthy": False, "status": "draining"},
            {"url": W2, "id": other, "healthy": True, "status": "ready"},
        ]
        # the worker's gauges decided; the gateway's count (its listing's load) rode along
        assert out["drain"]["drained"] is True and out["drain"]["gateway_in_flight"] in (1.0, None), out
        # already draining: listed, so no error, but nothing removed again (check mode says the same)
        draining = fake.listed(worker)  # (gone by now: listed again, as another client's removal left it)
        fake.workers[worker].update(status="draining", is_healthy=False)
        fake.leaving[worker] = 50
        for check_mode in (True, False):
            rc, out = worker_module(tmp_path, check_mode=check_mode, action="remove", **smg)
            assert rc == 0 and out["changed"] is False and out["worker_ids"] == [], out
        assert [p for p in seen if p[0] == "DELETE"] == [("DELETE", f"/workers/{wid}")]
        # add: a draining worker would be added again (check mode); it is, once smg has let it go
        rc, out = worker_module(tmp_path, check_mode=True, action="add", **smg)
        assert rc == 0 and out["changed"] is True and out["worker_id"] is None
        fake.leaving[worker] = 2
        rc, out = worker_module(tmp_path, action="add", timeout=10, **smg)
        assert rc == 0 and out["changed"] is True and out["worker_id"] not in (wid, draining), out
        assert fake.bodies == [{"url": worker, "api_key": KEY}]  # smg's body carries the worker's key
        assert {w["url"]: w["status"] for w in out["workers"]} == {worker: "ready", W2: "ready"}
        # drain alone, with the router named: its count beside the worker's
        rc, out = worker_module(tmp_path, action="drain", drain_timeout=10, **smg)
        assert rc == 0 and out["drain"]["gateway_in_flight"] == 0.0, out
    # sglang-router (the default) keeps no count: the drain's result is as it was
    with running_worker([0.0]) as (worker, _):
        rc, out = worker_module(tmp_path, action="drain", router_url=url, api_key=KEY, worker_url=worker)
        assert rc == 0 and set(out["drain"]) == {"drained", "seconds", "running", "queued", "why"}
    rc, out = worker_module(tmp_path, action="list", impl="sglang-router-0.4", router_url=url, api_key=KEY)
    assert rc == 1 and "impl" in out["msg"] and "sglang-router, smg" in out["msg"], out["msg"]


@pytest.mark.parametrize("name, value", [("timeout", "nan"), ("drain_timeout", "inf"), ("timeout", -1)])
def test_a_wait_that_could_never_end_is_refused_naming_the_option(tmp_path, router, name, value):
    _, url, seen = router
    rc, out = worker_module(tmp_path, action="remove", router_url=url, worker_url=W1, **{name: value})
    assert rc == 1 and out["msg"].endswith(f": {name}={float(value)!r}: a number of seconds, 0 or more, is wanted")
    assert seen == []  # before any request to the router


def test_a_gateway_with_a_discovery_file_is_edited_not_called(tmp_path, smg_router):
    """routers[].discovery_file: remove takes the worker out of smg's file (no DELETE: smg would add it back while
    the file names it, tests/test_discovery.py); the wait on the listing follows as in the API mode."""
    fake, url, seen = smg_router
    fake.listed(W1)
    fake.listed(W2)
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"version": 1, "workers": [{"url": W1}, {"url": W2}]}))
    gw = {"name": "gw", "url": url, "impl": "smg", "discovery_file": str(path)}
    rc, out = worker_module(tmp_path, action="remove", routers=[gw], api_key=KEY, worker_url=W1, timeout=0.5)
    assert json.loads(path.read_text())["workers"] == [{"url": W2}]
    assert not [p for p in seen if p[0] == "DELETE"]
    # the fake never reads the file: it lists W1 on, so the wait fails, naming it
    assert rc != 0 and out["msg"].endswith(
        f"still lists {W1} after 0.5 s (last: still listed (id {out['worker_id'] if 'worker_id' in out else fake.workers[W1]['id']} ready))"
    ), out
    rc, out = worker_module(
        tmp_path, check_mode=False, action="add", routers=[gw], api_key=KEY, worker_url=W1, timeout=1
    )
    assert json.loads(path.read_text())["workers"] == [{"url": W2}, {"url": W1}]
    assert not [p for p in seen if p[0] == "POST"], "added through the file, never posted"
