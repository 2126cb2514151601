"""Two gateways in front of the same workers (sglang_deploy/gateways.py, issue #32): every action on each, the
worker drained once after it left both, a gateway down or refusing named, and the quorum deciding whether the step
counts. Against the fakes of sglang-router 0.3.2 and smg 1.13.0 (tests/support/fake_gateway.py) and of SGLang's
worker, on loopback."""

from __future__ import annotations

import math

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import gateways as gws
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router as rt
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import router_actions as ra
from support import REPO
from support.fake_gateway import KEY, W1, W2, Gateway, closed_port, deletes, params, serving, worker
from support.modules import http_server, run_module


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
    """A gateway nothing listens for (a closed loopback port)."""
    return {"name": name, "url": f"http://127.0.0.1:{closed_port()}", "impl": "smg", "api_key": KEY}


def test_one_gateway_given_as_routers_is_the_single_gateways_action_unchanged(pair):
    a, _, routers = pair
    a.add_now(W1)
    one = gws.act_all(params(action="list", routers=routers[:1], api_key=KEY))
    assert one == ra.act(params(action="list", router_url=routers[0]["url"], api_key=KEY))
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
        with pytest.raises(ra.ActionFailed) as err:
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
        with pytest.raises(ra.ActionFailed) as err:
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
        assert second["listed"] is False and second["healthy_in_router"] is None  # listed by gw-a only: each view below
        assert second["gateways"]["gw-b"] == {"listed": False, "healthy_in_router": None}
        assert out["problems"] == [
            f"{u2}: not listed by the router {routers[1]['url']} (it lists: {u1}{ra.SENTINEL_HINT})"
        ]
        with pytest.raises(ra.ActionFailed) as err:
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
        with pytest.raises(ra.ActionFailed, match=r"^1 of 2 gateways carried it out, 2 wanted"):
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
        with pytest.raises(ra.ActionFailed, match=r"^not drained: drain timeout \(0.3 s\)") as err:
            gws.act_all(params(action="drain", routers=routers, api_key=KEY, worker_url=url, drain_timeout=0.3))
        assert err.value.result["drain"]["drained"] is False and err.value.result["drain"]["running"] == 5.0


def metrics_of(states: dict[str, float]):
    """A gateway's Prometheus endpoint: smg_worker_cb_state per worker label (and a series that is not it)."""
    lines = ["# TYPE smg_worker_cb_state gauge", 'smg_worker_health{worker="x"} 1']
    lines += [f'smg_worker_cb_state{{worker="{url}"}} {v}' for url, v in states.items()]
    return lambda h, raw: (200, "\n".join(lines) + "\n") if h.path == "/metrics" else (404, "no")


def test_view_says_what_every_gateway_thinks_of_each_worker_and_a_gateway_down_is_a_row(pair):
    a, b, routers = pair
    a.add_now(W1), b.add_now(W1.upper() + "/", load=2)  # smg lists it under another spelling: the same worker
    a.add_now(W2, healthy=False)
    with serving(metrics_of({W1: 0, W2: 1})) as ma, serving(metrics_of({W1: 2})) as mb:
        three = [{**routers[0], "metrics_url": ma}, {**routers[1], "metrics_url": mb}, down()]
        out = gws.act_all(params(action="view", routers=three, api_key=KEY, worker_urls=[W1, W2], timeout=5))
    gone = [r for r in out["view"] if r["gateway"] == "gw-down"]
    assert [r["worker"] for r in gone] == [W1, W2]
    assert all(r["why"].startswith("the gateway did not answer: ") and r["listed"] is None for r in gone)
    rows = {(r["worker"], r["gateway"]): {k: v for k, v in r.items() if k not in ("worker", "gateway")} for r in out["view"] if r["gateway"] != "gw-down"}  # fmt: skip
    assert rows == {
        (W1, "gw-a"): {"listed": True, "healthy": True, "status": None, "in_flight": None, "circuit": "closed", "why": ""},
        (W1, "gw-b"): {"listed": True, "healthy": True, "status": "ready", "in_flight": 2.0, "circuit": "half-open", "why": ""},
        (W2, "gw-a"): {"listed": True, "healthy": False, "status": None, "in_flight": None, "circuit": "open", "why": ""},
        (W2, "gw-b"): {"listed": False, "healthy": None, "status": None, "in_flight": None, "circuit": None, "why": ""},
    }  # fmt: skip
    assert [r["gateway"] for r in out["view"]] == ["gw-a", "gw-b", "gw-down"] * 2  # by worker, then gateway
    assert out["changed"] is False


