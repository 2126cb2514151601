"""A fixed benchmark of one running instance, on its host: what autotune measures per combination (issue 15).

At each concurrency level, `requests` streamed /generate requests of `max_new_tokens` each (ignore_eos, so
every answer is as long as asked), `concurrency` at a time, after `warmup` unmeasured ones. Per level:
output tok/s (the tokens of the measured requests over the level's wall time), accept length (their tokens
over their verify steps, SGLang's meta_info.spec_verify_ct; 1.0 without speculation), TTFT and inter-token
latency (median and p99; ITL per token, a streamed event's gap spread over the tokens it brought), and
the requests that failed. SGLang's own bench_serving needs the model's tokenizer and a dataset; this load
runs with what a host has. The safe restart runs it (sglang_deploy.restart.measure, Settings.bench).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
import urllib.request

from .http import OPENER, HttpError
from .secret_rule import clip

# Two-sided 95 % critical values of Student's t by degrees of freedom (n - 1 for n repeats); beyond 30, 1.96.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042}  # fmt: skip


def interval(samples: list[float], digits: int = 2, floor: float = 0.0) -> tuple[float, float] | None:
    """The 95 % t-interval of the mean of repeated measurements, (low, high), rounded outwards to `digits` (never
    narrower than computed) and never below `floor` (no figure here is negative; an accept length is at least 1);
    None with fewer than two (one measurement says nothing of its own noise)."""
    if len(samples) < 2:
        return None
    mean = statistics.fmean(samples)
    half = T95.get(len(samples) - 1, 1.96) * statistics.stdev(samples) / len(samples) ** 0.5
    scale = 10**digits
    low = max(floor, math.floor(round((mean - half) * scale, 6)) / scale)  # round(.., 6): 75.16 stays 75.16
    return low, math.ceil(round((mean + half) * scale, 6)) / scale


# The figures a level's repeats give an interval to: (digits, floor). Latencies in seconds, to the microsecond (a
# speculative ITL is a few milliseconds).
INTERVAL_FIGURES = {"output_tokens_per_s": (2, 0.0), "accept_length": (3, 1.0), "ttft_median_s": (6, 0.0),
                    "itl_median_s": (6, 0.0)}  # fmt: skip


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def one(base: str, prompt: str, max_new_tokens: int, api_key: str | None, timeout: float, clock=time.monotonic) -> dict:
    """One streamed /generate: {tokens, verify_ct, ttft_s, itl_s: [per token], seconds}. Raises HttpError."""
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{base}/generate", data=json.dumps(body).encode(), headers=headers)
    t0 = clock()
    tokens, verify_ct, ttft, itl, last, done = 0, None, None, [], t0, False
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                meta = (json.loads(data).get("meta_info") or {}) if data else {}
                n = int(meta.get("completion_tokens") or 0)
                now = clock()
                if n > tokens:
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl += [(now - last) / (n - tokens)] * (n - tokens)
                    tokens, last = n, now
                if meta.get("spec_verify_ct") is not None:
                    verify_ct = int(meta["spec_verify_ct"])
    except (OSError, ValueError) as exc:  # refused, reset, timed out, an HTTP error status, a malformed event
        raise HttpError(f"{base}/generate: {exc}") from exc
    if not done or tokens < max_new_tokens:
        raise HttpError(f"{base}/generate: the stream ended after {tokens} of {max_new_tokens} tokens")
    return {"tokens": tokens, "verify_ct": verify_ct, "ttft_s": ttft, "itl_s": itl, "seconds": clock() - t0}


def level(
    base: str,
    concurrency: int,
    requests: int,
    max_new_tokens: int,
    api_key=None,
    timeout=120.0,
    request=one,
    stop: threading.Event | None = None,
) -> dict:
    """`requests` requests, `concurrency` at a time: the level's figures. With `stop`: set at the first failed
    request, after which no request begins (the rest are counted as skipped)."""
    t0 = time.monotonic()
    results, failures = _load(base, concurrency, requests, max_new_tokens, api_key, timeout, request, stop)
    return _figures(concurrency, requests, results, failures, time.monotonic() - t0)


def _load(
    base: str,
    concurrency: int,
    requests: int,
    max_new_tokens: int,
    api_key,
    timeout,
    request,
    stop: threading.Event | None,
) -> tuple[list[dict], list[str]]:
    """(results, failures): `requests` requests sent by `concurrency` threads, each taking the next one until
    none is left (or `stop` is set); a failure is its message, clipped, and sets `stop`."""
    results, failures, lock = [], [], threading.Lock()
    todo = iter(range(requests))

    def worker() -> None:
        while True:
            with lock:
                n = None if stop is not None and stop.is_set() else next(todo, None)
            if n is None:
                return
            try:
                r = request(base, f"sglang-deploy tune request {n}: count", max_new_tokens, api_key, timeout)
            except HttpError as exc:
                with lock:
                    failures.append(clip(str(exc), 300))
                if stop is not None:
                    stop.set()
                continue
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, failures


def _figures(concurrency: int, requests: int, results: list[dict], failures: list[str], wall: float) -> dict:
    """The level's figures from its requests' results over its wall time (None where no request gave one)."""
    tokens = sum(r["tokens"] for r in results)
    steps = [r["verify_ct"] for r in results if r["verify_ct"]]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    itl = [x for r in results for x in r["itl_s"]]
    # Latencies to the microsecond: a speculative ITL is a few milliseconds, and its repeats' interval is of that.
    us = lambda v: None if v is None else round(v, 6)  # noqa: E731
    return {
        "concurrency": concurrency,
        "requests": requests,
        "ok": len(results),
        "failed": len(failures),
        "skipped": requests - len(results) - len(failures),
        "failures": failures[:5],
        "output_tokens_per_s": round(tokens / wall, 2) if results and wall > 0 else None,
        "accept_length": (round(tokens / sum(steps), 3) if steps and len(steps) == len(results) else 1.0)
        if results
        else None,
        "ttft_median_s": us(statistics.median(ttft)) if ttft else None,
        "ttft_p99_s": us(percentile(ttft, 99)),
        "itl_median_s": us(statistics.median(itl)) if itl else None,
        "itl_p99_s": us(percentile(itl, 99)),
        "seconds": round(wall, 3),
    }


def combined(repeats: list[dict]) -> dict:
    """One level's repeats as one: counts summed, each figure the median of the repeats', the samples kept."""
    med = lambda key: median([r[key] for r in repeats])  # noqa: E731
    # The medians of tok/s, accept length, TTFT and ITL per repeat, each with its interval: the ledger keeps them all.
    # Only a figure every repeat measured has an interval: a repeat cut short is no sample.
    samples = {k: [r[k] for r in repeats] for k in INTERVAL_FIGURES}
    intervals = {k: figure_interval(samples[k], *rule) for k, rule in INTERVAL_FIGURES.items()}
    return {
        "concurrency": repeats[0]["concurrency"],
        "requests": sum(r["requests"] for r in repeats),
        "ok": sum(r["ok"] for r in repeats),
        "failed": sum(r["failed"] for r in repeats),
        "skipped": sum(r["skipped"] for r in repeats),
        "failures": [f for r in repeats for f in r["failures"]][:5],
        "output_tokens_per_s": med("output_tokens_per_s"),
        # tok/s's, the ranking's, under their own names as well
        "samples": samples["output_tokens_per_s"],
        "interval": intervals["output_tokens_per_s"],
        "figure_samples": samples,
        "intervals": intervals,
        **{k: med(k) for k in ("accept_length", "ttft_median_s", "ttft_p99_s", "itl_median_s", "itl_p99_s")},
        "seconds": round(sum(r["seconds"] for r in repeats), 3),
    }


def figure_interval(values: list, digits: int, floor: float) -> tuple[float, float] | None:
    """A figure's interval over the repeats, only where every repeat has it (a failed or cut one has not)."""
    known = [v for v in values if v is not None]
    return interval(known, digits, floor) if len(known) == len(values) else None


