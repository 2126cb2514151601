"""LAB TEST DOUBLE: stands in for `python -m sglang.launch_server` on lab nodes.

Lab nodes have no GPU, so SGLang itself cannot serve there. The lab points the
very same systemd unit at this module (`sglang_service_launch_module:
lab_sglang_standin`, PYTHONPATH=/opt/lab-standin, mounted read-only from lab/
by lab/lab.py). Never installed by the roles.

What it does like SGLang 0.5.23:
- parses its arguments with SGLang's real parser (a bad flag exits 2 with
  SGLang's own message);
- runs several processes (one "scheduler" per tensor-parallel rank), each
  holding simulated GPU memory that the lab's simulated nvidia-smi lists;
- serves /health, /health_generate, /generate, /v1/completions,
  /v1/chat/completions, /v1/models, /v1/loads (smg's load feed), /model_info, /server_info (and the
  deprecated /get_* names), and, with --enable-metrics, /metrics with
  sglang:spec_accept_length, sglang:gen_throughput, the load gauges, the token counters and the
  TTFT and inter-token latency histograms (SGLang's names, labels and buckets);
- reports per-request speculative stats in meta_info (spec_verify_ct,
  spec_accept_length) as SGLang's tokenizer manager does;
- streams (SSE, `"stream": true`) on /generate, /v1/completions and
  /v1/chat/completions: one event per few tokens, then `data: [DONE]`;
- counts its running and queued requests (sglang:num_running_reqs, sglang:num_queue_reqs: beyond
  --max-running-requests a request waits in a queue) and, on a SIGTERM to its main process only,
  drains like SGLang's tokenizer manager: new requests get 503, the running ones finish (up to
  LAB_STANDIN_DRAIN_S), then it stops its children itself and exits.

What it does as unkindly as SGLang 0.5.23 (the operations depend on it; docs/lab.md):
- a SIGTERM delivered to a scheduler child kills it (run_scheduler_process in
  sglang/srt/managers/scheduler.py installs no SIGTERM handler: the default action). A stop that signals
  the whole process group at once (systemd's KillMode=control-group) therefore kills the schedulers
  mid-forward; the main process notices within 1 s (SubprocessWatchdog, sglang/srt/utils/watchdog.py,
  started by Engine._launch_subprocesses in sglang/srt/entrypoints/engine.py: a child whose exit code is
  not 0 makes it SIGQUIT itself) and TokenizerManager's SignalHandler.running_phase_sigquit_handler
  (sglang/srt/managers/tokenizer_manager.py) calls kill_process_tree(os.getpid())
  (sglang/srt/utils/common.py): SIGKILL to every child, then to itself. Every stream and request in
  flight is cut (the connection closes mid-stream or before any answer); until then they make no
  progress (no scheduler left to decode them). Only a SIGTERM to the main process alone drains, as
  docker stop and Kubernetes deliver it (issue #29 cites sgl-project/sglang PR 35202, "drain survives
  group-delivered stop signals", for this; 0.5.23's code above has no such handling);
- /metrics exists only with --enable-metrics (sglang/srt/entrypoints/http_server.py:
  `if get_observability().enable_metrics: add_prometheus_middleware(app)`, which mounts /metrics,
  sglang/srt/utils/common.py); without it FastAPI answers 404 `{"detail":"Not Found"}`.

Knobs (environment, set through the instance's env):
  LAB_STANDIN_READY_S        seconds from process start to ready (default 2)
  LAB_STANDIN_TOKENS_PER_S   decode speed of one request (default 400)
  LAB_STANDIN_ACCEPT_LENGTH  speculative accept length (default 2.6 with a spec algorithm)
  LAB_STANDIN_RELEASE_S      seconds GPU memory takes to free after exit (default 0)
  LAB_STANDIN_DRAIN_S        at most this many seconds of waiting for running requests on SIGTERM (default 60)
  LAB_STANDIN_SHARDS         checkpoint shards "loaded" (default 2; the model load's steps are logged with
                             SGLang 0.5.23's lines over what is left of 80 % of LAB_STANDIN_READY_S)
  LAB_STANDIN_LOAD_S         the model load's steps over this many seconds from the end of the parse instead
                             (SGLang's parser can take most of a short LAB_STANDIN_READY_S on a busy machine)
  LAB_STANDIN_SPEC_MODEL     1: decode speed and accept length follow the flags (throughput_model: steps,
                             topk, draft tokens, CUDA-graph batch size) and the requests decoding at once, with
                             a known optimum per concurrency (autotune's tests)
  LAB_STANDIN_SPEC_GAIN      with the model: the power its ratio to no speculation is raised to (default 1; 2
                             widens every gain and loss, 0.01 puts every combination within the noise)
  LAB_STANDIN_METRICS        how /metrics answers (with --enable-metrics; without it, 404 whatever this says):
     slow:<seconds>       each answer that many seconds late: SGLang serves /metrics from the tokenizer
                          manager's own event loop (prometheus_client's ASGI app mounted in the same uvicorn
                          app, reading every process's multiprocess files on each scrape), so a busy tokenizer
                          manager (tokenizing and detokenizing a large batch) answers a scrape late
     503                  every answer 503 (a proxy or load balancer in front of a saturated server)
     503-under-load:<n>   503 while more than n requests run, 200 otherwise
                          (so that the rollout's drain, which reads sglang:num_running_reqs there, is tested
                          against a /metrics it cannot read)
  LAB_STANDIN_HANG_AFTER     n: the first n generations are served, every one after them is admitted (it counts
                             in sglang:num_running_reqs) and never gets a token, while /health stays 200 and
                             the 1-token health generation of /health_generate still answers: #22779's failure
                             ("after a SIGKILL restart /health is 200 but requests hang after ~100 completions",
                             ../shared/reference/fleet-anchors.md); what the gateway's wedge detection and the
                             rollout's verify must catch
  LAB_STANDIN_FAULT          comma-separated faults:
     crash-startup        exit with a traceback while loading
     crash-first-decode   load, then die on the first decode (the seed's AttributeError)
     hang                 never become ready
     stall-load           log "Load weight begin." and never go on (a stalled weight load)
     stray-child          a child that ignores SIGTERM and keeps its GPU memory
     slow-release         GPU memory takes LAB_STANDIN_RELEASE_S (default 4) to free
     wrong-accept         accept length 1.0 (what an EAGLE/EAGLE3 mix-up shows)
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

T0 = time.monotonic()
VERSION = "0.5.23"
H200_MIB = 143771
CHILDREN: list[int] = []  # this process's scheduler children, in rank order
# SubprocessWatchdog's interval (sglang/srt/utils/watchdog.py: interval=1.0, as Engine._launch_subprocesses makes it).
WATCHDOG_INTERVAL_S = 1.0
# Set once this process stops its children itself (the drain's end, a crash): their exits are expected then, as
# TokenizerManager.sigterm_watchdog stops the SubprocessWatchdog before its ShutdownReq. Set and checked under
# SHUTDOWN, so that the watchdog never takes an expected exit for a crash.
EXPECTED_EXITS = threading.Event()
SHUTDOWN = threading.RLock()
# LoadSnapshot's scalar fields in 0.5.23 (sglang/srt/managers/load_snapshot.py), the "core" of /v1/loads, in order.
LOAD_CORE_KEYS = (
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens", "num_used_tokens",
    "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens", "max_total_num_tokens",
    "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
    "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
)  # fmt: skip
NOT_FOUND = b'{"detail":"Not Found"}'  # FastAPI's 404 body (starlette's JSONResponse: no spaces)
# SGLang 0.5.23's latency histograms' buckets (sglang/srt/observability/metrics_collector.py, TokenizerMetricsCollector:
# bucket_time_to_first_token, bucket_inter_token_latency), so that a dashboard's quantiles read the same buckets.
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100, 0.200, 0.400,
    0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count) of one label set."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str, labels: str) -> list[str]:
        out = [
            f'{name}_bucket{{{labels},le="{float(le)}"}} {float(c)}'
            for le, c in zip(self.buckets, self.counts, strict=True)
        ]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {float(self.count)}')
        return [*out, f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {float(self.count)}"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(argv)


class Knobs:
    def __init__(self, env: dict[str, str], args: argparse.Namespace):
        self.faults = {f.strip() for f in env.get("LAB_STANDIN_FAULT", "").split(",") if f.strip()}
        self.ready_s = float(env.get("LAB_STANDIN_READY_S", "2"))
        self.tokens_per_s = float(env.get("LAB_STANDIN_TOKENS_PER_S", "400"))
        self.spec = args.speculative_algorithm
        default_accept = "2.6" if self.spec else "1.0"
        self.accept_length = float(env.get("LAB_STANDIN_ACCEPT_LENGTH", default_accept))
        if "wrong-accept" in self.faults:
            self.accept_length = 1.0
        self.graph_bs = None
        # LAB_STANDIN_SPEC_MODEL=1: decode speed and accept length follow throughput_model (the requests decoding
        # at once included); LAB_STANDIN_SPEC_GAIN is the power of its ratios to no speculation (0.01: within the noise).
        self.model: tuple[int, int, int] | None = None
        self.gain = gain_knob(env.get("LAB_STANDIN_SPEC_GAIN", ""))
        if env.get("LAB_STANDIN_SPEC_MODEL") == "1":
            steps = (args.speculative_num_steps or 0) if self.spec else 0
            self.model = (steps, args.speculative_eagle_topk or 1, args.speculative_num_draft_tokens or steps + 1)
            accept, _ = throughput_model(*self.model)
            self.accept_length = 1.0 if "wrong-accept" in self.faults else accept
            self.graph_bs = getattr(args, "cuda_graph_max_bs_decode", None) or getattr(args, "cuda_graph_max_bs", None)
        self.release_s = float(env.get("LAB_STANDIN_RELEASE_S", "4" if "slow-release" in self.faults else "0"))
        self.drain_s = float(env.get("LAB_STANDIN_DRAIN_S", "60"))
        self.shards = int(env.get("LAB_STANDIN_SHARDS", "2"))
        self.load_s = float(env.get("LAB_STANDIN_LOAD_S", "0"))
        self.metrics = metrics_knob(env.get("LAB_STANDIN_METRICS", ""))
        self.hang_after = hang_after_knob(env.get("LAB_STANDIN_HANG_AFTER", ""))

    def decode_tokens_per_s(self, running: int) -> float:
        """One request's decode speed with `running` requests decoding at once: the model's, or the knob's."""
        if self.model is None:
            return self.tokens_per_s
        return self.tokens_per_s * throughput_model(*self.model, concurrency=max(1, running), gain=self.gain)[1]


