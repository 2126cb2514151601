"""The gateways' worker API and the module's actions as their callers read them (issue #31: the behaviours behind
the mutants the unit suite let survive in sglang_deploy/router.py, since split into router.py, router_actions.py,
worker_load.py and worker_urls.py).

`act` is what plugins/modules/sglang_router_worker.py runs; its own tests run it under Ansible's name, so here it is called
as `sglang_deploy.router_actions.act`, with the module's parameters, against fakes of both gateways and of SGLang's
worker on loopback. The fakes are as unkind as the real binaries (docs/router.md, "The two gateways"): the key required on
/workers, removal by UUID only (400 for anything else, 404 for an unknown id), an addition listed a few listings
later and unhealthy at first, a removal that takes effect a few listings later (smg: `draining` first), smg's 409
for a URL it has; where a test scripts a gateway's bad day (a restart between two requests, an answer cut short),
it says so. Every result and message a caller reads is checked as written.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.parse

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http, outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router as rt
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router_actions as ra
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_load as wl
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_urls as wu
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import MASK
from support.fake_gateway import (
    KEY,
    W1,
    W2,
    W3,
    FakeClock,
    Gateway,
    closed_port,
    deletes,
    fake_dns,
    gets,
    hang_up,
    metrics_text,
    params,
    router,
    serving,
    uuid,
    worker,
)


@pytest.fixture
def gw32():
    gw = Gateway()
    with serving(gw.respond) as url:
        yield gw, url


@pytest.fixture
def gwsmg():
    gw = Gateway(smg=True)
    with serving(gw.respond) as url:
        yield gw, url


# --------------------------------------------------------------------------- act: the module's actions


def test_list_is_the_gateways_membership_and_needs_no_wait_setting(gw32, gwsmg):
    gw, url = gw32
    a = gw.add_now(W1 + "/")
    b = gw.add_now(W2, healthy=False)
    listed = [{"url": W1, "id": a, "healthy": True}, {"url": W2, "id": b, "healthy": False}]
    # a caller that passes only what a listing needs: no timeout, no impl (the playbooks' sglang-router)
    assert ra.act({"action": "list", "router_url": url, "api_key": KEY}) == {"changed": False, "workers": listed}
    assert ra.act(params(action="list", router_url=url, api_key=KEY, impl=None)) == {
        "changed": False,
        "workers": listed,
    }
    with pytest.raises(rt.RouterError, match="HTTP 401"):
        ra.act(params(action="list", router_url=url, api_key=None))
    smg, smg_url = gwsmg
    c = smg.add_now(W3, load=1)
    assert ra.act(params(action="list", router_url=smg_url, api_key=KEY, impl="smg")) == {
        "changed": False,
        "workers": [{"url": W3, "id": c, "healthy": True, "status": "ready"}],
    }


@pytest.mark.parametrize(
    "name, value",
    [(name, v) for name in ("timeout", "drain_timeout") for v in (math.nan, math.inf, -0.5)],
)
def test_a_wait_that_could_never_end_is_refused_before_any_request(gw32, name, value):
    gw, url = gw32
    with pytest.raises(rt.RouterError) as err:
        ra.act(params(action="list", router_url=url, api_key=KEY, **{name: value}))
    assert str(err.value) == f"{name}={value!r}: a number of seconds, 0 or more, is wanted"
    assert gw.requests == []


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 1e9])
def test_no_wait_and_a_fraction_of_a_second_are_waits(gw32, value):
    _, url = gw32
    out = ra.act(params(action="list", router_url=url, api_key=KEY, timeout=value, drain_timeout=value))
    assert out == {"changed": False, "workers": []}


def test_an_unknown_action_is_refused_naming_it(gw32):
    _, url = gw32
    with pytest.raises(rt.RouterError) as err:
        ra.act(params(action="frobnicate", router_url=url, api_key=KEY, worker_url=W1))
    assert str(err.value) == "unknown action 'frobnicate'"


class SteppingTime:
    """time for http.generate: each monotonic() `step` seconds after the last."""

    def __init__(self, step: float):
        self.t, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.t += self.step
        return self.t


def test_measure_reports_tokens_over_seconds_of_the_requests_as_asked(monkeypatch):
    monkeypatch.setattr(http, "time", SteppingTime(0.0777))  # each generation 0.0777 s
    with worker() as (w, url):
        p = params(action="measure", worker_url=url, api_key=KEY, prompt="Once upon", requests=3, max_new_tokens=7)
        out = ra.act(p)
        # 3 x 7 tokens over 3 x 0.0777 s
        assert out == {"changed": False, "worker_url": url, "tokens_per_s": 90.1, "requests": 3, "seconds": 0.233}
        assert [g["text"] for g in w.generated] == ["Once upon"] * 3
        with pytest.raises(http.HttpError, match="HTTP 401"):
            ra.act({**p, "api_key": None})
        # a clock too coarse to see a generation: no division by zero, the rate of 1 ns
        monkeypatch.setattr(http, "time", SteppingTime(0.0))
        assert wl.measure(url, "Once upon", 3, 7, api_key=KEY) == {
            "tokens_per_s": 21e9,
            "requests": 3,
            "seconds": 0.0,
        }


def test_measure_gives_up_on_a_generation_at_its_timeout():
    def slow(h, raw):
        time.sleep(0.5)
        return 200, {"text": " Paris", "meta_info": {"completion_tokens": 8}}

    with serving(slow) as url, pytest.raises(http.HttpError) as err:
        wl.measure(url, "The capital of France is", 1, 8, api_key=KEY, timeout=0.1)
    assert isinstance(err.value.cause, TimeoutError)


def test_drain_alone_reads_the_worker_and_the_gateways_count_where_one_is_kept(gw32, gwsmg):
    smg, smg_url = gwsmg
    with worker(0.0) as (_, url):
        # smg named but no gateway given: the worker's gauges only
        out = ra.act(params(action="drain", worker_url=url, drain_timeout=10, impl="smg", api_key=KEY))
        drained = {"drained": True, "running": 0.0, "queued": 0.0, "why": "no running or queued requests"}
        assert out == {
            "changed": False,
            "worker_url": url,
            "drain": {**drained, "seconds": out["seconds"]},
            "seconds": out["seconds"],
        }
        # smg named with its gateway: its own count of the worker's requests rides along
        smg.add_now(url, load=3)
        out = ra.act(
            params(action="drain", worker_url=url, drain_timeout=10, impl="smg", router_url=smg_url, api_key=KEY)
        )
        assert out["drain"] == {**drained, "seconds": out["seconds"], "gateway_in_flight": 3.0}
        # sglang-router keeps no count: none reported
        _, url32 = gw32
        out = ra.act(params(action="drain", worker_url=url, drain_timeout=10, router_url=url32, api_key=KEY))
        assert out["drain"] == {**drained, "seconds": out["seconds"]}


def test_drain_alone_that_does_not_drain_fails_with_its_result():
    with worker((1.0, 0.0)) as (_, url), pytest.raises(ra.ActionFailed) as err:
        ra.act(params(action="drain", worker_url=url, drain_timeout=0.2))
    assert str(err.value) == "not drained: drain timeout (0.2 s): 1 running, 0 queued"
    d = err.value.result["drain"]
    assert err.value.result == {"changed": False, "worker_url": url, "drain": d, "seconds": d["seconds"]}
    assert d == {
        "drained": False,
        "seconds": d["seconds"],
        "running": 1.0,
        "queued": 0.0,
        "why": "drain timeout (0.2 s): 1 running, 0 queued",
    }
    assert 0.2 <= d["seconds"] < 5


def test_drain_in_check_mode_reads_nothing():
    with worker(1.0) as (w, url):
        out = ra.act(params(action="drain", worker_url=url, router_url="http://127.0.0.1:1"), True)
    assert out == {"changed": False, "worker_url": url, "drain": {"drained": None, "why": "check mode"}}
    assert w.scrapes == 0


def test_wait_healthy_until_the_gateway_lists_it_healthy(gw32):
    gw, url = gw32
    gw.add_now(W1, healthy=False)
    gw.at(3, lambda: gw.healthy(W1))
    out = ra.act(params(action="wait_healthy", router_url=url, api_key=KEY, worker_url=W1 + "/", timeout=5))
    wid = gw.workers[W1]["id"]
    assert out == {
        "changed": False,
        "worker_url": W1 + "/",
        "seconds": out["seconds"],
        "workers": [{"url": W1, "id": wid, "healthy": True}],
    }
    assert 0 < out["seconds"] < 5
    with pytest.raises(rt.RouterError) as err:
        ra.act(params(action="wait_healthy", router_url=url, api_key=KEY, worker_url=W2, timeout=0.2))
    assert str(err.value) == f"{url} does not list {W2} as healthy after 0.2 s (last: not listed)"


def test_inspect_reads_the_gateway_and_each_worker_once_and_a_plan_refuses_on_problems(gw32):
    gw, url = gw32
    with worker((1.0, 2.0)) as (_, good), worker(("status", 503), (0.0, 0.0)) as (_, busy):
        wid = gw.add_now(good)
        p = params(action="inspect", router_url=url, api_key=KEY, worker_urls=[good, busy], timeout=2)
        out = ra.act(p)
        assert out == {
            "changed": False,
            "workers": [
                {
                    "url": good,
                    "listed": True,
                    "ids": [wid],
                    "healthy_in_router": True,
                    "serving": True,
                    "drainable": True,
                    "why": "",
                },
                {
                    "url": busy,
                    "listed": False,
                    "ids": [],
                    "healthy_in_router": None,
                    "serving": True,
                    "drainable": False,
                    "why": f"not drainable: {busy}/metrics answered HTTP 503",
                },
            ],
            "problems": [
                f"{busy}: not listed by the router {url} (it lists: {good}{ra.SENTINEL_HINT})",
                f"{busy}: cannot be drained on evidence: {busy}/metrics answered HTTP 503",
            ],
        }
        # a rollout's plan: refused for its problems, with the inspection, nothing touched
        gone = f"http://127.0.0.1:{closed_port()}"
        with pytest.raises(ra.ActionFailed) as err:
            ra.act({**p, "worker_urls": [good, gone], "fail_on_problems": True})
        failed = err.value.result
        assert failed == {**ra.act({**p, "worker_urls": [good, gone]}), "outcome": outcomes.INVALID_CONFIG}
    assert failed["problems"] == [
        f"{gone}: not listed by the router {url} (it lists: {good}{ra.SENTINEL_HINT})",
        f"{gone}: cannot be drained on evidence: connection refused",
    ]
    assert str(err.value) == "; ".join(failed["problems"]) and outcomes.INVALID_CONFIG == "invalid_config"
    assert {m for m, _ in gw.requests} == {"GET"}


def test_inspect_for_a_plan_with_no_problem_returns_it(gw32):
    gw, url = gw32
    with worker(("status", 503), (0.0, 0.0)) as (w, busy):
        gw.add_now(busy)
        out = ra.act(params(action="inspect", router_url=url, api_key=KEY, worker_urls=[busy], fail_on_problems=True))
    assert out["problems"] == [] and out["workers"][0]["drainable"] is True and w.scrapes == 2


def test_inspect_gives_up_on_a_worker_at_its_timeout(gw32):
    gw, url = gw32
    with worker(("slow", 0.5, 0.0)) as (w, slow):
        w.health = ("slow", 0.5, ("status", 200))
        gw.add_now(slow)
        out = ra.act(params(action="inspect", router_url=url, api_key=KEY, worker_urls=[slow], timeout=0.1))
    [rec] = out["workers"]
    assert rec["serving"] is False and rec["drainable"] is False
    up, load = rec["why"].split("; ")
    assert up.startswith("not serving: no answer in time (") and load.startswith("not drainable: no answer in time (")


# --------------------------------------------------------------------------- act: add


def test_add_posts_waits_until_healthy_and_reports_the_listed_id(gw32):
    gw, url = gw32
    other = gw.add_now(W2)
    out = ra.act(params(action="add", router_url=url, api_key=KEY, worker_url=W1 + "/", timeout=5))
    wid = gw.workers[W1]["id"]
    assert out == {
        "changed": True,
        "worker_url": W1 + "/",
        "worker_id": wid,
        "seconds": out["seconds"],
        "workers": [{"url": W2, "id": other, "healthy": True}, {"url": W1, "id": wid, "healthy": True}],
    }
    assert gw.bodies == [{"url": W1}] and out["seconds"] > 0
    # listed already: nothing posted, the same answer but unchanged
    again = ra.act(params(action="add", router_url=url, api_key=KEY, worker_url=W1, timeout=5))
    assert again == {**out, "changed": False, "worker_url": W1, "seconds": again["seconds"]} and len(gw.bodies) == 1


def test_add_in_check_mode_says_whether_it_would_post(gw32, gwsmg):
    gw, url = gw32
    p = params(action="add", router_url=url, api_key=KEY, worker_url=W1, timeout=5)
    assert ra.act(p, check_mode=True) == {"changed": True, "worker_url": W1, "worker_id": None}
    a = gw.add_now(W1)
    gw.add_now(W1 + "/")  # registered twice: the first record's id
    assert ra.act(p, check_mode=True) == {"changed": False, "worker_url": W1, "worker_id": a}
    assert gw.bodies == []
    # smg: a record it is letting go would be posted again; one in rotation beside it would not
    smg, smg_url = gwsmg
    d = smg.add_now(W1)
    smg.workers[W1].update(status="draining", is_healthy=False)
    p = params(action="add", router_url=smg_url, api_key=KEY, worker_url=W1, timeout=5, impl="smg")
    assert ra.act(p, check_mode=True) == {"changed": True, "worker_url": W1, "worker_id": None}
    r = smg.add_now(W1 + "/")
    assert ra.act(p, check_mode=True) == {"changed": False, "worker_url": W1, "worker_id": r} and r != d
    assert smg.bodies == []


def test_add_waits_its_timeout_for_a_draining_record_to_go(gwsmg):
    gw, url = gwsmg
    old = gw.add_now(W1)
    gw.workers[W1].update(status="draining", is_healthy=False)
    gw.at(3, lambda: gw.drop(W1, old))
    out = ra.act(params(action="add", router_url=url, api_key=KEY, worker_url=W1, timeout=5, impl="smg"))
    assert out["changed"] is True and out["worker_id"] == gw.workers[W1]["id"] != old
    assert gw.bodies == [{"url": W1, "api_key": KEY}]
    # a settle time longer than the timeout: failed at the timeout, nothing posted
    gw.workers[W1].update(status="draining", is_healthy=False)
    gw.at(40, lambda: gw.workers.pop(W1))
    with pytest.raises(rt.RouterError) as err:
        ra.act(params(action="add", router_url=url, api_key=KEY, worker_url=W1, timeout=0.2, impl="smg"))
    wid = gw.workers[W1]["id"]
    assert str(err.value) == f"{url} still lists {W1} after 0.2 s (last: still listed (id {wid} draining))"
    assert len(gw.bodies) == 1


def test_add_of_a_worker_another_client_is_adding_reports_the_id_it_gets(gwsmg):
    """smg answers 409 WORKER_CREATE_IN_PROGRESS, naming no id: "not added", and the id is the one it lists once
    the addition is done."""
    gw, url = gwsmg
    gw.adding.add(W1)
    gw.at(3, lambda: gw.add_now(W1, healthy=False))
    gw.at(5, lambda: gw.healthy(W1))
    out = ra.act(params(action="add", router_url=url, api_key=KEY, worker_url=W1, timeout=5, impl="smg"))
    wid = gw.workers[W1]["id"]
    assert out == {
        "changed": False,
        "worker_url": W1,
        "worker_id": wid,
        "seconds": out["seconds"],
        "workers": [{"url": W1, "id": wid, "healthy": True, "status": "ready"}],
    }


def test_add_reports_the_posted_id_when_the_worker_is_gone_again(gw32):
    """Removed by another client right after it was listed healthy: the id the POST answered."""
    gw, url = gw32
    out_of = {}

    def removed_after_healthy():
        out_of["id"] = gw.workers[W1]["id"]
        del gw.workers[W1]

    gw.at(6, removed_after_healthy)  # after the listing that showed it healthy (the 5th: the POST's 4th)
    out = ra.act(params(action="add", router_url=url, api_key=KEY, worker_url=W1, timeout=5))
    assert out == {
        "changed": True,
        "worker_url": W1,
        "worker_id": out_of["id"],
        "seconds": out["seconds"],
        "workers": [],
    }


# --------------------------------------------------------------------------- act: remove


def test_remove_in_check_mode_names_what_it_would_remove_and_sends_nothing(gw32):
    gw, url = gw32
    ids = [gw.add_now(W1), gw.add_now("HTTP://10.0.0.1:30000/")]  # registered twice
    gw.add_now(W2)
    p = params(action="remove", router_url=url, api_key=KEY, worker_url=W1 + "/", timeout=5)
    out = {"changed": True, "worker_url": W1 + "/", "worker_id": ids[0], "worker_ids": ids}
    assert ra.act(p, check_mode=True) == out
    assert ra.act({**p, "drain": True}, True) == {**out, "drain": {"drained": None, "why": "check mode"}}
    # not listed: an error naming what is listed, unless the caller allows it
    q = {**p, "worker_url": W3}
    with pytest.raises(rt.RouterError) as err:
        ra.act(q, True)
    assert str(err.value) == f"{url} does not list {W3} under any spelling; it lists: {W1}, HTTP://10.0.0.1:30000, {W2}"
    missing = {"changed": False, "worker_url": W3, "worker_id": None, "worker_ids": []}
    assert ra.act({**q, "missing_ok": True}, True) == missing
    assert {m for m, _ in gw.requests} == {"GET"}


def test_remove_in_check_mode_leaves_out_what_smg_is_letting_go(gwsmg):
    gw, url = gwsmg
    d = gw.add_now(W1)
    gw.workers[W1].update(status="draining", is_healthy=False)
    p = params(action="remove", router_url=url, api_key=KEY, worker_url=W1, impl="smg")
    assert ra.act(p, True) == {"changed": False, "worker_url": W1, "worker_id": None, "worker_ids": []}
    r = gw.add_now(W1 + "/")
    assert ra.act(p, True) == {"changed": True, "worker_url": W1, "worker_id": r, "worker_ids": [r]} and r != d
    assert deletes(gw) == []


def test_remove_takes_every_record_out_and_waits_until_the_gateway_lets_go(gw32):
    gw, url = gw32
    ids = [gw.add_now(W1), gw.add_now("HTTP://10.0.0.1:30000/")]
    other = gw.add_now(W2)
    out = ra.act(params(action="remove", router_url=url, api_key=KEY, worker_url=W1, timeout=5))
    assert out == {
        "changed": True,
        "worker_url": W1,
        "worker_id": ids[0],
        "worker_ids": ids,
        "seconds": out["seconds"],
        "workers": [{"url": W2, "id": other, "healthy": True}],
    }
    assert deletes(gw) == ids and out["seconds"] > 0  # gone two listings after the DELETEs: waited for
    # gone: nothing to remove, and the caller says that is fine (no wait, no listing in the result)
    p = params(action="remove", router_url=url, api_key=KEY, worker_url=W1, missing_ok=True)
    assert ra.act(p) == {"changed": False, "worker_url": W1, "worker_id": None, "worker_ids": []}
    with pytest.raises(rt.RouterError, match=f"does not list {W1} under any spelling"):
        ra.act({**p, "missing_ok": False})


def test_remove_fails_at_its_timeout_while_the_gateway_keeps_the_worker(gw32):
    gw, url = gw32
    wid = gw.add_now(W1)
    gw.on_delete = lambda wid: (202, {"status": "accepted", "worker_id": wid})  # accepted, never carried out
    with pytest.raises(rt.RouterError) as err:
        ra.act(params(action="remove", router_url=url, api_key=KEY, worker_url=W1, timeout=0.2))
    assert str(err.value) == f"{url} still lists {W1} after 0.2 s (last: still listed (id {wid}))"


def test_remove_with_drain_drains_after_the_removal(gw32, gwsmg):
    gw, url = gw32
    with worker(0.0) as (_, w):
        wid = gw.add_now(w)
        out = ra.act(params(action="remove", router_url=url, api_key=KEY, worker_url=w, drain=True, drain_timeout=10))
        assert out["worker_ids"] == [wid] and out["workers"] == [] and w not in gw.workers
        assert out["drain"] == {
            "drained": True,
            "seconds": out["drain"]["seconds"],
            "running": 0.0,
            "queued": 0.0,
            "why": "no running or queued requests",
        }
    # smg: the gateway's count beside the worker's gauges, its record draining all along
    smg, smg_url = gwsmg
    smg.settle = 50
    with worker(0.0) as (_, w):
        wid = smg.add_now(w, load=2)
        p = params(action="remove", router_url=smg_url, api_key=KEY, worker_url=w, drain=True, drain_timeout=10)
        out = ra.act({**p, "impl": "smg"})
    assert out["worker_ids"] == [wid] and out["drain"]["gateway_in_flight"] == 2.0 and out["drain"]["drained"] is True
    assert out["workers"] == [{"url": w, "id": wid, "healthy": False, "status": "draining"}]


def test_remove_with_a_drain_that_does_not_end_fails_with_what_was_removed(gw32):
    gw, url = gw32
    with worker((1.0, 0.0)) as (_, w):
        wid = gw.add_now(w)
        with pytest.raises(ra.ActionFailed) as err:
            ra.act(params(action="remove", router_url=url, api_key=KEY, worker_url=w, drain=True, drain_timeout=0.2))
    out = err.value.result
    assert str(err.value) == "not drained: drain timeout (0.2 s): 1 running, 0 queued"
    assert out == {
        "changed": True,
        "worker_url": w,
        "worker_id": wid,
        "worker_ids": [wid],
        "seconds": out["seconds"],
        "workers": [],
        "drain": {
            "drained": False,
            "seconds": out["drain"]["seconds"],
            "running": 1.0,
            "queued": 0.0,
            "why": "drain timeout (0.2 s): 1 running, 0 queued",
        },
    }


# --------------------------------------------------------------------------- the client: listing


def test_the_listing_is_each_record_with_its_url_in_one_spelling_and_nothing_else(gw32):
    gw, url = gw32
    gw.workers["junk"] = "not a record"  # type: ignore[assignment]
    gw.workers["no-url"] = {"id": uuid(99), "is_healthy": True}
    wid = gw.add_now(W1 + "/")
    assert router(url).workers() == [
        {"id": wid, "url": W1, "is_healthy": True, "worker_type": "regular", "healthy": True}
    ]


def test_a_listing_the_gateway_refuses_is_an_error_quoting_its_answer():
    body = {"workers": [], "error": f"shutting down {KEY} " + "z" * 400}  # a listing's shape, but not 200
    with serving(lambda h, raw: (503, body)) as url, pytest.raises(rt.RouterError) as err:
        router(url).workers()
    assert str(err.value) == f"GET {url}/workers: HTTP 503: " + str(body).replace(KEY, MASK)[:300]


@pytest.mark.parametrize("answer, quoted", [(b"", "{}"), (b"   \n", "{}")])
def test_an_empty_answer_is_quoted_as_nothing(answer, quoted):
    with serving(lambda h, raw: (502, answer)) as url, pytest.raises(rt.RouterError) as err:
        router(url).workers()
    assert str(err.value) == f"GET {url}/workers: HTTP 502: {quoted}"


def test_an_answer_that_is_not_json_is_quoted_masked_and_cut():
    """An HTML error page from whatever fronts the gateway, echoing the key, with bytes that are not UTF-8."""
    page = KEY.encode() + b" \xff\xfe <html>bad gateway</html> " + b"y" * 400
    with serving(lambda h, raw: (502, page)) as url, pytest.raises(rt.RouterError) as err:
        router(url).workers()
    text = page.decode(errors="replace").replace(KEY, MASK)[:300]  # masked, then cut (cut first, the mask is
    assert str(err.value) == f"GET {url}/workers: HTTP 502: " + str({"raw": text})[:300]  # shorter than the key)


def test_an_answer_that_is_not_json_is_quoted_from_its_first_300_characters():
    """What lies past them does not show, not even in how the quote is written: an apostrophe after the 300th
    character would have the text quoted in double quotes."""
    page = b"x" * 300 + b"'s all"
    with serving(lambda h, raw: (502, page)) as url, pytest.raises(rt.RouterError) as err:
        router(url).workers()
    assert str(err.value) == f"GET {url}/workers: HTTP 502: " + ("{'raw': '" + "x" * 300)[:300]


def test_an_error_answer_cut_short_is_quoted_as_nothing():
    def cut(h, raw):
        h.send_response(500)
        h.send_header("Content-Length", "100")
        h.end_headers()
        h.wfile.write(b'{"err')
        h.wfile.flush()
        hang_up(h)

    with serving(cut) as url, pytest.raises(rt.RouterError) as err:
        router(url).workers()
    assert str(err.value) == f"GET {url}/workers: HTTP 500: {{}}"


def test_a_gateway_that_does_not_answer_is_an_http_error_naming_why():
    port = closed_port()
    with pytest.raises(http.HttpError) as err:
        router(f"http://127.0.0.1:{port}").workers()
    assert str(err.value) == f"GET http://127.0.0.1:{port}/workers: URLError: [Errno 111] Connection refused"
    assert isinstance(err.value.cause, ConnectionRefusedError)
    with serving(lambda h, raw: hang_up(h)) as url, pytest.raises(http.HttpError) as err:
        router(url).workers()
    assert str(err.value) == f"GET {url}/workers: RemoteDisconnected: Remote end closed connection without response"
    assert isinstance(err.value.cause, ConnectionResetError)  # the exception itself: no reason of its own


def test_a_slow_gateway_is_given_up_on_at_the_clients_timeout():
    def slow(h, raw):
        time.sleep(0.5)
        return 200, {"workers": []}

    with serving(slow) as url, pytest.raises(http.HttpError) as err:
        rt.Router(url, api_key=KEY, timeout=0.1).workers()
    assert isinstance(err.value.cause, TimeoutError)


def test_a_record_of_the_other_gateway_is_refused_naming_it_and_impl(gwsmg):
    gw, url = gwsmg
    gw.add_now(W1 + "/")
    with pytest.raises(rt.RouterError) as err:
        router(url).workers()
    assert str(err.value) == (
        f"{url}/workers lists {W1} with `status`, which sglang-router 0.3.2 never lists: is the gateway another one "
        "than impl sglang-router names?"
    )


def test_in_flight_reads_a_listing_given_rather_than_the_gateway(gwsmg):
    gw, url = gwsmg
    gw.add_now(W1, load=5)
    listing = [{"url": W1, "id": uuid(7), "status": "ready", "load": 2, "healthy": True}]
    assert router(url, impl="smg").in_flight(W1, listing=listing) == 2.0
    assert gets(gw) == 0


# --------------------------------------------------------------------------- the client: add and remove


def test_add_of_a_worker_in_rotation_decides_on_one_listing(gw32):
    gw, url = gw32
    wid = gw.add_now(W1)
    gw.at(2, lambda: gw.workers.pop(W1))  # removed by another client just after
    assert router(url).add(W1) == (wid, False)
    assert gets(gw) == 1 and gw.bodies == []


def test_add_of_a_record_without_an_id_reports_no_id(gw32, gwsmg):
    gw, url = gw32
    gw.add_now(W1)
    del gw.workers[W1]["id"]
    assert router(url).add(W1) == ("", False)
    # smg: listed again in rotation, without an id, while add waited out a draining record
    smg, smg_url = gwsmg
    d = smg.add_now(W1)
    smg.workers[W1].update(status="draining", is_healthy=False)

    def back_without_id():
        smg.drop(W1, d)
        smg.add_now(W1)
        del smg.workers[W1]["id"]

    smg.at(2, back_without_id)
    assert router(smg_url, impl="smg", poll=0.01).add(W1, timeout=5) == ("", False)
    # and when the 409 for it is followed by such a record
    smg.workers.clear()
    smg.on_post = lambda body: (409, {"code": "WORKER_ALREADY_EXISTS", "error": f"Worker {uuid(42)} already exists"})
    smg.at(2, back_without_id)
    assert router(smg_url, impl="smg").add(W1) == ("", False)


def test_smg_409_for_an_addition_in_progress_then_listed_is_its_id(gwsmg):
    gw, url = gwsmg
    gw.adding.add(W1)  # another client's addition: 409 WORKER_CREATE_IN_PROGRESS, no id named
    gw.at(2, lambda: gw.add_now(W1))
    assert router(url, impl="smg").add(W1) == (gw.workers[W1]["id"], False)
    assert gets(gw) == 2


def test_smg_409_naming_the_id_in_its_message_is_that_id(gwsmg):
    gw, url = gwsmg
    gw.on_post = lambda body: (409, {"code": "WORKER_ALREADY_EXISTS", "message": f"Worker {uuid(42)} already exists"})
    assert router(url, impl="smg").add(W1) == (uuid(42), False)


@pytest.mark.parametrize("code", [200, 201, 202])
def test_an_addition_accepted_with_any_success_is_added(gw32, code):
    gw, url = gw32
    gw.on_post = lambda body: (code, {"worker_id": uuid(5)})
    assert router(url).add(W1) == (uuid(5), True)
    gw.on_post = lambda body: (code, {"status": "accepted"})  # naming no id
    assert router(url).add(W2) == ("", True)


def test_an_addition_refused_is_an_error_quoting_the_answer(gw32):
    gw, url = gw32
    body = {"error": f"upstream said no to {KEY}: " + "n" * 400}
    gw.on_post = lambda b: (500, body)
    with pytest.raises(rt.RouterError) as err:
        router(url).add(W1 + "/")
    assert str(err.value) == f"POST {url}/workers {W1}: HTTP 500: " + str(body).replace(KEY, MASK)[:300]


def test_remove_with_every_removal_accepted_reads_the_listing_once(gw32):
    gw, url = gw32
    ids = [gw.add_now(W1), gw.add_now(W1 + "/")]
    assert router(url).remove(W1) == ids
    assert gets(gw) == 1 and deletes(gw) == ids


def test_remove_passes_over_a_record_smg_is_letting_go_to_the_next(gwsmg):
    gw, url = gwsmg
    gw.add_now(W1)
    gw.workers[W1].update(status="draining", is_healthy=False)
    ready = gw.add_now(W1 + "/")
    assert router(url, impl="smg").remove(W1) == [ready] and deletes(gw) == [ready]


def test_remove_of_a_record_without_an_id_is_an_error_naming_it(gw32):
    gw, url = gw32
    gw.workers[W1] = {"url": W1 + "/", "is_healthy": True}
    with pytest.raises(rt.RouterError) as err:
        router(url).remove(W1)
    assert (
        str(err.value)
        == f"{url}/workers lists {W1} without an id: {{'url': '{W1}', 'is_healthy': True, 'healthy': True}}"
    )
    assert deletes(gw) == []


@pytest.mark.parametrize("code", [200, 202, 204])
def test_a_removal_accepted_with_any_success_is_removed(gw32, code):
    gw, url = gw32
    wid = gw.add_now(W1)
    gw.on_delete = lambda w: (code, b"")
    assert router(url).remove(W1) == [wid]


def test_a_removal_refused_is_an_error_quoting_the_answer(gw32):
    gw, url = gw32
    wid = gw.add_now(W1 + "/")
    body = {"error": f"no, {KEY}: " + "m" * 400}
    gw.on_delete = lambda w: (500, body)
    with pytest.raises(rt.RouterError) as err:
        router(url).remove(W1)
    assert str(err.value) == f"DELETE {url}/workers/{wid} ({W1}): HTTP 500: " + str(body).replace(KEY, MASK)[:300]


def test_remove_after_a_404_removes_the_record_listed_anew_and_not_one_twice(gw32):
    """The gateway re-registered one of two records under a new id between the listing and its DELETE (404): the
    new one is removed, the one accepted is not asked again while it is still listed."""
    gw, url = gw32
    a = gw.add_now(W1)
    b = gw.add_now(W1 + "/")
    renewed = []

    def reregistered(wid):
        if wid == b and not renewed:
            renewed.append(gw.add_now(W1 + "/"))
            return 404, {"error": "WORKER_NOT_FOUND"}
        return None

    gw.on_delete = reregistered
    assert router(url).remove(W1) == [a, renewed[0]]
    assert deletes(gw) == [a, b, renewed[0]]


def test_remove_after_a_404_goes_on_in_listing_order(gw32):
    gw, url = gw32
    a = gw.add_now(W1)
    b = gw.add_now(W1 + "/")
    renewed = []

    def reregistered(wid):
        if wid == a and not renewed:
            renewed.append(gw.add_now(W1))  # in the first record's place
            return 404, {"error": "WORKER_NOT_FOUND"}
        return None

    gw.on_delete = reregistered
    ids = router(url).remove(W1)
    assert ids == [b, renewed[0]]  # worker_id, the first, is the one the first listing's DELETEs removed


def test_remove_ends_when_the_last_round_leaves_nothing_in_rotation_it_has_not_asked(gw32):
    """Two restarts in a row (each DELETE 404, the worker listed anew), then a duplicate record removed by another
    client (404, gone): what is left is the record whose removal was accepted, still listed for a moment."""
    gw, url = gw32
    first = gw.add_now(W1)
    script = {}

    def bad_day(wid):
        if wid == first:
            script["second"] = gw.add_now(W1)
            return 404, {}
        if wid == script.get("second"):
            script["third"] = gw.add_now(W1)
            script["dup"] = gw.add_now(W1 + "/")
            return 404, {}
        if wid == script.get("dup"):
            del gw.workers[W1 + "/"]
            return 404, {}
        return None

    gw.on_delete = bad_day
    assert router(url).remove(W1) == [script["third"]]


def test_remove_gives_up_on_a_worker_listed_anew_after_every_removal(gw32):
    gw, url = gw32
    ids = [gw.add_now(W1)]

    def anew(wid):
        ids.append(gw.add_now(W1))
        return 404, {}

    gw.on_delete = anew
    with pytest.raises(rt.RouterError) as err:
        router(url).remove(W1 + "/")
    assert str(err.value) == (
        f"{url} still lists {W1} under a new id after 3 removals answered 404 (ids tried: {', '.join(ids[:3])})"
    )


# --------------------------------------------------------------------------- the client: waits


def slow_router(url: str, impl: str = "sglang-router", **kw) -> tuple[rt.Router, FakeClock]:
    clock = FakeClock()
    return rt.Router(url, api_key=KEY, impl=impl, clock=clock, sleep=clock.sleep, **kw), clock


def test_a_wait_takes_its_time_in_the_clients_own_poll_and_says_it_to_the_millisecond(gw32):
    gw, url = gw32
    gw.add_now(W1, healthy=False)
    gw.at(4, lambda: gw.healthy(W1))  # healthy at the 4th listing: three polls
    r, _ = slow_router(url)  # the default poll: 0.1 s
    assert r.wait_healthy(W1, timeout=5) == 0.3
    gw.workers[W1]["is_healthy"] = False
    gw.at(4, lambda: gw.healthy(W1))
    r, _ = slow_router(url, poll=0.1234)
    assert r.wait_healthy(W1, timeout=5) == 0.37  # 3 x 0.1234 s, to the millisecond
    gw.workers[W1]["is_healthy"] = False
    gw.at(4, lambda: gw.healthy(W1))
    r, _ = slow_router(url, poll=0.25)
    assert r.wait_healthy(W1, timeout=5) == 0.75


@pytest.mark.parametrize("timeout, healthy", [(2, False), (3, True), (4, True)])
def test_a_wait_ends_at_its_timeout_to_the_poll(gw32, timeout, healthy):
    """Polls at 0, 1, 2, 3 s; healthy from the 4th listing (3 s): a timeout of 3 s sees it, one of 2 s does not."""
    gw, url = gw32
    gw.add_now(W1, healthy=False)
    gw.at(4, lambda: gw.healthy(W1))
    r, _ = slow_router(url, poll=1.0)
    if healthy:
        assert r.wait_healthy(W1 + "/", timeout=timeout) == 3.0
    else:
        with pytest.raises(rt.RouterError) as err:
            r.wait_healthy(W1 + "/", timeout=timeout)
        assert str(err.value) == f"{url} does not list {W1} as healthy after 2 s (last: listed, not healthy)"


def test_a_wait_polls_through_a_gateway_that_fails_and_names_its_last_failure():
    answers = [(503, {"error": "starting"}), (200, {"workers": [{"id": uuid(1), "url": W1, "is_healthy": True}]})]

    def flaky(h, raw):
        return answers.pop(0) if len(answers) > 1 else answers[0]

    with serving(flaky) as url:
        r, _ = slow_router(url, poll=1.0)
        assert r.wait_healthy(W1, timeout=5) == 1.0  # the 503 was no answer: polled on
        answers[:] = [(503, {"error": "starting"})]
        with pytest.raises(rt.RouterError) as err:
            r.wait_healthy(W1, timeout=1)
    assert str(err.value) == (
        f"{url} does not list {W1} as healthy after 1 s (last: GET {url}/workers: HTTP 503: {{'error': 'starting'}})"
    )


def test_a_wait_resolves_each_name_once_for_all_its_polls(gw32, gwsmg):
    """Resolver: one per decision; a wait is one decision however many times it polls."""
    gw, url = gw32
    calls: list[str] = []
    dns = fake_dns({"gpu-a": ["10.0.0.1"]}, calls)
    gw.add_now(W1, healthy=False)
    gw.at(3, lambda: gw.healthy(W1))
    r, _ = slow_router(url, getaddrinfo=dns)
    assert r.wait_healthy("http://gpu-a:30000", timeout=5) == 0.2 and calls == ["gpu-a"]
    calls.clear()
    gw.at(3, lambda: gw.workers.pop(W1))  # listed at two polls, gone at the third
    assert r.wait_gone("http://gpu-a:30000", timeout=5) == 0.2 and calls == ["gpu-a"]
    # find and in_flight with a resolver given: that one
    smg, smg_url = gwsmg
    d = smg.add_now(W1, load=2)
    s, _ = slow_router(smg_url, impl="smg", getaddrinfo=dns)
    calls.clear()
    shared = s.resolver()
    assert [w["id"] for w in s.find("http://gpu-a:30000", shared)] == [d]
    assert s.in_flight("http://gpu-a:30000", resolver=shared) == 2.0
    read = s.reader("http://gpu-a:30000")
    assert [read(), read(), read()] == [2.0, 2.0, 2.0] and calls == ["gpu-a", "gpu-a"]  # shared's, the reader's
    # wait_left: until the draining record goes
    smg.workers[W1].update(status="draining", is_healthy=False)
    smg.at(3, lambda: smg.drop(W1, d))
    calls.clear()
    assert s.wait_left("http://gpu-a:30000", timeout=5) == 0.2 and calls == ["gpu-a"]


def test_a_wait_for_a_draining_record_names_it_at_its_timeout(gwsmg):
    gw, url = gwsmg
    wid = gw.add_now(W1)
    gw.workers[W1].update(status="draining", is_healthy=False)
    r, _ = slow_router(url, impl="smg", poll=1.0)
    with pytest.raises(rt.RouterError) as err:
        r.wait_left(W1 + "/", timeout=2)
    assert str(err.value) == f"{url} still lists {W1} after 2 s (last: still listed (id {wid} draining))"


def test_a_wait_names_each_record_of_the_worker_with_its_state(gwsmg):
    """The worker registered twice (two spellings of its URL), both records draining: each id with its state, in
    the gateway's order, one after the other."""
    gw, url = gwsmg
    first, second = gw.add_now(W1), gw.add_now(W1 + "/")
    for w in (W1, W1 + "/"):
        gw.workers[w].update(status="draining", is_healthy=False)
    r, _ = slow_router(url, impl="smg", poll=1.0)
    with pytest.raises(rt.RouterError) as err:
        r.wait_left(W1, timeout=2)
    assert str(err.value) == (
        f"{url} still lists {W1} after 2 s (last: still listed (id {first} draining, {second} draining))"
    )