def median(values: list) -> float | None:
    """The median of the values measured; None when none was (a level that failed)."""
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 4) if known and len(known) == len(values) else None


# bench_error of a benchmark a SIGTERM cut short (restart.measure): it says nothing of the combination, so a re-run of
# the sweep measures it again (driver/tune.py).
INTERRUPTED = "the benchmark was interrupted (SIGTERM)"

# The load's settings as an Ansible argument spec (sglang_server's bench option; restart.Settings.bench holds them).
OPTIONS = {
    "concurrency": {"type": "list", "elements": "int", "default": [1]},
    "requests": {"type": "int", "default": 8},
    "max_new_tokens": {"type": "int", "default": 64, "no_log": False},  # a count: no secret (validate-modules asks)
    "warmup": {"type": "int", "default": 2},
    "timeout": {"type": "float", "default": 120.0},
    "repeat": {"type": "int", "default": 1},
}


def check(
    concurrency: list[int], requests: int, max_new_tokens: int, warmup: int = 0, timeout: float = 1.0, repeat: int = 1
) -> None:
    """ValueError unless the load is one that can run: before anything is restarted for it."""
    if (
        not concurrency
        or any(c < 1 for c in concurrency)
        or requests < 1
        or max_new_tokens < 1
        or warmup < 0
        or not timeout > 0
        or repeat < 1
    ):
        raise ValueError(
            "concurrency levels, requests, max_new_tokens and repeat must be at least 1, warmup at least 0, timeout "
            f"above 0 (concurrency {concurrency}, requests {requests}, max_new_tokens {max_new_tokens}, warmup {warmup}, "
            f"timeout {timeout}, repeat {repeat})"
        )