GAIN_MAX = 10.0


def gain_knob(value: str) -> float:
    """LAB_STANDIN_SPEC_GAIN as a number at least 0 (unset: 1.0); anything else is refused (ValueError)."""
    value = value.strip()
    try:
        gain = float(value) if value else 1.0
    except ValueError:
        gain = -1.0
    if not 0 <= gain <= GAIN_MAX:  # beyond it the ratio's power overflows or reaches a speed of 0
        raise ValueError(
            f"LAB_STANDIN_SPEC_GAIN={value!r}: expected a number from 0 to {GAIN_MAX} (1: the model as it is)"
        )
    return gain


def hang_after_knob(value: str) -> int | None:
    """LAB_STANDIN_HANG_AFTER as the number of generations served before every next one hangs (None: never).
    Anything but a whole number >= 0 is refused (ValueError), as a misspelt knob must not test the normal case."""
    value = value.strip()
    if not value:
        return None
    if value.isdigit():
        return int(value)
    raise ValueError(f"LAB_STANDIN_HANG_AFTER={value!r}: expected a whole number of generations (0 or more)")


def metrics_knob(value: str) -> tuple[str, float]:
    """LAB_STANDIN_METRICS as (kind, number): ("", 0) normal, ("slow", seconds), ("503", 0), ("503-under-load", n).
    Anything else is refused (ValueError): a knob misspelt must not test the normal case instead."""
    value = value.strip()
    kind, _, number = value.partition(":")
    try:
        if value in ("", "503"):
            return value, 0.0
        if kind in ("slow", "503-under-load") and number and float(number) >= 0:
            return kind, float(number)
    except ValueError:
        pass
    raise ValueError(f"LAB_STANDIN_METRICS={value!r}: expected slow:<seconds>, 503 or 503-under-load:<n>")


