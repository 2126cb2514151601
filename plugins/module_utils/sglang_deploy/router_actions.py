"""plugins/modules/sglang_router_worker.py's actions on one gateway (``act``): list, add, remove, wait_healthy,
inspect, drain and measure, over the gateway's client (router.py) and what the worker itself says (worker_load.py);
and ``inspect``, a rollout plan's read of both, which changes nothing.

gateways.py runs them on every gateway at once; the module is the thin adapter. No Ansible here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import outcomes
from .router import DEFAULT_IMPL, Router, RouterError
from .worker_load import drain, measure, read_load, serving

# Said with a worker the gateway does not list: the sentinel (sentinel.py) may have taken it out.
SENTINEL_HINT = (
    "; a worker the gateway's hung-worker sentinel took out is listed again once it generates: "
    "journalctl -u sglang-router-sentinel"
)


class ActionFailed(RouterError):
    """An action of plugins/modules/sglang_router_worker.py that fails with a result (its failed result carries it)."""

    def __init__(self, msg: str, result: dict):
        super().__init__(msg)
        self.result = result


INSPECT_RETRY_S = 10.0  # how long a rollout's plan reads a /metrics that says nothing again before refusing it


def inspect(
    router: Router,
    worker_urls: list[str],
    timeout: float = 5.0,
    retry_s: float = INSPECT_RETRY_S,
    poll: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """What the router and each worker say, over HTTP only (reads nothing else, changes nothing):
    {workers: [{url, listed, ids, healthy_in_router, serving, drainable, why}], problems: [str]}.

    ``listed``/``ids``: the router's records of the worker under any spelling (same_worker); ``healthy_in_router``:
    whether one of them is healthy (None when not listed); ``serving``: its own /health answered 200 within
    ``timeout``; ``drainable``: its /metrics answered 200 with both load gauges (read_load), so that a drain can
    end on evidence (a port nothing listens on is no more: a replica already down would leave the fleet a replica
    short while another is out for its turn, beyond --max-unavailable, so it refuses the rollout). A read that says
    nothing either way (a 503, a timeout: a server busy under load answers so) is read again, ``poll`` apart, for
    up to ``retry_s``: one busy moment does not refuse a rollout, a /metrics unreadable all along does.
    ``problems``: each worker not listed, or not drainable."""
    listing = router.workers()
    resolver = router.resolver()
    matched = [router.matches(u, listing, resolver) for u in worker_urls]
    probes = _probe(worker_urls, timeout, retry_s, poll, clock, sleep)
    workers, problems = [], []
    lists = ", ".join(w["url"] for w in listing) or "no worker"
    for url, found, ((up, up_why), load) in zip(worker_urls, matched, probes, strict=True):
        drainable = load["state"] == "load"
        why = [f"not serving: {up_why}"] if not up else []
        why += [] if drainable else [f"not drainable: {load['why']}"]
        workers.append(
            {
                "url": url,
                "listed": bool(found),
                "ids": [w.get("id") for w in found],
                "healthy_in_router": any(w["healthy"] for w in found) if found else None,
                "serving": up,
                "drainable": drainable,
                "why": "; ".join(why),
            }
        )
        if not found:
            problems.append(f"{url}: not listed by the router {router.url} (it lists: {lists}{SENTINEL_HINT})")
        if not drainable:
            problems.append(f"{url}: cannot be drained on evidence: {load['why']}")
    return {"workers": workers, "problems": problems}


def _probe(
    worker_urls: list[str],
    timeout: float,
    retry_s: float,
    poll: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
) -> list[tuple[tuple[bool, str], dict]]:
    """inspect's reads of each worker, in parallel: (serving, read_load); a load read that says nothing either way
    (``error``) read again, ``poll`` apart, for up to ``retry_s``."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, 2 * len(worker_urls)))) as pool:  # the reads in parallel
        ups = [pool.submit(serving, u, timeout) for u in worker_urls]
        loads = [pool.submit(read_load, u, timeout) for u in worker_urls]
        probes = [(up.result(), load.result()) for up, load in zip(ups, loads, strict=True)]
        deadline = clock() + retry_s
        while any(load["state"] == "error" for _, load in probes) and clock() + poll <= deadline:
            sleep(poll)
            again = {
                i: pool.submit(read_load, u, timeout)
                for i, u in enumerate(worker_urls)
                if probes[i][1]["state"] == "error"
            }
            for i, load in again.items():
                probes[i] = (probes[i][0], load.result())
    return probes


# ---------------------------------------------------------------------- the module's actions


