"""smg 1.13.0 (the Shepherd Model Gateway, PyPI `smg`) on loopback for the tests: its own virtualenv, the gateway
process, lab stand-ins in front of which it runs, and small readers of its API and metrics.

Shared by tests/test_gateway_smg.py (the facts of docs/router.md's "The two gateways") and
tests/test_router_client.py (router.py's client against the real binary): test modules do not import one another.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http
from support import REPO, wait_for

SMG_VERSION = "1.13.0"
CACHE = Path.home() / ".cache" / "sglang-deploy"
WHEELHOUSE = CACHE / "wheelhouse"
KEY = "smg-test-key"
MODEL = "/srv/models/lab-target"
TOKENS_PER_S = 40

# The lab stand-in's HTTP server (lab/standin/lab_sglang_standin.py: State, Handler) on a loopback port, stdlib
# only (no SGLang parser, no simulated GPUs): it counts its running requests into sglang:num_running_reqs and
# streams as SGLang does. Started as SGLang with --enable-metrics (the drain reads /metrics); a stand-in that
# does not report sglang:num_queue_reqs yet gets it here, 0 (it queues nothing: every request runs at once).
STANDIN = r"""
import argparse, os, sys
from http.server import ThreadingHTTPServer
import lab_sglang_standin as s

port, key, tps = int(sys.argv[1]), sys.argv[2], sys.argv[3]
args = argparse.Namespace(model_path="/srv/models/lab-target", served_model_name=None, api_key=key,
                          speculative_algorithm=None, enable_metrics=True)
metrics = s.State.metrics
def with_queue(self):
    text = metrics(self)
    return text if "sglang:num_queue_reqs" in text else text + 'sglang:num_queue_reqs{model_name="lab"} 0.0\n'
s.State.metrics = with_queue
knobs = {k: v for k, v in os.environ.items() if k.startswith("LAB_STANDIN_")}  # a fault, as the unit's env sets it
state = s.State(args, [], s.Knobs({**knobs, "LAB_STANDIN_TOKENS_PER_S": tps}, args))
state.ready = True
srv = ThreadingHTTPServer(("127.0.0.1", port), type("H", (s.Handler,), {"state": state}))
srv.daemon_threads = True
print("serving", flush=True)
srv.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smg_venv() -> Path:
    """smg's own virtualenv: $SGD_SMG_VENV, else one made once under the controller's cache, from a wheel set
    fetched for it (no index), else from the package index. Not made: the test fails (no skip)."""
    if os.environ.get("SGD_SMG_VENV"):
        return Path(os.environ["SGD_SMG_VENV"])
    sets = sorted(WHEELHOUSE.glob(f"smg-{SMG_VERSION}-*/wheels"))
    key = hashlib.sha256(str(sets[-1] if sets else "index").encode()).hexdigest()[:12]
    venv = CACHE / f"test-smg-{SMG_VERSION}-{key}"
    if not (venv / ".complete").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        src = ["--no-index", "--find-links", str(sets[-1])] if sets else []
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *src, f"smg=={SMG_VERSION}"],
            check=True,
            capture_output=True,
        )
        (venv / ".complete").touch()
    return venv


def call(method: str, url: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, object]:
    """One request through http.OPENER (no proxy): (status, the JSON body, else its text)."""
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with http.OPENER.open(req, timeout=30) as resp:
            code, data = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        code, data = exc.code, exc.read()
    try:
        return code, json.loads(data)
    except ValueError:
        return code, data.decode(errors="replace")


def per_worker(text: str, url: str) -> dict[str, float]:
    """The Prometheus samples labelled with this worker, {name: value} (the last one of each name)."""
    out = {}
    for line in text.splitlines():
        if f'worker="{url}"' in line and not line.startswith("#"):
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


class Gateway:
    def __init__(self, venv: Path, log: Path, *flags: str):
        self.port, self.prometheus = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.prometheus}/metrics"
        self.log = log
        argv = [str(venv / "bin" / "smg"), "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus)]
        argv += ["--policy", "round_robin", "--health-check-interval-secs", "1", "--api-key", KEY, *flags]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)

    def workers(self) -> list[dict]:
        code, doc = call("GET", f"{self.url}/workers")
        assert code == 200, doc
        return doc["workers"]

    def by_url(self) -> dict[str, dict]:
        return {w["url"]: w for w in self.workers()}

    def metrics(self) -> str:
        code, text = call("GET", self.metrics_url, key=None)
        assert code == 200, text
        return text

    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))  # the log is coloured

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Standins:
    """Three stand-ins on loopback ports: the gateway fronts the first two; the third is spare."""

    def __init__(self):
        self.urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
        self.procs = [self.start(u) for u in self.urls]
        try:
            for u in self.urls:
                wait_for(f"{u} healthy", lambda u=u: http.healthy(u), timeout=20)
        except AssertionError:
            self.stop()  # the fixture's own cleanup does not run when its setup fails
            raise

    def start(self, url: str, **knobs: str) -> subprocess.Popen:
        """A stand-in on url's port; knobs: its LAB_STANDIN_* environment (hang_after="0": LAB_STANDIN_HANG_AFTER)."""
        port = url.rsplit(":", 1)[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAB_STANDIN_")}
        env.update({f"LAB_STANDIN_{k.upper()}": v for k, v in knobs.items()}, PYTHONPATH=str(REPO / "lab" / "standin"))
        cmd = [sys.executable, "-c", STANDIN, port, KEY, str(TOKENS_PER_S)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def restart(self, i: int) -> None:
        self.procs[i] = self.start(self.urls[i])
        wait_for(f"{self.urls[i]} healthy again", lambda: http.healthy(self.urls[i]), timeout=20)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def all_ready(gw: Gateway, *urls: str) -> bool:
    try:
        listed = gw.by_url()
    except (AssertionError, OSError):
        return False
    return all(u in listed and listed[u]["is_healthy"] and listed[u]["status"] == "ready" for u in urls)