# Tokens a decode step takes on before it slows: each further request of the batch adds 1/BATCH_TOKENS of a step
# without speculation, and draft_tokens/BATCH_TOKENS with it (it verifies all its draft tokens): a memory-bound
# step at low concurrency, compute-bound at high (SGLang's bench_speculative.py sweeps batch size for this reason).
BATCH_TOKENS = 8


def throughput_model(
    steps: int, topk: int, draft_tokens: int, concurrency: int = 1, gain: float = 1.0
) -> tuple[float, float]:
    """(accept length, one request's decode speed relative to no speculation at concurrency 1) of EAGLE-style
    speculation, a toy with a known optimum per concurrency: each of min(steps, draft_tokens - 1) positions is
    accepted with q = 1 - 0.45 / sqrt(topk) (a wider tree guesses better); a step costs the draft model's 0.2,
    0.08 per draft step, 0.01 per step and extra branch, 0.04 x (draft_tokens - 1)^2 to verify, and each other
    request decoding at once draft_tokens / BATCH_TOKENS (no speculation: 1 / BATCH_TOKENS). `gain` is the power
    the ratio to no speculation at that concurrency is raised to (0: no difference, 1: the model, 2: every gain
    and loss wider; above 0 for every gain the knob takes, 0 to 10).

    At concurrency 1, over steps {1, 3} x topk {1, 4} x draft tokens {4, 8} (SGLang sets draft tokens to
    steps + 1 when topk is 1) the best is steps 3, topk 4, 4 draft tokens (x1.50), and steps 3, topk 4, 8 draft
    tokens is slower than no speculation (x0.81); at concurrency 16 every combination is slower than no
    speculation (the best x0.88 of it). tests/test_tune.py holds it."""
    plain = 1 + (concurrency - 1) / BATCH_TOKENS  # a step's cost without speculation
    if steps <= 0:
        return 1.0, 1.0 / plain
    q = 1 - 0.45 / topk**0.5
    accept = 1 + sum(q**i for i in range(1, min(steps, draft_tokens - 1) + 1))
    cost = 1 + 0.2 + 0.08 * steps + 0.01 * steps * (topk - 1) + 0.04 * (draft_tokens - 1) ** 2
    cost += (concurrency - 1) * draft_tokens / BATCH_TOKENS
    versus = accept * plain / cost  # speculation against none, at this concurrency
    return round(accept, 3), versus**gain / plain


def gpus() -> list[int]:
    return [int(g) for g in os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",") if g.strip()]


def lab_gpu(*args: str) -> None:
    subprocess.run(["lab-gpu", *args], check=True)


# --------------------------------------------------------------------------- the model load's log


def bar(desc: str, total: int, step_s: float, completed: bool) -> None:
    """A tqdm bar as SGLang's (weight_utils.BAR_FORMAT "{desc}: 50% Completed | 1/2", or tqdm's default
    "{desc}:  50%|#####     | 2/4" for CUDA graphs): redrawn with "\r", ended with "\n", as tqdm writes."""
    for n in range(total + 1):
        pct = round(100 * n / total)
        if completed:
            text = f"{desc}: {pct:3d}% Completed | {n}/{total} [00:0{n}<00:0{total - n}, 1.00it/s]"
        else:
            text = f"{desc}: {pct:3d}%|{'#' * (pct // 10):<10}| {n}/{total} [00:0{n}<00:0{total - n}, 1.00it/s]"
        sys.stderr.write(("\r" if n else "") + text)
        sys.stderr.flush()
        if n < total:
            time.sleep(step_s)
    sys.stderr.write("\n")
    sys.stderr.flush()


