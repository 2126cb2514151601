"""The lab's SGLang stand-in (lab/standin/lab_sglang_standin.py) as unkind as SGLang 0.5.23 where operations depend
on it (issue #29): a stop signal sent to the whole process group kills its schedulers and cuts what is in flight,
one sent to the main process alone drains; /metrics only with --enable-metrics; the LAB_STANDIN_METRICS knob.

The stand-in runs here as the unit runs it, `python -m lab_sglang_standin <flags>` in a process group of its own
(a scheduler child per GPU of CUDA_VISIBLE_DEVICES), on a loopback port. It parses its flags with SGLang's parser:
the real one where it is importable, else a fake of the flags it reads, named as SGLang 0.5.23 names them (the
controller's virtualenv has no SGLang; lab nodes have its parser). `lab-gpu` (the simulated GPUs' bookkeeping)
is a no-op here.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from support import REPO, env_with_pythonpath, lab_standin, wait_for

FAKE_SERVER_ARGS = '''
"""TEST FAKE of sglang.srt.server_args (tests/test_standin.py): the flags the lab stand-in reads."""


class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", required=True)
        parser.add_argument("--served-model-name")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=30000)
        parser.add_argument("--tp-size", type=int, default=1)
        parser.add_argument("--mem-fraction-static", type=float)
        parser.add_argument("--api-key")
        parser.add_argument("--enable-metrics", action="store_true")
        parser.add_argument("--max-running-requests", type=int)
        parser.add_argument("--speculative-algorithm")
        parser.add_argument("--speculative-num-steps", type=int)
        parser.add_argument("--speculative-eagle-topk", type=int)
        parser.add_argument("--speculative-num-draft-tokens", type=int)
        parser.add_argument("--cuda-graph-max-bs-decode", type=int)
'''
FAKE_NETWORK = """
def is_port_available(port):
    return True