def test_view_without_a_metrics_endpoint_or_with_one_that_fails_says_so(pair):
    a, _, routers = pair
    a.add_now(W1)
    with serving(lambda h, raw: (503, "busy")) as busy:
        p = params(action="view", routers=[routers[0], {**routers[1], "metrics_url": busy}], api_key=KEY)
        out = gws.act_all({**p, "worker_urls": [W1], "timeout": 5})
    first, second = out["view"]
    assert first["circuit"] is None and first["why"] == ""  # none named: nothing to read, nothing wrong
    assert second["why"] == "its /metrics answered HTTP 503" and second["listed"] is False


# ------------------------------------------------------------------ a gateway's bad day (issue #32's review)


def task(path: str, name: str) -> dict:
    return next(t for t in yaml.safe_load((REPO / path).read_text()) if t.get("name") == name)


def render(expr: str, **variables):
    return Templar(loader=DataLoader(), variables=variables).template(trust_as_template(expr))


# ------------------------------------------------------------------ the rescue's readers


def test_a_group_removed_from_one_gateway_but_refused_by_another_goes_back_into_the_first(pair):
    """rollout_groups.yml: a removal below the quorum leaves the group unrolled; the gateways that let it go get it
    back (the failed result's worker_id says some did), and a removal nobody carried out puts back nothing."""
    a, _, routers = pair
    with worker(0.0) as (_, url):
        a.add_now(url)
        with pytest.raises(ra.ActionFailed) as err:
            gws.act_all(
                params(api_key=KEY, action="remove", routers=[routers[0], down("gw-down")], worker_url=url, timeout=5)
            )
        assert url not in a.workers and err.value.result["worker_id"]  # out of gw-a
    path = "roles/sglang_service/tasks/rollout_groups.yml"
    partly = {
        **err.value.result,
        "failed": True,
        "msg": str(err.value),
        "__sglang_service_lead": {"key": "g", "value": url},
    }
    nobody = {"failed": True, "msg": "refused", "worker_id": None, "__sglang_service_lead": {"key": "h", "value": "x"}}
    went = {"changed": True, "worker_id": "i", "__sglang_service_lead": {"key": "k", "value": "y"}}
    back = render(
        task(path, "Put back the groups whose removal failed on some gateways only")["loop"],
        __sglang_service_rollout_removed={"results": [partly, nobody, went]},
    )
    assert [i["__sglang_service_lead"]["key"] for i in back] == ["g"]


def test_an_accepted_removal_whose_wait_timed_out_still_names_its_id_for_the_rescue(pair):
    """gw-a took the DELETE (the worker leaves it) but its wait for it to go timed out, gw-b is down: the
    failed result still names gw-a's id, so that the rollout's rescue puts the worker back (rollout_instance.yml)."""
    a, _, routers = pair
    with worker(0.0) as (_, url):
        ida = a.add_now(url)
        a.on_delete = lambda wid: (202, {"status": "accepted", "worker_id": wid})  # queued, listed a while yet
        with pytest.raises(ra.ActionFailed) as err:
            gws.act_all(
                params(api_key=KEY, action="remove", routers=[routers[0], down("gw-down")], worker_url=url, timeout=0.3)
            )
        assert ("DELETE", f"/workers/{ida}") in a.requests
        assert err.value.result.get("worker_id") == ida