def log_model_load(args: argparse.Namespace, knobs: Knobs) -> None:
    """SGLang 0.5.23's lines for the model load, in its order (model_runner.py, weight_utils.py,
    cuda_graph_setup.py, eagle_worker_v2.py, decode_cuda_graph_runner.py), over 80 % of the time to ready."""
    spec = bool(knobs.spec)
    steps = knobs.shards + (1 if spec else 0) + 4 + (2 if spec else 0)
    dt = (knobs.load_s or max(0.0, knobs.ready_s * 0.8 - (time.monotonic() - T0))) / steps
    models = [("target", knobs.shards)] + ([("draft", 1)] if spec else [])
    for _, shards in models:
        log("Load weight begin. avail mem=139.50 GB")
        bar("Loading safetensors checkpoint shards", shards, dt, completed=True)
        log("Load weight end. elapsed=0.50 s, type=LabStandIn, avail mem=120.25 GB, mem usage=19.25 GB.")
    kind = "verify" if spec else "decode"
    log(f"Capture target {kind} CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=100.00 GB")
    bar("Capturing batches (bs=8 avail_mem=100.00 GB)", 4, dt, completed=False)
    log(f"Capture target {kind} CUDA graph end. bs=[1, 2, 4, 8], elapsed=1.00 s, mem usage=0.50 GB.")
    if spec:
        log(
            "Capture draft decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=[1, 2, 4, 8], avail mem=99.50 GB"
        )
        time.sleep(dt)
        log("Capture draft decode CUDA graph end. elapsed=0.50 s, mem usage=0.25 GB, avail mem=99.25 GB.")


# --------------------------------------------------------------------------- processes


def hang_in_cuda_graph_capture(rank: int, parent: int) -> None:
    """Fault hang: the rank stays here (a py-spy dump of it names this frame) while its launcher lives."""
    log(f"scheduler TP{rank}: Capture cuda graph begin. (lab fault hang)")
    while os.getppid() == parent:
        time.sleep(0.2)


def main_thread_sleep() -> None:
    """0.1 s of the main thread's idling. Never one long sleep: Python runs a signal's handler in the main thread,
    and a SIGTERM the kernel hands to another thread (the HTTP server's, the watchdog) does not interrupt the main
    thread's sleep, so its handler (the drain) would wait for that sleep to end."""
    time.sleep(0.1)


def wait_for_schedulers_ready() -> None:
    """Fault hang: the launcher waits here for ranks that never report ready."""
    while True:
        main_thread_sleep()


def scheduler_process(rank: int, gpu: int, mib: int, release_s: float, stray: bool, hang: bool = False) -> None:
    """Child: one tensor-parallel rank holding its GPU's memory until told to stop.

    SIGTERM kills it (the default action): SGLang 0.5.23's run_scheduler_process (sglang/srt/managers/scheduler.py)
    installs no SIGTERM handler, so a SIGTERM sent to the whole group (KillMode=control-group) kills every
    scheduler mid-forward. Only its parent's ShutdownReq (TokenizerManager.sigterm_watchdog) stops it gracefully."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    lab_gpu(
        "hold",
        "--pid",
        str(os.getpid()),
        "--gpu",
        str(gpu),
        "--mib",
        str(mib),
        "--name",
        "python3",
        "--release-seconds",
        str(release_s),
    )
    if stray:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        log(f"scheduler TP{rank}: ignoring SIGTERM (fault stray-child)")
        while True:
            time.sleep(3600)
    parent = os.getppid()
    if hang:
        hang_in_cuda_graph_capture(rank, parent)
    while os.getppid() == parent:
        time.sleep(0.2)


def start_schedulers(args: argparse.Namespace, knobs: Knobs) -> list[int]:
    mib = int(H200_MIB * float(args.mem_fraction_static or 0.85))
    pids = []
    for rank, gpu in enumerate(gpus()):
        pid = os.fork()
        if pid == 0:
            try:
                scheduler_process(
                    rank,
                    gpu,
                    mib,
                    knobs.release_s,
                    "stray-child" in knobs.faults and rank == 0,
                    hang="hang" in knobs.faults,
                )
            finally:
                os._exit(0)
        pids.append(pid)
    return pids


_ALIVE = {"at": -1.0, "alive": True}  # schedulers_alive's last answer, read at most every 0.05 s


def schedulers_alive() -> bool:
    """Whether every scheduler child still runs (a zombie or a reaped one does not): with one gone, no request
    makes progress (SGLang decodes in the schedulers, the main process only tokenizes and answers)."""
    now = time.monotonic()
    if now - _ALIVE["at"] < 0.05:
        return _ALIVE["alive"]
    alive = True
    for pid in CHILDREN:
        try:
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            alive = False
        if not alive:
            break
    _ALIVE.update(at=now, alive=alive)
    return alive


def kill_process_tree_and_exit() -> None:
    """SGLang 0.5.23's end when a child died: TokenizerManager's SignalHandler.running_phase_sigquit_handler
    (sglang/srt/managers/tokenizer_manager.py) calls kill_process_tree(os.getpid()) (sglang/srt/utils/common.py):
    SIGKILL to every child, then to itself (`itself.kill()`), so every connection in flight is closed without
    its answer. The children are reaped first, for the lab's cgroup-v1 containers (kill_children)."""
    kill_children(signal.SIGKILL, wait=2.0)
    os.kill(os.getpid(), signal.SIGKILL)


