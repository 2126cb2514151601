"""Several gateways in front of one fleet (issue #32, docs/router.md "Two gateways"): each action of
plugins/modules/sglang_router_worker.py on every gateway of ``routers``, at once, and the quorum that says how many of them
must carry the step out for it to count.

A worker leaves the fleet only when no gateway sends it anything: removed from every gateway first, then drained
once (the worker's own gauges count what every gateway sent it; each smg's own count is evidence beside them).
A gateway that fails the step (down, refusing, not listing the worker) is named in the result (``gateways``); the
step fails when fewer than ``quorum`` carried it out (default: all of them), with what the others did in the
failed result, so that the rollout's rescue knows what to put back. A quorum below all is the operator's choice
(--gateway-quorum): a gateway down during a worker's turn that comes back may route to it while it restarts.

One gateway (the usual fleet) runs router_actions.act unchanged: the same results and messages as before there were two.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import http, outcomes
from .router import DEFAULT_IMPL, Router, RouterError
from .router_actions import INSPECT_RETRY_S, ActionFailed, act, check_waits, inspect
from .worker_load import _gateway_count, drain
from .worker_urls import normalize as router_base

# The actions run on each gateway (drain and measure speak to the worker only).
ON_EACH = ("remove", "add", "wait_healthy", "list", "inspect")


def gateways(p: dict) -> list[dict]:
    """The module's gateways, each {name, url, impl, api_key}: ``routers`` as given, else the one of router_url.
    RouterError for an empty ``routers`` and for a gateway given twice (by name or by URL: it would count twice)."""
    if p.get("routers") is None:
        url = p.get("router_url")
        return [{"name": url, "url": url, "impl": p.get("impl"), "api_key": p.get("api_key")}]
    if not p["routers"]:
        raise RouterError("routers: empty: at least one gateway is wanted")
    key = p.get("api_key")
    out = [{**g, "name": g.get("name") or g["url"], "api_key": g.get("api_key") or key} for g in p["routers"]]
    for field in ("name", "url"):
        seen = [router_base(g[field]) if field == "url" else g[field] for g in out]
        twice = sorted({n for n in seen if seen.count(n) > 1})
        if twice:
            raise RouterError(f"routers: {', '.join(twice)} given twice (each gateway once, by {field})")
    return out


def quorum_of(p: dict, count: int) -> int:
    q = count if p.get("quorum") is None else p["quorum"]
    if not 1 <= q <= count:
        raise RouterError(f"quorum={q}: between 1 and the {count} gateway(s) of routers is wanted")
    return q


def _router(g: dict, **kw) -> Router:
    """One gateway's client (its impl, else the module's default, as router_actions.act takes it)."""
    return Router(
        g["url"],
        api_key=g.get("api_key"),
        impl=g.get("impl") or DEFAULT_IMPL,
        discovery_file=g.get("discovery_file"),
        **kw,
    )


def one(p: dict, gateway: dict) -> dict:
    """``p`` for router_actions.act on one gateway."""
    return {
        **p,
        "router_url": gateway["url"],
        "impl": gateway.get("impl"),
        "api_key": gateway.get("api_key"),
        "discovery_file": gateway.get("discovery_file"),
    }


def act_all(p: dict, check_mode: bool = False, run: Callable[[dict, bool], dict] = act) -> dict:
    """plugins/modules/sglang_router_worker.py's action on every gateway; router_actions.act's result, plus
    ``gateways`` (one entry each: name, url, ok, and why not). ActionFailed (its result too) when fewer than the
    quorum carried it out."""
    gws = gateways(p)
    check_waits(p)
    quorum = quorum_of(p, len(gws))  # refused before any request, whatever the action
    if p["action"] == "view":  # every gateway read, whatever the quorum: status reports, it decides nothing
        return view(p)
    if len(gws) > 1 and p["action"] == "drain" and not check_mode:  # the worker's, with every smg's count beside
        out = _drain(p, gws)
        result = {"changed": False, "worker_url": p["worker_url"], "drain": out, "seconds": out["seconds"]}
        if not out["drained"]:
            raise ActionFailed(f"not drained: {out['why']}", result)
        return result
    if len(gws) == 1 or p["action"] not in ON_EACH:  # one gateway, or the worker alone: router_actions.act as ever
        return run(one(p, gws[0]), check_mode)
    if p["action"] == "inspect":
        return _inspect(p, gws, quorum)
    step = {**p, "drain": False}  # out of every gateway first; then the one drain below

    def each(g: dict) -> tuple[dict, str | None]:
        if p["action"] == "remove" and not check_mode:
            return _remove_one(one(step, g))
        return _try(run, one(step, g), check_mode)

    with ThreadPoolExecutor(max_workers=len(gws)) as pool:
        done = list(pool.map(each, gws))
    results = [r for r, _ in done]
    summary = [_entry(g, why) for g, (_, why) in zip(gws, done, strict=True)]
    ok = [r for r, (_, why) in zip(results, done, strict=True) if why is None]
    out = _merged(results, ok, summary)
    if len(ok) < quorum:
        raise ActionFailed(_short(len(ok), quorum, summary), out)
    if p["action"] == "remove" and p.get("drain"):
        if check_mode:
            out["drain"] = {"drained": None, "why": "check mode"}
            return out
        out["drain"] = _drain(p, gws)
        if not out["drain"]["drained"]:
            raise ActionFailed(f"not drained: {out['drain']['why']}", out)
    return out


def _try(run: Callable[[dict, bool], dict], p: dict, check_mode: bool) -> tuple[dict, str | None]:
    try:
        return run(p, check_mode), None
    except ActionFailed as exc:  # what it did before failing (a worker removed, say): for the rescue
        return exc.result, str(exc)
    except (RouterError, http.HttpError) as exc:
        return {}, str(exc)
    except Exception as exc:  # one gateway's odd answer must not lose what the others did
        return {}, f"{type(exc).__name__}: {exc}"


def _remove_one(p: dict) -> tuple[dict, str | None]:
    """One gateway's removal, its ids kept even when the wait for it to let go fails (the DELETE was taken: the
    rescue must put the worker back into this gateway too)."""
    out: dict = {"changed": False, "worker_url": p["worker_url"], "worker_id": None, "worker_ids": []}
    try:
        router = _router(
            {
                "url": p["router_url"],
                "api_key": p["api_key"],
                "impl": p.get("impl"),
                "discovery_file": p.get("discovery_file"),
            }
        )
        ids = router.remove(p["worker_url"], missing_ok=p["missing_ok"])
        out.update(changed=bool(ids), worker_id=ids[0] if ids else None, worker_ids=ids)
        if ids:
            out["seconds"] = router.wait_gone(p["worker_url"], p["timeout"])
            out["workers"] = router.membership()
        return out, None
    except (RouterError, http.HttpError) as exc:
        return out, str(exc)
    except Exception as exc:  # as _try
        return out, f"{type(exc).__name__}: {exc}"


def _entry(g: dict, why: str | None) -> dict:
    return {"name": g["name"], "url": g["url"], "ok": why is None, **({"why": why} if why else {})}


def _short(ok: int, quorum: int, summary: list[dict]) -> str:
    failed = "; ".join(f"{s['name']}: {s['why']}" for s in summary if not s["ok"])
    return f"{ok} of {len(summary)} gateways carried it out, {quorum} wanted (--gateway-quorum): {failed}"


def _merged(results: list[dict], ok: list[dict], summary: list[dict]) -> dict:
    """One result for the rollout's tasks: the first gateway that answered gives workers and seconds; worker_id is
    the first id any gateway removed or added (what the rescue puts back), worker_ids every one."""
    first = ok[0] if ok else next((r for r in results if r), {})
    out = {**first, "changed": any(r.get("changed") for r in results), "gateways": summary}
    ids = [i for r in results for i in (r.get("worker_ids") or ([r["worker_id"]] if r.get("worker_id") else []))]
    if "worker_id" in first or ids:
        out["worker_id"] = ids[0] if ids else None
    if "worker_ids" in first or any("worker_ids" in r for r in results):
        out["worker_ids"] = ids
    return out


def _drain(p: dict, gws: list[dict]) -> dict:
    """The worker drained once, with every answering gateway's own in-flight count summed beside its gauges."""
    readers = []  # every smg's, one that refused the removal included: it may still route to the worker
    for g in gws:
        router = _router(g)
        if router.gateway.in_flight_field:
            readers.append(router.reader(p["worker_url"]))
    counted = {"gateway_in_flight": lambda: _sum(readers)} if readers else {}
    return drain(p["worker_url"], p["drain_timeout"], **counted)