"""


@pytest.fixture(scope="module")
def standin_env(tmp_path_factory) -> dict[str, str]:
    """The environment the stand-in runs in here: its directory (and a fake SGLang parser when the real one is not
    importable) on PYTHONPATH, a no-op lab-gpu first on PATH, two GPUs."""
    root = tmp_path_factory.mktemp("standin")
    paths: list[Path | str] = [REPO / "lab" / "standin"]
    if importlib.util.find_spec("sglang") is None:
        pkg = root / "fake" / "sglang"
        for sub in ("", "srt", "srt/utils"):
            (pkg / sub).mkdir(parents=True, exist_ok=True)
            (pkg / sub / "__init__.py").write_text("")
        (pkg / "srt" / "server_args.py").write_text(FAKE_SERVER_ARGS)
        (pkg / "srt" / "utils" / "network.py").write_text(FAKE_NETWORK)
        paths.append(root / "fake")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    (bin_dir / "lab-gpu").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "lab-gpu").chmod(0o755)
    env = env_with_pythonpath(dict(os.environ), *paths)
    env.update(
        {
            "PATH": f"{bin_dir}:{env.get('PATH', '')}",
            "CUDA_VISIBLE_DEVICES": "0,1",
            "LAB_STANDIN_READY_S": "0.3",
            "LAB_STANDIN_TOKENS_PER_S": "20",
        }
    )
    env.pop("LAB_STANDIN_FAULT", None)
    env.pop("LAB_STANDIN_METRICS", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Standin:
    """One stand-in process (and its scheduler children) on a loopback port."""

    def __init__(self, env: dict[str, str], *flags: str, **knobs: str):
        self.port = free_port()
        argv = [sys.executable, "-m", "lab_sglang_standin", "--model-path", "/srv/models/lab-target"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), "--tp-size", "2", *flags]
        self.proc = subprocess.Popen(
            argv,
            env={**env, **{k.upper(): v for k, v in knobs.items()}},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a process group of its own, as a unit's cgroup
        )
        self.children: list[int] = []

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body: dict, timeout: float = 30.0) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def ready(self) -> Standin:
        def up():
            assert self.proc.poll() is None, f"the stand-in exited {self.proc.returncode}: {self.proc.stderr.read()}"
            try:
                return self.get("/health", timeout=2)[0] == 200
            except OSError:
                return False

        wait_for("the stand-in to be ready", up, timeout=60, interval=0.05)
        self.children = child_pids(self.proc.pid)
        assert len(self.children) == 2, self.children  # a scheduler per GPU
        return self

    def exit_code(self, timeout: float = 30.0) -> int:
        self.proc.wait(timeout)
        return self.proc.returncode

    def stop(self) -> str:
        """Kill whatever is left of it (the group); its stderr."""
        for pid in [self.proc.pid, *self.children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.stderr.read() if self.proc.stderr else ""


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return sorted(out)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def standin(standin_env):
    started: list[Standin] = []

    def start(*flags: str, **knobs: str) -> Standin:
        s = Standin(standin_env, *flags, **knobs)
        started.append(s)
        return s.ready()

    yield start
    for s in started:
        s.stop()


class Stream(threading.Thread):
    """A streamed /generate read to its end; .events (JSON pieces), .done ([DONE] seen), .error (how it ended
    otherwise), .first (set at the first event)."""

    def __init__(self, port: int, tokens: int):
        super().__init__(daemon=True)
        self.port, self.tokens = port, tokens
        self.events: list[dict] = []
        self.done = False
        self.error: BaseException | None = None
        self.first = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        body = {"text": "stream me", "sampling_params": {"max_new_tokens": self.tokens}, "stream": True}
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200, resp.status
            while line := resp.readline():
                if line.startswith(b"data: [DONE]"):
                    self.done = True
                elif line.startswith(b"data: "):
                    self.events.append(json.loads(line[6:]))
                    self.first.set()
        except (OSError, http.client.HTTPException) as exc:
            self.error = exc
        finally:
            self.first.set()
            conn.close()

    @property
    def completion_tokens(self) -> int:
        return self.events[-1]["meta_info"]["completion_tokens"] if self.events else 0


# --------------------------------------------------------------------------- /metrics


def test_metrics_is_404_without_enable_metrics_as_in_sglang(standin):
    s = standin()
    assert s.get("/metrics") == (404, b'{"detail":"Not Found"}')
    assert s.get("/no-such-route") == (404, b'{"detail":"Not Found"}')
    assert s.get("/health")[0] == 200  # the server itself serves


def test_metrics_reports_running_and_queued_requests_with_enable_metrics(standin):
    # Two requests, one running slot (--max-running-requests 1): one runs, the other waits in the queue.
    s = standin("--enable-metrics", "--max-running-requests", "1")
    code, text = s.get("/metrics")
    assert code == 200
    assert 'sglang:num_running_reqs{model_name="/srv/models/lab-target"} 0.0' in text.decode()
    assert 'sglang:num_queue_reqs{model_name="/srv/models/lab-target"} 0.0' in text.decode()
    streams = [Stream(s.port, 20) for _ in range(2)]  # 1 s each at 20 tok/s
    for t in streams:
        t.start()

    def gauges():
        lines = dict(line.rsplit(" ", 1) for line in s.get("/metrics")[1].decode().splitlines() if line[:1] != "#")
        return {k.split("{")[0]: float(v) for k, v in lines.items() if k.startswith("sglang:num_")}

    wait_for("one running, one queued", lambda: gauges() == {"sglang:num_running_reqs": 1, "sglang:num_queue_reqs": 1})
    for t in streams:
        t.join(30)
    assert all(t.done and t.completion_tokens == 20 for t in streams)
    assert gauges() == {"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 0}


def histogram(text: str, name: str, **labels: str) -> dict[str, float]:
    """One label set's series of a histogram: {le: cumulative count} plus _sum and _count."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    out = {}
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.startswith(f"{name}_bucket{{{want},le="):
            out[key.split('le="')[1].rstrip('"}')] = float(value)
        elif key in (f"{name}_sum{{{want}}}", f"{name}_count{{{want}}}"):
            out[key.split("{")[0].rsplit("_", 1)[1]] = float(value)
    return out