def test_inspect_with_no_gateway_answering_does_not_say_the_workers_do_not_serve(pair):
    """No gateway answers: the inspection fails as with one gateway down, saying nothing of the workers (never
    "not serving" for a worker it did not read: rollout_replica.yml would take that for a verdict)."""
    with worker(0.0) as (_, url):
        with pytest.raises(rt.RouterError) as err:
            gws.act_all(
                params(api_key=KEY, action="inspect", routers=[down("g1"), down("g2")], worker_urls=[url], timeout=5)
            )
        assert not isinstance(err.value, ra.ActionFailed)  # no result: nothing said of the worker
        assert str(err.value).startswith("0 of 2 gateways carried it out, 2 wanted (--gateway-quorum): g1: ")


# ------------------------------------------------------------------ what the single gateway refuses, refused too


@pytest.mark.parametrize("action", ["drain", "inspect"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_wait_that_could_never_end_is_refused_with_several_gateways_too(pair, monkeypatch, action, value):
    """A wait that would never end is refused before any request, as router_actions.act refuses it."""
    _, _, routers = pair
    monkeypatch.setattr(gws, "drain", lambda *a, **k: pytest.fail("drain started with an endless timeout"))
    name = "drain_timeout" if action == "drain" else "timeout"
    p = params(
        api_key=KEY, action=action, routers=routers, worker_url="http://127.0.0.1:1", worker_urls=["http://127.0.0.1:1"]
    )
    with pytest.raises(rt.RouterError, match=rf"^{name}="):
        gws.act_all({**p, name: value})


def test_the_same_gateway_under_two_names_is_refused(pair):
    """One gateway under two names would count twice toward the quorum: refused."""
    _, _, routers = pair
    with pytest.raises(rt.RouterError, match="twice"):
        gws.act_all(params(api_key=KEY, action="list", routers=[routers[0], {**routers[0], "name": "alias"}]))


@pytest.mark.parametrize(
    "p",
    [
        {"routers": "one", "quorum": 2},
        {"routers": "one", "quorum": 0},
        {"routers": "two", "quorum": 5, "action": "drain"},
    ],
)
def test_a_quorum_outside_the_gateways_is_refused_whatever_the_action_or_count(pair, p):
    a, b, routers = pair
    given = routers[:1] if p["routers"] == "one" else routers
    args = params(
        api_key=KEY, action=p.get("action", "list"), routers=given, quorum=p["quorum"], worker_url="http://127.0.0.1:1"
    )
    with pytest.raises(rt.RouterError, match=r"^quorum="):
        gws.act_all({**args, "drain_timeout": 0.1})
    assert a.requests == [] and b.requests == []


def test_an_empty_routers_list_is_refused_with_a_message():
    """routers: [] passes the module's required_if (the key is given): refused with a message, not a traceback."""
    with pytest.raises(rt.RouterError):
        gws.act_all(params(api_key=KEY, action="list", routers=[]))


def test_a_gateway_that_refused_the_removal_and_still_routes_to_the_worker_counts_in_the_drain(pair):
    """quorum 1: gw-b (smg) refuses the DELETE and keeps routing to the worker, 3 requests in flight: its count is
    in the drain's evidence (evidence only: the worker's gauges decide)."""
    a, b, routers = pair
    with worker(0.0) as (_, url):
        a.add_now(url), b.add_now(url, load=3)
        b.on_delete = lambda wid: (500, {"error": "internal"})
        out = gws.act_all(
            params(
                api_key=KEY,
                action="remove",
                routers=routers,
                quorum=1,
                worker_url=url,
                drain=True,
                timeout=5,
                drain_timeout=2,
            )
        )
        assert b.workers[url]["status"] == "ready"  # still routed to
        assert out["drain"]["gateway_in_flight"] == 3.0 and out["drain"]["drained"] is True


def test_every_gateways_key_is_masked_in_the_modules_result(tmp_path):
    keys = ["gwkey-" + "a1" * 30, "gwkey-" + "b2" * 30]

    def echo(key):
        def handle(method, path, body, headers):
            return 500, {"error": f"bad request with {headers.get('Authorization')} / {key!r}"}

        return handle

    with http_server(echo(keys[0])) as (u1, _), http_server(echo(keys[1])) as (u2, _):
        routers = [{"name": "g1", "url": u1, "api_key": keys[0]}, {"name": "g2", "url": u2, "api_key": keys[1]}]
        rc, out = run_module(
            "sglang_router_worker", {"action": "remove", "routers": routers, "worker_url": "http://w:1"}, tmp_path
        )
    text = repr(out)
    assert rc == 1 and "g1" in text and "g2" in text
    assert not any(k in text or k[6:] in text for k in keys)


def test_an_unexpected_error_on_one_gateway_keeps_what_the_others_did(pair):
    """Anything one gateway's call raises (an odd answer's TypeError) fails that gateway, not the step: what the
    others did (gw-a's removal) stays in the failed result for the rescue."""
    a, _, routers = pair

    def run(p, check_mode):
        if p["router_url"] == routers[1]["url"]:
            raise TypeError("unhashable type: 'list'")
        return ra.act(p, check_mode)

    with worker(0.0) as (_, url):
        a.add_now(url)
        with pytest.raises(ra.ActionFailed) as err:
            gws.act_all(params(api_key=KEY, action="remove", routers=routers, worker_url=url, timeout=5), run=run)
        assert url not in a.workers and err.value.result["worker_id"]


def test_check_mode_on_two_gateways_sends_nothing_that_changes_them(pair):
    a, b, routers = pair
    with worker(0.0) as (w, url):
        a.add_now(url), b.add_now(url)
        out = gws.act_all(
            params(api_key=KEY, action="remove", routers=routers, worker_url=url, drain=True), check_mode=True
        )
        assert out["changed"] is True and out["drain"] == {"drained": None, "why": "check mode"}
        add = gws.act_all(
            params(api_key=KEY, action="add", routers=routers, worker_url="http://10.9.9.9:1"), check_mode=True
        )
        assert add["changed"] is True and [g["ok"] for g in add["gateways"]] == [True, True]
        assert all(m == "GET" for m, _ in a.requests + b.requests) and w.scrapes == 0


def test_view_says_a_listing_it_cannot_read_and_still_reads_the_other_gateways(pair, monkeypatch):
    """Anything one gateway's read raises (an answer no listing comes from) is that gateway's row, not status's end."""
    a, _, routers = pair
    a.add_now(W1)
    real = rt.Router.workers

    def workers(self):
        if self.url == routers[1]["url"]:
            raise TypeError("unhashable type: 'list'")
        return real(self)

    monkeypatch.setattr(rt.Router, "workers", workers)
    out = gws.act_all(params(action="view", routers=routers, api_key=KEY, worker_urls=[W1], timeout=5))
    first, second = out["view"]
    assert (first["gateway"], first["listed"], first["why"]) == ("gw-a", True, "")
    assert (second["gateway"], second["listed"]) == ("gw-b", None)
    assert second["why"] == "the gateway's listing could not be read: TypeError: unhashable type: 'list'"


def test_a_gateway_with_a_discovery_file_among_several_is_edited_not_called(pair, tmp_path):
    """routers[].discovery_file reaches that gateway's removal and addition (each gateway's own client): the worker
    leaves and re-enters smg's file, never a DELETE or a POST there (the fake smg reads no file: it lists the worker
    on, so its wait fails, naming it)."""
    import json

    a, b, routers = pair
    ida, _ = a.add_now(W1), b.add_now(W1)
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"version": 1, "workers": [{"url": W1}, {"url": W2}]}))
    routers[1]["discovery_file"] = str(path)
    with pytest.raises(ra.ActionFailed) as failed:
        gws.act_all(params(action="remove", routers=routers, api_key=KEY, worker_url=W1, timeout=0.5))
    assert deletes(a) == [ida] and deletes(b) == []
    assert json.loads(path.read_text())["workers"] == [{"url": W2}]
    assert f"gw-b: {routers[1]['url']} still lists {W1} after 0.5 s" in str(failed.value)