def _sum(readers: list[Callable[[], float | None]]) -> float | None:
    counts = [c for c in (_gateway_count(r) for r in readers) if c is not None]  # one down: the others still count
    return float(sum(counts)) if counts else None


def _inspect(p: dict, gws: list[dict], quorum: int) -> dict:
    """Each worker as every gateway sees it: listed only when every answering gateway lists it, healthy only when
    healthy in each; serving and drainable as the worker answers (read beside each gateway's listing)."""
    retry_s = INSPECT_RETRY_S if p.get("fail_on_problems") else 0.0

    def look(g: dict) -> tuple[dict, str | None]:
        try:
            router = _router(g)
            return inspect(router, p["worker_urls"], timeout=p["timeout"], retry_s=retry_s), None
        except (RouterError, http.HttpError) as exc:
            return {}, str(exc)
        except Exception as exc:  # as _try
            return {}, f"{type(exc).__name__}: {exc}"

    with ThreadPoolExecutor(max_workers=len(gws)) as pool:
        done = list(pool.map(look, gws))
    summary = [_entry(g, why) for g, (_, why) in zip(gws, done, strict=True)]
    seen = [(g["name"], r) for g, (r, why) in zip(gws, done, strict=True) if why is None]
    if not seen:  # as one gateway down: no worker said anything of (not read, not "not serving")
        raise RouterError(_short(0, quorum, summary))
    workers, problems = [], []
    for i, url in enumerate(p["worker_urls"]):
        views = {name: r["workers"][i] for name, r in seen}
        base = next(iter(views.values()), {"url": url, "serving": None, "drainable": None, "why": ""})
        listed = bool(views) and all(v["listed"] for v in views.values())
        healthy = [v["healthy_in_router"] for v in views.values() if v["listed"]]
        workers.append(
            {
                **base,
                "listed": listed,
                "ids": [i for v in views.values() for i in v.get("ids", [])],
                "healthy_in_router": all(healthy) if listed else None,  # each gateway's under "gateways"
                "gateways": {
                    n: {"listed": v["listed"], "healthy_in_router": v["healthy_in_router"]} for n, v in views.items()
                },
            }
        )
    for _, r in seen:
        problems += [x for x in r["problems"] if x not in problems]
    out = {"changed": False, "workers": workers, "problems": problems, "gateways": summary}
    if len(seen) < quorum:
        raise ActionFailed(_short(len(seen), quorum, summary), out)
    if p.get("fail_on_problems") and problems:
        # a rollout's plan: refused, nothing touched (exit 3), as router_actions.act says it
        raise ActionFailed("; ".join(problems), {**out, "outcome": outcomes.INVALID_CONFIG})
    return out