def watch_children(interval: float = WATCHDOG_INTERVAL_S) -> None:
    """SGLang 0.5.23's SubprocessWatchdog (sglang/srt/utils/watchdog.py, _check_processes), a daemon thread of
    the main process: every `interval`, a child that exited with a code other than 0 (a scheduler killed by a
    SIGTERM has exit code -15) is a crash: "Triggering SIGQUIT for cleanup...", and the SIGQUIT handler kills the
    process tree, the main process included (kill_process_tree_and_exit). It runs on while the main process
    drains after its own SIGTERM (TokenizerManager.sigterm_watchdog stops it only when the drain is over)."""
    reaped: set[int] = set()
    while not EXPECTED_EXITS.wait(interval):
        for rank, pid in enumerate(list(CHILDREN)):
            with SHUTDOWN:
                if EXPECTED_EXITS.is_set():
                    return
                if pid in reaped:
                    continue
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if not done:
                    continue
                reaped.add(pid)
                code = os.waitstatus_to_exitcode(status)  # -15: killed by SIGTERM, as multiprocessing's exitcode
                if code == 0:
                    continue
                log(
                    f"Subprocess scheduler_{rank} (pid={pid}) crashed with exit code {code}. "
                    "Triggering SIGQUIT for cleanup..."
                )
                log(f"SIGQUIT received. signum={int(signal.SIGQUIT)}, frame=None. It usually means one child failed.")
                kill_process_tree_and_exit()


# --------------------------------------------------------------------------- serving


