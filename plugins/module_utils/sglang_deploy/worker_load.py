"""A worker read over HTTP, the gateway aside: its load on /metrics (``read_load``), its /health (``serving``), its
speed (``measure``), and draining it on that evidence before it is stopped (``drain``, docs/rollout.md).

Nothing says when a worker's requests are done once a gateway has removed it: ``drain`` watches the worker itself,
SGLang's ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` gauges on its /metrics (open without the key,
SGLang's auth rule), until both say 0; only a read that says so (or a refused connection: nothing listens) counts as
drained. SGLang 0.5.23 serves /metrics only with ``--enable-metrics`` (sglang/srt/entrypoints/http_server.py:
``if get_observability().enable_metrics: add_prometheus_middleware(app)``, which mounts ``/metrics``,
sglang/srt/utils/common.py); without it the route is 404 and the worker cannot be drained on evidence.

Every wait polls through injected ``clock``/``sleep`` (tests pass fakes); all HTTP goes through http.py, which
ignores any proxy from the environment.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from . import http
from .worker_urls import normalize

RUNNING_METRIC = "sglang:num_running_reqs"
QUEUE_METRIC = "sglang:num_queue_reqs"
# Why a worker's /metrics says nothing: SGLang 0.5.23 mounts the route only with this flag
# (sglang/srt/entrypoints/http_server.py, add_prometheus_middleware in sglang/srt/utils/common.py).
ENABLE_METRICS = "SGLang serves /metrics and its load gauges only with --enable-metrics"


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of a Prometheus series (one per label set: a data-parallel rank, a model), None
    when it has none. SGLang 0.5.23 writes a queue gauge's total under ``priority=""`` and, with priority
    scheduling, each priority's part again under ``priority="<n>"`` (metrics_collector._log_gauge_queue_count):
    those parts are left out, so that they are not counted twice."""
    samples = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})?\s+(\S+)", text, re.M)
    if not samples:
        return None
    total = 0.0
    for labels, s in samples:
        if re.search(r'(?:^|,)\s*priority="[^"]+"', labels):
            continue
        try:
            total += float(s)
        except ValueError:
            return None
    return total


def refused(exc: http.HttpError) -> bool:
    """Whether the worker refused the connection: nothing listens on its port (its server process is gone)."""
    return isinstance(getattr(exc, "cause", None), ConnectionRefusedError)


def _failure(exc: http.HttpError) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, TimeoutError):  # socket.timeout is TimeoutError
        return f"no answer in time ({exc})"
    return str(exc)