# smg_worker_cb_state's values (smg 1.13.0; 0.3.2 writes the series too: docs/router.md, per-worker series).
CIRCUIT = {0: "closed", 1: "open", 2: "half-open"}
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def circuits(text: str) -> dict[str, str]:
    """smg_worker_cb_state per worker URL from a gateway's /metrics: {url as labelled: state}."""
    out = {}
    for labels, value in re.findall(r"^smg_worker_cb_state\{([^}]*)\}\s+(\S+)", text, re.M):
        worker = dict(LABEL.findall(labels)).get("worker")
        try:
            state = CIRCUIT.get(int(float(value)), f"unknown ({value})")
        except ValueError:
            state = f"unknown ({value})"
        if worker:
            out[worker] = state
    return out


def view(p: dict) -> dict:
    """What every gateway thinks of each of ``worker_urls`` (python -m driver status): one row per worker and gateway,
    {worker, gateway, listed, healthy, status, in_flight, circuit, why}. Reads only, and never fails on a gateway:
    one that does not answer is a row with its why (its listing unknown: listed None)."""
    gws = gateways(p)

    def look(g: dict) -> list[dict]:
        router = _router(g, timeout=p["timeout"])
        rows = [{"worker": u, "gateway": g["name"], "listed": None, "healthy": None, "status": None,
                 "in_flight": None, "circuit": None, "why": ""} for u in p["worker_urls"]]  # fmt: skip
        try:
            listing = router.workers()
        except (RouterError, http.HttpError) as exc:
            return [{**r, "why": f"the gateway did not answer: {exc}"} for r in rows]
        except Exception as exc:  # an answer no listing comes from: said in its rows, the others still read
            return [{**r, "why": f"the gateway's listing could not be read: {type(exc).__name__}: {exc}"} for r in rows]
        resolver = router.resolver()
        states, unread = {}, ""
        if g.get("metrics_url"):
            try:
                code, data = http.request(f"{router_base(g['metrics_url'])}/metrics", timeout=p["timeout"])
                states = circuits(data.decode(errors="replace")) if code == 200 else {}
                unread = "" if code == 200 else f"its /metrics answered HTTP {code}"
            except http.HttpError as exc:
                unread = f"its /metrics did not answer: {exc}"
        for r in rows:
            found = router.matches(r["worker"], listing, resolver)
            state = [v for w in found for v in router.status(w).values()]  # smg's state field; 0.3.2 has none
            circuit = next((s for u, s in states.items() if resolver.same(r["worker"], u)), None)
            r.update(
                listed=bool(found),
                healthy=any(w["healthy"] for w in found) if found else None,
                status=state[0] if state else None,
                in_flight=router.in_flight(r["worker"], listing, resolver) if found else None,
                circuit=circuit,
                why=unread,
            )
        return rows

    with ThreadPoolExecutor(max_workers=len(gws)) as pool:
        per_gateway = list(pool.map(look, gws))
    rows = [rows_of[i] for i in range(len(p["worker_urls"])) for rows_of in per_gateway]  # by worker, then gateway
    return {"changed": False, "view": rows}