class State:
    def __init__(self, args: argparse.Namespace, argv: list[str], knobs: Knobs):
        self.args = args
        self.argv = argv
        self.knobs = knobs
        self.ready = False
        self.draining = False
        self.running = 0  # requests being decoded now (sglang:num_running_reqs)
        self.queued = 0  # requests accepted, waiting for a running slot (sglang:num_queue_reqs)
        # --max-running-requests: more requests than that wait in the queue (none set: no limit, the queue stays 0).
        self.max_running = getattr(args, "max_running_requests", None) or 0
        # /metrics only with --enable-metrics: SGLang's parser sets enable_metrics (False without the flag). A
        # Namespace made by hand without the attribute (tests that serve State without the parser) keeps /metrics.
        self.metrics_enabled = bool(getattr(args, "enable_metrics", True))
        self.decodes = 0
        self.admitted = 0  # generations given a running slot, health checks apart (LAB_STANDIN_HANG_AFTER counts them)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.verify_ct = 0
        # SGLang observes TTFT per request (labelled is_streaming) and the inter-token latency per decoded chunk, its
        # interval spread over the chunk's tokens (observe_inter_token_latency); a health check is a request too.
        self.ttft = {"true": Histogram(TTFT_BUCKETS), "false": Histogram(TTFT_BUCKETS)}
        self.itl = Histogram(ITL_BUCKETS)
        # /v1/loads' progress counters (SGLang 0.5.23 scheduler.py _accumulate_decode_moment, load_inquirer.py): per
        # decode step [steps, sum batch, sum step_us, sum batch^2, sum batch*step_us, tokens]; a hung worker's stop.
        self.decode_moments = [0.0] * 6
        self.prefill_busy_us = 0
        self.prefill_uncached_tokens = 0
        self.lock = threading.Condition()  # guards the counters; notified when a running slot frees
        self.last_throughput = 0.0

    @property
    def in_flight(self) -> int:
        """Requests the server has (running or queued): what SGLang's drain waits for (rid_to_state)."""
        return self.running + self.queued

    def decode(self, prompt: str, max_new_tokens: int, health: bool = False) -> dict:
        """A whole answer: the last of decode_stream's pieces."""
        return list(self.decode_stream(prompt, max_new_tokens, every=0, health=health))[-1]

    def decode_stream(self, prompt: str, max_new_tokens: int, every: int = 4, health: bool = False):
        """Yield the answer so far every `every` tokens (0: only once, whole), as SGLang's /generate stream does.
        health: the server's own 1-token health generation, which LAB_STANDIN_HANG_AFTER neither counts nor hangs."""
        if "crash-first-decode" in self.knobs.faults:
            crash_on_decode()
        n = max(1, int(max_new_tokens))
        step = n if every <= 0 else every
        started = time.monotonic()
        words = ["lab", "stand-in", "tokens"]
        with self.lock:
            self.queued += 1
            try:
                while self.max_running and self.running >= self.max_running:
                    self.lock.wait()
            finally:
                self.queued -= 1
            self.running += 1
            if not health:
                self.admitted += 1
            # The prefill (the health generation's one token included: SGLang runs it as a real request).
            self.prefill_uncached_tokens += max(1, len(prompt.split()))
            self.prefill_busy_us += 1000
            hangs = not health and self.knobs.hang_after is not None and self.admitted > self.knobs.hang_after
        try:
            while hangs:  # in flight for good, no token: cut only when the process ends (a drain times out)
                time.sleep(0.1)
            # Each step sleeps for its length: a loaded machine's late wake-ups add up over a request, as a CPU-bound
            # scheduler's steps stretch under load (tests timed against a request's length keep that margin).
            done = 0
            while done < n:
                k = min(step, n - done)
                while not schedulers_alive():  # no scheduler left to decode it: it waits to be cut
                    time.sleep(0.05)
                graphs = self.knobs.graph_bs is None or self.running <= self.knobs.graph_bs
                speed = self.knobs.decode_tokens_per_s(self.running)
                step_s = k / (speed * (1.0 if graphs else 0.7))  # past the graphs: eager
                time.sleep(step_s)
                done += k
                with self.lock:  # k tokens of this request as one step of a batch of `running` (an approximation)
                    b, t, m = float(self.running), step_s * 1e6, self.decode_moments
                    for i, v in enumerate((1.0, b, t, b * b, b * t, float(k))):
                        m[i] += v
                elapsed = time.monotonic() - started
                with self.lock:
                    if done == k:
                        self.ttft["true" if every > 0 else "false"].observe(elapsed)
                    else:
                        self.itl.observe(step_s / k, k)
                text = " ".join(words[i % len(words)] for i in range(done))
                verify_ct = max(1, round(done / self.knobs.accept_length))
                meta = {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": done,
                    "e2e_latency": elapsed,
                    "finish_reason": {"type": "length", "length": n} if done == n else None,
                }
                if self.knobs.spec:
                    meta.update({"spec_verify_ct": verify_ct, "spec_accept_length": done / verify_ct})
                if done == n:
                    with self.lock:
                        self.decodes += 1
                        self.prompt_tokens += len(prompt.split())
                        self.generation_tokens += n
                        self.verify_ct += verify_ct
                        self.last_throughput = n / elapsed if elapsed > 0 else 0.0
                yield {"text": text, "meta_info": meta}
        finally:
            with self.lock:
                self.running -= 1
                self.lock.notify()

    def server_info(self) -> dict:
        info = dict(vars(self.args))
        info["launch_command"] = " ".join(["python3", "-m", "sglang.launch_server", *self.argv])
        states = [{}]
        if self.knobs.spec and self.verify_ct:
            states[0]["avg_spec_accept_length"] = self.generation_tokens / self.verify_ct
        info.update({"internal_states": states, "version": VERSION, "frontend": "python", "lab_standin": True})
        return info

    def loads(self) -> dict:
        """/v1/loads as SGLang 0.5.23 answers it (sglang/srt/entrypoints/v1_loads.py get_loads; one DP rank): the
        "core" section of LoadSnapshot.to_dict (sglang/srt/managers/load_snapshot.py), every scalar field, the
        ones a stand-in has no model for at 0; the progress counters (decode_moments, the prefill's) as it
        generates; the other sections are left out (SGLang fills them only when asked for and present)."""
        core = dict.fromkeys(LOAD_CORE_KEYS, 0)
        with self.lock:
            core.update(
                timestamp=time.time(),
                num_running_reqs=self.running,
                num_waiting_reqs=self.queued,
                max_running_requests=self.max_running,
                gen_throughput=self.last_throughput,
                total_prefill_uncached_tokens=self.prefill_uncached_tokens,
                total_prefill_busy_us=self.prefill_busy_us,
                decode_moments=list(self.decode_moments) if self.decode_moments[0] > 0 else None,
            )
        tp = int(getattr(self.args, "tp_size", 1) or 1)
        return {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "version": VERSION,
            "accelerator": "NVIDIA H200",
            "num_accelerators": tp,
            "loads": [core],
        }

    def metrics(self) -> str:
        labels = f'model_name="{self.args.served_model_name or self.args.model_path}"'
        accept = self.generation_tokens / self.verify_ct if self.verify_ct else 0.0
        lines = [
            "# HELP sglang:gen_throughput The generation throughput (token/s).",
            "# TYPE sglang:gen_throughput gauge",
            f"sglang:gen_throughput{{{labels}}} {self.last_throughput}",
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{labels}}} {float(self.running)}",
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{labels}}} {float(self.queued)}",
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{labels}}} {float(self.generation_tokens)}",
        ]
        with self.lock:
            lines += [
                "# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.",
                "# TYPE sglang:time_to_first_token_seconds histogram",
                *self.ttft["false"].lines("sglang:time_to_first_token_seconds", f'{labels},is_streaming="false"'),
                *self.ttft["true"].lines("sglang:time_to_first_token_seconds", f'{labels},is_streaming="true"'),
                "# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.",
                "# TYPE sglang:inter_token_latency_seconds histogram",
                *self.itl.lines("sglang:inter_token_latency_seconds", labels),
            ]
        # Exported without speculation too, as 0: SGLang 0.5.23's metrics_reporter.py sets spec_accept_length = 0
        # when spec_algorithm.is_none() (an alert on a low accept length must tell "off" from "accepting nothing").
        lines += [
            "# HELP sglang:spec_accept_length Mean acceptance length of speculative decoding.",
            "# TYPE sglang:spec_accept_length gauge",
            f"sglang:spec_accept_length{{{labels}}} {accept if self.knobs.spec else 0.0}",
        ]
        return "\n".join(lines) + "\n"