def run(
    base: str,
    concurrency: list[int],
    requests: int,
    max_new_tokens: int,
    warmup: int = 2,
    api_key=None,
    timeout: float = 120.0,
    request=one,
    repeat: int = 1,
) -> dict:
    """Warm-up, then every level, `repeat` times over, the levels interleaved (1, 8, 1, 8, ...: a drift of the
    machine falls on every level alike). A level's figures are the median of its repeats, with `samples` (each
    repeat's output tok/s) and `interval` (their mean's 95 % t-interval, None for one), and the same of tok/s,
    accept length, TTFT and ITL (their medians) in `figure_samples` and `intervals`. The first level's figures
    are the result's own.

    The first failed request ends it: a partial benchmark is no measurement, and the restart that runs it holds the
    instance's lock (restart.measure), so a failing server is not asked again and again, each time up to
    `timeout`. What did not run is counted as skipped."""
    check(concurrency, requests, max_new_tokens, warmup, timeout, repeat)
    t0 = time.monotonic()
    stop = threading.Event()
    warm_failed = []
    for n in range(warmup):
        try:
            request(base, f"sglang-deploy tune warm-up {n}", max_new_tokens, api_key, timeout)
        except HttpError as exc:
            warm_failed.append(clip(str(exc), 300))
            stop.set()
            break
    runs = [[level(base, c, requests, max_new_tokens, api_key, timeout, request, stop) for c in concurrency]
            for _ in range(repeat)]  # fmt: skip
    levels = [combined([r[i] for r in runs]) for i in range(len(concurrency))]
    first = levels[0]
    keys = ("output_tokens_per_s", "accept_length", "ttft_median_s", "ttft_p99_s", "itl_median_s", "itl_p99_s")
    return {
        **{k: first[k] for k in keys},
        "levels": levels,
        "failed": sum(lv["failed"] for lv in levels) + len(warm_failed),
        "warmup_failures": warm_failed[:5],
        "max_new_tokens": max_new_tokens,
        "seconds": round(time.monotonic() - t0, 3),
    }
