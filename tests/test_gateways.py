"""Two gateways in front of the same workers (sglang_deploy/gateways.py, issue #32): every action on each, the
worker drained once after it left both, a gateway down or refusing named, and the quorum deciding whether the step
counts. Against the fakes of sglang-router 0.3.2 and smg 1.13.0 (tests/support/fake_gateway.py) and of SGLang's
worker, on loopback."""

from __future__ import annotations

import pytest

from sglang_deploy import gateways as gws
from sglang_deploy import outcomes
from sglang_deploy import router as rt
from support.fake_gateway import KEY, W1, W2, Gateway, closed_port, deletes, params, serving, worker


@pytest.fixture
def pair():
    """sglang-router 0.3.2 as gw-a, smg as gw-b; the module's routers for them."""
    a, b = Gateway(), Gateway(smg=True, settle=2)
    with serving(a.respond) as ua, serving(b.respond) as ub:
        routers = [
            {"name": "gw-a", "url": ua, "impl": "sglang-router", "api_key": KEY},
            {"name": "gw-b", "url": ub, "impl": "smg", "api_key": None},  # the module's api_key stands in
        ]
        yield a, b, routers


def down(name: str = "gw-down") -> dict:
    return {"name": name, "url": f"http://127.0.0.1:{closed_port()}", "impl": "smg", "api_key": KEY}


def test_one_gateway_given_as_routers_is_the_single_gateways_action_unchanged(pair):
    a, _, routers = pair
    a.add_now(W1)
    one = gws.act_all(params(action="list", routers=routers[:1], api_key=KEY))
    assert one == rt.act(params(action="list", router_url=routers[0]["url"], api_key=KEY))
    assert "gateways" not in one


def test_remove_takes_the_worker_out_of_every_gateway_then_drains_it_once(pair):
    a, b, routers = pair
    with worker(2.0, 1.0, 0.0) as (w, url):
        ida, idb = a.add_now(url), b.add_now(url, load=1)
        other = a.add_now(W2)
        out = gws.act_all(
            params(
                action="remove", routers=routers, api_key=KEY, worker_url=url, drain=True, timeout=5, drain_timeout=10
            )
        )
        assert deletes(a) == [ida] and deletes(b) == [idb]
        assert url not in a.workers and url not in b.workers
        assert out["changed"] is True
        assert out["worker_id"] == ida and out["worker_ids"] == [ida, idb]
        assert out["workers"] == [{"url": W2, "id": other, "healthy": True}]  # the first gateway's listing
        assert out["gateways"] == [
            {"name": "gw-a", "url": routers[0]["url"], "ok": True},
            {"name": "gw-b", "url": routers[1]["url"], "ok": True},
        ]
        assert out["drain"]["drained"] is True and out["drain"]["why"] == "no running or queued requests"
        assert w.scrapes >= 4  # 2 running, 1, then 0 twice over the settle window: one drain, on the worker
        assert out["drain"]["gateway_in_flight"] is None  # smg let it go: no count left to read


def test_a_gateway_down_fails_the_step_with_what_the_others_did_and_no_drain(pair):
    a, _, routers = pair
    gone = down()
    with worker(0.0) as (w, url):
        ida = a.add_now(url)
        with pytest.raises(rt.ActionFailed) as err:
            gws.act_all(
                params(action="remove", routers=[routers[0], gone], api_key=KEY, worker_url=url, drain=True, timeout=5)
            )
        msg = str(err.value)
        assert msg.startswith("1 of 2 gateways carried it out, 2 wanted (--gateway-quorum): gw-down: ")
        assert "gw-a" not in msg
        result = err.value.result
        assert result["worker_id"] == ida  # out of gw-a: the rollout's rescue puts it back
        assert [g["ok"] for g in result["gateways"]] == [True, False]
        assert result["gateways"][1]["why"] and "drain" not in result
        assert w.scrapes == 0  # not drained: it may still get requests from nowhere, but the step failed first


def test_a_quorum_of_one_goes_on_without_the_gateway_that_is_down_and_names_it(pair):
    a, _, routers = pair
    gone = down()
    with worker(0.0) as (_, url):
        a.add_now(url)
        p = params(action="remove", routers=[gone, routers[0]], quorum=1, api_key=KEY, worker_url=url, drain=True)
        out = gws.act_all({**p, "timeout": 5, "drain_timeout": 10})
        assert out["drain"]["drained"] is True
        assert out["gateways"][0]["name"] == "gw-down" and out["gateways"][0]["ok"] is False
        assert "Connection refused" in out["gateways"][0]["why"] or "refused" in out["gateways"][0]["why"]
        assert out["gateways"][1] == {"name": "gw-a", "url": routers[0]["url"], "ok": True}
        # the answering gateway gives the result's fields, not the one that is down
        assert out["worker_id"] == out["worker_ids"][0] and url not in a.workers


def test_a_gateway_that_does_not_list_the_worker_fails_its_part(pair):
    a, _, routers = pair
    with worker(0.0) as (_, url):
        a.add_now(url)  # gw-b never had it
        with pytest.raises(rt.ActionFailed) as err:
            gws.act_all(params(action="remove", routers=routers, api_key=KEY, worker_url=url, timeout=5))
        assert str(err.value).endswith(
            f"gw-b: {routers[1]['url']} does not list {url} under any spelling; it lists: no worker"
        )
        assert url not in a.workers  # what gw-a did stands, and the result says so
        assert err.value.result["worker_id"] is not None