def crash_on_decode() -> None:
    """The seed's failure: an attribute left unset by a half-failed __init__, read on the first decode."""
    try:

        class EAGLEWorkerV2:
            def forward_batch_generation(self):
                return self.adaptive_controller.on_verify()

        EAGLEWorkerV2().forward_batch_generation()
    except AttributeError:
        log("Scheduler hit an exception: " + traceback.format_exc())
        log("Received sigquit from a child process. It usually means the child failed.")
        kill_children(signal.SIGKILL, wait=2.0)
        os._exit(1)


def kill_children(sig: int, wait: float = 0.0) -> set[int]:
    """Signal every child; with wait, reap them for up to that many seconds. The ones left. Their exits are
    expected from here on: the watchdog (watch_children) stands down first."""
    with SHUTDOWN:
        EXPECTED_EXITS.set()
    for pid in CHILDREN:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    # Reap them before exiting, as SGLang's launcher does: in lab containers (cgroup v1,
    # no release agent) systemd learns that a unit's cgroup emptied only when its main
    # process exits last; otherwise each stop would wait out TimeoutStopSec.
    deadline = time.monotonic() + wait
    waiting = set(CHILDREN)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    waiting.discard(pid)
            except ChildProcessError:
                waiting.discard(pid)
        time.sleep(0.02)
    return waiting


class Handler(BaseHTTPRequestHandler):
    state: State
    server_version = "uvicorn"
    sys_version = ""

    def log_message(self, fmt: str, *args) -> None:  # quieter than the default
        pass

    def reply(self, code: int, body: object = None, ctype: str = "application/json") -> None:
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, events) -> None:
        """Server-sent events, as SGLang streams: `data: {json}` per piece, then `data: [DONE]`."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # no Content-Length: the end of the stream is the connection's close (HTTP/1.0)
        for event in events:
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def authorized(self, path: str) -> bool:
        """SGLang 0.5.23's rule (srt/utils/auth.py): /health*, /ready*, /metrics* are open; the rest need the key."""
        key = self.state.args.api_key
        if not key or path.startswith(("/health", "/ready", "/metrics")):
            return True
        kind, _, token = (self.headers.get("Authorization") or "").partition(" ")
        if kind.lower() == "bearer" and hmac.compare_digest(token, key):
            return True
        self.reply(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:
        st = self.state
        path = self.path.split("?", 1)[0]
        if not self.authorized(path):
            return None
        if path in ("/health", "/ready"):
            # 503 while draining too, as SGLang 0.5.23 (http_server.py health_generate: "Health check request
            # received during shutdown. Returning 503."; /ready: TokenizerManager.is_ready).
            return self.reply(200 if st.ready and not st.draining else 503)
        if not st.ready:
            return self.reply(503)
        if path.startswith("/metrics"):  # SGLang's Mount: path_regex ^/metrics(?P<path>.*)$ (add_prometheus_middleware)
            return self.metrics()
        if path == "/health_generate":
            if st.draining:
                return self.reply(503)
            st.decode("", 1, health=True)
            return self.reply(200)
        if path == "/v1/loads":  # what smg's load feed polls (/v1/loads?include=core); its hung-worker checks read it
            return self.reply(200, st.loads())
        if path in ("/server_info", "/get_server_info"):
            return self.reply(200, st.server_info())
        if path in ("/model_info", "/get_model_info"):
            return self.reply(200, {"model_path": st.args.model_path, "is_generation": True, "lab_standin": True})
        if path == "/v1/models":
            name = st.args.served_model_name or st.args.model_path
            return self.reply(200, {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "sglang"}]})
        return self.reply(404, NOT_FOUND)

    def metrics(self) -> None:
        """/metrics: 404 without --enable-metrics, as SGLang 0.5.23 (the route is not mounted); with it, the
        series, unless LAB_STANDIN_METRICS makes the answer late or a 503 (see the module's docstring)."""
        st = self.state
        if not st.metrics_enabled:
            return self.reply(404, NOT_FOUND)
        kind, number = st.knobs.metrics
        if kind == "slow":
            time.sleep(number)
        if kind == "503" or (kind == "503-under-load" and st.running > number):
            return self.reply(503)
        return self.reply(200, st.metrics().encode(), "text/plain; version=0.0.4")

    def do_POST(self) -> None:
        st = self.state
        if not st.ready or st.draining:
            return self.reply(503)
        path = self.path.split("?", 1)[0]
        if not self.authorized(path):
            return None
        req = self.body()
        stream = bool(req.get("stream"))
        if path == "/generate":
            params = req.get("sampling_params") or {}
            prompt, tokens = str(req.get("text", "")), params.get("max_new_tokens", 16)
            if stream:
                return self.stream(st.decode_stream(prompt, tokens))
            return self.reply(200, st.decode(prompt, tokens))
        if path in ("/v1/completions", "/v1/chat/completions"):
            chat = path.endswith("chat/completions")
            prompt = (
                " ".join(m.get("content", "") for m in req.get("messages", [])) if chat else str(req.get("prompt", ""))
            )
            tokens = req.get("max_tokens", 16)
            head = {
                "id": f"lab-{st.decodes}",
                "created": int(time.time()),
                "model": req.get("model", st.args.model_path),
            }
            if stream:
                usage = bool((req.get("stream_options") or {}).get("include_usage"))
                return self.stream(openai_chunks(st.decode_stream(prompt, tokens), head, chat, usage))
            out = st.decode(prompt, tokens)
            meta = out["meta_info"]
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": out["text"]}} if chat else {"text": out["text"]})
            return self.reply(
                200,
                {
                    **head,
                    "object": "chat.completion" if chat else "text_completion",
                    "choices": [choice],
                    "usage": usage_of(meta),
                },
            )
        return self.reply(404, NOT_FOUND)