# --------------------------------------------------------------------------- the worker: load, health, drain


def test_read_load_says_each_kind_of_answer_in_the_same_four_fields():
    with worker((3.0, None), (None, 1.0), (2.0, 1.0), ("status", 503), ("status", 404)) as (_, url):
        m = f"{url}/metrics"
        enable = "(SGLang serves /metrics and its load gauges only with --enable-metrics)"
        assert wl.read_load(url) == {
            "state": "no_metrics",
            "running": 3.0,
            "queued": None,
            "why": f"{m} has no sglang:num_queue_reqs {enable}",
        }
        assert wl.read_load(url) == {
            "state": "no_metrics",
            "running": None,
            "queued": 1.0,
            "why": f"{m} has no sglang:num_running_reqs {enable}",
        }
        assert wl.read_load(url) == {"state": "load", "running": 2.0, "queued": 1.0, "why": "2 running, 1 queued"}
        assert wl.read_load(url) == {"state": "error", "running": None, "queued": None, "why": f"{m} answered HTTP 503"}
        assert wl.read_load(url) == {
            "state": "no_metrics",
            "running": None,
            "queued": None,
            "why": f"{m} answered HTTP 404 {enable}",
        }
    gone = f"http://127.0.0.1:{closed_port()}"
    assert wl.read_load(gone) == {
        "state": "nothing_listens",
        "running": None,
        "queued": None,
        "why": "connection refused",
    }
    with serving(lambda h, raw: hang_up(h)) as url:
        out = wl.read_load(url)
    assert out == {"state": "error", "running": None, "queued": None, "why": out["why"]}
    assert out["why"].startswith(f"{url}/metrics: ")  # what the failure was, in its own words