def test_add_puts_the_worker_into_every_gateway_and_waits_until_each_says_healthy(pair):
    a, b, routers = pair
    with worker(0.0) as (_, url):
        out = gws.act_all(params(action="add", routers=routers, api_key=KEY, worker_url=url, timeout=10))
        assert a.workers[url]["is_healthy"] and b.workers[url]["status"] == "ready"
        assert b.bodies[-1].get("api_key") == KEY  # smg gets the worker's key (the module's, gw-b has none)
        assert out["changed"] is True and [g["ok"] for g in out["gateways"]] == [True, True]
        assert out["worker_id"] == a.workers[url]["id"]


def test_inspect_says_each_gateways_view_and_a_worker_missing_from_one_is_a_problem(pair):
    a, b, routers = pair
    with worker(0.0) as (_, u1), worker(0.0) as (_, u2):
        a.add_now(u1), b.add_now(u1), a.add_now(u2, healthy=False)
        out = gws.act_all(params(action="inspect", routers=routers, api_key=KEY, worker_urls=[u1, u2], timeout=5))
        first, second = out["workers"]
        assert first["listed"] is True and first["healthy_in_router"] is True
        assert first["gateways"] == {
            "gw-a": {"listed": True, "healthy_in_router": True},
            "gw-b": {"listed": True, "healthy_in_router": True},
        }
        assert len(first["ids"]) == 2 and first["serving"] is True and first["drainable"] is True
        assert second["listed"] is False and second["healthy_in_router"] is False  # listed by gw-a only, unhealthy
        assert second["gateways"]["gw-b"] == {"listed": False, "healthy_in_router": None}
        assert out["problems"] == [f"{u2}: not listed by the router {routers[1]['url']} (it lists: {u1})"]
        with pytest.raises(rt.ActionFailed) as err:
            gws.act_all(
                params(action="inspect", routers=routers, api_key=KEY, worker_urls=[u1, u2], fail_on_problems=True)
            )
        assert err.value.result["outcome"] == outcomes.INVALID_CONFIG
        assert str(err.value) == out["problems"][0]


def test_inspect_with_a_gateway_down_fails_unless_the_quorum_allows_it(pair):
    a, _, routers = pair
    with worker(0.0) as (_, url):
        a.add_now(url)
        p = params(action="inspect", routers=[routers[0], down()], api_key=KEY, worker_urls=[url], timeout=5)
        with pytest.raises(rt.ActionFailed, match=r"^1 of 2 gateways carried it out, 2 wanted"):
            gws.act_all(p)
        out = gws.act_all({**p, "quorum": 1})
        assert out["workers"][0]["listed"] is True and out["problems"] == []
        assert [g["ok"] for g in out["gateways"]] == [True, False]


@pytest.mark.parametrize("quorum", [0, 3, -1])
def test_a_quorum_outside_the_gateways_is_refused_before_any_request(pair, quorum):
    a, b, routers = pair
    with pytest.raises(rt.RouterError, match=f"^quorum={quorum}: between 1 and the 2 gateway"):
        gws.act_all(params(action="list", routers=routers, quorum=quorum, api_key=KEY))
    assert a.requests == [] and b.requests == []


def test_a_gateway_named_twice_is_refused(pair):
    _, _, routers = pair
    with pytest.raises(rt.RouterError, match=r"^routers: gw-a given twice"):
        gws.act_all(params(action="list", routers=[routers[0], {**routers[1], "name": "gw-a"}], api_key=KEY))


def test_list_gives_the_first_gateways_workers_and_every_gateways_state(pair):
    a, b, routers = pair
    a.add_now(W1), b.add_now(W2)
    out = gws.act_all(params(action="list", routers=routers, api_key=KEY))
    assert [w["url"] for w in out["workers"]] == [W1]
    assert [g["ok"] for g in out["gateways"]] == [True, True] and out["changed"] is False


def test_drain_alone_sums_every_smg_gateways_own_count_beside_the_workers_gauges(pair):
    a, b, routers = pair
    c = Gateway(smg=True)
    with serving(c.respond) as uc, worker(0.0) as (_, url):
        a.add_now(url), b.add_now(url, load=2), c.add_now(url, load=1)
        three = [*routers, {"name": "gw-c", "url": uc, "impl": "smg", "api_key": KEY}]
        out = gws.act_all(params(action="drain", routers=three, api_key=KEY, worker_url=url, drain_timeout=10))
        assert out["drain"]["drained"] is True and out["drain"]["gateway_in_flight"] == 3.0  # 0.3.2 keeps none
        assert out["worker_url"] == url and out["seconds"] == out["drain"]["seconds"]
        # a gateway that does not answer adds nothing, and fails nothing: the worker's gauges decide
        out = gws.act_all(
            params(action="drain", routers=[*three, down()], api_key=KEY, worker_url=url, drain_timeout=10)
        )
        assert out["drain"]["gateway_in_flight"] == 3.0


def test_drain_alone_that_does_not_drain_fails_with_its_result(pair):
    _, _, routers = pair
    with worker(5.0) as (_, url):
        with pytest.raises(rt.ActionFailed, match=r"^not drained: drain timeout \(0.3 s\)") as err:
            gws.act_all(params(action="drain", routers=routers, api_key=KEY, worker_url=url, drain_timeout=0.3))
        assert err.value.result["drain"]["drained"] is False and err.value.result["drain"]["running"] == 5.0