class Server(ThreadingHTTPServer):
    # SGLang's listen backlog is uvicorn's 2048 (0.5.23 srt/entrypoints/http_server.py); the stdlib's 5 reset a
    # connection of 16 opened at once in an e2e benchmark, a failure SGLang would not have.
    request_queue_size = 2048


def usage_of(meta: dict) -> dict:
    return {
        "prompt_tokens": meta["prompt_tokens"],
        "completion_tokens": meta["completion_tokens"],
        "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"],
    }


def openai_chunks(pieces, head: dict, chat: bool, usage: bool):
    """OpenAI-style stream chunks (the text added since the last piece); usage in a last chunk when asked."""
    sent = ""
    meta: dict = {}
    for piece in pieces:
        meta = piece["meta_info"]
        delta, sent = piece["text"][len(sent) :], piece["text"]
        finish = "length" if meta["finish_reason"] else None
        choice = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"content": delta}} if chat else {"text": delta})
        yield {**head, "object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}
    if usage and meta:
        yield {
            **head,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [],
            "usage": usage_of(meta),
        }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)  # SGLang's parser: exits 2 with its message on a bad flag
    knobs = Knobs(dict(os.environ), args)
    # As SGLang 0.5.23 does at start (entrypoints/engine.py: only watermark secrets are redacted, the API key is
    # not), so that masking the journal in what the modules report is tested.
    log("server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in sorted(vars(args).items())) + ")")
    # As SGLang's launcher checks its port at start: the installed SGLang's own code (srt/utils/network.py), so an
    # upgrade broken there dies here, while SGLang's parser (validation) never runs it.
    from sglang.srt.utils.network import is_port_available

    if not is_port_available(args.port):
        log(f"port {args.port} is in use")
    log(
        f"LAB STAND-IN for sglang.launch_server {VERSION}: model {args.model_path}, tp {args.tp_size}, "
        f"GPUs {gpus()}, speculative {args.speculative_algorithm}, faults {sorted(knobs.faults) or 'none'}"
    )
    CHILDREN.extend(start_schedulers(args, knobs))
    # SGLang's SubprocessWatchdog: a scheduler that dies (a group SIGTERM kills them) takes the server down with it.
    threading.Thread(target=watch_children, daemon=True, name="subprocess-watchdog").start()

    def stop(signum, frame):
        log(f"SIGTERM received. signum={signum} frame=None. Draining requests and shutting down...")
        state = Handler.__dict__.get("state")
        if state is not None and state.ready:
            # As SGLang's tokenizer manager does on SIGTERM (SignalHandler.sigterm_handler sets gracefully_exit,
            # TokenizerManager.sigterm_watchdog waits while rid_to_state is not empty): no new requests (503), the
            # running and queued ones finish. The watchdog runs on meanwhile: should a scheduler die now (the
            # SIGTERM went to the whole group), the server is killed with its requests (watch_children).
            # Not modelled: SGLang notices the SIGTERM only at its next 5 s poll (asyncio.sleep(5) in
            # sigterm_watchdog) and then waits in 5 s steps; the stand-in starts at once and polls every 0.05 s.
            state.draining = True
            deadline = time.monotonic() + knobs.drain_s
            if state.in_flight:
                log(f"Gracefully exiting... Remaining number of requests {state.in_flight}.")
            while state.in_flight and time.monotonic() < deadline:
                time.sleep(0.05)
        # Then its schedulers are stopped by the process itself (a ShutdownReq, then kill_process_tree of its
        # children), the watchdog first (kill_children).
        left = kill_children(signal.SIGTERM, wait=2.0)
        if left:
            log(f"children {sorted(left)} still running after SIGTERM; exiting without them")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if "crash-startup" in knobs.faults:
        time.sleep(min(knobs.ready_s, 0.5))
        log("Load weight begin.")
        try:
            raise RuntimeError("CUDA error: out of memory while loading draft model weights (lab fault crash-startup)")
        except RuntimeError:
            log("Scheduler hit an exception: " + traceback.format_exc())
        kill_children(signal.SIGKILL, wait=2.0)
        return 1

    state = State(args, argv, knobs)
    Handler.state = state
    httpd = Server((args.host, args.port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    if "stall-load" in knobs.faults:
        log("Load weight begin. avail mem=139.50 GB (lab fault stall-load: the load never goes on)")
        wait_for_schedulers_ready()
    log_model_load(args, knobs)
    log(f"Uvicorn running on http://{args.host}:{args.port}")
    if "hang" in knobs.faults:
        log("Capture cuda graph begin. (lab fault hang: never ready)")
        wait_for_schedulers_ready()
    time.sleep(max(0.0, knobs.ready_s - (time.monotonic() - T0)))
    state.ready = True
    log("The server is fired up and ready to roll!")
    while True:  # the watchdog thread watches the children; SIGTERM (stop) ends this
        main_thread_sleep()


if __name__ == "__main__":
    sys.exit(main())