def check_waits(p: dict) -> None:
    """RouterError before any request for a wait that would never end (Ansible's float takes nan and inf)."""
    for name in ("timeout", "drain_timeout"):
        if name in p and not 0 <= p[name] < float("inf"):
            raise RouterError(f"{name}={p[name]!r}: a number of seconds, 0 or more, is wanted")


def act(p: dict, check_mode: bool = False) -> dict:
    """plugins/modules/sglang_router_worker.py's action ``p["action"]`` with its parameters; its result. ActionFailed
    (with a result) or RouterError/HttpError when it fails."""
    url, action = p.get("worker_url"), p["action"]
    check_waits(p)
    if action == "measure":
        out = measure(url, p["prompt"], p["requests"], p["max_new_tokens"], api_key=p["api_key"])
        return {"changed": False, "worker_url": url, **out}
    if action == "drain":
        if check_mode:
            return {"changed": False, "worker_url": url, "drain": {"drained": None, "why": "check mode"}}
        # The gateway's count beside the worker's, where a gateway is named and keeps one (evidence, not a rule).
        gateway = Router(p["router_url"], api_key=p["api_key"], impl=_impl(p)) if p.get("router_url") else None
        counted = {"gateway_in_flight": gateway.reader(url)} if gateway and gateway.gateway.in_flight_field else {}
        out = drain(url, p["drain_timeout"], **counted)
        result = {"changed": False, "worker_url": url, "drain": out, "seconds": out["seconds"]}
        if not out["drained"]:
            raise ActionFailed(f"not drained: {out['why']}", result)
        return result
    router = Router(p["router_url"], api_key=p["api_key"], impl=_impl(p), discovery_file=p.get("discovery_file"))
    if action == "list":
        return {"changed": False, "workers": router.membership()}
    if action == "inspect":  # reads only: the same in check mode
        # A plan's check reads an unanswered /metrics again before refusing; the other reads answer at once.
        retry_s = INSPECT_RETRY_S if p["fail_on_problems"] else 0.0
        out = {"changed": False, **inspect(router, p["worker_urls"], timeout=p["timeout"], retry_s=retry_s)}
        if p["fail_on_problems"] and out["problems"]:  # a rollout's plan: refused, nothing touched (exit 3)
            raise ActionFailed("; ".join(out["problems"]), {**out, "outcome": outcomes.INVALID_CONFIG})
        return out
    if action == "wait_healthy":
        seconds = router.wait_healthy(url, p["timeout"])
        return {"changed": False, "worker_url": url, "seconds": seconds, "workers": router.membership()}
    if action == "remove":
        return _remove(router, p, check_mode)
    if action != "add":
        raise RouterError(f"unknown action {action!r}")
    if check_mode:
        listed = [w for w in router.find(url) if not router.leaving(w)]  # a leaving record would be added again
        return {"changed": not listed, "worker_url": url, "worker_id": listed[0].get("id") if listed else None}
    wid, added = router.add(url, timeout=p["timeout"])
    seconds = router.wait_healthy(url, p["timeout"])
    listed_now = router.find(url)
    return {
        "changed": added,
        "worker_url": url,
        "worker_id": (listed_now[0].get("id") if listed_now else None) or wid,
        "seconds": seconds,
        "workers": router.membership(),
    }


def _impl(p: dict) -> str:
    """The module's gateway (its impl option; a caller without one, the playbooks' sglang-router)."""
    return p.get("impl") or DEFAULT_IMPL


def _remove(router: Router, p: dict, check_mode: bool) -> dict:
    url = p["worker_url"]
    if check_mode:  # nothing removed, nothing read but the router's list (as action=drain in check mode)
        listing = router.workers()
        found = router.matches(url, listing)
        ids = [w.get("id") for w in found if not router.leaving(w)]  # as remove: a leaving one is not removed again
        if not found and not p["missing_ok"]:
            raise router.not_listed(url, listing)
        out = {"changed": bool(ids), "worker_url": url, "worker_id": ids[0] if ids else None, "worker_ids": ids}
        return {**out, "drain": {"drained": None, "why": "check mode"}} if p["drain"] else out
    ids = router.remove(url, missing_ok=p["missing_ok"])
    out = {"changed": bool(ids), "worker_url": url, "worker_id": ids[0] if ids else None, "worker_ids": ids}
    if ids:
        out["seconds"] = router.wait_gone(url, p["timeout"])
        out["workers"] = router.membership()
    if p["drain"]:  # the worker's /metrics: api_key is the router's here, not the worker's (and /metrics is open)
        counted = {"gateway_in_flight": router.reader(url)} if router.gateway.in_flight_field else {}
        out["drain"] = drain(url, p["drain_timeout"], **counted)
        if not out["drain"]["drained"]:
            raise ActionFailed(f"not drained: {out['drain']['why']}", out)
    return out