def test_metrics_has_sglangs_latency_histograms_with_its_buckets(standin):
    """TTFT per request (is_streaming), inter-token latency per token after the first chunk: SGLang 0.5.23's names,
    labels and buckets (metrics_collector.py), which the dashboard's quantiles read."""
    s = standin("--enable-metrics")
    model = "/srv/models/lab-target"

    def now():
        text = s.get("/metrics")[1].decode()
        return (
            histogram(text, "sglang:time_to_first_token_seconds", model_name=model, is_streaming="true"),
            histogram(text, "sglang:inter_token_latency_seconds", model_name=model),
        )

    ttft0, itl0 = now()
    stream = Stream(s.port, 20)
    stream.start()
    stream.join(30)
    assert stream.done and stream.completion_tokens == 20
    ttft, itl = now()
    assert list(ttft)[:-3] == [str(float(b)) for b in lab_standin().TTFT_BUCKETS]
    assert list(itl)[:-3] == [str(float(b)) for b in lab_standin().ITL_BUCKETS]
    assert ttft["count"] - ttft0["count"] == 1 and ttft["+Inf"] == ttft["count"]
    first_chunk = stream.events[0]["meta_info"]["completion_tokens"]
    assert itl["count"] - itl0["count"] == 20 - first_chunk > 0
    buckets = [v for k, v in itl.items() if k not in ("sum", "count")]
    assert buckets == sorted(buckets)  # cumulative
    assert 0 < itl["sum"] - itl0["sum"] < 20 * 1.0  # 20 tok/s: 0.05 s a token


def served_state(knobs: dict[str, str]):
    """The stand-in's State and Handler on a loopback port, without its processes (metrics on)."""
    s = lab_standin()
    args = type("A", (), {"model_path": "m", "served_model_name": None, "api_key": None})()
    args.speculative_algorithm = None
    args.enable_metrics = True
    state = s.State(args, [], s.Knobs({"LAB_STANDIN_TOKENS_PER_S": "20", **knobs}, args))
    state.ready = True
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (s.Handler,), {"state": state}))
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return state, srv


def get(srv, path: str, timeout: float = 10.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_lab_standin_metrics_slow_answers_late():
    _, srv = served_state({"LAB_STANDIN_METRICS": "slow:0.6"})
    try:
        t0 = time.monotonic()
        assert get(srv, "/metrics") == 200
        assert time.monotonic() - t0 >= 0.6
        with pytest.raises(TimeoutError):  # a reader with a shorter timeout than the delay gets nothing
            get(srv, "/metrics", timeout=0.2)
    finally:
        srv.shutdown()


def test_lab_standin_metrics_503_and_503_under_load():
    _, srv = served_state({"LAB_STANDIN_METRICS": "503"})
    try:
        assert get(srv, "/metrics") == 503
        assert get(srv, "/server_info") == 200  # only /metrics
    finally:
        srv.shutdown()
    state, srv = served_state({"LAB_STANDIN_METRICS": "503-under-load:0"})
    try:
        assert get(srv, "/metrics") == 200  # nothing runs
        t = threading.Thread(target=lambda: state.decode("x", 20))  # 1 s
        t.start()
        wait_for("a running request", lambda: state.running == 1)
        assert get(srv, "/metrics") == 503  # more than 0 run
        t.join(10)
        assert get(srv, "/metrics") == 200
    finally:
        srv.shutdown()


@pytest.mark.parametrize("value", ["slow", "slow:x", "503-under-load", "404", "slow:-1"])
def test_a_misspelt_lab_standin_metrics_is_refused(value):
    with pytest.raises(ValueError, match="LAB_STANDIN_METRICS"):
        lab_standin().metrics_knob(value)


def post_generate(srv, tokens: int, timeout: float) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", srv.server_port, timeout=timeout)
    try:
        body = json.dumps({"text": "x", "sampling_params": {"max_new_tokens": tokens}})
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())
    finally:
        conn.close()