def test_metrics_with_bytes_that_are_not_utf8_are_read():
    """A label value (a model path, say) in another encoding: the gauges are read all the same."""
    text = b'sglang:num_running_reqs{model_name="m\xe9"} 2\nsglang:num_queue_reqs{model_name="m\xe9"} 1\n'
    with serving(lambda h, raw: (200, text)) as url:
        assert wl.read_load(url)["state"] == "load"
        assert wl.running_requests(url) == 2.0


def test_running_requests_is_the_gauge_or_an_error_naming_the_answer():
    with worker(("status", 503)) as (_, url), pytest.raises(http.HttpError) as err:
        wl.running_requests(url)
    assert str(err.value) == f"{url}/metrics: HTTP 503"
    with worker(("slow", 0.5, 1.0)) as (_, url), pytest.raises(http.HttpError) as err:
        wl.running_requests(url, timeout=0.1)
    assert isinstance(err.value.cause, TimeoutError)


def test_serving_is_its_own_health_answered_200():
    with worker() as (w, url):
        assert wl.serving(url + "/") == (True, "")
        w.health = ("status", 503)
        assert wl.serving(url) == (False, f"{url}/health answered HTTP 503")


def drain_on(url: str, **kw) -> dict:
    clock = FakeClock()
    return wl.drain(url, clock=clock, sleep=clock.sleep, **kw)


