"""The hung-worker sentinel: a worker whose generations stop is taken out of its gateway's rotation, and put back
once it generates again (issue #32, docs/router.md "Hung workers").

Neither gateway does it. sgl-project/sglang#22779's failure (after a SIGKILL restart, /health answers 200 and
generations hang) leaves the health check passing: SGLang 0.5.23's ``/health`` generates nothing, and its
``/health_generate`` answers 200 once *any* output reaches the tokenizer manager (http_server.py, and sglang#6624's
false positives). smg 1.13.0's ``--worker-wedge-secs`` was not seen to act on such a worker (streamed or not, for
any policy: tests/test_gateway_smg.py); 0.3.2 has no such check. What tells is a real generation, so every
``interval_s`` this streams a short one straight to each worker the gateway has in rotation:

- no token within ``stall_s`` is a stall; ``failures`` stalls in a row take the worker out of the gateway (its
  DELETE, or out of smg's discovery file), unless that would leave the gateway with fewer than half its workers in
  rotation (never the last one: a probe too strict for the load would otherwise take the fleet out);
- what the worker held then (its running and queued requests, and the gateway's own in-flight count for it) is
  reported: those requests are the ones it failed, or holds until it restarts;
- a worker it took out is probed on; ``successes`` tokens in a row put it back (the gateway's POST), so a restart
  of the replica (``python -m driver restart``) is all an operator does;
- a refused connection or another error is no stall: a dead worker is the gateway's health check's to take out.

Its own takings-out are kept in ``state_path`` (an atomic write), so that a restart of the sentinel still puts
back what it took out. Workers the gateway does not list (a rollout's, being restarted) are not its business.
One sentinel per gateway, beside it (roles/sglang_router: sglang-router-sentinel.service). No Ansible here.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from . import durable, http
from .router import Router, RouterError
from .worker_load import read_load
from .worker_urls import normalize

PROGRESS, STALLED, ERROR = "progress", "stalled", "error"


@dataclass(frozen=True)
class Settings:
    """The sentinel's rule (roles/sglang_router's sglang_router_sentinel_* variables, docs/router.md)."""

    interval_s: float = 10.0
    stall_s: float = 30.0
    failures: int = 2
    successes: int = 2
    prompt: str = "The sentinel asks for a few tokens:"
    max_new_tokens: int = 4

    def __post_init__(self):
        for name in ("interval_s", "stall_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: a number of seconds above 0 is wanted")
        for name in ("failures", "successes", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: a whole number of 1 or more is wanted")


@dataclass
class Watch:
    """One worker as the sentinel sees it: its streak of stalls (or, taken out, of tokens)."""

    url: str
    stalls: int = 0
    first_stall: float | None = None  # the clock when this streak of stalls began
    taken_out: dict | None = None  # set while out of rotation by the sentinel: when, why, what it held
    tokens: int = 0  # good probes in a row while taken out
    error: str | None = None  # why it cannot be probed (a key refused, a 503), said once per change


@dataclass
class Sentinel:
    router: Router
    settings: Settings
    state_path: str | None = None
    api_key: str | None = None  # the workers' key (the probe goes to the worker itself)
    log: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    probe: Callable[[str], dict] | None = None
    watches: dict[str, Watch] = field(default_factory=dict)

    def __post_init__(self):
        if self.probe is None:
            self.probe = self.probe_worker
        for url, out in self.load().items():
            self.watches[url] = Watch(url, taken_out=out)

    # ------------------------------------------------------------------ the probe

    def probe_worker(self, url: str) -> dict:
        """{state: progress|stalled|error, seconds, why} of one streamed generation on the worker."""
        s = self.settings
        try:
            seconds = http.first_token(url, s.prompt, s.max_new_tokens, s.stall_s, api_key=self.api_key)
        except http.Stalled as exc:
            return {"state": STALLED, "seconds": None, "why": str(exc)}
        except http.HttpError as exc:
            return {"state": ERROR, "seconds": None, "why": str(exc)}
        return {"state": PROGRESS, "seconds": seconds, "why": f"first token in {seconds:.2f} s"}

    # ------------------------------------------------------------------ one round

    def round(self) -> list[dict]:
        """Probe every worker in rotation and every one taken out; take out and put back by the rule. The events
        (each also logged): {event: taken_out|kept|put_back|relisted|failed, worker, ...}; the state is saved as
        soon as what the sentinel took out changes (before the gateway is told: a sentinel stopped in between still
        knows the worker is its to put back)."""
        listing = self.router.workers()
        same = self.router.resolver().same  # one worker under any spelling: one decision
        in_rotation: list[str] = []
        for w in listing:
            if w["healthy"] and not any(same(w["url"], u) for u in in_rotation):
                in_rotation.append(w["url"])
        listed = [w["url"] for w in listing]
        mine = [u for u, w in self.watches.items() if w.taken_out]
        for url in list(self.watches):  # gone from rotation by other hands: its streak starts again
            if url not in mine and not any(same(url, u) for u in in_rotation):
                del self.watches[url]
        events = []
        for url in mine:
            w = self.watches[url]
            back = any(same(url, u) for u in in_rotation)
            if not back and not any(same(url, u) for u in listed):
                w.taken_out["seen_out"] = True
            elif back and w.taken_out.get("seen_out"):  # out, then in again by other hands (a restarted gateway)
                events.append({"event": "relisted", "worker": url, "out_s": round(self.wall() - w.taken_out["at"], 1)})
                w.taken_out, w.tokens, w.stalls, w.first_stall = None, 0, 0, None
        mine = [u for u, w in self.watches.items() if w.taken_out]
        targets = [u for u in in_rotation if not any(same(u, m) for m in mine)] + mine
        with ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as pool:
            probes = dict(zip(targets, pool.map(self.safe_probe, targets), strict=True))
        for e in events:
            self.log(self.say(e))
        if events:
            self.save()
        for url in targets:
            w = self.watches.setdefault(url, Watch(url))
            event = self.judge(w, probes[url], [u for u in in_rotation if not same(u, url)])
            if event:
                events.append(event)
                self.log(self.say(event))
        return events

    def safe_probe(self, url: str) -> dict:
        """The probe, whatever it raises: an error it did not expect is no stall (the health check's to judge)."""
        try:
            return self.probe(url)
        except Exception as exc:  # a probe never stops the round
            return {"state": ERROR, "seconds": None, "why": f"{type(exc).__name__}: {exc}"}

    def judge(self, w: Watch, probe: dict, others: list[str]) -> dict | None:
        s = self.settings
        unprobed = probe["why"] if probe["state"] == ERROR else None
        if unprobed != w.error:  # said when it starts and when it ends, not every round
            w.error = unprobed
            event = {"event": "unprobed" if unprobed else "probed", "worker": w.url, "why": probe["why"]}
            self.log(self.say(event))
        if w.taken_out:
            w.tokens = w.tokens + 1 if probe["state"] == PROGRESS else 0
            if w.tokens < s.successes:
                return None
            try:
                self.router.add(w.url, timeout=max(s.interval_s, 10.0))
            except (RouterError, http.HttpError, OSError) as exc:
                return {"event": "failed", "worker": w.url, "why": f"putting it back: {exc}"}
            out, w.taken_out, w.tokens = w.taken_out, None, 0
            w.stalls, w.first_stall = 0, None
            self.save_quietly()
            return {"event": "put_back", "worker": w.url, "out_s": round(self.wall() - out["at"], 1), "probe": probe}
        if probe["state"] == PROGRESS:
            w.stalls, w.first_stall = 0, None
            return None
        if probe["state"] != STALLED:
            return None  # a dead or refusing worker is the health check's; the streak neither grows nor ends
        now = self.clock()
        w.stalls += 1
        w.first_stall = now if w.first_stall is None else w.first_stall
        if w.stalls < s.failures:
            return None
        stalled_s = round(now - w.first_stall + s.stall_s, 1)  # the first stalled probe began stall_s earlier
        # others: the workers in rotation besides this one, less those taken out earlier in this round
        staying = [u for u in others if not (self.watches.get(u) and self.watches[u].taken_out)]
        out = sum(1 for x in self.watches.values() if x.taken_out)
        if not staying or out + 1 > (len(staying) + out + 1) // 2:  # never more than half the workers out
            return {"event": "kept", "worker": w.url, "stalls": w.stalls, "stalled_s": stalled_s, "probe": probe,
                    "out": out, "staying": len(staying)}  # fmt: skip
        held = self.held(w.url)
        w.taken_out = {"at": self.wall(), "stalls": w.stalls, "stalled_s": stalled_s, "held": held, "why": probe["why"]}
        w.tokens = 0
        try:
            self.save()  # first: a sentinel stopped before the gateway hears of it still puts the worker back
            self.router.remove(w.url, missing_ok=True)
        except (RouterError, http.HttpError, OSError) as exc:
            w.taken_out = None
            self.save_quietly()
            return {"event": "failed", "worker": w.url, "why": f"taking it out: {exc}", "held": held}
        return {"event": "taken_out", "worker": w.url, "stalls": w.stalls, "stalled_s": stalled_s, "held": held}

    def held(self, url: str) -> dict:
        """What the worker holds as it is taken out: its running and queued requests (its /metrics) and the
        gateway's own in-flight count for it (smg; None for 0.3.2). ``requests``: the larger count, None unread."""
        load = read_load(url, timeout=5.0)
        try:
            gateway = self.router.in_flight(url)
        except (RouterError, http.HttpError, OSError, ValueError):
            gateway = None
        worker = None if load["state"] != "load" else load["running"] + load["queued"]
        counts = [c for c in (worker, gateway) if c is not None and math.isfinite(c)]  # a gauge may say NaN
        return {
            "requests": int(max(counts)) if counts else None,
            "running": load["running"],
            "queued": load["queued"],
            "gateway_in_flight": gateway,
            "why": load["why"],
        }

    def say(self, e: dict) -> str:
        s, gw = self.settings, self.router.url
        if e["event"] == "taken_out":
            h = e["held"]
            count = "an unknown number of" if h["requests"] is None else str(h["requests"])
            return (
                f"sentinel: {e['worker']} taken out of {gw}: no token in {s.stall_s:g} s on {e['stalls']} probes in a "
                f"row (stalled about {e['stalled_s']:g} s); it held {count} requests ({h['why']}; the gateway "
                f"counted {h['gateway_in_flight'] if h['gateway_in_flight'] is not None else 'none'} in flight): "
                "they fail or wait until it is restarted"
            )
        if e["event"] == "kept":
            why = (
                "is the last worker in rotation at {gw}: left in (taking it out would leave nothing to serve)"
                if not e["staying"]
                else "{out} of the workers at {gw} are out already: left in (never more than half of them out)"
            ).format(gw=gw, out=e["out"])
            return (
                f"sentinel: {e['worker']} stalls ({e['stalls']} probes in a row, no token in {s.stall_s:g} s) but {why}"
            )
        if e["event"] == "put_back":
            return (
                f"sentinel: {e['worker']} put back into {gw} after {s.successes} good probes in a row "
                f"({e['probe']['why']}); it was out {e['out_s']:g} s"
            )
        if e["event"] == "relisted":
            return (
                f"sentinel: {e['worker']} is in rotation at {gw} again, not by the sentinel (out {e['out_s']:g} s): "
                "watched afresh"
            )
        if e["event"] == "unprobed":
            return f"sentinel: cannot probe {e['worker']} (its health check's to judge): {e['why']}"
        if e["event"] == "probed":
            return f"sentinel: {e['worker']} answers its probes again ({e['why']})"
        return f"sentinel: {e['worker']} at {gw}: {e['why']}"

    # ------------------------------------------------------------------ its state

    def load(self) -> dict[str, dict]:
        """The workers it took out, by URL, as saved (none without a state file). A state file it cannot read is
        moved aside (PATH.bad) and said: the sentinel starts afresh rather than not at all."""
        if not self.state_path or not os.path.exists(self.state_path):
            return {}
        try:
            with open(self.state_path, encoding="utf-8") as f:
                doc = json.load(f)
            out = {normalize(u): {**o, "at": float(o.get("at", 0.0))} for u, o in doc["taken_out"].items()}
            if not all(isinstance(o, dict) for o in out.values()):
                raise ValueError("an entry is not an object")
            return out
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            bad = f"{self.state_path}.bad"
            try:
                durable.rename(self.state_path, bad)
            except OSError:
                pass
            self.log(f"sentinel: {self.state_path} unreadable ({type(exc).__name__}: {exc}), moved to {bad}: "
                     "the workers it names, if any, are not put back by the sentinel")  # fmt: skip
            return {}

    def save(self) -> None:
        if not self.state_path:
            return
        doc = {
            "gateway": self.router.url,
            "settings": asdict(self.settings),
            "taken_out": {u: w.taken_out for u, w in sorted(self.watches.items()) if w.taken_out},
        }
        durable.write_atomic(self.state_path, json.dumps(doc, indent=1, sort_keys=True) + "\n", mode=0o644)

    def save_quietly(self) -> None:
        """save, a failure said rather than raised (the gateway has been told already)."""
        try:
            self.save()
        except OSError as exc:
            self.log(f"sentinel: cannot save {self.state_path}: {exc}")

    def run(self, rounds: int | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        """Round after round, one every interval_s (or `rounds` of them); a round that fails is logged, not fatal:
        the gateway restarting is no reason for the sentinel to stop."""
        done, skipped = 0, None
        while rounds is None or done < rounds:
            start = self.clock()
            try:
                self.round()
                if skipped:
                    self.log("sentinel: rounds resume")
                skipped = None
            except (RouterError, http.HttpError, OSError) as exc:  # the gateway restarting: said once
                if str(exc) != skipped:
                    self.log(f"sentinel: round skipped: {exc}")
                skipped = str(exc)
            except Exception as exc:  # never a crash loop: said with where; the next round runs
                self.log(f"sentinel: round failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                skipped = None
            done += 1
            if rounds is None or done < rounds:
                sleep(max(0.0, self.settings.interval_s - (self.clock() - start)))


# The secrets file's variable (roles/sglang_router: secrets.env, the gateway launcher's too): the gateway's key,
# which is the workers' own unless sglang_router_api_key says otherwise.
KEY_VAR = "SGLANG_ROUTER_API_KEY"


def main(argv: list[str], environ: dict[str, str]) -> None:
    """``sglang-router-sentinel --gateway-url URL --impl IMPL [--state PATH] [the rule's settings]``: nothing secret
    on it; the key comes from the environment (the unit's EnvironmentFile=), taken out of it before anything runs."""
    import argparse

    ap = argparse.ArgumentParser(prog="sglang-router-sentinel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateway-url", required=True, help="the gateway it watches (its worker API)")
    ap.add_argument("--impl", required=True, help="smg or sglang-router")
    ap.add_argument("--state", help="where it keeps the workers it took out (JSON, written atomically)")
    ap.add_argument("--discovery-file", help="smg's discovery file: workers are taken out and put back there")
    defaults = Settings()
    for name in ("interval_s", "stall_s", "failures", "successes", "max_new_tokens"):
        kind = float if name.endswith("_s") else int
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(defaults, name))
    key = environ.pop(KEY_VAR, "") or None
    args = ap.parse_args(argv)
    try:
        settings = Settings(
            **{n: getattr(args, n) for n in ("interval_s", "stall_s", "failures", "successes", "max_new_tokens")}
        )
        router = Router(args.gateway_url, api_key=key, impl=args.impl, timeout=10.0, discovery_file=args.discovery_file)
    except (ValueError, RouterError) as exc:
        raise SystemExit(f"sglang-router-sentinel: {exc}") from None
    sentinel = Sentinel(router, settings, state_path=args.state, api_key=key, log=lambda m: print(m, flush=True))
    print(
        f"sentinel: watching {router.url} ({args.impl}): a probe every {settings.interval_s:g} s, "
        f"{settings.failures} stalls of {settings.stall_s:g} s take a worker out, {settings.successes} tokens put it back",
        flush=True,
    )
    sentinel.run()