def test_lab_standin_hang_after_serves_n_then_hangs_while_health_answers():
    state, srv = served_state({"LAB_STANDIN_HANG_AFTER": "2", "LAB_STANDIN_TOKENS_PER_S": "200"})
    try:
        for _ in range(2):  # the first two are served whole
            assert post_generate(srv, 4, timeout=10)["meta_info"]["completion_tokens"] == 4
        with pytest.raises(TimeoutError):  # the third is taken in and never answered
            post_generate(srv, 4, timeout=1.0)
        assert state.running == 1 and state.decodes == 2  # still in flight: the drain and the gateway see it
        assert get(srv, "/health") == 200
        assert get(srv, "/health_generate", timeout=5) == 200  # the 1-token health generation is not hung
        assert state.admitted == 3  # ... nor counted
        with pytest.raises(TimeoutError):  # every later one hangs too
            post_generate(srv, 1, timeout=0.5)
    finally:
        srv.shutdown()


def test_v1_loads_reports_the_running_and_queued_requests_as_sglang_does():
    """smg's load feed polls /v1/loads?include=core (SGLang 0.5.23's v1_loads.py): the stand-in answers it with
    LoadSnapshot's core fields, the running and waiting requests counted."""
    state, srv = served_state({"LAB_STANDIN_HANG_AFTER": "0"})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server_port, timeout=5)
        t = threading.Thread(target=lambda: state.decode("x", 4), daemon=True)  # hangs: in flight for good
        t.start()
        wait_for("a running request", lambda: state.running == 1)
        conn.request("GET", "/v1/loads?include=core")
        doc = json.loads(conn.getresponse().read())
        conn.close()
        assert doc["version"] == "0.5.23" and len(doc["loads"]) == 1
        core = doc["loads"][0]
        assert tuple(core) == lab_standin().LOAD_CORE_KEYS
        assert (core["num_running_reqs"], core["num_waiting_reqs"], core["dp_rank"]) == (1, 0, 0)
    finally:
        srv.shutdown()


def test_v1_loads_progress_counters_grow_with_tokens_and_stop_when_generations_hang():
    """SGLang 0.5.23's /v1/loads carries the scheduler's progress (load_inquirer.get_loads: decode_moments, None
    before the first decode step, its last item the tokens generated; the prefill's busy time and tokens): they
    grow while it generates and stand still once its generations hang (what a gateway could read a wedge from)."""
    state, srv = served_state({"LAB_STANDIN_HANG_AFTER": "1", "LAB_STANDIN_TOKENS_PER_S": "400"})
    try:
        assert state.loads()["loads"][0]["decode_moments"] is None
        post_generate(srv, 8, timeout=10)
        core = state.loads()["loads"][0]
        assert core["decode_moments"][0] >= 1 and core["decode_moments"][5] == 8
        assert core["total_prefill_uncached_tokens"] == 1 and core["total_prefill_busy_us"] > 0
        with pytest.raises(TimeoutError):
            post_generate(srv, 8, timeout=0.5)
        after = state.loads()["loads"][0]
        assert after["decode_moments"] == core["decode_moments"] and after["num_running_reqs"] == 1
    finally:
        srv.shutdown()


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "two"])
def test_a_misspelt_lab_standin_hang_after_is_refused(value):
    with pytest.raises(ValueError, match="LAB_STANDIN_HANG_AFTER"):
        lab_standin().hang_after_knob(value)


def test_no_lab_standin_hang_after_never_hangs():
    assert lab_standin().hang_after_knob("") is None and lab_standin().hang_after_knob("0") == 0


# --------------------------------------------------------------------------- stop signals