def test_drain_polls_every_tenth_of_a_second_by_default_and_says_its_seconds_to_the_millisecond():
    with worker(1.0, 0.0) as (w, url):
        assert drain_on(url, timeout=60)["seconds"] == 0.3  # 1 at 0, 0 at 0.1, 0.2, 0.3: 0.2 s of zeros
        w.script[:] = [1.0, 0.0]
        assert drain_on(url, timeout=60, poll=0.1234)["seconds"] == 0.37  # 3 x 0.1234 s


def test_drain_ends_when_the_zeros_last_the_settle_time_to_the_instant():
    settle = 0.5 + 1e-6  # less the float tolerance (1e-6): 0.5 s exactly, the two reads' distance
    with worker(0.0) as (_, url):
        assert drain_on(url, timeout=60, poll=0.5, settle_s=settle)["seconds"] == 0.5


def test_drain_of_a_worker_without_a_gauge_reports_what_it_read():
    with worker((3.0, None)) as (_, url):
        out = drain_on(url, timeout=60)
    assert out == {
        "drained": False,
        "seconds": 0.0,
        "running": 3.0,
        "queued": None,
        "why": f"cannot be drained on evidence: {url}/metrics has no sglang:num_queue_reqs (SGLang serves /metrics "
        "and its load gauges only with --enable-metrics)",
    }


