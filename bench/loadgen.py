"""A steady mixed load through sglang-router, counting every failed or truncated response (docs/rollout.md).

    python3 bench/loadgen.py --url http://127.0.0.1:30000 [--api-key K] [--concurrency 4] [--duration 600]
                             [--stop-file /tmp/loadgen.stop] [--stream-ratio 0.5]

Standard library only: it runs on the controller or on a lab node (tests/e2e/test_rollout.py copies it to the
router's node, whose port is not published). Each of --concurrency workers sends one request after another
until --duration passes, the stop file appears, or SIGTERM/SIGINT; the kinds rotate: /generate and
/v1/completions, each streamed (SSE) or not (--stream-ratio). A response counts as

- ok: HTTP 200 and the whole answer: as many tokens as asked (ignore_eos), a streamed one ending in [DONE];
- failed: no answer, another status, a body that is not the JSON asked for;
- truncated: 200, but fewer tokens than asked, or a stream cut before [DONE];
- not_streamed: a stream asked for and a whole (ok) JSON answer given, as such or inside an event stream (a
  server that does not stream, such as the lab's stand-in); counted apart, not as a failure.

At the end one JSON document on stdout: counts, by kind, every failure's reason (the first 50), latency p50/p99
(seconds) overall and per 10 s window.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an http_proxy
KINDS = ("generate", "completions")


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {"sent": 0, "ok": 0, "failed": 0, "truncated": 0, "not_streamed": 0}
        self.by_kind: dict[str, dict[str, int]] = {}
        self.failures: list[dict] = []
        self.latencies: list[tuple[float, float]] = []  # (start, seconds) of ok requests

    def add(self, kind: str, verdict: str, started: float, seconds: float, why: str = "") -> None:
        with self.lock:
            self.counts["sent"] += 1
            self.counts[verdict] += 1
            k = self.by_kind.setdefault(kind, {"sent": 0, "ok": 0, "failed": 0, "truncated": 0, "not_streamed": 0})
            k["sent"] += 1
            k[verdict] += 1
            if verdict in ("failed", "truncated"):
                self.failures.append({"kind": kind, "verdict": verdict, "at_s": round(started, 2), "why": why[:300]})
            else:
                self.latencies.append((started, seconds))


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))], 4)


def body_of(kind: str, stream: bool, tokens: int, n: int, model: str = "default") -> tuple[str, dict]:
    prompt = f"loadgen request {n}: count the lab tokens"
    if kind == "generate":
        params = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
        # A gateway that routes by model (smg with a discovery file) wants it on /generate too; SGLang ignores it.
        named = {} if model == "default" else {"model": model}
        return "/generate", {"text": prompt, "sampling_params": params, "stream": stream, **named}
    return "/v1/completions", {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def tokens_of(kind: str, doc: dict) -> int:
    """The completion tokens a whole (non-streamed) answer reports."""
    if kind == "generate":
        return int((doc.get("meta_info") or {}).get("completion_tokens") or 0) if doc.get("text") else 0
    choices = doc.get("choices") or []
    if not choices or not (choices[0].get("text") or "").strip():
        return 0
    return int((doc.get("usage") or {}).get("completion_tokens") or 0)


def judge_whole(kind: str, data: bytes, tokens: int) -> tuple[str, str]:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return "truncated", f"body is not JSON ({exc}): {data[:120]!r}"
    if not isinstance(doc, dict):
        return "failed", f"not a JSON object: {data[:120]!r}"
    got = tokens_of(kind, doc)
    if got < tokens:
        return "truncated", f"{got} of {tokens} tokens"
    return "ok", ""


def judge_stream(kind: str, resp, tokens: int) -> tuple[str, str]:
    """Read an SSE stream to its end: ok only with [DONE] and as many tokens as asked."""
    done = False
    last: dict = {}
    chunks = 0
    other = []  # what is not an SSE line: a whole JSON answer passed through as a stream
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            other.append(raw)
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        try:
            last = json.loads(payload)
        except ValueError:
            return "truncated", f"a stream chunk is not JSON: {payload[:120]!r}"
        chunks += 1
    if not done and not chunks and other:
        verdict, why = judge_whole(kind, b"".join(other), tokens)
        return ("not_streamed", "") if verdict == "ok" else (verdict, why)
    if not done:
        return "truncated", f"stream ended without [DONE] after {chunks} chunks"
    if kind == "generate":
        got = int((last.get("meta_info") or {}).get("completion_tokens") or 0)
    else:
        got = int((last.get("usage") or {}).get("completion_tokens") or 0) or chunks
    if got < tokens:
        return "truncated", f"stream of {got} of {tokens} tokens"
    return "ok", ""


def one(
    url: str, key: str | None, kind: str, stream: bool, tokens: int, n: int, timeout: float, model: str = "default"
) -> tuple[str, str]:
    path, body = body_of(kind, stream, tokens, n, model)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            ctype = resp.headers.get("Content-Type", "")
            if stream and "text/event-stream" in ctype:
                return judge_stream(kind, resp, tokens)
            verdict, why = judge_whole(kind, resp.read(), tokens)
            if stream and verdict == "ok":
                return "not_streamed", ""
            return verdict, why
    except urllib.error.HTTPError as exc:
        try:
            detail = exc.read()[:200].decode(errors="replace")
        except OSError:
            detail = ""
        return "failed", f"HTTP {exc.code}: {detail}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return "failed", f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    except Exception as exc:  # http.client's IncompleteRead, RemoteDisconnected: an answer cut short
        return "truncated", f"{type(exc).__name__}: {exc}"


def run(args: argparse.Namespace, stop: threading.Event) -> dict:
    stats = Stats()
    t0 = time.monotonic()
    counter = iter(range(10**9))
    counter_lock = threading.Lock()

    def worker(w: int) -> None:
        while not stop.is_set():
            with counter_lock:
                n = next(counter)
            kind = KINDS[n % len(KINDS)]
            stream = (n * 7919 % 100) < args.stream_ratio * 100
            tokens = args.min_tokens + (n * 31 % (args.max_tokens - args.min_tokens + 1))
            started = time.monotonic() - t0
            verdict, why = one(args.url, args.api_key, kind, stream, tokens, n, args.timeout, args.model)
            stats.add(f"{kind}{'-stream' if stream else ''}", verdict, started, time.monotonic() - t0 - started, why)

    def watch() -> None:
        while not stop.is_set():
            if args.duration and time.monotonic() - t0 >= args.duration:
                stop.set()
            if args.stop_file and os.path.exists(args.stop_file):
                stop.set()
            stop.wait(0.2)

    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(args.concurrency)]
    threads.append(threading.Thread(target=watch, daemon=True))
    for t in threads:
        t.start()
    if args.ready_file:
        with open(args.ready_file, "w") as fh:
            fh.write("running\n")
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    lat = [s for _, s in stats.latencies]
    windows = {}
    for start, s in stats.latencies:
        windows.setdefault(int(start // 10) * 10, []).append(s)
    return {
        **stats.counts,
        "lost": stats.counts["failed"] + stats.counts["truncated"],
        "by_kind": stats.by_kind,
        "failures": stats.failures[:50],
        # Every failure's start (the list above keeps 50): where failures fall against a fault's window.
        "failed_at_s": sorted(f["at_s"] for f in stats.failures),
        "duration_s": round(elapsed, 1),
        "requests_per_s": round(stats.counts["sent"] / elapsed, 2) if elapsed else 0.0,
        "p50_s": percentile(lat, 50),
        "p99_s": percentile(lat, 99),
        "p99_by_10s": {str(k): percentile(v, 99) for k, v in sorted(windows.items())},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="loadgen", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the router (or a server): http://host:port")
    p.add_argument("--api-key", default=os.environ.get("LOADGEN_API_KEY"), help="Bearer key (or LOADGEN_API_KEY)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--duration", type=float, default=0, help="seconds, 0: until stopped")
    p.add_argument("--stop-file", help="stop once this file exists")
    p.add_argument("--ready-file", help="written once the workers run")
    p.add_argument("--stream-ratio", type=float, default=0.5)
    # SGLang and sglang-router 0.3.2 take any name; smg routes by it (404 for a name no worker serves)
    p.add_argument("--model", default="default", help="the completions' model: the served name behind smg")
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    args = p.parse_args(argv)
    if args.max_tokens < args.min_tokens or args.concurrency < 1:
        p.error("--max-tokens must be at least --min-tokens, --concurrency at least 1")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps(run(args, stop)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