def test_a_sigterm_to_the_whole_group_cuts_the_stream_as_sglang_does(standin):
    """KillMode=control-group: every process gets SIGTERM; the schedulers die at once (no SIGTERM handler), the
    main process's watchdog sees them crashed and kills the process tree, itself included: the stream is cut."""
    s = standin("--enable-metrics")
    stream = Stream(s.port, 60)  # 3 s at 20 tok/s
    stream.start()
    assert stream.first.wait(20) and stream.events, stream.error
    os.killpg(s.proc.pid, signal.SIGTERM)
    stream.join(30)
    assert not stream.is_alive()
    assert not stream.done, "the stream ended with [DONE]: a group SIGTERM let it finish"
    assert stream.completion_tokens < 60
    assert s.exit_code() == -signal.SIGKILL  # kill_process_tree: the main process SIGKILLs itself
    assert not any(alive(pid) for pid in s.children)
    err = s.stop()
    assert "crashed with exit code -15. Triggering SIGQUIT for cleanup..." in err
    assert "It usually means one child failed." in err


def test_a_request_without_streaming_is_dropped_by_a_group_sigterm(standin):
    s = standin("--enable-metrics")
    out: list = []

    def call():
        try:
            out.append(s.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 60}}))
        except (OSError, http.client.HTTPException) as exc:
            out.append(exc)

    t = threading.Thread(target=call)
    t.start()
    wait_for("a request in flight", lambda: b"sglang:num_running_reqs" in (m := s.get("/metrics")[1]) and b"} 1.0" in m)
    os.killpg(s.proc.pid, signal.SIGTERM)
    t.join(30)
    assert out and isinstance(out[0], (OSError, http.client.HTTPException)), out  # no answer at all
    assert s.exit_code() == -signal.SIGKILL


def test_a_sigterm_to_the_main_process_only_drains_the_stream(standin):
    """KillMode=mixed (and docker stop, Kubernetes): the main process alone gets SIGTERM and drains: new requests
    503, the stream finishes with [DONE], then it stops its schedulers itself and exits 0."""
    s = standin("--enable-metrics")
    stream = Stream(s.port, 40)  # 2 s at 20 tok/s
    stream.start()
    assert stream.first.wait(20) and stream.events, stream.error
    os.kill(s.proc.pid, signal.SIGTERM)
    wait_for("the drain (/health 503, as SGLang's while it shuts down)", lambda: s.get("/health")[0] == 503)
    assert s.post("/generate", {"text": "new"})[0] == 503
    stream.join(30)
    assert stream.done and stream.completion_tokens == 40 and stream.error is None
    assert s.exit_code() == 0
    assert not any(alive(pid) for pid in s.children), "it stopped (and reaped) its schedulers itself"
    err = s.stop()
    assert "Gracefully exiting... Remaining number of requests 1." in err
    assert "crashed" not in err


def test_a_scheduler_that_dies_alone_takes_the_server_down(standin):
    """SGLang's SubprocessWatchdog: any child that exits with a code other than 0 is a crash of the server."""
    s = standin()
    os.kill(s.children[1], signal.SIGKILL)
    assert s.exit_code() == -signal.SIGKILL
    assert not alive(s.children[0])
    assert "Subprocess scheduler_1" in s.stop()


def test_the_standin_listens_with_sglangs_backlog_so_a_burst_of_connections_is_queued_not_dropped():
    """64 connections opened while nothing accepts them: all are queued at once, as behind SGLang's 2048
    (uvicorn's backlog); the stdlib's default of 5 drops the rest's handshakes, which once reset a request of an
    e2e benchmark at concurrency 16."""
    s = lab_standin()
    srv = s.Server(("127.0.0.1", 0), s.Handler)  # bound and listening; serve_forever never runs, so none is accepted
    socks = []
    try:
        for _ in range(64):
            c = socket.socket()
            c.settimeout(0.5)  # a dropped SYN is sent again only after 1 s
            c.connect(srv.server_address)
            socks.append(c)
        assert len(socks) == 64
    finally:
        for c in socks:
            c.close()
        srv.server_close()