# --------------------------------------------------------------------------- inspect's reads


def test_inspect_reads_an_unanswered_metrics_again_each_poll_within_retry_s(gw32):
    """Reads at 0 s and then each second while a next one fits within retry_s (its default poll: 1 s)."""
    _, url = gw32
    with worker(("status", 503)) as (w, busy):
        for retry_s, reads in ((0, 1), (1.5, 2), (2, 3), (2.5, 3), (10, 11)):
            w.script[:] = [("status", 503)]
            w.scrapes = 0
            clock = FakeClock()
            ra.inspect(router(url), [busy], timeout=2, retry_s=retry_s, clock=clock, sleep=clock.sleep)
            assert w.scrapes == reads, retry_s
        w.script[:] = [("status", 503)] * 3 + [("slow", 0.5, 0.0)]  # then a read past its timeout
        clock = FakeClock()
        out = ra.inspect(router(url), [busy], timeout=0.1, retry_s=5, clock=clock, sleep=clock.sleep)
    assert out["workers"][0]["why"].startswith("not drainable: no answer in time (")


def test_inspect_resolves_each_name_once_for_every_worker_it_matches(gw32):
    gw, url = gw32
    calls: list[str] = []
    dns = fake_dns({"gpu-b": ["10.0.0.2"], "gpu-c": ["10.0.0.3"]}, calls)
    with worker() as (_, w):
        port = urllib.parse.urlsplit(w).port
        gw.add_now(f"http://gpu-b:{port}")
        r = rt.Router(url, api_key=KEY, getaddrinfo=dns)
        out = ra.inspect(r, [w, f"http://localhost:{port}"], timeout=2, retry_s=0)
    assert [x["listed"] for x in out["workers"]] == [False, False]
    assert sorted(calls) == ["gpu-b", "localhost"]  # gpu-b once, for both