def running_requests(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> float | None:
    """The worker's running requests (sglang:num_running_reqs): None when its /metrics lacks the series.
    HttpError when the worker does not answer 200."""
    url = f"{normalize(worker_url)}/metrics"
    code, data = http.request(url, timeout=timeout, api_key=api_key)
    if code != 200:
        raise http.HttpError(f"{url}: HTTP {code}")
    return metric_sum(data.decode(errors="replace"), RUNNING_METRIC)


def read_load(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> dict:
    """One read of the worker's load on its /metrics; never raises. {state, running, queued, why}, state:

    - ``load``: both series read (``running``, ``queued``: each summed over its label sets);
    - ``no_metrics``: /metrics answered 404, or 200 without one of the series: SGLang without --enable-metrics
      (0.5.23 mounts /metrics only with it: sglang/srt/entrypoints/http_server.py); no later read will say more;
    - ``nothing_listens``: the connection was refused: nothing listens on the port (the server process is gone);
    - ``error``: anything else (a 503, another status, a read timeout, a reset connection): no evidence either way.
    """
    url = f"{normalize(worker_url)}/metrics"
    out: dict = {"state": "error", "running": None, "queued": None, "why": ""}
    try:
        code, data = http.request(url, timeout=timeout, api_key=api_key)
    except http.HttpError as exc:
        return {**out, "state": "nothing_listens" if refused(exc) else "error", "why": _failure(exc)}
    if code == 404:
        return {**out, "state": "no_metrics", "why": f"{url} answered HTTP 404 ({ENABLE_METRICS})"}
    if code != 200:
        return {**out, "why": f"{url} answered HTTP {code}"}
    text = data.decode(errors="replace")
    running, queued = metric_sum(text, RUNNING_METRIC), metric_sum(text, QUEUE_METRIC)
    missing = [name for name, v in ((RUNNING_METRIC, running), (QUEUE_METRIC, queued)) if v is None]
    if missing:
        why = f"{url} has no {' nor '.join(missing)} ({ENABLE_METRICS})"
        return {**out, "state": "no_metrics", "running": running, "queued": queued, "why": why}
    return {"state": "load", "running": running, "queued": queued, "why": f"{running:g} running, {queued:g} queued"}


def drain(
    worker_url: str,
    timeout: float,
    api_key: str | None = None,
    poll: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    settle_s: float = 0.2,
    read_timeout: float = 5.0,
    gateway_in_flight: Callable[[], float | None] | None = None,
) -> dict:
    """Wait until the worker has no running nor queued request, on evidence, or the drain timeout; never raises.

    Drained only from positive evidence: reads (``poll`` apart) of both ``sglang:num_running_reqs`` and
    ``sglang:num_queue_reqs`` whose sum said 0 for ``settle_s`` seconds, two reads at least (a request the router
    sent just before the removal took effect may still be on its way to the worker at the first read: a LAN's
    milliseconds), every read between them successful; or a refused connection (nothing listens: the server is
    gone, nothing runs there). Polling faster finds the first 0 sooner; it does not shorten that window. What no
    short window covers: SGLang updates the gauges when it logs a batch, so a request it has just taken may not
    show yet; the stop that follows covers it (SGLang's SIGTERM handler waits for the requests it has).

    Not evidence, so never drained: a read that fails otherwise (a 503, another status, a read timeout, a reset
    connection: a server busy under load answers so), waited through until the timeout; and a /metrics that
    cannot say (404, or without either series: SGLang without --enable-metrics), which ends the drain at once.

    {drained: bool, seconds, running, queued (the last values read, None when not read), why}; with
    ``gateway_in_flight`` (Router.in_flight for this worker, read beside each load), also ``gateway_in_flight``:
    the gateway's own count at the last read, the other side's evidence only: it decides nothing (smg drops it
    with the worker after its settle time, while a request may still run there).
    """
    start = clock()
    last: dict = {"running": None, "queued": None}  # the last load read (a failed read keeps the one before)
    first_zero: float | None = None  # when the reads started saying 0 (None: the last read did not)
    while True:
        read = read_load(worker_url, timeout=read_timeout, api_key=api_key)
        gateway = {} if gateway_in_flight is None else {"gateway_in_flight": _gateway_count(gateway_in_flight)}
        now = clock()
        if read["state"] == "load":
            last = {"running": read["running"], "queued": read["queued"]}
        first_zero, settled = _settled(read, first_zero, now, settle_s)
        end = _drain_end(read, last, settled, now - start, timeout)
        if end is not None:
            return {**end, **gateway}
        sleep(poll)


def _settled(read: dict, first_zero: float | None, now: float, settle_s: float) -> tuple[float | None, bool]:
    """(when the reads started saying 0, None when this one did not; whether they have said so for ``settle_s``).
    The read that opens the window never closes it: two reads at least, whatever ``settle_s``."""
    if read["state"] != "load" or read["running"] + read["queued"] > 0:
        return None, False
    if first_zero is None:
        return now, False
    return first_zero, now - first_zero >= settle_s - 1e-6  # (the tolerance: a float clock's sums)


def _drain_end(read: dict, last: dict, settled: bool, elapsed: float, timeout: float) -> dict | None:
    """The drain's result after this read (the gateway's count aside), None while it goes on: nothing listens,
    /metrics cannot say, the reads said 0 long enough, or the timeout."""
    seconds = round(elapsed, 3)
    if read["state"] == "nothing_listens":
        return {"drained": True, "seconds": seconds, **last, "why": "not serving: connection refused"}
    if read["state"] == "no_metrics":
        return {
            "drained": False,
            "seconds": seconds,
            "running": read["running"],
            "queued": read["queued"],
            "why": f"cannot be drained on evidence: {read['why']}",
        }
    if settled:
        return {"drained": True, "seconds": seconds, **last, "why": "no running or queued requests"}
    if elapsed >= timeout:
        why = read["why"] if read["state"] == "load" else f"last read: {read['why']}"
        return {"drained": False, "seconds": seconds, **last, "why": f"drain timeout ({timeout:g} s): {why}"}
    return None


def _gateway_count(read: Callable[[], float | None]) -> float | None:
    """One read of the gateway's count; None when the gateway does not answer, or answers what no count can be read
    from (evidence only: never a failure, whatever the gateway says)."""
    try:
        return read()
    except Exception:  # RouterError, HttpError; a listing no count comes from (OverflowError, TypeError)
        return None


def serving(worker_url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[bool, str]:
    """(whether the worker's own GET /health answered 200 within timeout, why not)."""
    url = f"{normalize(worker_url)}/health"
    try:
        code, _ = http.request(url, timeout=timeout, api_key=api_key)
    except http.HttpError as exc:
        return False, _failure(exc)
    return (True, "") if code == 200 else (False, f"{url} answered HTTP {code}")


def measure(
    worker_url: str, prompt: str, requests: int, max_new_tokens: int, api_key: str | None = None, timeout: float = 120.0
) -> dict:
    """The worker's output tok/s as the safe restart's verify measures it (checks.load_checks): ``requests``
    generations of ``max_new_tokens`` one after another, their tokens over their seconds. HttpError when one fails."""
    runs = [
        http.generate(worker_url, prompt, max_new_tokens, timeout=timeout, api_key=api_key) for _ in range(requests)
    ]
    seconds = sum(r["seconds"] for r in runs) or 1e-9
    tokens = sum(r["completion_tokens"] for r in runs)
    return {"tokens_per_s": round(tokens / seconds, 1), "requests": len(runs), "seconds": round(seconds, 3)}