def test_inspect_reads_every_worker_at_once_sixteen_at_most(gw32):
    """Each read of /health and /metrics is held until a 17th is in flight, or 2 s (room for 16 threads to connect on a busy machine): all 16 of 8 workers at once,
    never more than 16 (9 workers: 18 reads)."""
    _, url = gw32
    lock = threading.Lock()
    seen = {"active": 0, "peak": 0}
    more = threading.Event()

    def respond(h, raw):
        with lock:
            seen["active"] += 1
            seen["peak"] = max(seen["peak"], seen["active"])
            if seen["active"] > 16:
                more.set()
        more.wait(2.0)
        with lock:
            seen["active"] -= 1
        return (200, b"") if h.path.endswith("/health") else (200, metrics_text(0.0, 0.0))

    with serving(respond) as base:
        out = ra.inspect(router(url), [f"{base}/w{i}" for i in range(9)], timeout=5, retry_s=0)
    assert all(w["drainable"] and w["serving"] for w in out["workers"])
    assert seen["peak"] == 16


# --------------------------------------------------------------------------- URLs


def test_worker_urls_in_each_spelling():
    assert wu.worker_url("XEON-01", 30000) == "http://XEON-01:30000"
    assert wu.worker_url("[fd00::12]", "30001", "https") == "https://[fd00::12]:30001"
    assert wu.normalize(" http://NODE-X/ ") == "http://NODE-X"
    assert wu.posted("gpu-node-01:30000/") == "gpu-node-01:30000"  # no scheme: as written, less the slash
    assert wu.posted("HTTP://NODE-X:30000/v1") == "http://NODE-X:30000"


def test_a_url_that_is_not_a_worker_url_is_refused_naming_it():
    with pytest.raises(ValueError) as err:
        wu.canonical("http:\t//gpu-node-01:30000")  # urlsplit drops the tab: a URL only once "fixed"
    assert str(err.value) == "not a worker URL (scheme://host:port): 'http:\\t//gpu-node-01:30000'"
    with pytest.raises(ValueError) as err:
        wu.canonical("ftp://gpu-node-01")
    assert str(err.value) == "no port, and no default port for ftp: 'ftp://gpu-node-01'"


def test_a_name_resolved_to_a_link_local_address_is_that_address_whatever_its_scope():
    """getaddrinfo writes a link-local IPv6 address with its interface (fe80::12%eth0); a router lists it without."""
    calls: list[str] = []
    dns = wu.Resolver(fake_dns({"gpu-a": ["fe80::12%eth0"]}, calls))
    assert dns.same("http://gpu-a:30000", "http://[fe80::12]:30000")
