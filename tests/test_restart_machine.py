"""The safe restart's state machine (sglang_deploy.restart, machine, phases, operate, failure) against fakes of systemd,
SGLang's HTTP server and nvidia-smi.

The fakes, all behind machine.Ports:

    Host        one instance's systemd unit (ActiveState/SubState, MainPID, NRestarts, an
                InvocationID per start, UnitFileState, the exit timestamp), its journal, the
                process table (cmdline) and nvidia-smi (snapshot, wait_clean); a fake clock;
                every call recorded; faults injected per call ("the 2nd systemctl stop times out")
    FakeServer  what `systemctl start` launches: an HTTP server on a free loopback port whose
                behaviour is chosen per profile (the new configuration and the known-good one
                can fail differently, so rollbacks succeed or fail)

The unit runs what its loaded unit file's ExecStart says (secrets expanded from the
EnvironmentFiles as systemd would), so a rollback really starts the known-good argv.
Every phase x every failure kind that can occur there (and SIGTERM of the module) ends
in exactly one defined outcome, and the test checks where the unit was left.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import (
    bench,
    boot,
    checks,
    failure,
    gpu,
    http,
    known_good,
    lock,
    machine,
    operate,
    outcomes,
    phases,
    procinfo,
    restart,
    stage,
    unit,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.checks import Thresholds, flag_value
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import (
    Instance,
    masked,
    read_env_file,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good import Store
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import InstanceLock, peek
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine import Machine, Ports, Settings
from support import COLLECTIONS, env_with_pythonpath

UNIT = "sglang-m.service"
KEY = "s3cret-key"
SECRET_REF = "${SGLANG_API_KEY}"  # as the unit renders --api-key (systemd expands it from the secrets file)
CRASH_AT_START = [
    "Loading the model from /models/m",
    "Traceback (most recent call last):",
    '  File "/opt/venv-new/lib/python3.11/site-packages/sglang/launch_server.py", line 11, in <module>',
    "    from sglang.srt.speculative.eagle_worker import EAGLEWorker",
    "ImportError: cannot import name 'EAGLEWorker' from 'sglang.srt.speculative.eagle_worker'",
]
CRASH_ON_GENERATE = [
    "The server is fired up and ready to roll!",
    "Traceback (most recent call last):",
    '  File "/opt/venv/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 1402, in event_loop',
    "    self.draft_worker.forward_batch_speculative_generation(batch)",
    "AttributeError: 'NoneType' object has no attribute 'verified_id'",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- the fake SGLang server


# The unit's ExecStartPre gate writes this under the invocation before the server's process runs (another _PID).
GATE_LINE = "sglang-gpu-gate: GPUs [0, 1] clean after 0.02s"
PRE_EXEC_LINE = (
    "ProtectHostname=yes is configured, but UTS namespace setup is prohibited (container manager?), ignoring"
)


@dataclass
class Behaviour:
    """How a started server behaves (per profile)."""

    crash_at_start: bool = False  # the unit fails at once, a traceback in its journal (Restart=on-failure)
    health: int = 200  # 503: never healthy (the ready timeout)
    health_generate: int = 200
    generate_fault: str | None = None  # crash | incomplete | malformed | http500 | empty | bad-tokens | sigterm
    good_generates: int = 0  # how many /generate requests succeed before the fault
    # crash: seconds (fake clock) from the dropped connection to the main process's exit. SGLang's scheduler dies
    # first; the parent exits when its watchdog or SIGQUIT handler kills the tree, later (http_server.py).
    crash_lag: float = 0.0
    server_info: str = "ok"  # ok | malformed | http500 | no_states (accept length from /metrics) | no_spec
    accept: float = 2.5  # spec_accept_length per request (1.0: no draft token ever accepted)
    require_key: str | None = None  # a key the server demands whatever its argv says


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def authorised(self) -> bool:
        key = self.server.fake.key
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self.reply(401, b'{"error": "Unauthorized"}')
            return False
        return True

    def do_GET(self) -> None:
        fake = self.server.fake
        b = fake.b
        fake.requests.append(self.path)
        if not self.authorised():
            return
        if self.path == "/health":
            self.reply(b.health, b"")
        elif self.path == "/health_generate":
            self.reply(b.health_generate, b"")
        elif self.path == "/server_info":
            if b.server_info == "malformed":
                self.reply(200, b'{"speculative_algorithm": "EAGLE", "internal_')
            elif b.server_info == "http500":
                self.reply(500, b"Internal Server Error")
            elif b.server_info == "no_spec":  # no draft model: SGLang's speculative_algorithm is None
                self.reply(200, json.dumps({"speculative_algorithm": None}).encode())
            else:
                info = {"speculative_algorithm": "EAGLE"}
                if b.server_info == "ok":
                    info["internal_states"] = [{"avg_spec_accept_length": b.accept}]
                self.reply(200, json.dumps(info).encode())
        elif self.path == "/metrics":
            self.reply(200, f'sglang:spec_accept_length{{model_name="m"}} {b.accept}\n'.encode(), "text/plain")
        else:
            self.reply(404, b"{}")

    def do_POST(self) -> None:
        fake = self.server.fake
        b = fake.b
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        fake.requests.append(self.path)
        if not self.authorised():
            return
        if self.path == "/generate" and not (body.get("text") or body.get("input_ids")):
            # SGLang's GenerateReqInput refuses it; the HTTP server answers 400 with the message
            msg = "Either text, input_ids or input_embeds should be provided."
            self.reply(400, json.dumps({"error": {"message": msg}}).encode())
            return
        with fake.lock:
            fake.generates += 1
            n = fake.generates
        fault = b.generate_fault if n > b.good_generates else None
        if fault == "crash":  # the seed: loaded, then died on its first decode; the connection drops
            if b.crash_lag:
                fake.host.dying = (fake.host.t + b.crash_lag, CRASH_ON_GENERATE)
            else:
                fake.host.crash(CRASH_ON_GENERATE)
            fake.crash_close()
            return
        if fault == "incomplete":  # a Content-Length larger than the body, then the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "4096")
            self.end_headers()
            self.wfile.write(b'{"text": " Paris, the capital')
            return
        if fault == "malformed":
            self.reply(200, b'{"text": " Paris", "meta_info": {"completion_tok')
            return
        if fault == "http500":
            self.reply(500, b"Internal Server Error: CUDA error: an illegal memory access was encountered")
            return
        if fault == "empty":
            self.reply(200, json.dumps({"text": "", "meta_info": {"completion_tokens": 0}}).encode())
            return
        if fault == "bad-tokens":
            self.reply(200, json.dumps({"text": " Paris", "meta_info": {"completion_tokens": "many"}}).encode())
            return
        if fault == "sigterm":  # the controller gives up while the module waits for the answer
            fake.host.sigterm(thread=threading.main_thread())
        tokens = body["sampling_params"]["max_new_tokens"]
        out = {
            "text": " Paris. Paris is the capital and largest city of France.",
            "meta_info": {"completion_tokens": tokens, "spec_accept_length": b.accept},
        }
        self.reply(200, json.dumps(out).encode())


class FakeServer:
    """SGLang's HTTP API on 127.0.0.1:port, in a thread, until the unit stops (or crashes)."""

    def __init__(self, host: Host, port: int, b: Behaviour, key: str | None):
        self.host, self.b, self.key = host, b, key
        self.generates = 0
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.closed = False
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
        self.thread.start()
        SERVERS.append(self)

    def crash_close(self) -> None:
        """From a handler thread: stop listening now (server_close would join this very thread)."""
        with self.lock:
            self.httpd.shutdown()
            self.httpd.socket.close()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()


SERVERS: list[FakeServer] = []


# ---------------------------------------------------------------------------- the fake host


@dataclass
class UnitRec:
    active: str = "inactive"
    sub: str = "dead"
    pid: int = 0
    restarts: int = 0
    invocation: str = ""
    file_state: str = "disabled"
    exit_us: int = 0
    code: str = "exited"
    status: int = 0
    argv: list[str] = field(default_factory=list)
    loaded: str = ""  # the unit file as systemd loaded it (daemon-reload)
    server: FakeServer | None = None
    pending_start: int = 0  # start --no-block: the job runs after this many more `show`s
    limit_hit: bool = False  # StartLimitBurst reached: systemd refuses a start until reset-failed


class Host:
    """systemd, the journal, /proc and nvidia-smi of one host running one instance."""

    def __init__(self, inst: Instance, lock_dir: str):
        self.inst, self.lock_dir = inst, lock_dir
        self.t = 1000.0
        self.calls: list[tuple] = []
        self.counts: Counter = Counter()
        self.faults: dict[tuple[str, int], str] = {}
        self.hooks: dict[tuple[str, int], Callable[[Host], None]] = {}
        self.behaviours: dict[str, Behaviour] = {}
        self.unit = UnitRec()
        self.journals: dict[str, list[str]] = defaultdict(list)
        self.pids = itertools.count(41000)
        self.foreign = False  # a process of another user on GPU 0
        self.others: list[dict] = []  # more processes on the GPUs (nvidia-smi's rows, described), until stopped
        self.starts: list[str] = []  # the profile of each start
        self.start_lag = 1
        self.sigterms = 0
        self.waits: list[int] = []  # the pids the start phase waited on (procinfo.wait_exit)
        self.dies_while_starting: list[str] = []  # journal lines of a main process that dies during such a wait
        self.bundles: list[dict] = []  # each evidence collection: what it was given, and the unit as it was then
        self.dying: tuple[float, list[str]] | None = None  # (when, journal lines): the main process exits then

    # ------------------------------------------------------------ the test's controls

    def inject(self, op: str, kind: str, nth: int = 1) -> None:
        """The nth call of op (a systemctl verb, show, journal, cmdline, snapshot, wait_clean) fails (0: all)."""
        self.faults[(op, nth)] = kind

    def hook(self, op: str, fn: Callable[[Host], None], nth: int = 1) -> None:
        self.hooks[(op, nth)] = fn

    def behave(self, profile: str, **kw) -> None:
        self.behaviours[profile] = Behaviour(**kw)

    def systemctl_calls(self, *verbs: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == "systemctl" and (not verbs or c[1] in verbs)]

    def sigterm(self, thread: threading.Thread | None = None) -> None:
        assert signal.getsignal(signal.SIGTERM) in (failure.sigterm, signal.SIG_IGN), "install the handlers first"
        self.sigterms += 1
        if thread is None:
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            signal.pthread_kill(thread.ident, signal.SIGTERM)

    # ------------------------------------------------------------ fault plumbing

    def enter(self, op: str, record: tuple) -> str | None:
        self.calls.append(record)
        self.counts[op] += 1
        n = self.counts[op]
        if (op, n) in self.hooks:
            self.hooks[(op, n)](self)
        kind = self.faults.get((op, n), self.faults.get((op, 0)))
        if kind == "timeout":
            raise subprocess.TimeoutExpired(["systemctl", *record[1:]] if record[0] == "systemctl" else [op], 30)
        if kind == "nvsmi":
            raise gpu.NvidiaSmiError(
                "nvidia-smi failed (exit 15): Unable to determine the device handle for "
                "GPU0000:1B:00.0: Unknown Error (a GPU fell off the bus?)"
            )
        if kind == "oserror":
            raise OSError(errno.EIO, "Input/output error")
        if kind == "boom":
            raise RuntimeError("boom: a bug in a port")
        if kind == "sigint":
            raise KeyboardInterrupt
        return kind

    def after(self, kind: str | None) -> None:
        if kind == "sigterm":  # arrives while the call runs: the action happened, then the handler raises
            self.sigterm()

    # ------------------------------------------------------------ the ports

    def ports(self) -> Ports:
        return Ports(
            systemctl=self.systemctl,
            show=self.show,
            journal=self.journal,
            journal_since=self.journal_since,
            snapshot=self.snapshot,
            wait_clean=self.wait_clean,
            cmdline=self.cmdline,
            wait_exit=self.wait_exit,
            clock=self.clock,
            sleep=self.sleep,
            lock_dir=self.lock_dir,
            evidence=self.evidence,
        )

    def evidence(self, inst, failure, invocation, *, request=None, budget_s=10.0) -> dict:
        self.bundles.append(
            {
                "failure": failure,
                "invocation": invocation,
                "request": request,
                "budget_s": budget_s,
                "calls_before": len(self.calls),
                "unit": (self.unit.active, self.unit.sub, self.unit.pid),
            }
        )
        return {"path": f"/var/lib/sglang/evidence/{inst.name}/bundle-{len(self.bundles)}.tar.gz", "items": []}

    def clock(self) -> float:
        return self.t

    def wait_exit(self, pid: int, timeout: float) -> bool:
        """The pidfd wait: the unit's running main process outlasts the timeout (or dies in it, with
        `dies_while_starting`, waking the wait at once); any other pid has exited."""
        self.waits.append(pid)
        if pid and pid == self.unit.pid and self.dies_while_starting:
            if self.unit.server:
                self.unit.server.close()  # the process is gone, its port with it
            self.crash(self.dies_while_starting)
            self.dies_while_starting = []  # once: the rollback's start runs normally
            return True
        if pid and pid == self.unit.pid:
            self.t += timeout
            return False
        return True

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def named(self, unit) -> bool:
        """As unkind as systemctl: None in an argv is subprocess's TypeError; another unit is not this one."""
        if not isinstance(unit, str):
            raise TypeError(f"expected str, bytes or os.PathLike object, not {type(unit).__name__}")
        return unit == self.inst.unit

    def systemctl(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
        verb = args[0]
        kind = self.enter(verb, ("systemctl", *args))
        cmd = ["systemctl", *args]
        if kind == "rc":
            return subprocess.CompletedProcess(cmd, 1, "", f"Failed to {verb} {args[-1]}: Access denied\n")
        if verb != "daemon-reload" and not self.named(args[-1]):
            return subprocess.CompletedProcess(
                cmd, 5, "", f"Failed to {verb} {args[-1]}: Unit {args[-1]} not loaded.\n"
            )
        u = self.unit
        if verb not in ("stop", "start", "reset-failed", "daemon-reload", "enable", "disable"):
            return subprocess.CompletedProcess(cmd, 1, "", f'Unknown command verb "{verb}".\n')
        if verb == "stop":
            self.stop_unit(stays=kind == "stays")
        elif verb == "start":
            if u.limit_hit:
                why = f"Job for {UNIT} failed because start of the service was attempted too often.\n"
                return subprocess.CompletedProcess(cmd, 1, "", why)
            if u.active != "active":
                u.pending_start = self.start_lag + 1
        elif verb == "reset-failed":
            u.limit_hit = False
            if u.active == "failed":
                u.active, u.sub = "inactive", "dead"
        elif verb == "daemon-reload":
            self.reload()
        elif verb in ("enable", "disable"):
            u.file_state = verb + "d"
        self.after(kind)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def show(self, unit: str) -> dict:
        kind = self.enter("show", ("show", unit))
        if not self.named(unit):  # what systemctl show says of a unit it does not know
            return {
                "ActiveState": "inactive",
                "SubState": "dead",
                "MainPID": 0,
                "NRestarts": 0,
                "LoadState": "not-found",
            }
        if self.dying and self.t >= self.dying[0]:
            self.crash(self.dying[1])
            self.dying = None
        u = self.unit
        if u.pending_start:
            u.pending_start -= 1
            if not u.pending_start:
                self.launch()
        props = {
            "ActiveState": u.active,
            "SubState": u.sub,
            "MainPID": u.pid,
            "NRestarts": u.restarts,
            "ExecMainStatus": u.status,
            "ExecMainCode": u.code,
            "InvocationID": u.invocation,
            "ExecMainExitTimestampMonotonic": u.exit_us,
            "UnitFileState": u.file_state,
            "NeedDaemonReload": "yes" if self.on_disk() != u.loaded else "no",  # systemd compares the file's
        }
        self.after(kind)
        return props

    def on_disk(self) -> str:
        try:
            return Path(self.inst.unit_path).read_text()
        except FileNotFoundError:
            return ""

    def journal(self, unit: str, invocation: str | None = None) -> list[str]:
        kind = self.enter("journal", ("journal", unit, invocation))
        if not self.named(unit):
            return []
        lines = list(self.journals[invocation]) if invocation else [x for v in self.journals.values() for x in v]
        self.after(kind)
        return lines

    def journal_since(self, invocation: str, cursor: str | None = None, lines: int = 2000, pid: int | None = None):
        """The server's own lines of one invocation (not systemd's, "<unit>: ..."), from the line after cursor; with
        pid, the main process's only (the ExecStartPre gate's line is its own process's)."""
        if pid is not None:  # the main process's: systemd's line from it before its exec, its own; not the gate's
            return [x for x in self.journals[invocation] if x != GATE_LINE and pid == self.unit.pid][-lines:], None
        own = [x for x in self.journals[invocation] if not x.startswith(f"{UNIT}: ")]
        start = int(cursor or 0)
        return own[start : start + lines], str(start + len(own[start : start + lines]))

    def cmdline(self, pid: int) -> list[str]:
        kind = self.enter("cmdline", ("cmdline", pid))
        out = list(self.unit.argv) if pid and pid == self.unit.pid else []
        self.after(kind)
        return out

    def snapshot(self) -> dict:
        kind = self.enter("snapshot", ("snapshot",))
        out = self.gpus()
        self.after(kind)
        return out

    def wait_clean(self, gpus, timeout, interval, max_used_mib, policy, unit, user) -> dict:
        kind = self.enter("wait_clean", ("wait_clean", tuple(gpus), policy))
        out = gpu.wait_clean(
            gpus,
            timeout,
            interval,
            max_used_mib,
            policy,
            unit,
            user,
            clock=self.clock,
            sleep=self.sleep,
            take_snapshot=lambda: self.gpus(dirty=kind == "dirty"),
        )
        self.after(kind)
        return out

    # ------------------------------------------------------------ systemd's side

    def exec_argv(self) -> list[str]:
        """ExecStart of the loaded unit, ${VAR} expanded from its EnvironmentFiles."""
        env: dict[str, str] = {}
        argv: list[str] = []
        for line in self.unit.loaded.splitlines():
            if line.startswith("EnvironmentFile="):
                env.update(read_env_file(line.split("=", 1)[1].lstrip("-")))
            elif line.startswith("ExecStart="):
                argv = shlex.split(line.split("=", 1)[1])
        out = []
        for arg in argv:
            for name, value in env.items():
                arg = arg.replace("${" + name + "}", value)
            out.append(arg)
        return out

    def reload(self) -> None:
        try:
            self.unit.loaded = Path(self.inst.unit_path).read_text()
        except FileNotFoundError:
            self.unit.loaded = ""

    def boot(self) -> None:
        """The unit as the test finds it: loaded, enabled, running and healthy (no call recorded)."""
        self.reload()
        self.unit.file_state = "enabled"
        self.launch(Behaviour(), guarded=False)  # started before the test, whatever the guard would say now

    def launch(self, b: Behaviour | None = None, guarded: bool = True) -> None:
        u = self.unit
        u.pending_start = 0
        u.invocation, u.restarts, u.exit_us, u.status = uuid.uuid4().hex, 0, 0, 0
        u.argv = self.exec_argv()
        profile = flag_value(u.argv, "--served-model-name") or "?"
        b = b or self.behaviours.get(profile) or Behaviour()
        self.starts.append(profile)
        # ExecStartPre's line, in the same invocation; then systemd's from the main process before its exec (podman
        # gives no UTS namespace), under the main process's _PID.
        self.journals[u.invocation] += [GATE_LINE, f"{UNIT}: {PRE_EXEC_LINE}"]
        # The unit's first ExecStartPre, as root: the boot guard (boot.py) on every start, not only a boot's.
        status, said = (
            (boot.GO, "")
            if not guarded
            else boot.check(
                self.inst.name,
                self.inst.state_dir,
                reload=self.reload,
                directory=boot.beside(self.lock_dir, boot.UNVERIFIED_DIR),
                put_back_dir=boot.beside(self.lock_dir, boot.PUT_BACK_DIR),
            )
        )
        if status != boot.GO:  # this start fails; Restart=on-failure starts the files put back, later
            u.active, u.sub, u.pid, u.restarts = "activating", "auto-restart", 0, u.restarts + 1
            u.code, u.status, u.exit_us = "exited", status, int(self.t * 1e6)
            self.journals[u.invocation] += [
                f"sglang-boot-guard: {said}",
                f"{UNIT}: Control process exited, code=exited, status={status}/TEMPFAIL",
            ]
            return
        if b.crash_at_start:
            self.crash(CRASH_AT_START)
            return
        u.pid = next(self.pids)
        u.active, u.sub = "active", "running"
        self.journals[u.invocation].append("server_args=ServerArgs(...)")  # SGLang's first line of its own
        if self.inst.serves_http:
            u.server = FakeServer(self, self.inst.port, b, flag_value(u.argv, "--api-key") or b.require_key)

    def crash(self, lines: list[str]) -> None:
        """The main process died: Restart=on-failure puts the unit in auto-restart (a crash loop, unless stopped)."""
        u = self.unit
        u.active, u.sub, u.pid = "activating", "auto-restart", 0
        u.restarts += 1
        u.code, u.status, u.exit_us = "exited", 1, int(self.t * 1e6)
        self.journals[u.invocation] += [*lines, f"{UNIT}: Main process exited, code=exited, status=1/FAILURE"]
        u.server = None  # its thread stops listening itself (crash_close)

    def stop_unit(self, stays: bool = False) -> None:
        u = self.unit
        u.pending_start = 0
        if stays:  # the main process ignores SIGTERM and outlives the stop job
            return
        if u.server:
            u.server.close()
            u.server = None
        failed = u.sub in ("auto-restart", "failed")
        u.active, u.sub = ("failed", "failed") if failed else ("inactive", "dead")
        u.pid = 0

    # ------------------------------------------------------------ nvidia-smi's side

    def gpus(self, dirty: bool = False) -> dict:
        u, inst = self.unit, self.inst
        procs = []
        if u.pid and u.active == "active":
            procs = [
                {
                    "gpu": g,
                    "pid": u.pid,
                    "used_mib": 70000,
                    "user": "sglang",
                    "unit": UNIT,
                    "cmdline": " ".join(u.argv)[:80],
                    "process_name": "python",
                }
                for g in inst.gpus
            ]
        if self.foreign:
            procs.append(
                {
                    "gpu": inst.gpus[0],
                    "pid": 999999,
                    "used_mib": 2048,
                    "user": "alice",
                    "unit": "session-7.scope",
                    "cmdline": "python train.py",
                    "process_name": "python",
                }
            )
        procs += [dict(p) for p in self.others]
        used = {g: 0 for g in range(4)}
        for p in procs:
            used[p["gpu"]] += p["used_mib"]
        if dirty:  # memory the driver has not released yet, no process listed
            used[inst.gpus[0]] += 30000
        return {
            "gpus": [
                {
                    "index": g,
                    "uuid": f"GPU-{g}",
                    "name": "NVIDIA H200",
                    "memory_used_mib": used[g],
                    "memory_total_mib": 143771,
                }
                for g in range(4)
            ],
            "processes": procs,
        }


# ---------------------------------------------------------------------------- the world of one test


@dataclass
class World:
    tmp: Path
    inst: Instance
    host: Host
    settings: Settings
    files: dict[str, dict[str, str]]  # profile -> {path: content}
    argv: dict[str, list[str]]  # profile -> argv as rendered (the secret a reference)
    running: dict[str, list[str]]  # profile -> argv as the process runs (the secret expanded)
    boot_invocation: str = ""

    def machine(self, action: str = "restart", **kw) -> Machine:
        return Machine(self.inst, replace(self.settings, **kw), self.host.ports(), action)

    def live(self) -> dict[str, str]:
        return {p: Path(p).read_text() for p in self.inst.config_files}

    def pending(self) -> list[str]:
        d = Path(self.inst.pending_dir)
        return sorted(x.name for x in d.iterdir() if not x.name.endswith(".staged")) if d.exists() else []

    def generations(self) -> list[str]:
        try:
            return Store(self.inst).records()
        except NotADirectoryError:
            return []

    def lock_free(self) -> bool:
        probe = InstanceLock(self.inst.name, "probe", command="probe", lock_dir=self.host.lock_dir)
        try:
            probe.acquire()
        except lock.Locked:
            return False
        probe.release()
        return True


def write_manifest(tmp: Path, path: Path, matches: bool) -> str:
    """A patch manifest over one patched file (its hash right or wrong) and one that is missing."""
    import hashlib

    site = tmp / "site-packages"
    site.mkdir(exist_ok=True)
    (site / "eagle.py").write_text("patched\n")
    files = {"eagle.py": {"after": hashlib.sha256(b"patched\n").hexdigest() if matches else "0" * 64}}
    if not matches:
        files["gone.py"] = {"after": "1" * 64}
    path.write_text(json.dumps({"site_packages": str(site), "patches": [{"name": "0001-eagle-fix"}], "files": files}))
    return str(path)


def unit_text(inst: Instance, argv: list[str]) -> str:
    return textwrap.dedent(f"""\
        [Unit]
        Description=SGLang instance {inst.name}

        [Service]
        User=sglang
        EnvironmentFile={inst.env_path}
        EnvironmentFile=-{inst.secrets_path}
        ExecStart={shlex.join(argv)}
        Restart=on-failure
        """)


def make_venv(root: Path, generation: str, version: str) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").write_text("#!/bin/sh\n")
    (root / "bin" / "python").chmod(0o755)  # a rollback refuses a generation whose program is not on the host
    meta = root / "sglang-deploy"
    meta.mkdir()
    (meta / "generation.json").write_text(
        json.dumps(
            {
                "generation": generation,
                "sglang_version": version,
                "lock_sha256": f"lock-{generation}",
                "patch_series_sha256": f"series-{generation}",
            }
        )
    )
    return root


def build(
    tmp: Path,
    *,
    new: str | None = "pending",
    known_good: bool = True,
    running: bool = True,
    api_key: bool = False,
    nnodes: int = 1,
    node_rank: int = 0,
    keep: int = 2,
    **settings,
) -> World:
    """new: pending (staged by deploy), live (written to the unit's files, not loaded), live-running, or None."""
    venvs = {"good": make_venv(tmp / "venv-good", "g1", "0.4.6"), "new": make_venv(tmp / "venv-new", "g2", "0.4.7")}
    port = free_port()
    argv = {
        p: [
            f"{venvs[p]}/bin/python",
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/m",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            p,
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-num-steps",
            "3" if p == "good" else "5",
        ]
        + (["--api-key", SECRET_REF] if api_key else [])
        for p in ("good", "new")
    }
    running_argv = {p: [KEY if a == SECRET_REF else a for a in v] for p, v in argv.items()}
    current = "good" if new is None else "new"
    inst = Instance(
        name="m",
        unit=UNIT,
        unit_path=str(tmp / "systemd" / UNIT),
        env_path=str(tmp / "etc" / "m.env"),
        secrets_path=str(tmp / "etc" / "secrets" / "m.env"),
        pending_dir=str(tmp / "etc" / "pending"),
        port=port,
        gpus=[0, 1],
        argv=list(argv[current]),
        profile=current,
        profiles_argv=dict(argv),
        nnodes=nnodes,
        node_rank=node_rank,
        state_dir=str(tmp / "state"),
    )
    files = {
        p: {inst.unit_path: unit_text(inst, argv[p]), inst.env_path: f'SGLANG_PROFILE="{p}"\nNCCL_DEBUG="WARN"\n'}
        for p in ("good", "new")
    }
    for path, content in files["good"].items():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    Path(inst.secrets_path).parent.mkdir(parents=True)
    Path(inst.secrets_path).write_text(f'SGLANG_API_KEY="{KEY}"\n')
    if known_good:
        good = Store(replace(inst, argv=argv["good"], profile="good"), keep)
        good.record(good.snapshot(), running_argv["good"], {"ok": True, "checks": [], "tokens_per_s": 1234.5})
    host = Host(inst, str(tmp / "run" / "locks"))
    if new == "pending":
        stage_as_deploy(inst, files["new"])
    if new == "live-running":
        for path, content in files["new"].items():
            Path(path).write_text(content)
    if running:
        host.boot()
    if new == "live":
        for path, content in files["new"].items():
            Path(path).write_text(content)
    s = Settings(
        ready_timeout=3.0,
        gpu_timeout=1.0,
        gpu_interval=0.1,
        known_good_keep=keep,
        controller="ctl-a",
        command="python -m driver restart",
        thresholds=Thresholds(load_requests=2, load_max_new_tokens=8),
    )
    s = replace(s, **settings)
    return World(tmp, inst, host, s, files, argv, running_argv, host.unit.invocation)


def stage_as_deploy(inst: Instance, files: dict[str, str]) -> None:
    """As a deploy stages a configuration: the files, then the manifest that makes the set complete."""
    Path(inst.pending_dir).mkdir(parents=True, exist_ok=True)
    for path, content in files.items():
        Path(inst.pending_path(path)).write_text(content)
    manifest = {inst.pending_path(p): stage.digest(c) for p, c in files.items()}
    Path(stage.manifest_path(inst)).write_text(json.dumps(manifest))


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    """No proxy between the module and the fake servers; nothing real is ever killed; every server stopped."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)

    def no_kill(pids, grace, interval):
        raise AssertionError(f"the test would kill real pids {pids}")

    monkeypatch.setattr(gpu, "terminate", no_kill)
    yield
    while SERVERS:
        SERVERS.pop().close()


@pytest.fixture
def handlers():
    """The module's signal handlers (SIGTERM fails the phase), the test runner's restored afterwards."""
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP), signal.getsignal(signal.SIGINT)
    failure.install_signal_handlers()
    yield
    signal.signal(signal.SIGTERM, old[0])
    signal.signal(signal.SIGHUP, old[1])
    signal.signal(signal.SIGINT, old[2])


@pytest.fixture
def world(tmp_path) -> World:
    return build(tmp_path)


def health(w: World) -> int:
    req = urllib.request.Request(f"{w.inst.base}/health")
    if any(a == "--api-key" for a in w.inst.argv):
        req.add_header("Authorization", f"Bearer {KEY}")
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status
    except OSError:
        return 0


def serving(w: World, profile: str) -> None:
    """The unit runs `profile`, active/running, never restarted, and answers /health."""
    u = w.host.unit
    assert (u.active, u.sub) == ("active", "running"), (u.active, u.sub)
    assert u.pid and u.restarts == 0
    assert u.argv == w.running[profile]
    if w.inst.serves_http:
        assert health(w) == 200


def stopped(w: World) -> None:
    """Stopped: inactive or failed, never activating / auto-restart (crash-looping on the GPUs)."""
    u = w.host.unit
    assert (u.active, u.sub) in (("inactive", "dead"), ("failed", "failed")), (u.active, u.sub)
    assert u.pid == 0 and not u.pending_start and u.server is None
    assert all(s.closed or s.httpd.socket.fileno() == -1 for s in SERVERS)


def untouched(w: World) -> None:
    """A refusal: no systemctl call at all, the old server still the same invocation, the staged files pending."""
    assert w.host.systemctl_calls() == []
    assert w.host.unit.invocation == w.boot_invocation
    serving(w, "good")
    assert w.live() == w.files["good"]
    assert w.pending() == ["m.env", UNIT]


# ---------------------------------------------------------------------------- the matrix


@dataclass
class Case:
    id: str
    setup: Callable[[World, pytest.MonkeyPatch], None]
    outcome: str
    phase: str  # the phase whose failure is reported (res["failure"]["phase"]); for record: known_good
    cause: str = ""
    rb_phase: str | None = None  # the rollback's failing phase
    rb_cause: str = ""
    interrupted: bool = False
    pending_kept: bool = False  # the staged files are still pending afterwards (nothing was promoted)
    failed_kept: bool = True  # on rollback, the failed files are kept under known-good/<instance>/failed/
    lock_checked: bool = True  # afterwards the lock is free (see the test of a SIGTERM while taking it)


def inject(op: str, kind: str, nth: int = 1):
    return lambda w, mp: w.host.inject(op, kind, nth)


def behave(profile: str, **kw):
    return lambda w, mp: w.host.behave(profile, **kw)


def both(*fns):
    def run(w, mp):
        for fn in fns:
            fn(w, mp)

    return run


def hold_lock(w, mp):
    other = InstanceLock("m", "restart m (profile new)", "ctl-b", "python -m driver restart", w.host.lock_dir)
    other.acquire()
    w.other_lock = other


def lock_dir_is_a_file(w, mp):
    Path(w.host.lock_dir).parent.mkdir(parents=True)
    Path(w.host.lock_dir).write_text("not a directory")


def sigterm_in_lock(w, mp):
    mp.setattr(lock, "command_of", lambda pid: (w.host.sigterm(), "unreachable")[1])
    w.settings = replace(w.settings, command="")


def foreign(w, mp):
    w.host.foreign = True


def write_fails(module, path_of: Callable[[World], str], times: int = 1):
    """module.write_atomic raises OSError (ENOSPC) for one path, the first `times` times."""

    def setup(w, mp):
        real, target, left = module.write_atomic, path_of(w), [times]

        def write(path, content, mode):
            if path == target and left[0]:
                left[0] -= 1
                raise OSError(errno.ENOSPC, "No space left on device", path)
            real(path, content, mode)

        mp.setattr(module, "write_atomic", write)

    return setup


def record_write_fails(w, mp):
    real = known_good.write_atomic

    def write(path, content, mode):
        if "/generations/" in path:
            raise OSError(errno.EROFS, "Read-only file system", path)
        real(path, content, mode)

    mp.setattr(known_good, "write_atomic", write)


def env_removed(w, mp):
    """The env file vanishes once promoted (the promote's daemon-reload): the start's snapshot cannot read it."""
    w.host.hook("daemon-reload", lambda h: os.unlink(w.inst.env_path))


def generations_dir_is_a_file(w, mp):
    gens = Path(w.inst.kg_dir, "generations")
    for p in gens.iterdir():
        p.unlink()
    gens.rmdir()
    gens.write_text("a file where the generations directory belongs")


def env_changed_during_verify(w, mp):
    w.host.hook("snapshot", lambda h: Path(w.inst.env_path).write_text('SGLANG_PROFILE="edited by hand"\n'), nth=2)


NEW_FAILS_VERIFY = behave("new", accept=1.0)  # the trigger of every rollback case: the new server runs, verify fails
R, N, REST = outcomes.ROLLED_BACK, outcomes.NOT_RECOVERED, outcomes.RESTARTED
SAME = "the failed configuration is the known-good one"
# A failure before the start phase ran (stop, gpus, a promote that wrote nothing) leaves the live files the
# known-good ones: recover() starts the known-good again (a rollback), the new configuration still pending.
PRE_START = R
KEPT = {"pending_kept": True, "failed_kept": False}  # nothing promoted: still pending, nothing failed to keep

CASES = [
    # lock: a refusal, nothing touched
    Case("lock-held", hold_lock, outcomes.LOCKED, "lock", "is locked by another operation"),
    # Not another operation's lock: refused (nothing touched), never reported as "locked" with no holder.
    Case("lock-oserror", lock_dir_is_a_file, outcomes.REFUSED, "lock", "FileExistsError", lock_checked=False),
    Case("lock-sigterm", sigterm_in_lock, outcomes.REFUSED, "lock", "SIGTERM", interrupted=True, lock_checked=False),
    # preflight: a refusal, nothing touched
    Case("preflight-foreign-process", foreign, outcomes.GPUS_NOT_CLEAN, "preflight", "user alice"),
    Case("preflight-nvsmi", inject("snapshot", "nvsmi"), outcomes.GPUS_NOT_CLEAN, "preflight", "Unknown Error"),
    Case(
        "preflight-sigterm", inject("snapshot", "sigterm"), outcomes.REFUSED, "preflight", "SIGTERM", interrupted=True
    ),
    # stop / gpus: before the promotion the live files are the known-good ones: contained, still pending
    Case("stop-mainpid-remains", inject("stop", "stays"), PRE_START, "stop", "still has main pid", **KEPT),
    Case(
        "stop-rc",
        inject("stop", "rc"),
        PRE_START,
        "stop",
        "systemctl stop sglang-m.service failed: Failed to stop",
        pending_kept=True,
        failed_kept=False,
    ),
    Case("stop-timeout", inject("stop", "timeout"), PRE_START, "stop", "TimeoutExpired", **KEPT),
    Case("stop-rc", inject("stop", "rc"), PRE_START, "stop", f"systemctl stop {UNIT} failed: Failed to stop", **KEPT),
    Case("stop-sigterm", inject("stop", "sigterm"), PRE_START, "stop", "SIGTERM", interrupted=True, **KEPT),
    Case("gpus-not-clean", inject("wait_clean", "dirty"), PRE_START, "gpus", "not clean after 1s", **KEPT),
    Case("gpus-nvsmi", inject("wait_clean", "nvsmi"), PRE_START, "gpus", "NvidiaSmiError", **KEPT),
    Case("gpus-sigterm", inject("wait_clean", "sigterm"), PRE_START, "gpus", "SIGTERM", interrupted=True, **KEPT),
    # promote
    Case(
        "promote-oserror-first-file",
        write_fails(stage, lambda w: w.inst.unit_path),
        PRE_START,
        "promote",
        "No space left on device",
        **KEPT,
    ),
    Case(
        "promote-oserror-second-file",
        write_fails(stage, lambda w: w.inst.env_path),
        R,
        "promote",
        "OSError: [Errno 28] No space left on device",
        pending_kept=True,
    ),
    Case("promote-daemon-reload-rc", inject("daemon-reload", "rc"), R, "promote", "systemctl daemon-reload failed"),
    Case("promote-daemon-reload-timeout", inject("daemon-reload", "timeout"), R, "promote", "TimeoutExpired"),
    Case("promote-sigterm", inject("daemon-reload", "sigterm"), R, "promote", "SIGTERM", interrupted=True),
    # start
    Case("start-crash", behave("new", crash_at_start=True), R, "start", CRASH_AT_START[-1]),
    Case("start-never-healthy", behave("new", health=503), R, "start", "not ready after 3s"),
    Case("start-api-key-401", behave("new", require_key="another-key"), R, "start", "/health never answered 200"),
    Case("start-rc", inject("start", "rc"), R, "start", "systemctl start --no-block sglang-m.service failed"),
    Case("start-timeout", inject("start", "timeout"), R, "start", "TimeoutExpired"),
    Case("start-show-timeout", inject("show", "timeout", nth=3), R, "start", "TimeoutExpired"),
    Case("start-oserror", env_removed, R, "start", "FileNotFoundError"),
    Case("start-sigterm", inject("start", "sigterm"), R, "start", "SIGTERM", interrupted=True),
    # generate
    Case("generate-crash", behave("new", generate_fault="crash"), R, "generate", CRASH_ON_GENERATE[-1]),
    Case("generate-incomplete-read", behave("new", generate_fault="incomplete"), R, "generate", "IncompleteRead"),
    Case("generate-malformed-json", behave("new", generate_fault="malformed"), R, "generate", "not JSON"),
    Case("generate-http-500", behave("new", generate_fault="http500"), R, "generate", "HTTP 500"),
    Case("generate-empty", behave("new", generate_fault="empty"), R, "generate", "without generating"),
    Case("generate-bad-token-count", behave("new", generate_fault="bad-tokens"), R, "generate", "without generating"),
    Case("generate-sigterm", behave("new", generate_fault="sigterm"), R, "generate", "SIGTERM", interrupted=True),
    # verify
    Case("verify-accept-length-1", NEW_FAILS_VERIFY, R, "verify", "accept_length: average accept length 1.0"),
    Case(
        "verify-incomplete-read",
        behave("new", generate_fault="incomplete", good_generates=1),
        R,
        "verify",
        "IncompleteRead",
    ),
    Case("verify-http-500", behave("new", health_generate=500), R, "verify", "/health_generate HTTP 500"),
    Case("verify-malformed-json", behave("new", server_info="malformed"), R, "verify", "server_info: "),
    Case("verify-server-info-http-500", behave("new", server_info="http500"), R, "verify", "/server_info: HTTP 500"),
    Case(
        "verify-load-incomplete-read",
        behave("new", generate_fault="incomplete", good_generates=2),
        R,
        "verify",
        "load: the measuring load failed",
    ),
    Case("verify-nvsmi", inject("snapshot", "nvsmi", nth=2), R, "verify", "NvidiaSmiError"),
    Case("verify-show-timeout", inject("show", "timeout", nth=5), R, "verify", "TimeoutExpired"),
    Case("verify-sigterm", inject("snapshot", "sigterm", nth=2), R, "verify", "SIGTERM", interrupted=True),
    Case(
        "verify-sigterm-http",
        behave("new", generate_fault="sigterm", good_generates=1),
        R,
        "verify",
        "SIGTERM",
        interrupted=True,
    ),
    # record: a warning; the new configuration runs and verified
    Case("record-config-changed", env_changed_during_verify, REST, "record", "changed during the restart"),
    Case("record-oserror", record_write_fails, REST, "record", "Read-only file system"),
    Case("record-generations-dir-is-a-file", generations_dir_is_a_file, REST, "record", "FileExistsError"),
    Case(
        "record-enable-rc",
        inject("enable", "rc"),
        REST,
        "record",
        "systemctl enable sglang-m.service failed: Failed to enable sglang-m.service: Access denied",
    ),
    Case("record-enable-timeout", inject("enable", "timeout"), REST, "record", "TimeoutExpired"),
    Case("record-sigterm", inject("cmdline", "sigterm", nth=3), REST, "record", "SIGTERM", interrupted=True),
    # the rollback's phases (the new configuration fails verify), each failing: stopped and not recovered
    Case(
        "rollback-restore-oserror",
        both(NEW_FAILS_VERIFY, write_fails(known_good, lambda w: w.inst.unit_path)),
        N,
        "verify",
        rb_phase="restore",
        rb_cause="No space left on device",
    ),
    Case(
        "rollback-restore-rc",
        both(NEW_FAILS_VERIFY, inject("daemon-reload", "rc", 2)),
        N,
        "verify",
        rb_phase="restore",
        rb_cause="systemctl daemon-reload failed",
    ),
    Case(
        "rollback-restore-timeout",
        both(NEW_FAILS_VERIFY, inject("daemon-reload", "timeout", 2)),
        N,
        "verify",
        rb_phase="restore",
        rb_cause="TimeoutExpired",
    ),
    Case(
        "rollback-restore-sigterm",
        both(NEW_FAILS_VERIFY, inject("daemon-reload", "sigterm", 2)),
        N,
        "verify",
        rb_phase="restore",
        rb_cause="SIGTERM",
        interrupted=True,
    ),
    Case(
        "rollback-stop-mainpid-remains",
        both(NEW_FAILS_VERIFY, inject("stop", "stays", 2)),
        N,
        "verify",
        rb_phase="stop",
        rb_cause="still has main pid",
    ),
    Case(
        "rollback-stop-rc",
        both(NEW_FAILS_VERIFY, inject("stop", "rc", 2)),
        N,
        "verify",
        rb_phase="stop",
        rb_cause="systemctl stop sglang-m.service failed",
    ),
    Case(
        "rollback-stop-timeout",
        both(NEW_FAILS_VERIFY, inject("stop", "timeout", 2)),
        N,
        "verify",
        rb_phase="stop",
        rb_cause="TimeoutExpired",
    ),
    Case(
        "rollback-stop-sigterm",
        both(NEW_FAILS_VERIFY, inject("stop", "sigterm", 2)),
        N,
        "verify",
        rb_phase="stop",
        rb_cause="SIGTERM",
        interrupted=True,
    ),
    Case(
        "rollback-gpus-not-clean",
        both(NEW_FAILS_VERIFY, inject("wait_clean", "dirty", 2)),
        N,
        "verify",
        rb_phase="gpus",
        rb_cause="not clean after 1s",
    ),
    Case(
        "rollback-gpus-nvsmi",
        both(NEW_FAILS_VERIFY, inject("wait_clean", "nvsmi", 2)),
        N,
        "verify",
        rb_phase="gpus",
        rb_cause="NvidiaSmiError",
    ),
    Case(
        "rollback-gpus-sigterm",
        both(NEW_FAILS_VERIFY, inject("wait_clean", "sigterm", 2)),
        N,
        "verify",
        rb_phase="gpus",
        rb_cause="SIGTERM",
        interrupted=True,
    ),
    Case(
        "rollback-start-crash",
        both(NEW_FAILS_VERIFY, behave("good", crash_at_start=True)),
        N,
        "verify",
        rb_phase="start",
        rb_cause=CRASH_AT_START[-1],
    ),
    Case(
        "rollback-start-never-healthy",
        both(NEW_FAILS_VERIFY, behave("good", health=503)),
        N,
        "verify",
        rb_phase="start",
        rb_cause="not ready after 3s",
    ),
    Case(
        "rollback-start-rc",
        both(NEW_FAILS_VERIFY, inject("start", "rc", 2)),
        N,
        "verify",
        rb_phase="start",
        rb_cause="systemctl start --no-block sglang-m.service failed",
    ),
    Case(
        "rollback-start-timeout",
        both(NEW_FAILS_VERIFY, inject("start", "timeout", 2)),
        N,
        "verify",
        rb_phase="start",
        rb_cause="TimeoutExpired",
    ),
    Case(
        "rollback-start-sigterm",
        both(NEW_FAILS_VERIFY, inject("start", "sigterm", 2)),
        N,
        "verify",
        rb_phase="start",
        rb_cause="SIGTERM",
        interrupted=True,
    ),
    Case(
        "rollback-generate-crash",
        both(NEW_FAILS_VERIFY, behave("good", generate_fault="crash")),
        N,
        "verify",
        rb_phase="generate",
        rb_cause=CRASH_ON_GENERATE[-1],
    ),
    Case(
        "rollback-generate-incomplete-read",
        both(NEW_FAILS_VERIFY, behave("good", generate_fault="incomplete")),
        N,
        "verify",
        rb_phase="generate",
        rb_cause="IncompleteRead",
    ),
    Case(
        "rollback-generate-malformed-json",
        both(NEW_FAILS_VERIFY, behave("good", generate_fault="malformed")),
        N,
        "verify",
        rb_phase="generate",
        rb_cause="not JSON",
    ),
    Case(
        "rollback-generate-http-500",
        both(NEW_FAILS_VERIFY, behave("good", generate_fault="http500")),
        N,
        "verify",
        rb_phase="generate",
        rb_cause="HTTP 500",
    ),
    Case(
        "rollback-generate-sigterm",
        both(NEW_FAILS_VERIFY, behave("good", generate_fault="sigterm")),
        N,
        "verify",
        rb_phase="generate",
        rb_cause="SIGTERM",
        interrupted=True,
    ),
    Case(
        "rollback-verify-accept-length-1",
        both(NEW_FAILS_VERIFY, behave("good", accept=1.0)),
        N,
        "verify",
        rb_phase="verify",
        rb_cause="accept_length",
    ),
    Case(
        "rollback-verify-http-500",
        both(NEW_FAILS_VERIFY, behave("good", health_generate=500)),
        N,
        "verify",
        rb_phase="verify",
        rb_cause="/health_generate HTTP 500",
    ),
    Case(
        "rollback-verify-nvsmi",
        both(NEW_FAILS_VERIFY, inject("snapshot", "nvsmi", 3)),
        N,
        "verify",
        rb_phase="verify",
        rb_cause="NvidiaSmiError",
    ),
    Case(
        "rollback-verify-sigterm",
        both(NEW_FAILS_VERIFY, inject("snapshot", "sigterm", 3)),
        N,
        "verify",
        rb_phase="verify",
        rb_cause="SIGTERM",
        interrupted=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_phase_and_failure_kind_ends_in_its_defined_outcome_and_unit_state(case, tmp_path, monkeypatch, handlers):
    w = build(tmp_path)
    case.setup(w, monkeypatch)
    gens = w.generations()
    res = restart.restart(w.machine())

    assert res["outcome"] == case.outcome, res.get("msg")
    if case.id == "lock-held":  # the holder named
        assert res["lock"]["holder"] == {**res["lock"]["holder"], "controller": "ctl-b", "pid": os.getpid()}
        assert res["lock"]["holder"]["since"].endswith("Z") and "from controller ctl-b since" in res["msg"]
    assert res["outcome"] in outcomes.ALL and res["msg"].startswith("m: ")
    # From the end of the last phase on, SIGTERM is ignored: the ending (containment, the lock, the result) runs whole.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    if hasattr(w, "other_lock"):
        w.other_lock.release()
    if case.lock_checked:
        assert w.lock_free()

    if case.outcome == REST:  # a warning: serving the new configuration, verified, not recorded as known-good
        assert "failure" not in res
        kg = res["known_good"]
        if case.id.startswith("record-enable"):  # recorded all the same, and said that enabling failed
            assert kg["enabled"] is False and case.cause in kg["enable_error"] and kg["generation"], kg
            assert res["phases"][-1]["phase"] == "record" and res["phases"][-1]["ok"]
        else:
            assert kg["recorded"] is False and case.cause in kg["why"], kg
            assert res["phases"][-1]["phase"] == "record" and not res["phases"][-1]["ok"]
            assert "not recorded as known-good" in res["msg"]
        assert res["verify"]["ok"]
        serving(w, "new")
        if case.id != "record-enable-rc" and case.id != "record-enable-timeout":
            assert w.generations() == gens
        return

    f = res["failure"]
    assert f["phase"] == case.phase, f
    assert case.cause in f["cause"], f["cause"]
    # A step's own failure names its own phase (nothing "raised_in" another), and a refusal's kind is its outcome.
    assert "raised_in" not in f and "kind" not in f and "checked" not in f, f
    assert res["phases"][-1]["detail"] == f["cause"] and set(res["phases"][-1]) == {
        "phase",
        "at",
        "seconds",
        "ok",
        "detail",
    }
    if case.phase == "gpus" and case.id == "gpus-not-clean":  # who holds them, and how much
        assert f["offenders"] == [] and [g["index"] for g in f["busy"]] == [0], f  # memory held, no process
    if case.phase == "verify" and "verify" in f:  # the verification that failed, at the result's top too
        assert res["verify"] == f["verify"] and res["verify"]["ok"] is False
    assert bool(f.get("interrupted")) == (case.interrupted and not case.rb_phase)
    assert res["phases"][-1] == {**res["phases"][-1], "phase": case.phase, "ok": False}
    assert w.generations() == gens  # a failed restart never records

    if case.outcome in outcomes.NOTHING_TOUCHED:
        assert res["changed"] is False
        untouched(w)
        return

    assert res["changed"] is True
    assert w.live() == w.files["good"]  # whatever happened, the files on disk are the known-good ones
    assert w.pending() == (["m.env", UNIT] if case.pending_kept else [])
    if case.outcome == R:
        rb = res["rollback"]
        assert rb["attempted"] and rb["outcome"] == "serving" and rb["to_profile"] == "good"
        good = Store(w.inst).latest()
        assert (rb["to_generation"], rb["config_hash"]) == (good["generation"], good["config_hash"])
        assert [p["phase"] for p in rb["phases"]] == ["rollback-" + p for p in outcomes.ROLLBACK_PHASES]
        assert rb["verify"]["ok"] and rb["verify"]["running_profile"] == "good"
        serving(w, "good")
        assert w.host.starts[-1] == "good"
        assert "Rolled back to the last-known-good configuration (profile good): serving." in res["msg"]
        failed = Path(w.inst.kg_dir, "failed")
        if case.failed_kept:
            assert (failed / UNIT).read_text() == w.files["new"][w.inst.unit_path]
        return

    assert case.outcome == N
    stopped(w)  # PRE_START cases too: the server that served the known-good configuration is stopped
    rb = res["rollback"]
    if case.rb_phase:
        assert rb["attempted"] and rb["outcome"] == "failed"
        assert rb["failure"]["phase"] == case.rb_phase, rb["failure"]
        assert "raised_in" not in rb["failure"], rb["failure"]
        assert case.rb_cause in rb["failure"]["cause"], rb["failure"]["cause"]
        assert bool(rb["failure"].get("interrupted")) == case.interrupted
        assert rb["phases"][-1]["phase"] == "rollback-" + case.rb_phase and not rb["phases"][-1]["ok"]
        assert f"Rollback failed too: {case.rb_phase}" in res["msg"]
    else:
        assert rb == {"attempted": False, "why": SAME}
        assert f"Not rolled back: {SAME}" in res["msg"]
    assert res["contained"]["stop"] is None
    assert res["contained"]["unit_state"] in ("inactive/dead", "failed/failed")
    c = res["contained"]
    said = (
        f". Rollback failed too: {rb['failure']['phase']}: {rb['failure']['cause']}"
        if case.rb_phase
        else f". Not rolled back: {SAME}"
    )
    files = f" {c['files']}." if c.get("files") else ""
    assert res["msg"] == f"m: {f['phase']} failed: {f['cause']}{said}; {UNIT} is stopped ({c['unit_state']}).{files}"
    assert w.host.unit.file_state == "enabled"  # the files are the known-good ones: a boot may start them


def test_files_edited_during_verify_are_put_back_as_they_verified_with_their_modes_and_reloaded(world, handlers):
    edited = world.files["new"][world.inst.unit_path].replace("Description=", "Description=edited by hand ")
    world.host.hook("snapshot", lambda h: Path(world.inst.unit_path).write_text(edited), nth=2)  # during verify
    res = restart.restart(world.machine())
    assert res["outcome"] == REST and res["known_good"]["recorded"] is False
    assert res["known_good"]["why"].endswith(
        "not recorded as known-good; the files that started and verified were put back"
    )
    assert world.live() == world.files["new"] and world.host.unit.loaded == world.files["new"][world.inst.unit_path]
    modes = {p: Path(p).stat().st_mode & 0o777 for p in world.inst.config_files}
    assert modes == {world.inst.unit_path: 0o644, world.inst.env_path: 0o600}  # the environment may hold secrets
    assert len(world.generations()) == 1
    serving(world, "new")


def test_a_command_line_changed_during_verify_is_not_recorded_and_the_files_stay(world, handlers):
    """The files are what verified; the process is not what verified: nothing to put back, nothing recorded."""
    world.host.hook("snapshot", lambda h: h.unit.argv.append("--enable-something"), nth=2)
    res = restart.restart(world.machine())
    assert res["outcome"] == REST and res["known_good"]["recorded"] is False
    assert res["known_good"]["why"] == (
        "the unit's configuration or command line changed during the restart (another tool wrote it?): not recorded "
        "as known-good"
    )
    assert world.live() == world.files["new"] and len(world.generations()) == 1
    assert len(world.host.systemctl_calls("daemon-reload")) == 1  # the promote's only


def test_a_record_enables_the_unit_and_ends_a_containments_note(world, handlers):
    note = Path(world.inst.kg_dir, "contained.json")
    note.write_text(json.dumps({"generation": "0001"}))
    res = restart.restart(world.machine())
    assert "unmark" not in res  # said only when ending the unverified window failed
    assert res["outcome"] == REST and res["known_good"]["enabled"] is True and "enable_error" not in res["known_good"]
    assert not note.exists()


# ---------------------------------------------------------------------------- details of the failures


def test_a_crash_at_start_reports_the_traceback_and_the_exception_line(world, handlers):
    world.host.behave("new", crash_at_start=True)
    res = restart.restart(world.machine())
    f = res["failure"]
    assert f["traceback"][0] == "Traceback (most recent call last):"
    assert f["traceback"][-1] == CRASH_AT_START[-1] == f["cause"]
    assert f["unit_state"] == "activating/auto-restart" and f["exit"] == "exited/1"
    assert f["journal_tail"][-1].endswith("status=1/FAILURE")
    assert f["exit_to_detect_s"] >= 0 and f["exit_to_report_s"] >= f["exit_to_detect_s"]
    # fail fast: the crash is seen at the first poll after the start job ran, not at the ready timeout
    start = next(p for p in res["phases"] if p["phase"] == "start")
    assert start["seconds"] < 0.5
    assert res["outcome"] == R


def test_a_server_dying_while_loading_wakes_the_start_phase_at_once_not_at_the_next_poll(world, handlers):
    """The start phase waits on the main process itself (a pidfd): its exit is seen within 0.01 s of the fake
    clock, where sleeping between polls would see it up to 0.1 s late."""
    world.host.behave("new", health=503)  # running, still loading: never healthy by itself
    world.host.dies_while_starting = CRASH_AT_START
    res = restart.restart(world.machine())
    f = res["failure"]
    assert f["phase"] == "start" and f["cause"] == CRASH_AT_START[-1]
    assert world.host.waits[0] >= 41000  # the new server's main pid (the fake's pids count from 41000)
    assert f["exit_to_detect_s"] == 0.01
    assert res["outcome"] == R, res["rollback"].get("failure")


def test_a_crash_on_the_first_generation_waits_for_the_unit_to_fail_and_names_the_exception(world, handlers):
    world.host.behave("new", generate_fault="crash")
    res = restart.restart(world.machine())
    assert res["failure"]["cause"] == "AttributeError: 'NoneType' object has no attribute 'verified_id'"
    assert res["failure"]["traceback"][-1] == res["failure"]["cause"]
    assert res["outcome"] == R


def test_a_crash_on_the_first_generation_seen_late_by_systemd_is_waited_for(world, handlers):
    world.host.behave("new", generate_fault="crash", crash_lag=0.5)
    res = restart.restart(world.machine())
    assert res["failure"]["phase"] == "generate"
    assert res["failure"]["cause"] == "AttributeError: 'NoneType' object has no attribute 'verified_id'"
    gen = next(p for p in res["phases"] if p["phase"] == "generate")
    assert 0.5 <= gen["seconds"] < 0.6  # the fake clock: polled every 0.05 s, no further
    assert res["outcome"] == R


def test_a_server_that_outlives_its_dropped_generation_by_2_s_is_not_blamed_on_a_crash(world, handlers):
    world.host.behave("new", generate_fault="crash", crash_lag=2.5)
    res = restart.restart(world.machine())
    assert res["failure"]["phase"] == "generate" and res["failure"]["cause"].startswith("generation failed: ")
    assert "traceback" not in res["failure"]


def test_the_generate_phase_reports_the_servers_counts_not_its_text(world, handlers):
    res = restart.restart(world.machine())
    gen = next(p for p in res["phases"] if p["phase"] == "generate")
    assert res["outcome"] == REST and "text" not in gen["detail"] and gen["detail"]["completion_tokens"] > 0


def test_a_failure_reads_the_failing_invocations_journal_only_for_about_a_second(world):
    """An earlier invocation's traceback is not this start's cause; an empty journal is read again for 1 s."""
    world.host.journals["earlier"] = ["Traceback (most recent call last):", "RuntimeError: an earlier crash"]
    t0 = world.host.t
    f = world.machine().failure_from_journal("start", {"InvocationID": "now", "ExecMainCode": "exited"}, "fallback")
    assert f.cause == "fallback" and f.details["journal_tail"] == f.details["traceback"] == []
    assert 1.0 <= world.host.t - t0 < 1.1  # the fake clock: polls every 0.05 s
    assert "exit_to_detect_s" not in f.details  # no exit time: the unit never exited
    assert f.details["invocation"] == "now" and f.details["exit"] == "exited/?"


def test_a_failure_keeps_the_last_40_journal_lines_and_times_the_exit(world):
    lines = [f"loading shard {n}" for n in range(60)] + CRASH_AT_START
    world.host.journals["now"] = lines
    exited_us = int((world.host.t - 0.25) * 1e6)
    props = {"InvocationID": "now", "ExecMainExitTimestampMonotonic": exited_us, "ExecMainCode": "exited"}
    f = world.machine().failure_from_journal("start", {**props, "ExecMainStatus": 1}, "fallback")
    assert f.details["journal_tail"] == lines[-40:] and f.cause == CRASH_AT_START[-1]
    assert f.details["exit_to_detect_s"] == f.details["exit_to_report_s"] == 0.25  # read at once: no time passed


def test_a_journal_that_lags_the_exit_is_read_again(world, handlers):
    """journald may lag: the first read is empty, the second has the traceback."""
    world.host.behave("new", crash_at_start=True)
    real = world.host.journal
    calls = []

    def lagging(unit, invocation=None):
        calls.append(invocation)
        return [] if len(calls) == 1 else real(unit, invocation)

    world.host.journal = lagging
    res = restart.restart(world.machine())
    assert len(calls) == 2 and res["failure"]["cause"] == CRASH_AT_START[-1]


def test_a_unit_exiting_without_a_journal_line_falls_back_to_the_generic_cause(world, handlers):
    world.host.behave("new", crash_at_start=True)
    world.host.journals = defaultdict(list)
    world.host.journal = lambda unit, invocation=None: []
    res = restart.restart(world.machine())
    assert res["failure"]["cause"] == f"{UNIT} exited while starting"
    assert res["failure"]["journal_tail"] == [] and res["outcome"] == R


def test_a_clock_that_fails_before_the_first_phase_starts_fails_that_phase_with_no_time(world, handlers):
    def wall():
        raise OSError(errno.EIO, "Input/output error")

    m = Machine(world.inst, world.settings, replace(world.host.ports(), wall=wall))
    res = restart.restart(m)
    assert res["outcome"] == outcomes.REFUSED
    assert res["phases"] == [
        {"phase": "lock", "at": None, "seconds": 0.0, "ok": False, "detail": "OSError: [Errno 5] Input/output error"}
    ]
    untouched(world)


def test_each_phase_is_logged_with_its_wall_time_and_seconds(world, handlers):
    world.host.t = 1234.56789
    m = Machine(world.inst, world.settings, replace(world.host.ports(), wall=lambda: 1700000000.123456))
    res = restart.restart(m)
    assert res["outcome"] == REST
    for p in res["phases"]:
        assert set(p) == {"phase", "at", "seconds", "ok", "detail"} and p["at"] == 1700000000.123, p
        assert p["seconds"] == round(p["seconds"], 3) >= 0


def test_a_unit_that_hit_its_start_limit_is_reset_and_started(world, handlers):
    """The old server crash-looped into StartLimitBurst: systemd refuses a start until reset-failed."""
    server = world.host.unit.server
    world.host.crash(CRASH_AT_START)
    server.close()  # the dead server's port is free again
    world.host.unit.active, world.host.unit.sub, world.host.unit.limit_hit = "failed", "failed", True
    res = restart.restart(world.machine())
    assert res["outcome"] == REST, res.get("failure")
    assert ("systemctl", "reset-failed", UNIT) in world.host.calls
    serving(world, "new")


def test_a_restarts_start_forgets_the_guards_earlier_put_backs(world, handlers):
    put_back = boot.beside(world.host.lock_dir, boot.PUT_BACK_DIR)
    os.makedirs(put_back, exist_ok=True)
    Path(boot.marker("m", put_back)).write_text(json.dumps({"count": 2, "generation": "0001"}))
    assert boot.put_backs("m", put_back)["count"] == 2
    assert restart.restart(world.machine())["outcome"] == REST
    assert boot.put_backs("m", put_back) == {"count": 0}


def test_the_ready_timeout_with_no_line_of_the_servers_says_none_and_keeps_the_invocations_journal(world, handlers):
    world.host.behave("new", health=503)
    world.host.journals["earlier"] = ["an earlier invocation's line"]
    world.host.hook("show", lambda h: h.journals[h.unit.invocation].clear(), nth=6)  # a server that says nothing
    res = restart.restart(world.machine())
    f = res["failure"]
    assert f["phase"] == "start" and f["cause"].endswith("Last log line: none"), f["cause"]
    started = f["invocation"]  # the new server's: neither the one serving before nor the rollback's
    assert started in world.host.journals and started not in (world.boot_invocation, world.host.unit.invocation)
    assert f["journal_tail"] == world.host.journals[started][-40:] and f["traceback"] == []


def test_the_ready_timeout_reports_the_last_journal_line(world, handlers):
    world.host.behave("new", health=503)
    many = [f"loading shard {n}" for n in range(50)]
    world.host.hook("show", lambda h: h.journals[h.unit.invocation].extend(many), nth=9)
    world.host.hook("show", lambda h: h.journals[h.unit.invocation].append("Capturing CUDA graphs (bs=160)"), nth=10)
    # systemd logs about the unit under its invocation too (a namespace it could not set up): not the server's line
    world.host.hook(
        "show",
        lambda h: h.journals[h.unit.invocation].append(f"{UNIT}: ProtectHostname=yes is configured, but ... ignoring"),
        nth=11,
    )
    res = restart.restart(world.machine())
    assert res["failure"]["cause"].endswith("Last log line: Capturing CUDA graphs (bs=160)")
    tail = res["failure"]["journal_tail"]
    assert len(tail) == 40 and tail[-2] == "Capturing CUDA graphs (bs=160)"  # the last 40, systemd's line last
    assert "unit active/running" in res["failure"]["cause"]


def test_a_generation_error_on_a_server_that_stays_up_is_not_blamed_on_a_crash(world, handlers):
    world.host.behave("new", generate_fault="http500")
    res = restart.restart(world.machine())
    assert res["failure"]["cause"].startswith("generation failed: ")
    assert "traceback" not in res["failure"]


def test_an_unexpected_exception_in_a_port_is_a_failure_with_its_traceback(world, handlers):
    world.host.inject("snapshot", "boom", nth=2)  # verify's
    res = restart.restart(world.machine())
    f = res["failure"]
    assert f["phase"] == "verify" and f["cause"] == "unexpected RuntimeError: boom: a bug in a port"
    # the traceback's last 12 lines: where it was raised and what, not the whole stack of the machine
    assert len(f["traceback"]) == 12 and f["traceback"][-1] == "RuntimeError: boom: a bug in a port"
    assert res["outcome"] == R
    serving(world, "good")


def test_sigint_is_a_failure_of_the_phase_too(world, handlers):
    world.host.inject("start", "sigint")
    res = restart.restart(world.machine())
    assert res["failure"] == {**res["failure"], "phase": "start", "cause": "interrupted (SIGINT)", "interrupted": True}
    assert res["outcome"] == R
    serving(world, "good")


def test_a_failure_raised_in_another_phase_is_reported_under_the_phase_that_ran(world, monkeypatch, handlers):
    def raises(*a):
        raise failure.Failure("gpus", "raised by a helper")

    monkeypatch.setattr(phases, "promote_pending", lambda inst, reload: raises())
    res = restart.restart(world.machine())
    assert res["failure"] == {"phase": "promote", "cause": "raised by a helper", "raised_in": "gpus"}


# ---------------------------------------------------------------------------- SIGTERM of the module


def test_sigterm_then_a_second_sigterm_during_the_rollback_ends_stopped(world, handlers):
    world.host.inject("start", "sigterm", 1)
    world.host.inject("start", "sigterm", 2)
    res = restart.restart(world.machine())
    assert world.host.sigterms == 2
    assert res["failure"]["interrupted"] and res["rollback"]["failure"]["interrupted"]
    assert res["rollback"]["failure"]["phase"] == "start"
    assert res["outcome"] == N
    stopped(world)
    assert world.live() == world.files["good"]


def test_a_sigterm_during_containment_is_ignored_and_the_handler_restored(world, handlers):
    world.host.behave("new", accept=1.0)
    world.host.behave("good", crash_at_start=True)
    world.host.inject("stop", "sigterm", 3)  # the containing stop
    res = restart.restart(world.machine())
    assert world.host.sigterms == 1
    assert res["outcome"] == N and res["contained"]["stop"] is None
    stopped(world)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_install_signal_handlers_ignores_sighup(handlers):
    assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    with pytest.raises(failure.Terminated):
        failure.sigterm(signal.SIGTERM, None)


def test_containment_outside_the_main_thread_still_contains(world):
    """signal.signal raises ValueError off the main thread: containment goes on without masking."""
    m = world.machine()
    res: dict = {}
    t = threading.Thread(target=m.contain, args=(res,))
    t.start()
    t.join(5)
    assert res["outcome"] == N and res["contained"]["stop"] is None
    stopped(world)


def test_a_sigterm_between_two_phases_still_ends_in_a_defined_outcome(world, handlers):
    clock = world.host.clock
    n = [0]

    def ticking():
        if "run_steps" in sys._getframe(1).f_code.co_name:  # mutmut's copy is xǁMachineǁrun_steps__mutmut_orig
            n[0] += 1  # run_steps reads the clock twice a step: t0 (before its try), then for the log
            if n[0] == 9:  # t0 of the stop: two reads each by the lock, validation, stage and preflight
                world.host.sigterm()
        return clock()

    world.host.clock = ticking
    res = restart.restart(world.machine())
    assert res["outcome"] in (R, N)


# ------------------------------------------------------------- an exception outside every phase (escaped)
# A signal's exception can land between two phases, where no phase's own handler catches it: the outcome is then
# decided by what the phases that ran have done (escaped), never left undefined.

INTERRUPTS = {
    "sigint": (KeyboardInterrupt(), "interrupted (SIGINT)"),
    "sigterm": (failure.Terminated("terminated (SIGTERM)"), "terminated (SIGTERM)"),
    "bug": (RuntimeError("a bug between phases"), "unexpected RuntimeError: a bug between phases"),
}


def raise_around(mp, steps, exc, *, before: bool = False) -> None:
    """exc raised as run_steps(steps) is entered (before=True) or right after it returned: outside every phase."""
    real = Machine.run_steps

    def run_steps(self, s, log, label=""):
        if tuple(s) == steps and before:
            raise exc
        out = real(self, s, log, label)
        if tuple(s) == steps:
            raise exc
        return out

    mp.setattr(Machine, "run_steps", run_steps)


@pytest.mark.parametrize("kind", sorted(INTERRUPTS))
def test_an_exception_before_the_first_phase_is_a_refusal_under_the_lock_phase(world, monkeypatch, handlers, kind):
    exc, cause = INTERRUPTS[kind]
    raise_around(monkeypatch, phases.REFUSALS, exc, before=True)
    res = restart.restart(world.machine())
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False and res["phases"] == []
    assert res["failure"]["phase"] == "lock" and res["failure"]["cause"] == cause
    untouched(world)
    assert world.lock_free()


@pytest.mark.parametrize("kind", sorted(INTERRUPTS))
def test_an_exception_after_the_preflight_before_the_stop_is_a_refusal_naming_the_last_phase(
    world, monkeypatch, handlers, kind
):
    exc, cause = INTERRUPTS[kind]
    raise_around(monkeypatch, phases.REFUSALS, exc)
    res = restart.restart(world.machine())
    assert [p["phase"] for p in res["phases"]] == ["lock", "validate", "stage", "preflight"]
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False
    assert res["failure"]["phase"] == "preflight" and res["failure"]["cause"] == cause
    assert bool(res["failure"].get("interrupted")) == (kind != "bug")
    untouched(world)
    assert world.lock_free()


@pytest.mark.parametrize("kind", sorted(INTERRUPTS))
def test_an_exception_after_verifying_before_the_record_is_restarted_with_a_note(world, monkeypatch, handlers, kind):
    exc, cause = INTERRUPTS[kind]
    raise_around(monkeypatch, phases.RESTART, exc)
    res = restart.restart(world.machine())
    assert res["outcome"] == REST and res["changed"] is True and "failure" not in res
    assert res["note"] == f"after verifying: {cause}"
    assert res["verify"]["ok"] is True
    assert "known_good" not in res and len(world.generations()) == 1  # not recorded: the next restart verifies again
    serving(world, "new")
    assert world.lock_free()


def test_an_exception_after_the_record_keeps_the_outcome_and_says_it_in_a_note(world, monkeypatch, handlers):
    raise_around(monkeypatch, (phases.RECORD,), KeyboardInterrupt())
    res = restart.restart(world.machine())
    assert res["outcome"] == REST and "failure" not in res
    assert res["note"] == "after the outcome: interrupted (SIGINT)"
    assert len(world.generations()) == 2
    serving(world, "new")
    assert world.lock_free()


@pytest.mark.parametrize("kind", sorted(INTERRUPTS))
def test_an_exception_between_a_failed_start_and_the_rollback_contains(world, monkeypatch, handlers, kind):
    exc, cause = INTERRUPTS[kind]
    world.host.behave("new", crash_at_start=True)
    raise_around(monkeypatch, phases.RESTART, exc)
    res = restart.restart(world.machine())
    assert res["outcome"] == N and res["changed"] is True and "rollback" not in res
    assert res["failure"]["phase"] == "start" and res["failure"]["cause"] == cause  # the phase that ran last
    assert res["phases"][-1] == {**res["phases"][-1], "phase": "start", "ok": False}
    stopped(world)
    assert world.lock_free()


def test_an_exception_after_the_rollback_verified_contains_and_keeps_the_start_failure(world, monkeypatch, handlers):
    world.host.behave("new", crash_at_start=True)
    raise_around(monkeypatch, phases.ROLLBACK, KeyboardInterrupt())
    res = restart.restart(world.machine())
    assert res["outcome"] == N
    assert res["failure"]["phase"] == "start" and "interrupted" not in res["failure"]  # the crash, not the signal
    assert [p["ok"] for p in res["rollback"]["phases"]] == [True] * len(phases.ROLLBACK)
    stopped(world)
    assert world.lock_free()


def test_an_operators_rollback_interrupted_after_its_lock_is_refused_and_touches_nothing(
    tmp_path, monkeypatch, handlers
):
    w = build(tmp_path, new="live-running")
    raise_around(monkeypatch, (phases.LOCK,), KeyboardInterrupt())
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False
    assert res["failure"] == {"phase": "lock", "cause": "interrupted (SIGINT)", "interrupted": True}
    assert w.host.systemctl_calls() == []
    serving(w, "new")
    assert w.lock_free()


def test_an_operators_rollback_interrupted_after_verifying_is_contained_not_called_restarted(
    tmp_path, monkeypatch, handlers
):
    """Only a restart's verified start outlives a signal as its outcome; the rollback's contains (stopped)."""
    w = build(tmp_path, new="live-running")
    raise_around(monkeypatch, phases.ROLLBACK, KeyboardInterrupt())
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == N and res["changed"] is True
    assert res["failure"] == {"phase": "verify", "cause": "interrupted (SIGINT)", "interrupted": True}
    stopped(w)
    assert w.lock_free()


def test_an_operators_rollback_interrupted_after_its_record_keeps_rolled_back(tmp_path, monkeypatch, handlers):
    w = build(tmp_path, new="live-running")
    raise_around(monkeypatch, (phases.RECORD,), KeyboardInterrupt())
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["note"] == "after the outcome: interrupted (SIGINT)"
    serving(w, "good")
    assert w.lock_free()


def test_a_sigterm_while_taking_the_lock_leaves_it_free(world, monkeypatch, handlers):
    sigterm_in_lock(world, monkeypatch)
    res = restart.restart(world.machine())
    assert res["failure"]["interrupted"]
    assert world.lock_free()


# ---------------------------------------------------------------------------- the lock


def test_a_second_machine_on_the_instance_is_refused_naming_the_holder_and_touches_nothing(world, handlers):
    second: dict = {}

    def during_stop(h):
        before = len(h.calls)
        second["res"] = restart.restart(Machine(world.inst, replace(world.settings, controller="ctl-b"), h.ports()))
        second["calls"] = h.calls[before:]

    world.host.hook("stop", during_stop)
    res = restart.restart(world.machine())
    assert res["outcome"] == REST
    other = second["res"]
    assert other["outcome"] == outcomes.LOCKED and other["changed"] is False
    holder = other["lock"]["holder"]
    assert holder["pid"] == os.getpid() and holder["controller"] == "ctl-a"
    assert holder["command"] == "python -m driver restart" and holder["since"].endswith("Z")
    assert holder["operation"] == "restart m (profile new)"
    assert f"pid {os.getpid()}" in other["msg"] and "from controller ctl-a since" in other["msg"]
    assert all(c[0] == "show" for c in second["calls"])  # nothing touched
    assert [p["phase"] for p in other["phases"]] == ["lock"]


def test_an_operators_rollback_holds_the_lock_as_a_rollback(tmp_path, handlers):
    w = build(tmp_path, new="live-running")
    seen: dict = {}
    w.host.hook("stop", lambda h: seen.update(peek("m", h.lock_dir) or {}))
    assert operate.rollback(w.machine("rollback"))["outcome"] == R
    assert seen["operation"] == "rollback m"  # its target is chosen under the lock: no profile to name yet


NO_MANIFEST = "/nonexistent/sglang-deploy/patches.json"  # named, absent: no patch check fails on it


def validating(w: World, verdict):
    """A machine whose restart validates the host's instances itself (restart.yml's replicas), with `verdict` as
    sglang_deploy.validate.validate_host's: a result, or an exception; the calls it got are kept."""
    calls = []

    def fake(instances, service_user, **kw):
        calls.append({"instances": instances, "service_user": service_user, **kw})
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    m = w.machine(validate_instances=[{"name": "m"}, {"name": "other"}], min_shm_mib=512, patch_manifest=NO_MANIFEST)
    m.ports = replace(m.ports, validate=fake)
    return m, calls


def test_a_restart_validating_in_its_own_call_refuses_a_bad_setting_naming_it_and_touches_nothing(world, handlers):
    problem = {"check": "parser", "key": "sglang_instances[0].flags.speculative_algorithm", "instance": "m"}
    msg = "m: --speculative-algorithm is EAGLE (set by sglang_instances[0].flags.speculative_algorithm): use EAGLE3"
    m, calls = validating(
        world, {"failed": True, "outcome": outcomes.INVALID_CONFIG, "msg": msg, "problems": [problem]}
    )
    res = restart.restart(m)
    assert res["outcome"] == outcomes.INVALID_CONFIG and res["changed"] is False
    assert res["failure"]["phase"] == outcomes.VALIDATE and res["failure"]["problems"] == [problem]
    assert res["failure"]["cause"] == f"{msg}. Nothing was stopped."
    assert set(res["failure"]) == {"phase", "cause", "problems"}  # the refusal's flags are not the result's
    assert [p["phase"] for p in res["phases"]] == [outcomes.LOCK, outcomes.VALIDATE]
    assert res["downtime_s"] == 0.0, "nothing was stopped"
    untouched(world)
    (call,) = calls
    assert call["instances"] == [{"name": "m"}, {"name": "other"}] and call["service_user"] == world.inst.service_user
    assert (call["min_shm_mib"], call["state_dir"], call["check_mode"]) == (512, world.inst.state_dir, False)
    assert world.lock_free()


def test_a_validation_that_cannot_run_is_a_refusal_with_its_cause(world, handlers):
    m, _ = validating(world, phases.ValidateError("SGLang's parser failed: exit 1"))
    res = restart.restart(m)
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False
    assert res["failure"] == {"phase": "validate", "cause": "SGLang's parser failed: exit 1. Nothing was stopped."}
    untouched(world)


def test_a_restart_validating_in_its_own_call_goes_on_when_valid(world, handlers):
    m, calls = validating(world, {"msg": "2 instance(s) valid (2 parser verdict(s) from the cache)", "seconds": 0.04})
    parser = m.ports.validate

    def slow_parser(*a, **kw):  # SGLang's parser run afresh takes seconds, while the old server still serves
        world.host.sleep(30.0)
        return parser(*a, **kw)

    m.ports = replace(m.ports, validate=slow_parser)
    res = restart.restart(m)
    assert res["outcome"] == outcomes.RESTARTED and len(calls) == 1
    assert calls[0]["patch_manifest"] == NO_MANIFEST and calls[0]["min_shm_mib"] == 512  # the settings', as given
    stop = next(p for p in res["phases"] if p["phase"] == outcomes.STOP)
    assert res["downtime_s"] == pytest.approx(sum(p["seconds"] for p in res["phases"][res["phases"].index(stop) :]))
    assert res["downtime_s"] < 30, "the downtime starts at the stop, not with the validation"
    validate = next(p for p in res["phases"] if p["phase"] == outcomes.VALIDATE)
    assert validate["ok"] and validate["detail"] == {
        "msg": "2 instance(s) valid (2 parser verdict(s) from the cache)",
        "seconds": 0.04,
    }
    assert [p["phase"] for p in res["phases"]][:3] == [outcomes.LOCK, outcomes.VALIDATE, outcomes.STAGE]
    serving(world, "new")


def test_a_lock_whose_holder_died_does_not_block(world, handlers):
    code = textwrap.dedent(f"""
        import os
        from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import InstanceLock, peek
        InstanceLock("m", "restart m", "ctl-dead", "killed", {world.host.lock_dir!r}).acquire()
        os._exit(0)  # dies holding it
    """)
    subprocess.run(
        [sys.executable, "-c", code], env=env_with_pythonpath(dict(os.environ), COLLECTIONS), check=True, timeout=30
    )
    holder = json.loads(Path(world.host.lock_dir, "m.lock").read_text())
    assert holder["controller"] == "ctl-dead"  # what it wrote is still there, the flock is not
    res = restart.restart(world.machine())
    assert res["outcome"] == REST
    assert Path(world.host.lock_dir, "m.lock").read_text() == ""  # released: the holder record cleared


def test_lock_describe_and_the_context_manager(tmp_path):
    assert lock.describe({}) == "a holder that has not written its name yet"
    assert "pid 7 (?)" in lock.describe({"pid": 7})
    with InstanceLock("x", "deploy x", lock_dir=str(tmp_path)) as held:
        holder = json.loads(Path(held.path).read_text())
        assert holder["command"] == lock.command_of(os.getpid()) != "?"
        assert lock.peek("x", str(tmp_path))["operation"] == "deploy x"
    assert lock.peek("x", str(tmp_path)) is None
    assert lock.peek("missing", str(tmp_path)) is None
    assert lock.command_of(2**22 + 12345) == "?"


def write_holder(lock_dir: Path, **holder) -> None:
    lock_dir.mkdir(exist_ok=True)
    (lock_dir / "x.lock").write_text(json.dumps({"operation": "deploy x", **holder}))


def test_status_names_a_holder_only_while_the_process_that_took_the_lock_runs(tmp_path):
    """A holder is its pid, started at the recorded time in this boot: a pid reused by another process (here, this
    one, with a start time that is not its own) or a holder from another boot is dead (issue #30)."""
    with InstanceLock("x", "deploy x", lock_dir=str(tmp_path)) as held:
        holder = json.loads(Path(held.path).read_text())
        assert holder["start_time"] == procinfo.start_time(os.getpid()) is not None
        assert holder["boot_id"] == procinfo.boot_id() is not None
        assert lock.peek("x", str(tmp_path))["start_time"] == holder["start_time"]
    me, boot = procinfo.start_time(os.getpid()), procinfo.boot_id()
    write_holder(tmp_path, pid=os.getpid(), start_time=me, boot_id=boot)
    assert lock.peek("x", str(tmp_path))["pid"] == os.getpid()
    write_holder(tmp_path, pid=os.getpid(), start_time=me + 1, boot_id=boot)  # the pid, reused
    assert lock.peek("x", str(tmp_path)) is None
    write_holder(tmp_path, pid=os.getpid(), start_time=me, boot_id="another boot")
    assert lock.peek("x", str(tmp_path)) is None
    write_holder(tmp_path, pid=os.getpid())  # a file an older version wrote: the pid alone, as then
    assert lock.peek("x", str(tmp_path))["pid"] == os.getpid()
    child = subprocess.Popen(["sleep", "30"])
    try:
        write_holder(tmp_path, pid=child.pid, start_time=me, boot_id=boot)  # the dead holder's; the pid now sleep's
        assert lock.peek("x", str(tmp_path)) is None
    finally:
        child.kill()
        child.wait()
    assert not lock.holder_alive({"pid": True, "start_time": me}) and not lock.holder_alive({"pid": "7"})


def test_a_zombie_has_no_start_time(tmp_path):
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while procinfo.read_proc(child.pid, "stat").rsplit(")", 1)[-1].split()[:1] != ["Z"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert procinfo.start_time(child.pid) is None  # its files (a flock) are closed already
    finally:
        child.wait()
    assert procinfo.start_time(child.pid) is None


# ---------------------------------------------------------------------------- staging and known-good


def test_a_successful_restart_promotes_records_a_masked_generation_with_its_software_and_enables(tmp_path, handlers):
    w = build(tmp_path, api_key=True)
    w.host.unit.file_state = "disabled"
    manifest = write_manifest(tmp_path, tmp_path / "venv-new" / "sglang-deploy" / "patches.json", matches=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == REST and res["changed"] and res["verify"]["ok"]
    patches = next(c for c in res["verify"]["checks"] if c["name"] == "patches")
    assert patches["ok"] and patches["detail"] == "1 patched files match the manifest (0001-eagle-fix)"
    assert [p["phase"] for p in res["phases"]] == list(outcomes.RESTART_PHASES)
    assert res["phases"][1]["detail"] == {"skipped": "validated by an earlier task"}
    assert res["phases"][2]["detail"] == {"skipped": "staged by an earlier task"}
    assert res["phases"][3]["detail"] == {"processes": 2, "pending": True}
    assert res["phases"][4]["detail"] == {"state": "inactive/dead"}  # the stop's
    gpus = res["phases"][5]["detail"]
    assert set(gpus) == {"waited_s", "polls", "stopped", "stopped_processes"} and gpus["polls"] >= 1
    assert gpus["waited_s"] == round(gpus["waited_s"], 3) >= 0
    start = res["phases"][7]
    assert start["detail"] == {"main_pid": w.host.unit.pid, "ready_after_s": start["detail"]["ready_after_s"]}
    assert 0 <= start["detail"]["ready_after_s"] <= start["seconds"]
    assert (res["instance"], res["unit"], res["profile"]) == ("m", UNIT, "new")
    serving(w, "new")

    assert w.live() == w.files["new"] and w.pending() == []
    assert ("systemctl", "enable", UNIT) in w.host.calls and w.host.unit.file_state == "enabled"
    # the generation: files, hash, argv as started with the key masked, the software of the unit's venv
    newest = w.generations()[-1]
    text = Path(newest).read_text()
    assert KEY not in text
    rec = json.loads(text)
    assert rec["files"] == w.files["new"] and rec["config_hash"] == known_good.content_hash(w.files["new"])
    assert rec["argv"] == masked(w.running["new"]) and rec["argv"][-2:] == ["--api-key", "<secret>"]
    assert rec["argv_hash"] == known_good.argv_hash(w.running["new"])
    assert rec["software"] == {
        "venv": str(tmp_path / "venv-new"),
        "generation": "g2",
        "sglang_version": "0.4.7",
        "lock_sha256": "lock-g2",
        "patch_series_sha256": "series-g2",
        "patch_manifest_sha256": known_good.file_sha256(manifest),
    }
    assert rec["profile"] == "new" and rec["accept_length"] == 2.5 and rec["tokens_per_s"] > 0
    assert {c["name"] for c in rec["checks"]} >= {"unit", "drift", "gpu_processes", "generate", "accept_length"}
    assert res["known_good"]["generation"] == rec["generation"] and res["known_good"]["software"]["generation"] == "g2"
    assert oct(os.stat(newest).st_mode & 0o777) == "0o600" and oct(os.stat(w.inst.kg_dir).st_mode & 0o777) == "0o700"
    assert w.host.systemctl_calls("disable") == []
    # the server demands the key on every request: health, generate and verify authenticated
    assert {"/health", "/generate", "/health_generate", "/server_info"} <= set(w.host.unit.server.requests)
    assert res["msg"] == "m: restarted"


def test_the_start_polls_a_start_job_every_tenth_of_a_second_not_in_a_busy_loop(world, handlers):
    world.host.start_lag = 3  # three polls find no main process yet
    res = restart.restart(world.machine())
    start = next(p for p in res["phases"] if p["phase"] == "start")
    assert res["outcome"] == REST and start["detail"]["ready_after_s"] >= 0.3, start


def test_the_stop_policy_none_still_restarts_a_unit_whose_own_server_holds_its_gpus(tmp_path, handlers):
    """The unit's own server is on its GPUs until the stop: not an offender, whatever the policy."""
    w = build(tmp_path, stop_policy="none")
    res = restart.restart(w.machine())
    assert res["outcome"] == REST, res.get("failure")
    assert (res["instance"], res["unit"]) == ("m", UNIT)


def test_generations_are_pruned_to_keep(tmp_path, handlers):
    w = build(tmp_path, keep=2)
    good = Store(replace(w.inst, argv=w.argv["good"], profile="good"))
    good.record(good.snapshot(), w.running["good"], {})  # a second old one: two kept already
    before = w.generations()
    assert len(before) == 2
    res = restart.restart(w.machine())
    after = w.generations()
    assert res["outcome"] == REST and len(after) == 2
    assert after[0] == before[1] and json.loads(Path(after[1]).read_text())["profile"] == "new"


def test_a_rollback_keeps_the_failed_files_and_the_pending_ones_are_consumed(world, handlers):
    world.host.behave("new", crash_at_start=True)
    res = restart.restart(world.machine())
    failed = Path(world.inst.kg_dir, "failed")
    assert (failed / UNIT).read_text() == world.files["new"][world.inst.unit_path]
    assert (failed / "m.env").read_text() == world.files["new"][world.inst.env_path]
    assert oct(failed.stat().st_mode & 0o777) == "0o700"
    assert res["rollback"]["phases"][0]["detail"]["failed_kept_in"] == str(failed)
    assert oct(os.stat(world.inst.env_path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(world.inst.unit_path).st_mode & 0o777) == "0o644"
    assert world.host.starts == ["good", "new", "good"]  # boot, the new one, the rollback
    assert res["outcome"] == R


def test_no_known_good_generation_ends_stopped_and_disabled(tmp_path, handlers):
    w = build(tmp_path, new="live", known_good=False, running=False)  # a first configuration, written live
    w.host.reload()
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == N
    assert res["rollback"] == {"attempted": False, "why": "no known-good generation is recorded"}
    stopped(w)
    assert ("systemctl", "disable", UNIT) in w.host.calls and w.host.unit.file_state == "disabled"
    assert (
        res["contained"]["files"] == "no known-good generation: the unit is disabled so that a boot does not start it"
    )
    c = res["contained"]
    assert res["msg"] == (
        f"m: start failed: {res['failure']['cause']}. Not rolled back: no known-good generation is recorded; "
        f"{UNIT} is stopped ({c['unit_state']}). {c['files']}."
    )


def test_rollback_off_ends_stopped_with_the_known_good_files_back(tmp_path, handlers):
    w = build(tmp_path, rollback=False)
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == N
    assert res["rollback"] == {"attempted": False, "why": "rollback is off (sglang_service_rollback)"}
    stopped(w)
    assert w.live() == w.files["good"] and "put back, not started" in res["contained"]["files"]
    assert w.host.starts == ["good", "new"]
    assert ". Not rolled back: rollback is off (sglang_service_rollback); " in res["msg"]


def test_a_failed_configuration_equal_to_the_known_good_ends_stopped_with_its_files(tmp_path, handlers):
    w = build(tmp_path, new=None)  # a plain restart of what is recorded; it fails now (a driver problem, say)
    w.host.behave("good", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == N and res["rollback"] == {"attempted": False, "why": SAME}
    stopped(w)
    assert w.live() == w.files["good"] and "files" not in res["contained"]
    assert [c[1] for c in w.host.systemctl_calls("daemon-reload")] == []


def test_gpus_not_clean_after_a_live_written_configuration_rolls_back(tmp_path, handlers):
    """Without staging (files written live by an older deploy) a failure after the stop does roll back."""
    w = build(tmp_path, new="live")
    w.host.inject("wait_clean", "dirty", 1)
    res = restart.restart(w.machine())
    assert res["failure"]["phase"] == "gpus" and res["outcome"] == R
    serving(w, "good")
    assert w.live() == w.files["good"]


def test_a_restore_failing_every_time_is_reported_in_the_containment(tmp_path, monkeypatch, handlers):
    w = build(tmp_path)
    w.host.behave("new", accept=1.0)
    write_fails(known_good, lambda w: w.inst.unit_path, times=99)(w, monkeypatch)
    res = restart.restart(w.machine())
    assert res["outcome"] == N and res["rollback"]["failure"]["phase"] == "restore"
    assert res["contained"]["files"].startswith("failed: OSError: [Errno 28] No space left on device")
    stopped(w)
    assert "Rollback failed too: restore" in res["msg"] and "is stopped (inactive/dead)" in res["msg"]


def test_a_restore_failing_every_time_leaves_nothing_that_a_boot_would_start(tmp_path, monkeypatch, handlers):
    w = build(tmp_path)
    w.host.behave("new", accept=1.0)
    write_fails(known_good, lambda w: w.inst.unit_path, times=99)(w, monkeypatch)
    res = restart.restart(w.machine())
    assert res["outcome"] == N
    assert w.live() == w.files["good"] or w.host.unit.file_state == "disabled"


def test_a_containing_stop_that_fails_is_reported(world, handlers):
    world.host.behave("new", accept=1.0)
    world.host.inject("stop", "stays", 2)
    world.host.inject("stop", "rc", 3)
    res = restart.restart(world.machine())
    assert res["outcome"] == N
    assert res["contained"]["stop"].startswith("failed: UnitError: systemctl stop sglang-m.service failed")
    assert res["contained"]["unit_state"] == "active/running"  # reported as it is, never hidden


def test_a_legacy_single_record_is_never_rolled_back_to_and_goes_with_the_first_generation(tmp_path, handlers):
    """Before generations the one record.json held the env file with its secrets inline: a rollback to it would
    bring a rotated secret back, so it is ignored, and removed once a generation is recorded."""
    w = build(tmp_path)
    gens = Path(w.inst.kg_dir, "generations")
    (rec_path,) = gens.iterdir()
    legacy = Path(w.inst.kg_dir, "record.json")
    legacy.write_text(rec_path.read_text())
    rec_path.unlink()
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == N and res["rollback"]["why"] == "no known-good generation is recorded"
    w.host.behave("new", crash_at_start=False)
    assert restart.restart(w.machine())["outcome"] == REST
    assert not legacy.exists() and len(w.generations()) == 1


def test_a_damaged_generation_is_skipped(tmp_path, handlers):
    w = build(tmp_path)
    Path(w.inst.kg_dir, "generations", "99999999T999999999999-bad.json").write_text("{not json")
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == R and res["rollback"]["to_profile"] == "good"


def test_a_generation_without_argv_never_escapes_restart(tmp_path, handlers):
    w = build(tmp_path)
    Path(w.inst.kg_dir, "generations", "99999999T999999999999-bad.json").write_text('{"config_hash": "x"}')
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] in (R, N)


def test_a_rotated_secret_survives_a_rollback(tmp_path, handlers):
    w = build(tmp_path, api_key=True)
    Path(w.inst.secrets_path).write_text('SGLANG_API_KEY="rotated-key"\n')
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine())
    assert res["outcome"] == R and res["rollback"]["verify"]["ok"]  # verify authenticated with the rotated key
    assert flag_value(w.host.unit.argv, "--api-key") == "rotated-key"
    assert Path(w.inst.secrets_path).read_text() == 'SGLANG_API_KEY="rotated-key"\n'
    assert Path(w.inst.kg_dir, "failed", "m.env").read_text() == w.files["new"][w.inst.env_path]  # not the secrets
    assert "rotated-key" not in Path(w.generations()[-1]).read_text()


def test_check_mode_takes_the_lock_and_touches_nothing(world, handlers):
    res = restart.restart(world.machine(check_mode=True))
    assert res["outcome"] == outcomes.WOULD_RESTART and res["pending"] is True and res["changed"] is False
    assert res["msg"] == "m: would_restart (check mode)"
    untouched(world)
    assert world.lock_free()


# ---------------------------------------------------------------------------- instances spanning nodes


@pytest.mark.parametrize("rank", [0, 1])
def test_multinode_phases_stop_start_confirm_record(tmp_path, rank, handlers):
    w = build(tmp_path, nnodes=2, node_rank=rank)
    w.inst.dist_init_addr = "127.0.0.2:5000"  # rank 0's host, whose server the confirm phase of rank 1 asks
    if rank == 1:
        rank0 = rank0_serving(w.inst.port)
    before = len(w.generations())
    stop = restart.restart(w.machine(phase="stop"))
    assert stop["outcome"] == outcomes.STOPPED and [p["phase"] for p in stop["phases"]] == [
        "lock",
        "validate",
        "stage",
        "preflight",
        "stop",
        "gpus",
    ]
    stopped(w)
    assert w.pending() == ["m.env", UNIT]  # promoted in the start phase
    start = restart.restart(w.machine(phase="start"))
    serving(w, "new")
    assert w.pending() == []
    marker = Path(w.machine().unverified_dir, "m")
    assert marker.exists()  # unverified until the group's record: a rank started again meanwhile is let through
    saved = Path(w.machine().started_path)  # the start's snapshot for the record phase: the files' contents
    assert saved.stat().st_mode & 0o777 == 0o600 and saved.parent.stat().st_mode & 0o777 == 0o700
    confirm = restart.restart(w.machine(phase="confirm"))
    assert start["outcome"] == outcomes.STARTED and confirm["outcome"] == outcomes.VERIFIED
    assert marker.exists()
    # Nothing is recorded before every rank is confirmed (the record phase, the next task over every node).
    assert len(w.generations()) == before
    if rank == 0:  # rank 0 serves: it generated and verified in its start phase
        assert [p["phase"] for p in start["phases"]][-4:] == ["promote", "start", "generate", "verify"]
        assert [p["phase"] for p in confirm["phases"]] == ["lock", "validate", "stage", "preflight"]
    else:  # a rank above 0: running (2 s on), verified once rank 0 serves
        assert start["msg"] == "m: started", start["msg"]
        assert [p["phase"] for p in start["phases"]][-2:] == ["promote", "start"]
        detail = start["phases"][-1]["detail"]
        assert set(detail) == {"main_pid", "running_after_s"} and isinstance(detail["running_after_s"], float)
        assert 2.0 <= detail["running_after_s"] <= start["phases"][-1]["seconds"]
        assert [p["phase"] for p in confirm["phases"]][-1] == "verify"
        assert confirm["verify"]["node_rank"] == 1
    record = restart.restart(w.machine(phase="record"))
    ran = [p["phase"] for p in record["phases"]]
    assert record["outcome"] == REST and ran == ["lock", "validate", "stage", "preflight", "record", "record"]
    started = json.loads(Path(w.machine().started_path).read_text())["started"]
    assert record["phases"][-2]["detail"] == {"started_hash": started["config_hash"]}  # the start phase's snapshot
    assert not marker.exists()
    assert len(w.generations()) == before + 1
    rec = json.loads(Path(w.generations()[-1]).read_text())
    assert rec["profile"] == "new" and rec["argv"] == w.running["new"]
    serving(w, "new")
    if rank == 1:
        rank0.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_multinode_group_is_rolled_back_in_step_to_its_known_good_generation(tmp_path, rank, handlers):
    """A rank failed (here or elsewhere): every node, in step, stops, starts its known-good generation, and rank 0
    verifies it; each node's result of the last phase is rolled_back, serving the known-good profile."""
    w = build(tmp_path, nnodes=2, node_rank=rank)
    w.inst.dist_init_addr = "127.0.0.2:5000"
    if rank == 1:
        rank0 = rank0_serving(w.inst.port)
    before = len(w.generations())
    restart.restart(w.machine(phase="stop"))
    assert restart.restart(w.machine(phase="start"))["outcome"] == outcomes.STARTED  # the new one runs here
    serving(w, "new")
    down = restart.restart(w.machine(phase="rollback_stop"))
    good = Store(w.inst).latest()
    to = {"attempted": True, "to_generation": good["generation"], "to_profile": "good"}
    assert down["outcome"] == outcomes.STOPPED and down["rollback"] == {**to, "config_hash": good["config_hash"]}
    assert [p["phase"] for p in down["phases"]] == ["lock", "rollback-stop", "rollback-gpus"]
    stopped(w)
    up = restart.restart(w.machine(phase="rollback_start"))
    assert up["outcome"] == outcomes.STARTED, up.get("failure")
    ran = ["restore", "start", "generate", "verify"] if rank == 0 else ["restore", "start"]  # rank 0 serves
    assert [p["phase"] for p in up["phases"]] == ["lock", *("rollback-" + p for p in ran)]
    serving(w, "good")
    assert w.live() == w.files["good"]
    done = restart.restart(w.machine(phase="rollback_confirm"))
    assert done["outcome"] == outcomes.ROLLED_BACK and done["rollback"]["outcome"] == "serving"
    assert done["verify"]["ok"] and done["profile"] == "good"
    assert [p["phase"] for p in done["phases"]] == ["lock", "rollback-verify"]
    assert ("rank0" in done["phases"][-1]["detail"]) == (rank == 1)  # a rank above 0 confirms rank 0 serves first
    serving(w, "good")
    assert len(w.generations()) == before  # the known-good generation was not recorded again
    if rank == 1:
        rank0.shutdown()


def test_the_last_rollback_phase_contains_a_rank_whose_group_failed_elsewhere(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    restart.restart(w.machine(phase="stop"))
    restart.restart(w.machine(phase="start"))
    restart.restart(w.machine(phase="rollback_stop"))
    restart.restart(w.machine(phase="rollback_start"))
    serving(w, "good")
    res = restart.restart(w.machine(phase="rollback_confirm", group_ok=False, group_why="rank 1 on b failed"))
    why = "the group's rollback failed: rank 1 on b failed"
    assert res["outcome"] == N and res["failure"] == {"phase": "rollback-restore", "cause": why}
    assert res["rollback"] == {"attempted": True, "outcome": "failed", "why": why}
    assert res["contained"]["stop"] is None
    stopped(w)
    assert w.live() == w.files["good"]  # what may start at boot is the known-good configuration


def test_a_multinode_group_without_a_known_good_generation_is_contained(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0, known_good=False)
    res = restart.restart(w.machine(phase="rollback_stop"))
    why = "no known-good generation of m is recorded on this node"
    assert res["outcome"] == N and res["failure"] == {"phase": "rollback-restore", "cause": why}
    assert res["rollback"] == {"attempted": False, "outcome": "failed", "why": why}
    assert res["contained"]["stop"] is None
    stopped(w)


def test_a_multinode_rollback_whose_start_fails_is_contained_with_the_failure_in_both_places(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    restart.restart(w.machine(phase="stop"))
    restart.restart(w.machine(phase="start"))
    restart.restart(w.machine(phase="rollback_stop"))
    w.host.behave("good", crash_at_start=True)
    res = restart.restart(w.machine(phase="rollback_start"))
    assert res["outcome"] == N and res["failure"]["phase"] == "start" and res["failure"]["cause"] == CRASH_AT_START[-1]
    assert res["rollback"]["outcome"] == "failed" and res["rollback"]["failure"] == res["failure"]
    assert res["contained"]["stop"] is None
    stopped(w)


def test_a_multinode_stop_is_refused_when_a_rank_is_not_in_the_run(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    res = restart.restart(w.machine(phase="stop", group_ok=False, group_why="1 of its 2 nodes not in this run"))
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False
    assert res["failure"] == {
        "phase": "preflight",
        "cause": "1 of its 2 nodes not in this run. Nothing was stopped on any node.",
    }
    assert w.host.calls == []  # not even the lock


def rank0_serving(port: int, host: str = "127.0.0.2", key: str | None = None) -> ThreadingHTTPServer:
    """Rank 0's HTTP server on another loopback address: /health answers 200 (401 without the key it demands)."""

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self.send_response(401)
            else:
                self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("has_key", [True, False], ids=["key", "no-key"])
def test_a_rank_above_0_reaches_an_ipv6_rank_0_in_brackets_with_the_instances_key(tmp_path, handlers, has_key):
    w = build(tmp_path, nnodes=2, node_rank=1, running=False)
    w.inst.dist_init_addr = "[::1]:5000"
    if not has_key:
        Path(w.inst.secrets_path).write_text("")
    rank0 = rank0_serving(w.inst.port, "::1", key=KEY)  # 401 without the key: not serving
    try:
        if has_key:
            assert phases.rank0_serving(w.machine()) == {"rank0": f"[::1]:{w.inst.port}"}
        else:
            with pytest.raises(failure.Failure, match=r"rank 0 of m \(\[::1\]:\d+\) does not serve"):
                phases.rank0_serving(w.machine())
    finally:
        rank0.shutdown()
        rank0.server_close()


@pytest.mark.parametrize(
    "addr, why",
    [(None, "dist_init_addr is not set"), ("rank0-host", "dist_init_addr 'rank0-host' has no port: write host:port")],
)
def test_a_rank_above_0_without_a_readable_dist_init_addr_is_not_confirmed(tmp_path, addr, why):
    w = build(tmp_path, nnodes=2, node_rank=1, running=False)
    w.inst.dist_init_addr = addr
    with pytest.raises(failure.Failure) as caught:
        phases.rank0_serving(w.machine())
    assert caught.value.phase == outcomes.VERIFY and str(caught.value) == f"m: {why}: rank 0 cannot be reached"


def test_a_rank_above_0_is_not_confirmed_while_rank_0_does_not_serve(tmp_path, handlers):
    """Rank 0 failed its start (contained, its host out of the play): rank 1 must not record or keep running."""
    w = build(tmp_path, nnodes=2, node_rank=1)
    w.inst.dist_init_addr = "127.0.0.2:5000"  # nothing serves there
    restart.restart(w.machine(phase="stop"))
    assert restart.restart(w.machine(phase="start"))["outcome"] == outcomes.STARTED
    res = restart.restart(w.machine(phase="confirm"))
    assert res["outcome"] == N and res["failure"] == {
        "phase": "verify",
        "cause": f"rank 0 of m (127.0.0.2:{w.inst.port}) does not serve: this rank's start is not confirmed",
    }
    stopped(w)
    assert w.live() == w.files["good"] and len(w.generations()) == 1, "nothing recorded; the known-good files back"


def confirmed_after(w: World, meanwhile: Callable[[Host], None]) -> tuple[dict, str]:
    """Rank 1 stopped and started, then `meanwhile` done to its host, then its confirm phase (rank 0 serving): the
    confirm's result, and the invocation its start phase saw."""
    w.inst.dist_init_addr = "127.0.0.2:5000"
    rank0 = rank0_serving(w.inst.port)
    try:
        restart.restart(w.machine(phase="stop"))
        assert restart.restart(w.machine(phase="start"))["outcome"] == outcomes.STARTED
        seen = w.host.unit.invocation
        meanwhile(w.host)
        return restart.restart(w.machine(phase="confirm")), seen
    finally:
        rank0.shutdown()
        rank0.server_close()


def test_a_rank_above_0_whose_unit_has_no_invocation_any_more_is_not_confirmed(tmp_path, handlers):
    def forgotten(h: Host) -> None:
        h.systemctl("stop", UNIT)
        h.unit.invocation = ""  # systemd forgets a stopped unit's invocation (a daemon-reexec, a reload)

    res, seen = confirmed_after(build(tmp_path, nnodes=2, node_rank=1), forgotten)
    assert res["outcome"] == N and res["failure"] == {
        "phase": "verify",
        "cause": f"{UNIT} is not the process its start phase saw (invocation {seen}, now none): it exited and systemd "
        "started it again",
    }


def test_a_rank_above_0_started_again_behind_our_back_is_not_confirmed(tmp_path, handlers):
    """Rank 1 passed its start phase, then died; Restart=on-failure started it again and its restart count was
    reset (reset-failed, an operator's start): the process the confirm phase finds is not the one the start phase
    saw. Not confirmed: contained for the group's rollback, nothing recorded."""
    w = build(tmp_path, nnodes=2, node_rank=1)

    def started_again(h: Host) -> None:
        h.crash(["RuntimeError: CUDA error: an illegal memory access was encountered"])
        before = h.unit.invocation
        h.launch()  # started again: a new invocation, NRestarts 0
        assert h.unit.invocation != before and h.unit.restarts == 0

    res, seen = confirmed_after(w, started_again)
    assert res["outcome"] == N and res["failure"]["phase"] == "verify", res
    assert res["failure"]["cause"].startswith(f"{UNIT} is not the process its start phase saw (invocation {seen}")
    stopped(w)
    assert w.live() == w.files["good"] and len(w.generations()) == 1, "nothing recorded; the known-good files back"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_multinode_start_failure_is_contained_on_the_node_for_the_group_rollback(tmp_path, rank, handlers):
    w = build(tmp_path, nnodes=2, node_rank=rank)
    restart.restart(w.machine(phase="stop"))
    w.host.behave("new", crash_at_start=True)
    res = restart.restart(w.machine(phase="start"))
    assert res["outcome"] == N and res["failure"]["phase"] == "start"
    assert res["rollback"] == {
        "attempted": False,
        "why": "m spans 2 nodes: restart.yml rolls every node of it back in step",
    }
    stopped(w)
    assert w.live() == w.files["good"]  # the known-good files back, not started


def test_a_multinode_stop_failure_is_contained(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=1)
    w.host.inject("stop", "timeout")
    res = restart.restart(w.machine(phase="stop"))
    assert res["outcome"] == N and res["failure"]["phase"] == "stop"
    stopped(w)


# ---------------------------------------------------------------------------- the operator's rollback


def test_operator_rollback_is_refused_for_an_instance_spanning_nodes(tmp_path):
    w = build(tmp_path, nnodes=2, node_rank=0)
    res = operate.rollback(w.machine("rollback"))
    cause = (
        "m spans 2 nodes: rolling its ranks back one node at a time would start them out of step. Put the known-good "
        "settings back in group_vars and run restart (all its nodes at once)."
    )
    assert res["outcome"] == outcomes.REFUSED and res["failure"] == {"phase": "restore", "cause": cause}
    assert res["msg"] == f"m: restore failed: {cause}" and res["changed"] is False
    assert w.host.calls == [] and not Path(w.host.lock_dir).exists()


def test_operator_rollback_is_refused_with_no_generation(tmp_path):
    w = build(tmp_path, new="live-running", known_good=False)
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == outcomes.REFUSED and res["failure"] == {
        "phase": "restore",
        "cause": f"no known-good generation of m is recorded in {Store(w.inst).dir}: a restart records one when it "
        "succeeds. Nothing was touched.",
    }
    assert w.host.systemctl_calls() == [] and w.lock_free()
    serving(w, "new")


def test_operator_rollback_rolls_back_and_records(tmp_path, handlers):
    w = build(tmp_path, new="live-running")
    serving(w, "new")
    good = Store(w.inst).latest()
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["profile"] == "good" and res["changed"] is True
    assert res["rollback"] == {
        "attempted": True,
        "to_generation": good["generation"],
        "to_profile": "good",
        "config_hash": good["config_hash"],
        "outcome": "serving",
    }
    assert res["verify"]["ok"] and res["verify"]["running_profile"] == "good"
    assert [p["phase"] for p in res["phases"]] == ["lock", *outcomes.ROLLBACK_PHASES, "record"]
    serving(w, "good")
    assert w.live() == w.files["good"]
    assert res["known_good"]["profile"] == "good" and len(w.generations()) == 2
    assert res["msg"] == f"m: rolled back to generation {good['generation']} (profile good): serving."
    assert w.lock_free()


def test_operator_rollback_whose_record_fails_still_serves(tmp_path, handlers):
    w = build(tmp_path, new="live-running")
    w.host.inject("enable", "rc")
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["known_good"]["enabled"] is False and res["known_good"]["generation"]
    serving(w, "good")


def test_operator_rollback_whose_record_cannot_be_written_says_why_and_still_serves(tmp_path, monkeypatch, handlers):
    w = build(tmp_path, new="live-running")

    def full(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Store, "record", full)
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R
    assert res["known_good"] == {"recorded": False, "why": "OSError: [Errno 28] No space left on device"}
    assert "Not recorded as known-good (OSError: [Errno 28] No space left on device)" in res["msg"]
    serving(w, "good")


def test_operator_rollback_failing_ends_stopped(tmp_path, handlers):
    w = build(tmp_path, new="live-running")
    w.host.behave("good", crash_at_start=True)
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == N and res["failure"]["phase"] == "start" and res["rollback"]["outcome"] == "failed"
    assert res["contained"]["stop"] is None and res["contained"]["unit_state"] in ("inactive/dead", "failed/failed")
    assert len(w.host.systemctl_calls("stop")) == 2  # the rollback's stop, then the containment's: once each
    stopped(w)
    assert w.live() == w.files["good"] and w.lock_free()


def test_operator_rollback_check_mode_and_lock(tmp_path, handlers):
    w = build(tmp_path, new="live-running")
    res = operate.rollback(w.machine("rollback", check_mode=True))
    assert res["outcome"] == outcomes.WOULD_ROLL_BACK and res["changed"] is False
    assert res["rollback"]["to_profile"] == "good"
    hold_lock(w, None)
    res = operate.rollback(w.machine("rollback"))
    w.other_lock.release()
    assert res["outcome"] == outcomes.LOCKED and res["lock"]["holder"]["controller"] == "ctl-b"
    assert w.host.systemctl_calls() == []
    serving(w, "new")


# ---------------------------------------------------------------------------- verify and status


def test_verify_verified(tmp_path):
    w = build(tmp_path, new=None)
    w.settings.thresholds.baseline_tokens_per_s = 1.0
    w.settings.thresholds.no_spec_tokens_per_s = 1.0
    res = operate.verify(w.machine())
    assert res["outcome"] == outcomes.VERIFIED and res["msg"] == "m: verified" and res["verify"]["ok"]
    assert (res["changed"], res["instance"], res["profile"]) == (False, "m", "good")
    assert w.host.bundles == [] and "evidence" not in res
    names = [c["name"] for c in res["verify"]["checks"]]
    assert names == [
        "unit",
        "drift",
        "gpu_processes",
        "health_generate",
        "generate",
        "speculative_algorithm",
        "accept_length",
        "throughput_vs_profile_baseline",
        "throughput_vs_no_speculation",
        "patches",
    ]
    assert res["verify"]["running_profile"] == "good" and res["verify"]["gpu_memory_mib"] == {0: 70000, 1: 70000}


def test_verify_failed_names_the_failed_checks(tmp_path):
    w = build(tmp_path, new="pending")  # configured: new; running: good
    w.host.foreign = True
    res = operate.verify(w.machine())
    assert res["outcome"] == outcomes.VERIFY_FAILED
    failed = " ".join(res["verify"]["failed_checks"])
    assert (
        "drift: running command line differs" in failed
        and "--speculative-num-steps: configured '5', running '3'" in failed
    )
    assert "running profile: good" in failed
    assert "gpu_processes: not the service's: GPU 0: pid 999999" in failed
    assert len(res["verify"]["failed_checks"]) >= 2
    assert res["msg"] == "m: verification failed: " + "; ".join(res["verify"]["failed_checks"])
    # the running server's evidence, taken while it still runs
    [bundle] = w.host.bundles
    assert bundle["failure"] == {"phase": outcomes.VERIFY, "cause": "; ".join(res["verify"]["failed_checks"])}
    assert bundle["unit"][0] == "active" and res["evidence"]["path"].endswith("bundle-1.tar.gz")


@pytest.mark.parametrize("kind", ["nvsmi", "timeout", "boom", "sigint"])
def test_verify_with_an_exception_inside_is_verify_failed_never_raised(tmp_path, kind):
    w = build(tmp_path, new=None)
    w.host.inject("snapshot" if kind == "nvsmi" else "show", kind)
    res = operate.verify(w.machine())
    assert res["outcome"] == outcomes.VERIFY_FAILED and res["changed"] is False
    (check,) = res["verify"]["checks"]
    cause = check["detail"]
    assert check == {"name": "verify", "ok": False, "severity": "fail", "detail": cause} and cause
    assert (
        cause == "interrupted (SIGINT)"
        if kind == "sigint"
        else cause.split(":")[0]
        in (
            "NvidiaSmiError",
            "TimeoutExpired",
            "unexpected RuntimeError",
        )
    )
    assert res["verify"]["warnings"] == [] and res["verify"]["failed_checks"] == [f"verify: {cause}"]
    assert res["failure"] == {"phase": "verify", "cause": f"verify: {cause}"}
    assert res["msg"] == f"m: verification failed: verify: {cause}"


def test_a_restarts_verify_reads_the_patch_manifest_its_settings_name_and_says_each_failed_check(tmp_path, handlers):
    w = build(tmp_path)
    w.host.behave("new", accept=1.0)  # a second failed check: no draft token accepted
    manifest = write_manifest(tmp_path, tmp_path / "elsewhere.json", matches=False)
    res = restart.restart(w.machine(patch_manifest=manifest))
    # the installed files differ for the rollback too (one manifest): contained after its verify
    assert (
        res["outcome"] == N and res["failure"]["phase"] == "verify" and res["rollback"]["failure"]["phase"] == "verify"
    )
    failed = res["verify"]["failed_checks"]
    assert len(failed) == 2 and any("installed files differ from the patch manifest" in x for x in failed), failed
    assert res["failure"]["cause"] == "verification failed: " + "; ".join(failed)


def test_a_restarts_verify_phase_says_how_many_checks_ran_and_their_warnings(world, handlers):
    res = restart.restart(world.machine())
    verify = next(p for p in res["phases"] if p["phase"] == "verify")
    assert verify["detail"] == {"checks": len(res["verify"]["checks"]), "warnings": res["verify"]["warnings"]}
    assert verify["detail"]["checks"] >= 5


def test_verify_reads_the_patch_manifest_its_settings_name(tmp_path):
    w = build(tmp_path, new=None)
    manifest = write_manifest(tmp_path, tmp_path / "elsewhere.json", matches=False)
    res = operate.verify(w.machine(patch_manifest=manifest))
    assert any("installed files differ from the patch manifest" in x for x in res["verify"]["failed_checks"])
    res = operate.verify(w.machine(patch_manifest=str(tmp_path / "none-here.json")))
    assert not any("patch manifest" in x for x in res["verify"]["failed_checks"]), res["verify"]["failed_checks"]


def test_verify_of_a_stopped_unit_and_a_patch_mismatch(tmp_path):
    w = build(tmp_path, new=None, running=False)
    write_manifest(tmp_path, tmp_path / "venv-good" / "sglang-deploy" / "patches.json", matches=False)
    res = operate.verify(w.machine())
    failed = res["verify"]["failed_checks"]
    assert any(x.startswith("unit: sglang-m.service inactive/dead") for x in failed)
    assert any(
        x.startswith("drift: running command line differs from the rendered configuration: no main process")
        for x in failed
    )
    assert any("installed files differ from the patch manifest: ['eagle.py', 'gone.py']" in x for x in failed)


def test_status_reports_every_part(tmp_path):
    w = build(tmp_path, api_key=True)  # new pending; good running
    out = operate.status(w.machine())
    assert out["errors"] == []
    assert out == {
        **out,
        "outcome": outcomes.STATUS,
        "state": "active/running",
        "restarts": 0,
        "main_pid": w.host.unit.pid,
        "configured_profile": "new",
        "running_profile": "good",
        "drift": True,
        "enabled": "enabled",
        "gpu_memory_mib": {0: 70000, 1: 70000},
        "health": True,
        "accept_length": 2.5,
        "pending": True,
        "lock": None,
        "changed": False,
    }
    assert out["known_good"]["profile"] == "good" and out["known_good"]["software"]["sglang_version"] == "0.4.6"
    assert w.host.systemctl_calls() == []


def test_status_shows_the_lock_holder_and_the_accept_length_from_metrics(tmp_path):
    w = build(tmp_path, new=None)
    w.host.unit.server.b = Behaviour(server_info="no_states", accept=3.25)
    hold_lock(w, None)
    try:
        out = operate.status(w.machine())
    finally:
        w.other_lock.release()
    assert out["lock"]["controller"] == "ctl-b" and out["accept_length"] == 3.25 and out["drift"] is False


def test_status_puts_each_parts_exception_in_errors(tmp_path):
    w = build(tmp_path)
    w.host.inject("show", "timeout")
    w.host.inject("snapshot", "nvsmi")
    w.host.unit.server.b = Behaviour(server_info="malformed")
    gens = Path(w.inst.kg_dir, "generations")
    for p in gens.iterdir():
        p.unlink()
    gens.rmdir()
    gens.write_text("a file where a directory belongs")
    out = operate.status(w.machine())
    errors = out["errors"]
    assert [e.split(":")[0] for e in errors] == ["unit", "gpus", "http", "known_good"]
    assert "TimeoutExpired" in errors[0] and "NvidiaSmiError" in errors[1]
    assert "not JSON" in errors[2] and "NotADirectoryError" in errors[3]
    assert out["health"] is True and out["outcome"] == outcomes.STATUS


def test_status_says_state_and_running_profile_in_one_line_and_rounds_the_accept_length(tmp_path):
    w = build(tmp_path, new=None, api_key=True)
    w.host.unit.server.b = Behaviour(server_info="no_states", accept=2.34567)  # from /metrics, with the key
    out = operate.status(w.machine())
    assert out["errors"] == [] and out["unit"] == UNIT and out["accept_length"] == 2.346 and out["instance"] == "m"
    assert out["msg"] == "m: active/running, profile good"


def test_status_of_a_server_without_a_draft_model_reads_no_accept_length(tmp_path):
    w = build(tmp_path, new=None)
    w.host.unit.server.b = Behaviour(server_info="no_spec")
    out = operate.status(w.machine())
    assert out["errors"] == [] and out["health"] is True and out["accept_length"] is None
    assert "/metrics" not in w.host.unit.server.requests


def test_status_with_nothing_recorded_and_nothing_running(tmp_path):
    w = build(tmp_path, new=None, known_good=False, running=False)
    out = operate.status(w.machine())
    assert out["errors"] == [] and out["known_good"] is None
    assert (out["state"], out["main_pid"], out["running_profile"], out["drift"]) == ("inactive/dead", 0, None, False)
    assert out["msg"] == "m: inactive/dead, profile ?"


def test_status_names_each_failing_part_in_its_one_line(tmp_path, monkeypatch):
    w = build(tmp_path, new=None)
    w.host.inject("show", "timeout")

    def jobs_fail(name, directory):
        raise OSError(errno.EACCES, "Permission denied", directory)

    monkeypatch.setattr(operate.job, "of_instance", jobs_fail)
    out = operate.status(w.machine())
    assert [e.split(":")[0] for e in out["errors"]] == ["unit", "jobs"]
    assert out["errors"][1].startswith("jobs: PermissionError: [Errno 13] Permission denied")
    assert out["msg"] == "m: ?, profile ?; errors: " + "; ".join(out["errors"])


def test_status_of_a_rank_above_0_has_no_http(tmp_path):
    w = build(tmp_path, new=None, nnodes=2, node_rank=1)
    out = operate.status(w.machine())
    assert out["errors"] == [] and out["health"] is None and out["accept_length"] is None
    assert out["running_profile"] == "good" and out["known_good"]["profile"] == "good"


# ---------------------------------------------------------------------------- the pieces underneath


def test_stage_writes_live_until_a_generation_is_verified_then_pending_then_unchanged(tmp_path, monkeypatch):
    w = build(tmp_path, new=None, known_good=False, running=False)
    for p in w.inst.config_files:
        os.unlink(p)
    Path(w.inst.secrets_path).unlink()
    verified, reloads = [], []
    monkeypatch.setattr(stage, "verify_unit", lambda path, unit: verified.append((os.path.basename(path), unit)))
    monkeypatch.setattr(stage, "checked", lambda *a: reloads.append(a))
    first = stage.stage(w.inst, w.files["good"], f'SGLANG_API_KEY="{KEY}"\n')
    assert first["outcome"] == outcomes.STAGED and first["first"] and first["secrets_changed"]
    assert w.live() == w.files["good"] and reloads == [("daemon-reload",)]
    assert verified == [(f".{UNIT}.verify", UNIT)]
    assert not list(Path(w.inst.unit_path).parent.glob(".*verify"))
    again_first = stage.stage(w.inst, w.files["new"], None)  # still nothing verified: written live again
    assert again_first["first"] and w.live() == w.files["new"] and reloads == [("daemon-reload",)] * 2
    stage.stage(w.inst, w.files["good"], None)
    good = Store(w.inst)
    good.record(good.snapshot(), w.running["good"], {})  # a restart verified it: from now on, staged
    changed = stage.stage(w.inst, w.files["new"], f'SGLANG_API_KEY="{KEY}"\n')
    assert changed["pending"] and changed["wrote"] == sorted(w.inst.pending_path(p) for p in w.files["new"])
    assert w.live() == w.files["good"] and w.pending() == ["m.env", UNIT]
    assert "secrets_changed" not in changed
    check = stage.stage(w.inst, w.files["good"], None, check_mode=True)
    assert check["outcome"] == outcomes.UNCHANGED and check["changed"] and w.pending() == ["m.env", UNIT]
    again = stage.stage(w.inst, w.files["good"], None)
    assert again["outcome"] == outcomes.UNCHANGED and again["removed_pending"] and w.pending() == []
    assert stage.promote(w.inst) == {"promoted": []}


def test_stage_verify_unit_refusals(monkeypatch, tmp_path):
    def refuse(*a, **kw):
        return subprocess.CompletedProcess(a, 1, "", "Unknown key name 'ExecStrat'")

    monkeypatch.setattr(stage.subprocess, "run", refuse)
    with pytest.raises(ValueError, match=r"refuses the rendered x\.service: Unknown key name"):
        stage.verify_unit(str(tmp_path / "u"), "x.service")

    def missing(*a, **kw):
        raise FileNotFoundError("systemd-analyze")

    monkeypatch.setattr(stage.subprocess, "run", missing)
    with pytest.raises(ValueError, match="could not run"):
        stage.verify_unit(str(tmp_path / "u"), "x.service")


def test_http_errors_are_one_kind():
    with pytest.raises(http.HttpError, match="expected a JSON object, got list"):
        http.json_of("u", b"[1]")
    assert http.metric("sglang:spec_accept_length nan-ish\n", "sglang:spec_accept_length") is None
    assert http.metric("", "x") is None
    assert (
        http.server_accept_length("http://127.0.0.1:9", {"internal_states": [{"avg_spec_accept_length": "x"}]}) is None
    )
    port = free_port()  # nothing listens: refused
    assert http.server_accept_length(f"http://127.0.0.1:{port}", {}) is None
    with pytest.raises(http.HttpError, match=r"ConnectionRefusedError|Connection refused"):
        http.get_json(f"http://127.0.0.1:{port}/server_info", timeout=1)


def test_checks_drift_summary_and_patch_manifest(tmp_path):
    assert checks.drift_summary(["p", "--a", "1"], ["p", "--a", "1", "--b"]) == "--b: not configured, running ''"
    assert checks.drift_summary(["p", "--a", "1", "--c"], ["p", "--a", "1"]) == "--c: configured '', not running"
    assert (
        checks.drift_summary(["p", "--a", "1", "--b", "2"], ["p", "--b", "2", "--a", "1"])
        == "same flags in another order"
    )
    assert checks.flag_value(["--x=3"], "--x") == "3" and checks.flag_value(["--x"], "--x") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert checks.patch_check(str(bad))[1] is False
    site = tmp_path / "site"
    site.mkdir()
    (site / "a.py").write_text("x")
    import hashlib

    good = tmp_path / "good.json"
    good.write_text(
        json.dumps(
            {
                "site_packages": str(site),
                "patches": [{"name": "0001"}],
                "files": {"a.py": {"after": hashlib.sha256(b"x").hexdigest()}},
            }
        )
    )
    assert checks.patch_check(str(good)) == ("patches", True, "1 patched files match the manifest (0001)")


def test_known_good_software_without_metadata_and_masking(tmp_path):
    assert known_good.software_of(None) == {}
    assert known_good.software_of(str(tmp_path)) == {
        "venv": str(tmp_path),
        "generation": None,
        "patch_manifest_sha256": None,
    }
    assert masked(["p", "--api-key=k", "--admin-api-key", "k2", "--x", "1"]) == [
        "p",
        "--api-key=<secret>",
        "--admin-api-key",
        "<secret>",
        "--x",
        "1",
    ]


def test_a_rank_above_0_restarted_as_one_phase_skips_the_generation(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=1)
    res = restart.restart(w.machine())
    assert res["outcome"] == REST
    gen = next(p for p in res["phases"] if p["phase"] == "generate")
    assert gen["detail"] == {"skipped": "rank above 0: rank 0 serves"}
    serving(w, "new")


def test_a_lock_whose_holder_wrote_garbage_is_still_refused(tmp_path):
    held = InstanceLock("m", "deploy m", lock_dir=str(tmp_path))
    held.acquire()
    try:
        os.pwrite(held.fd, b"{half a rec", 0)
        with pytest.raises(lock.Locked, match="a holder that has not written its name yet") as exc:
            InstanceLock("m", "restart m", lock_dir=str(tmp_path)).acquire()
        assert exc.value.holder == {}
        assert lock.peek("m", str(tmp_path)) is None, "no live holder named: status shows none, and takes no lock"
    finally:
        held.release()


def test_http_healthy_is_false_when_nothing_listens():
    assert http.healthy(f"http://127.0.0.1:{free_port()}", timeout=1) is False


def test_unit_show_parses_and_cause_of_reads_the_journal(monkeypatch):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import unit

    out = "ActiveState=failed\nSubState=failed\nMainPID=0\nNRestarts=x\nInvocationID=abc\n"
    monkeypatch.setattr(unit, "systemctl", lambda *a, timeout=0: subprocess.CompletedProcess(a, 0, out, ""))
    props = unit.show(UNIT)
    assert props["MainPID"] == 0 and props["NRestarts"] == 0 and props["ExecMainStatus"] == 0
    assert unit.state(props) == "failed/failed" and unit.has_failed(props)
    monkeypatch.setattr(unit, "systemctl", lambda *a, timeout=0: subprocess.CompletedProcess(a, 5, "", "no such unit"))
    with pytest.raises(unit.UnitError, match="systemctl start x failed: no such unit"):
        unit.checked("start", "x")
    assert unit.cause_of([f"{UNIT}: Main process exited, code=killed, status=31/SYS"]).endswith(
        "(a system call the unit's SystemCallFilter denies)"
    )
    assert unit.cause_of(["launch_server.py: error: argument --tp-size: invalid int value: 'x'"]) == (
        "error: argument --tp-size: invalid int value: 'x'"
    )
    assert unit.cause_of(["sglang-gpu-gate: GPU 0 held by pid 7: refusing to start"]).startswith("sglang-gpu-gate:")
    assert unit.cause_of(["nothing to see"]) is None and unit.traceback_of(["no traceback"]) == []


def test_instance_record_from_params_env_file_and_venv(tmp_path):
    inst = Instance.from_params(
        {
            "name": "m",
            "unit": UNIT,
            "unit_path": "u",
            "env_path": "e",
            "secrets_path": "s",
            "pending_dir": "p",
            "port": 1,
            "gpus": [0],
            "argv": ["/usr/bin/sglang"],
            "profile": "a",
            "nnodes": None,
            "unknown": 1,
        }
    )
    assert inst.nnodes == 1 and inst.venv is None and inst.api_key() is None and inst.profile_of([]) is None
    assert inst.profile_of(["other"]) is None
    for bad in ("50%", "a\nb", "a b"):  # the module refuses what the filter would have (issue #30)
        with pytest.raises(ValueError, match="profile name"):
            Instance.from_params({**vars(inst), "profile": bad})
    env = tmp_path / "x.env"
    env.write_text('# comment\n\nA="q\\"uote \\$HOME \\\\"\nB=plain\nnot a line\n')
    assert read_env_file(str(env)) == {"A": 'q"uote $HOME \\', "B": "plain"}


# ---------------------------------------------------------------------------- staging inside the restart


def staged_by_the_restart(w: World, monkeypatch, refuse: str | None = None, **kw) -> tuple[Machine, list[bool]]:
    """A machine given this run's rendered configuration (restart.yml: no earlier stage task); systemd-analyze
    replaced (absent here), refusing with `refuse`; the list says, per staging, whether the lock was free then."""

    def analyze(path, unit_name):
        if refuse:
            raise ValueError(refuse)

    monkeypatch.setattr(stage, "verify_unit", analyze)
    w.inst = replace(w.inst, argv=list(w.argv["new"]), profile="new")  # this run renders the new profile
    m = w.machine(rendered=dict(w.files["new"]), secrets=f'SGLANG_API_KEY="{KEY}-rotated"\n', **kw)
    lock_free_while_staging: list[bool] = []

    def staging(inst, rendered, secrets, check_mode):
        lock_free_while_staging.append(w.lock_free())
        return stage.stage(inst, rendered, secrets, check_mode)

    m.ports.stage = staging
    return m, lock_free_while_staging


def test_a_restart_given_its_configuration_stages_it_under_the_lock_it_holds_then_starts_exactly_it(
    tmp_path, handlers, monkeypatch
):
    w = build(tmp_path, new=None)
    m, lock_free = staged_by_the_restart(w, monkeypatch)
    res = restart.restart(m)
    assert res["outcome"] == REST, res.get("failure")
    assert lock_free == [False]  # no other operation could stage between this staging and the start
    stage_phase = res["phases"][2]
    assert stage_phase["phase"] == outcomes.STAGE and stage_phase["ok"]
    assert stage_phase["detail"]["outcome"] == outcomes.STAGED and stage_phase["detail"]["pending"] is True
    # what the staging wrote: the pending copies of the unit's files
    assert sorted(stage_phase["detail"]["wrote"]) == sorted(w.inst.pending_path(f) for f in w.inst.config_files)
    assert m.target.config_hash == known_good.content_hash(w.files["new"]) == stage_phase["detail"]["config_hash"]
    assert m.s.expected_config_hash is None  # the machine's target holds it: the settings stay as given
    serving(w, "new")
    assert w.live() == w.files["new"] and w.pending() == []
    assert Path(w.inst.secrets_path).read_text() == f'SGLANG_API_KEY="{KEY}-rotated"\n'


def test_a_unit_systemd_refuses_at_the_restarts_staging_is_invalid_config_and_nothing_is_stopped(
    tmp_path, handlers, monkeypatch
):
    w = build(tmp_path, new=None)
    m, _ = staged_by_the_restart(w, monkeypatch, refuse="systemd-analyze verify refused the unit: bad ExecStart")
    res = restart.restart(m)
    assert res["outcome"] == outcomes.INVALID_CONFIG
    assert res["failure"]["phase"] == outcomes.STAGE
    assert "systemd-analyze verify refused the unit: bad ExecStart. Nothing was stopped." in res["failure"]["cause"]
    assert set(res["failure"]) == {"phase", "cause"}
    assert w.host.systemctl_calls() == [] and w.host.unit.invocation == w.boot_invocation
    serving(w, "good")
    assert w.live() == w.files["good"] and w.pending() == []
    assert w.lock_free()


def test_a_locked_instance_refuses_the_restart_before_its_staging_writes_anything(tmp_path, handlers, monkeypatch):
    w = build(tmp_path, new=None)
    m, lock_free = staged_by_the_restart(w, monkeypatch)
    holder = InstanceLock(w.inst.name, "deploy m", "ctl-b", "python -m driver deploy", w.host.lock_dir)
    holder.acquire()
    try:
        res = restart.restart(m)
    finally:
        holder.release()
    assert res["outcome"] == outcomes.LOCKED and lock_free == []
    assert [p["phase"] for p in res["phases"]] == [outcomes.LOCK]
    assert w.pending() == [] and w.host.systemctl_calls() == []
    serving(w, "good")


def test_a_unit_file_changed_on_disk_but_not_loaded_is_reloaded_before_the_start(tmp_path, handlers):
    """Written by hand (or a deploy cut short before its daemon-reload): systemd would start what it loaded."""
    w = build(tmp_path, new="live")
    assert w.host.show(UNIT)["NeedDaemonReload"] == "yes"
    res = restart.restart(w.machine())
    promote_phase = next(p for p in res["phases"] if p["phase"] == "promote")
    assert promote_phase["detail"]["promoted"] == [] and promote_phase["detail"]["reloaded"] is True
    assert res["outcome"] == REST, res.get("failure")
    serving(w, "new")


def damage_manifest(w):
    Path(stage.manifest_path(w.inst)).unlink()


def unreadable_pending(w):
    env = Path(w.inst.pending_path(w.inst.env_path))
    env.unlink()
    env.mkdir()  # read as text: IsADirectoryError


@pytest.mark.parametrize(
    "damage, settings, cause",
    [
        (
            damage_manifest,
            {},
            "the pending configuration of m is incomplete (a deploy was interrupted?): run deploy again. "
            "Nothing was stopped.",
        ),
        (unreadable_pending, {}, "the configuration to start cannot be read ([Errno 21] Is a directory: "),
        (
            lambda w: None,
            {"expected_config_hash": "0" * 64},
            "the configuration staged for m is not the one this run rendered (hash ",
        ),
    ],
    ids=["incomplete", "unreadable", "another-controllers"],
)
def test_a_staged_configuration_that_is_not_whole_or_not_this_runs_is_refused_before_the_stop(
    tmp_path, handlers, damage, settings, cause
):
    w = build(tmp_path)
    damage(w)
    res = restart.restart(w.machine(**settings))
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False
    assert res["failure"]["phase"] == "preflight" and res["failure"]["cause"].startswith(cause), res["failure"]
    assert set(res["failure"]) == {"phase", "cause"}  # its kind became the outcome
    assert res["failure"]["cause"].endswith("Nothing was stopped.")
    if settings:  # the staged one's hash, then this run's
        staged = known_good.content_hash(w.files["new"])
        assert f"(hash {staged}, this run {'0' * 64}): another controller staged it." in res["failure"]["cause"]
    assert w.host.systemctl_calls() == [] and w.host.unit.invocation == w.boot_invocation
    serving(w, "good")
    assert w.lock_free()


def test_check_mode_stages_nothing_and_says_it_would_restart(tmp_path, handlers, monkeypatch):
    w = build(tmp_path, new=None)
    m, _ = staged_by_the_restart(w, monkeypatch, check_mode=True)
    res = restart.restart(m)
    assert res["outcome"] == outcomes.WOULD_RESTART
    assert res["phases"][2]["detail"]["outcome"] == outcomes.STAGED and m.s.expected_config_hash is None
    assert w.pending() == [] and w.live() == w.files["good"] and w.host.systemctl_calls() == []
    assert Path(w.inst.secrets_path).read_text() == f'SGLANG_API_KEY="{KEY}"\n'


# ---------------------------------------------------------------------------- the crash evidence bundle


def test_a_crash_on_the_first_generation_is_bundled_before_the_rollback_stops_anything(world, handlers):
    world.host.behave("new", generate_fault="crash")
    res = restart.restart(world.machine(evidence_budget_s=4.5))
    assert res["outcome"] == R
    [bundle] = world.host.bundles
    assert res["evidence"]["path"] == "/var/lib/sglang/evidence/m/bundle-1.tar.gz"
    assert bundle["failure"]["phase"] == outcomes.GENERATE and bundle["failure"]["cause"] == res["failure"]["cause"]
    assert bundle["invocation"] and bundle["invocation"] == res["failure"]["invocation"]  # the failing start's
    assert bundle["request"] == {"prompt": "The capital of France is", "max_new_tokens": 16}
    assert bundle["budget_s"] == 4.5  # the setting's, not the port's default
    # taken before any stop of the rollback: the rollback's systemctl calls all come after it
    later = [c for c in world.host.calls[bundle["calls_before"] :] if c[:2] == ("systemctl", "stop")]
    assert later and not [c for c in world.host.calls[: bundle["calls_before"]] if c[:2] == ("systemctl", "stop")][1:]


def test_a_server_that_never_becomes_ready_is_bundled_while_its_processes_still_run(tmp_path, handlers):
    w = build(tmp_path, ready_timeout=1.0)
    w.host.behave("new", health=503)
    res = restart.restart(w.machine())
    assert res["outcome"] == R and res["failure"]["phase"] == outcomes.START
    [bundle] = w.host.bundles
    assert bundle["unit"][0] == "active" and bundle["unit"][2] > 0  # py-spy can still dump every rank
    assert bundle["request"] is None


def test_no_bundle_for_a_refusal_a_failed_stop_or_when_switched_off(tmp_path, handlers):
    w = build(tmp_path)
    w.host.foreign = True
    assert restart.restart(w.machine())["outcome"] == outcomes.GPUS_NOT_CLEAN
    w.host.foreign = False
    w.host.inject("stop", "rc")
    res = restart.restart(w.machine())
    assert res["failure"]["phase"] == outcomes.STOP and "evidence" not in res
    w2 = build(tmp_path / "off")
    w2.host.behave("new", generate_fault="crash")
    res = restart.restart(w2.machine(evidence=False))
    assert res["outcome"] == R and "evidence" not in res
    assert w.host.bundles == [] and w2.host.bundles == []


def test_a_bundle_that_fails_is_reported_and_the_rollback_still_runs(world, handlers):
    world.host.behave("new", generate_fault="crash")
    m = world.machine()

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    m.ports.evidence = broken
    res = restart.restart(m)
    assert res["outcome"] == R
    assert res["evidence"] == {"error": "no evidence bundle: OSError: [Errno 28] No space left on device"}
    serving(world, "good")


# ---------------------------------------------------------------------------- progress of a detached restart

LOAD_LOG = [
    ["[2026-12-02 10:00:00 TP0] Load weight begin. avail mem=139.50 GB"],
    [
        "Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]"
        "\rLoading safetensors checkpoint shards: 100% Completed | 2/2 [00:04<00:00, 0.50it/s]",
        "[2026-12-02 10:00:04 TP0] Load weight end. elapsed=4.00 s, type=LlamaForCausalLM, avail mem=120.00 GB",
    ],
    ["[2026-12-02 10:00:04 TP0] Load weight begin. avail mem=120.00 GB"],
    ["[2026-12-02 10:00:06 TP0] Capture target verify CUDA graph begin. backend=full, avail mem=100.00 GB"],
    ["Capturing batches (bs=8 avail_mem=99.00 GB): 100%|##########| 4/4 [00:03<00:00, 1.20it/s]"],
]


def test_a_reporting_restart_says_each_phase_and_model_load_step_in_order_with_their_times(world, handlers):
    """The journal's new lines are read while start waits (a cursor each time), the steps SGLang logs reported
    as they come; the server turns healthy before its last batch is read, which the start's last read takes."""
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import progress

    world.host.behave("new", health=503)
    batches = list(LOAD_LOG)
    cursors = []
    said = []

    asked = []

    def journal_since(invocation, cursor=None):
        asked.append(invocation)  # an assertion here would be swallowed: progress never fails the start
        cursors.append(cursor)
        if len(batches) == 2:  # healthy now: the last batch is read by the start's last read, whenever it comes
            world.host.unit.server.b.health = 200
        return (batches.pop(0) if batches else []), f"c{len(cursors)}"

    m = world.machine()
    m.ports = replace(m.ports, journal_since=journal_since)
    m.progress = progress.Reporter(None, clock=world.host.clock)
    real_write = m.progress._write

    def write():
        real_write()
        d = m.progress.doc
        said.append((d["phase"], d["step"], d["detail"]))

    m.progress._write = write
    res = restart.restart(m)
    assert res["outcome"] == outcomes.RESTARTED, res.get("failure")
    assert list(dict.fromkeys(p for p, *_ in said)) == [p["phase"] for p in res["phases"]]  # each, in order
    start = [(step, detail) for phase, step, detail in said if phase == "start" and step]
    assert list(dict.fromkeys(start)) == [
        (progress.WEIGHTS, ""),
        (progress.WEIGHTS, "2/2 (100%)"),  # one read held the bar's line and "Load weight end.": both reported
        (progress.WEIGHTS, "done"),
        (progress.DRAFT_WEIGHTS, ""),
        (progress.GRAPHS, ""),
        (progress.GRAPHS, "4/4 (100%)"),
    ]
    assert cursors[:3] == [None, "c1", "c2"]  # each read goes on from the last
    assert set(asked) == {world.host.unit.invocation} != {world.boot_invocation}  # the new server's journal only
    steps = m.progress.finish()
    assert [s["step"] for s in steps] == [progress.WEIGHTS, progress.DRAFT_WEIGHTS, progress.GRAPHS]
    # One read at most every 0.5 s of the fake clock; the last batch came with the ready server's last read, at once.
    assert all(s["seconds"] >= 0.5 for s in steps[:-1]) and steps[-1]["seconds"] < 0.5, steps


# ---------------------------------------------------------------------------- autotune's benchmark in the restart

BENCH = {"concurrency": [1, 4], "requests": 3, "max_new_tokens": 16, "warmup": 1, "timeout": 7.0}


def benching(w: World, then=None) -> tuple[Machine, list[dict]]:
    """A machine with Settings.bench whose benchmark port records what it saw (the lock, the known-good records,
    the unit), advances the fake clock by 30 s, then does `then` (raise) or answers."""
    m = w.machine(bench=BENCH)
    calls: list[dict] = []

    def bench(base, concurrency, requests, max_new_tokens, warmup, api_key=None, timeout=120.0):
        calls.append(
            {
                "args": (base, concurrency, requests, max_new_tokens, warmup, api_key, timeout),
                "locked": not w.lock_free(),
                "generations": len(w.generations()),
                "unit": (w.host.unit.active, w.host.unit.sub),
            }
        )
        w.host.t += 30.0
        if then is not None:
            then()
        return {"output_tokens_per_s": 123.4, "accept_length": 2.5, "failed": 0, "levels": [], "seconds": 30.0}

    m.ports.bench = bench
    return m, calls


def test_a_restart_with_a_benchmark_measures_after_the_record_under_its_lock_and_not_in_the_downtime(
    tmp_path, handlers
):
    w = build(tmp_path, api_key=True)
    before = len(w.generations())
    m, calls = benching(w)
    res = restart.restart(m)
    assert res["outcome"] == REST and res["known_good"]["generation"]
    assert res["bench"]["output_tokens_per_s"] == 123.4 and "bench_error" not in res
    assert res["gpu_model"] == "NVIDIA H200"  # from the preflight's snapshot: no nvidia-smi of its own
    (call,) = calls
    assert call["args"] == (w.inst.base, [1, 4], 3, 16, 1, KEY, 7.0)  # the instance's port, with its API key
    assert call["locked"], "the benchmark runs under the restart's lock: nothing restarts it in between"
    assert call["generations"] == before + 1, "after the record: the restart is known-good before it is measured"
    assert call["unit"] == ("active", "running")
    assert res["downtime_s"] < 30.0, res["downtime_s"]  # the benchmark is not downtime
    assert w.lock_free()
    serving(w, "new")


def test_a_benchmarks_long_error_is_cut_to_600_characters_and_the_live_table_says_bench(world, handlers):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import progress

    def long_error():
        raise RuntimeError("x" * 2000)

    m, _ = benching(world, long_error)
    m.progress = progress.Reporter(None, clock=world.host.clock)
    phases = []
    real_phase = m.progress.phase
    m.progress.phase = lambda name: (phases.append(name), real_phase(name))[1]
    res = restart.restart(m)
    assert res["outcome"] == REST and res["bench"] is None
    assert res["bench_error"] == f"the benchmark could not run: RuntimeError('{'x' * 2000}')"[:600]
    assert phases[-1] == outcomes.BENCH


def test_a_benchmark_that_cannot_run_leaves_the_restart_standing_with_the_cause(world, handlers):
    def reset():
        raise ConnectionResetError(104, "Connection reset by peer")

    m, calls = benching(world, reset)
    res = restart.restart(m)
    assert res["outcome"] == REST and len(calls) == 1
    assert res["bench"] is None
    assert res["bench_error"] == "the benchmark could not run: ConnectionResetError(104, 'Connection reset by peer')"
    assert world.lock_free()
    serving(world, "new")


def test_a_sigterm_during_the_benchmark_is_restarted_with_a_note(world, handlers):
    m, _ = benching(world, world.host.sigterm)
    res = restart.restart(m)
    assert res["outcome"] == REST and res["bench"] is None
    assert res["bench_error"] == bench.INTERRUPTED  # the driver measures it again in a re-run
    assert res["note"].startswith("after the outcome: ")
    assert world.lock_free()
    serving(world, "new")


def test_no_benchmark_after_a_failed_restart_nor_in_check_mode(world, handlers):
    world.host.behave("new", crash_at_start=True)
    m, calls = benching(world)
    res = restart.restart(m)
    assert res["outcome"] == R and calls == [] and "bench" not in res
    m, calls = benching(world)
    m.s.check_mode = True
    res = restart.restart(m)
    assert res["outcome"] == outcomes.WOULD_RESTART and calls == [] and "bench" not in res


def rank_start_sees_it_die(w, show) -> None:
    """Rank 1's start phase, the unit as `show` has it: it fails there on the draft model's OOM, and is contained."""
    w.host.show = show
    m = w.machine(phase="start", ready_timeout=20.0)
    m.ports.show = show
    calls = len(w.host.calls)
    res = restart.restart(m)
    assert res["outcome"] == N and res["failure"]["phase"] == "start", res
    assert "out of memory while loading draft model weights" in res["failure"]["cause"]
    stops = [c for c in w.host.calls[calls:] if c[:2] == ("systemctl", "stop")]
    assert len(stops) == 1  # contained once, by this phase
    assert [b["failure"]["phase"] for b in w.host.bundles] == ["start"]  # its evidence, before the stop
    stopped(w)


def test_a_rank_above_0_slow_to_get_going_is_judged_from_its_first_line_not_from_its_start(tmp_path, handlers):
    """Rank 1 (no HTTP to ask) is up once its process runs its own code and still runs 2 s on. Its Python takes 3 s
    to write a first line (a busy host) and it dies 0.5 s after: counted from the unit's start it would have passed
    the 2 s before it died; counted from its first line, the start phase sees it die. The ExecStartPre gate's line,
    in the same invocation's journal from the unit's start, is not the process's own (CI, 2026-12-01: a crashing
    rank 1 was reported started, then restarted, its crash looping)."""
    w = build(tmp_path, nnodes=2, node_rank=1)
    restart.restart(w.machine(phase="stop"))
    show, h = w.host.show, w.host
    seen: dict[str, float] = {}

    def slow_show(unit_name):
        props = show(unit_name)
        u = h.unit
        if u.active == "active" and u.invocation not in seen:
            seen[u.invocation] = h.t
            h.journals[u.invocation][:] = [GATE_LINE, f"{UNIT}: {PRE_EXEC_LINE}"]  # none of its own yet
        t0 = seen.get(u.invocation)
        own = [x for x in h.journals[u.invocation] if not x.startswith((f"{UNIT}: ", GATE_LINE))]
        if t0 is not None and not own and h.t - t0 >= 3.0:
            h.journals[u.invocation].append("server_args=ServerArgs(...)")
            seen[u.invocation + "/line"] = h.t
        line_at = seen.get(u.invocation + "/line")
        if line_at is not None and u.active == "active" and h.t - line_at >= 0.5:
            h.crash(["RuntimeError: CUDA error: out of memory while loading draft model weights"])
            return show(unit_name)
        return props

    rank_start_sees_it_die(w, slow_show)


def test_a_rank_above_0_restarted_between_two_polls_is_judged_on_its_new_process(tmp_path, handlers):
    """Rank 1's first process writes its line, dies 1.5 s on, and a new one (another invocation and pid) is already
    running at the next poll: its 2 s start over from its own line. It dies 1 s after that line: counted from the
    first process's line it would have passed at 2 s; counted from its own, the start phase sees it die."""
    w = build(tmp_path, nnodes=2, node_rank=1)
    restart.restart(w.machine(phase="stop"))
    show, h = w.host.show, w.host
    lines: dict[str, float] = {}

    def flaky_show(unit_name):
        u = h.unit
        if u.active == "active" and u.invocation not in lines:
            lines[u.invocation] = h.t  # its line (the fake's launch wrote it) seen now
        born = lines.get(u.invocation)
        if born is not None and u.active == "active":
            if len(lines) == 1 and h.t - born >= 1.5:
                h.crash(["RuntimeError: CUDA error: an illegal memory access was encountered"])
                h.launch()  # Restart=on-failure, between two polls: active again, another process
            elif len(lines) == 2 and h.t - born >= 1.0:
                h.crash(["RuntimeError: CUDA error: out of memory while loading draft model weights"])
        return show(unit_name)

    rank_start_sees_it_die(w, flaky_show)


def test_a_rank_above_0_whose_journal_cannot_be_read_yet_is_asked_again(tmp_path, handlers):
    """journalctl timing out (a busy host) is not yet a line of its own: the next poll asks again, and the rank is
    started 2 s after the first answer that shows one."""
    w = build(tmp_path, nnodes=2, node_rank=1)
    restart.restart(w.machine(phase="stop"))
    m = w.machine(phase="start", ready_timeout=20.0)
    real, failures = m.ports.journal_since, iter(range(3))

    def slow_journal(invocation, cursor=None, lines=2000, pid=None):
        if pid is not None and next(failures, None) is not None:
            raise subprocess.TimeoutExpired(["journalctl"], 10)
        return real(invocation, cursor, lines, pid=pid)

    m.ports = replace(m.ports, journal_since=slow_journal)
    res = restart.restart(m)
    assert res["outcome"] == outcomes.STARTED, res
    assert next(failures, None) is None, "every timed-out read was retried"
    assert res["phases"][-1]["detail"]["running_after_s"] >= 2.0


def test_journal_since_asks_journalctl_for_one_invocation_and_with_pid_one_process(monkeypatch):
    seen: list[list[str]] = []

    def run(args, **kw):
        seen.append(args)
        return subprocess.CompletedProcess(args, 0, "server_args=ServerArgs(...)\n-- cursor: s=abc\n", "")

    monkeypatch.setattr(unit.subprocess, "run", run)
    assert unit.journal_since("inv1", None, 3, pid=4242) == (["server_args=ServerArgs(...)"], "s=abc")
    assert unit.journal_since("inv1", "s=abc") == (["server_args=ServerArgs(...)"], "s=abc")
    first, second = seen
    assert "_SYSTEMD_INVOCATION_ID=inv1" in first and "_PID=4242" in first and first[-2:] == ["-n", "3"]
    assert not any(a.startswith("_PID=") for a in second) and "--after-cursor=s=abc" in second


# ---------------------------------------------------------------------------- another instance on the same GPUs (#29)


def on_gpus(pid: int, unit: str | None, gpus=(0, 1)) -> list[dict]:
    """nvidia-smi's rows of one process of the service user holding `gpus`, described as procinfo would (its unit)."""
    return [
        {
            "gpu": g,
            "pid": pid,
            "used_mib": 60000,
            "user": "sglang",
            "unit": unit,
            "cmdline": "python -m sglang.launch_server",
        }
        for g in gpus
    ]


@pytest.fixture
def kills(monkeypatch):
    """gpu.terminate on the fake host: each pid it is given leaves the GPUs (SIGTERM); the pids, in order."""
    killed: list[int] = []

    def attach(host: Host) -> list[int]:
        def terminate(pids, grace, interval):
            killed.extend(pids)
            host.others = [p for p in host.others if p["pid"] not in pids]
            return {pid: "SIGTERM" for pid in pids}

        monkeypatch.setattr(gpu, "terminate", terminate)
        return killed

    return attach


@pytest.mark.parametrize("policy", ["own", "none"])
def test_another_instances_unit_on_the_gpus_is_refused_before_anything_is_stopped(tmp_path, kills, policy):
    """Issue #29: every instance runs as the service user; another unit's process is never "own"."""
    w = build(tmp_path, stop_policy=policy)
    killed = kills(w.host)
    w.host.others = on_gpus(52001, "sglang-main.service", gpus=(0, 1, 2)) + on_gpus(52002, "sglang-main.service")
    res = restart.restart(w.machine())
    assert res["outcome"] == outcomes.GPUS_NOT_CLEAN and res["failure"]["phase"] == outcomes.PREFLIGHT
    cause = res["failure"]["cause"]
    assert cause.startswith(
        "GPUs [0, 1] are held by another unit: sglang-main.service (sglang instance main): pids 52001, 52002 on GPUs [0, 1]."
    ), cause
    assert "Nothing was stopped." in cause and res["downtime_s"] == 0.0
    assert killed == [] and len(w.host.others) == 5
    untouched(w)


def test_a_stranger_on_the_gpus_is_refused_naming_it_and_nothing_else(world, handlers):
    world.host.foreign = True
    res = restart.restart(world.machine())
    f = res["failure"]
    assert res["outcome"] == outcomes.GPUS_NOT_CLEAN and f["phase"] == "preflight"
    assert [(o["pid"], o["user"]) for o in f["offenders"]] == [(999999, "alice")]  # not the unit's own server
    assert f["cause"].startswith("GPUs held by processes outside this service: ") and "another unit" not in f["cause"]
    assert f["cause"].endswith(". Nothing was stopped. Stop them, or rerun with stop policy 'force'.")
    untouched(world)


def test_a_unit_not_named_as_an_instance_is_named_as_it_is(tmp_path, kills):
    w = build(tmp_path)
    kills(w.host)
    w.host.others = on_gpus(52001, "jupyter.service", gpus=(1,))
    res = restart.restart(w.machine())
    assert res["outcome"] == outcomes.GPUS_NOT_CLEAN
    assert res["failure"]["cause"].startswith("GPUs [0, 1] are held by another unit: jupyter.service: pids 52001 on")
    untouched(w)


def test_force_still_stops_another_instances_unit_and_says_whose_it_was(tmp_path, kills, handlers):
    w = build(tmp_path, stop_policy="force")
    killed = kills(w.host)
    w.host.others = on_gpus(52001, "sglang-main.service")
    res = restart.restart(w.machine())
    assert res["outcome"] == REST, res.get("failure")
    pre = next(p for p in res["phases"] if p["phase"] == outcomes.PREFLIGHT)
    assert pre["detail"]["note"] == (
        "GPUs [0, 1] are held by another unit: sglang-main.service (sglang instance main): pids 52001 on GPUs [0, 1]; "
        "stop policy 'force' stops them"
    )
    gpus = next(p for p in res["phases"] if p["phase"] == outcomes.GPUS)
    assert killed == [52001] and gpus["detail"]["stopped"] == {52001: "SIGTERM"}
    assert gpus["detail"]["stopped_processes"] == [
        {
            "pid": 52001,
            "user": "sglang",
            "unit": "sglang-main.service",
            "gpus": [0, 1],
            "command": "python -m sglang.launch_server",
            "how": "SIGTERM",
        }
    ]


def test_the_processes_a_restart_stopped_are_gathered_with_the_phase_that_stopped_them(tmp_path, kills, handlers):
    w = build(tmp_path, stop_policy="force")
    kills(w.host)
    w.host.others = on_gpus(52001, "sglang-main.service")
    res = restart.restart(w.machine())
    assert res["outcome"] == REST, res.get("failure")
    gpus = next(p for p in res["phases"] if p["phase"] == outcomes.GPUS)
    assert Machine.stopped_in(res) == [{**p, "phase": "gpus"} for p in gpus["detail"]["stopped_processes"]]
    assert [p["pid"] for p in Machine.stopped_in(res)] == [52001]
    # a rollback's own GPU wait, labelled as the rollback logs it; a phase whose detail is text is passed over
    res["rollback"] = {"phases": [{"phase": "rollback-gpus", "detail": {"stopped_processes": [{"pid": 7}]}}]}
    res["phases"].append({"phase": "verify", "detail": "accept length 1.0"})
    assert [(p["pid"], p["phase"]) for p in Machine.stopped_in(res)] == [(52001, "gpus"), (7, "rollback-gpus")]


@pytest.mark.parametrize("unit", [None, "session-4.scope", UNIT], ids=["no-unit", "login-session", "this-unit"])
def test_own_stops_the_service_users_strays_no_unit_owns_and_this_units_own(tmp_path, kills, handlers, unit):
    """A stray of the service user outside any unit (or in a login shell's scope), or a leftover of this very unit:
    the preflight lets it through, the GPU wait after the stop stops it."""
    w = build(tmp_path)
    killed = kills(w.host)
    w.host.others = on_gpus(52001, unit, gpus=(1,))
    res = restart.restart(w.machine())
    assert res["outcome"] == REST, res.get("failure")
    gpus = next(p for p in res["phases"] if p["phase"] == outcomes.GPUS)
    assert killed == [52001] and [(p["pid"], p["unit"], p["how"]) for p in gpus["detail"]["stopped_processes"]] == [
        (52001, unit, "SIGTERM")
    ]
    serving(w, "new")


def test_another_units_process_showing_up_after_the_preflight_is_never_stopped_by_the_gpu_wait(
    tmp_path, kills, handlers
):
    """Between the preflight and the wait another instance takes the GPUs: policy own waits for it, never kills it."""
    w = build(tmp_path)
    killed = kills(w.host)
    w.host.hook("stop", lambda h: h.others.extend(on_gpus(52001, "sglang-main.service", gpus=(0,))))
    res = restart.restart(w.machine())
    assert res["failure"]["phase"] == outcomes.GPUS and "unit sglang-main.service" in res["failure"]["cause"]
    assert "never stopped" in res["failure"]["cause"]
    assert killed == [] and [p["pid"] for p in w.host.others] == [52001]
    assert res["outcome"] == outcomes.NOT_RECOVERED  # the rollback's wait finds it too: contained, not killed
    stopped(w)


# ---------------------------------------------------------------------------- a multi-node group's lease (#29)

TOKEN = "mn-20270115T080000Z-0000000000000001"


def group(w: World, phase: str, token: str = TOKEN, wall: Callable[[], float] | None = None, **kw) -> dict:
    """One phase of a multi-node restart run on this node, as restart_multinode.yml calls it: its run's token."""
    settings = replace(w.settings, phase=phase, group_token=token, group_lease_s=kw.pop("lease_s", 600.0), **kw)
    ports = w.host.ports() if wall is None else replace(w.host.ports(), wall=wall)
    return restart.restart(Machine(w.inst, settings, ports))


def lease_file(w: World) -> Path:
    return Path(w.host.lock_dir, f"{w.inst.name}.lease")


@pytest.mark.parametrize("rank", [0, 1])
def test_between_a_groups_phases_no_other_operation_gets_the_instance_and_the_record_ends_the_lease(
    tmp_path, rank, handlers
):
    """The bug: each phase is its own module call, so the flock ended with the stop and a deploy, a single restart
    or another controller could come in before the start. Now the stop leaves the run's lease, which refuses them
    (locked, the driver's exit 9) and lets the same run's start, confirm and record in; the record removes it."""
    w = build(tmp_path, nnodes=2, node_rank=rank)
    w.inst.dist_init_addr = "127.0.0.2:5000"
    rank0 = rank0_serving(w.inst.port) if rank == 1 else None
    try:
        stop = group(w, "stop")
        assert stop["outcome"] == outcomes.STOPPED and stop["group_lease"]["token"] == TOKEN
        assert json.loads(lease_file(w).read_text())["token"] == TOKEN and w.lock_free() is False
        calls = len(w.host.calls)
        single = restart.restart(w.machine())  # a single-node restart of the same instance name
        assert single["outcome"] == outcomes.LOCKED and single["changed"] is False
        assert [p["phase"] for p in single["phases"]] == ["lock"]
        assert "a multi-node restart's group lease (run " + TOKEN in single["failure"]["cause"]
        assert single["lock"]["holder"]["group_lease"]["token"] == TOKEN
        with pytest.raises(lock.Locked, match="group lease"):  # a deploy's sglang_stage takes the same lock
            InstanceLock("m", "deploy m (stage profile new)", "ctl-b", "driver deploy", w.host.lock_dir).acquire()
        theirs = group(w, "stop", token="mn-another-controllers-run", controller="ctl-b")
        assert theirs["outcome"] == outcomes.LOCKED and "from controller ctl-a" in theirs["failure"]["cause"]
        assert len(w.host.calls) == calls, "none of them touched anything"
        stopped(w)
        assert w.pending() == ["m.env", UNIT], "nothing staged in between"
        assert group(w, "start")["outcome"] == outcomes.STARTED
        assert group(w, "confirm")["outcome"] == outcomes.VERIFIED
        assert lease_file(w).exists()
        record = group(w, "record")
        assert record["outcome"] == REST and record["group_lease"] == {"token": TOKEN, "ended": True}
        assert not lease_file(w).exists() and w.lock_free()
        serving(w, "new")
    finally:
        if rank0 is not None:
            rank0.shutdown()


def test_a_groups_phase_renews_the_lease_for_the_gap_to_the_next(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    now = [1_800_000_000.0]
    stop = group(w, "stop", wall=lambda: now[0], lease_s=300)
    assert stop["group_lease"]["expires"] == now[0] + 300
    now[0] += 250
    start = group(w, "start", wall=lambda: now[0], lease_s=300)
    assert start["outcome"] == outcomes.STARTED and start["group_lease"]["expires"] == now[0] + 300


def test_a_failed_group_keeps_its_lease_until_its_rollback_ends_it(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    group(w, "stop")
    w.host.behave("new", crash_at_start=True)
    start = group(w, "start")
    assert start["outcome"] == N and start["group_lease"]["token"] == TOKEN, "contained here, not the group's end"
    assert restart.restart(w.machine())["outcome"] == outcomes.LOCKED, "still nobody else before the rollback"
    assert group(w, "rollback_stop")["outcome"] == outcomes.STOPPED and lease_file(w).exists()
    assert group(w, "rollback_start")["outcome"] == outcomes.STARTED and lease_file(w).exists()
    done = group(w, "rollback_confirm")
    assert done["outcome"] == R and done["group_lease"] == {"token": TOKEN, "ended": True}
    assert not lease_file(w).exists() and w.lock_free()
    serving(w, "good")


def test_a_group_contained_at_its_rollbacks_end_removes_its_lease(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    group(w, "stop")
    group(w, "rollback_stop")
    res = group(w, "rollback_confirm", group_ok=False, group_why="rank 1 on b failed")
    assert res["outcome"] == N and res["group_lease"]["ended"] is True
    assert not lease_file(w).exists() and w.lock_free()
    stopped(w)


def test_a_record_that_fails_still_ends_the_lease_and_leaves_the_rank_serving(tmp_path, handlers):
    """Every rank was confirmed before the record: a rank whose record cannot be made serves on, not recorded (a
    rank stopped here would take the group down with no rollback of the others)."""
    w = build(tmp_path, nnodes=2, node_rank=0)
    group(w, "stop")
    group(w, "start")
    Path(w.machine().started_path).unlink()  # what the start phase saved is gone: the record cannot load it
    res = group(w, "record")
    assert res["outcome"] == REST and res["known_good"]["recorded"] is False
    assert "FileNotFoundError" in res["known_good"]["why"] and "not recorded as known-good" in res["msg"]
    assert res["group_lease"]["ended"] is True and not lease_file(w).exists() and w.lock_free()
    serving(w, "new")


def test_an_expired_lease_lets_others_in_and_the_group_goes_no_further_until_its_rollback(tmp_path, handlers):
    """A controller that died mid-group blocks the instance for the lease's lifetime, no longer. Its run, were it
    to come back, does not go forward after that: somebody may have come in; its rollback takes the lease again."""
    w = build(tmp_path, nnodes=2, node_rank=0)
    now = [1_800_000_000.0]
    group(w, "stop", wall=lambda: now[0], lease_s=60)
    now[0] += 61
    single = restart.restart(Machine(w.inst, w.settings, replace(w.host.ports(), wall=lambda: now[0])))
    assert single["outcome"] == REST
    lock_phase = single["phases"][0]
    assert "expired at 2027-01-15T08:01:00Z, 1 s ago" in lock_phase["detail"]["holder"]["ignored_lease"]
    serving(w, "new")
    calls = len(w.host.calls)
    late = group(w, "start", wall=lambda: now[0], lease_s=60)
    assert late["outcome"] == outcomes.LOCKED and late["changed"] is False
    assert "lease on this node expired at 2027-01-15T08:01:00Z, 1 s before this phase" in late["failure"]["cause"]
    assert len(w.host.calls) == calls and "group_lease" not in late
    serving(w, "new")
    assert group(w, "rollback_stop", wall=lambda: now[0])["outcome"] == outcomes.STOPPED  # the lease taken anew
    assert json.loads(lease_file(w).read_text())["expires"] == now[0] + 600


def test_check_mode_reads_the_lease_and_writes_none(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    dry = group(w, "stop", check_mode=True)
    assert dry["outcome"] == outcomes.WOULD_RESTART and "group_lease" not in dry and not lease_file(w).exists()
    group(w, "stop")
    theirs = group(w, "stop", token="mn-another-controllers-run", check_mode=True)
    assert theirs["outcome"] == outcomes.LOCKED


def test_a_single_node_restart_given_a_token_takes_no_lease(tmp_path, handlers):
    w = build(tmp_path)
    res = group(w, "all")
    assert res["outcome"] == REST and "group_lease" not in res and not lease_file(w).exists()


def test_status_names_a_groups_lease(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    group(w, "stop")
    st = operate.status(w.machine())
    assert st["lock"]["group_lease"]["token"] == TOKEN and st["lock"]["group_lease"]["expired"] is False
    assert st["lock"]["controller"] == "ctl-a"


# ---------------------------------------------------------------------- the unit's boot guard (sglang_deploy.boot)


def test_the_unverified_window_is_marked_from_promote_to_the_record_for_the_boot_guard(tmp_path, handlers):
    w = build(tmp_path)
    m = w.machine()
    marker = Path(m.unverified_dir, "m")
    seen = {}
    w.host.hook("start", lambda h: seen.update(marked=marker.exists(), live=w.live()))
    res = restart.restart(m)
    assert res["outcome"] == REST
    assert seen == {"marked": True, "live": w.files["new"]}  # the start the restart makes is let through
    assert not marker.exists()  # recorded: the window is over
    # A boot now: the guard finds the recorded generation on disk and lets it start.
    status, said = boot.check("m", w.inst.state_dir, reload=lambda: pytest.fail("nothing to reload"),
                              directory=m.unverified_dir)  # fmt: skip
    assert status == boot.GO and "is known-good generation" in said


def test_a_rolled_back_restart_ends_its_unverified_window_too(tmp_path, handlers):
    w = build(tmp_path)
    w.host.behave("new", accept=1.0)
    m = w.machine()
    res = restart.restart(m)
    assert res["outcome"] == outcomes.ROLLED_BACK
    assert not Path(m.unverified_dir, "m").exists()


def test_a_restart_refused_by_the_lock_leaves_the_holders_unverified_window_marked(world, handlers):
    other: dict = {}

    def during_start(h):
        other["res"] = restart.restart(Machine(world.inst, replace(world.settings, controller="ctl-b"), h.ports()))
        other["marked"] = Path(world.machine().unverified_dir, "m").exists()

    world.host.hook("start", during_start)
    assert restart.restart(world.machine())["outcome"] == REST
    assert other["res"]["outcome"] == outcomes.LOCKED and other["marked"]  # the refused run did not unmark it


def test_a_restart_cut_short_after_promote_leaves_the_mark_and_a_boot_puts_the_known_good_files_back(
    tmp_path, handlers
):
    w = build(tmp_path)
    m = w.machine()
    phases.promote(m)  # then the host goes down: the worker's defined ending never runs
    assert w.live() == w.files["new"] and Path(m.unverified_dir, "m").exists()
    reloads = []
    put_back = boot.beside(m.ports.lock_dir, boot.PUT_BACK_DIR)  # never this machine's /run/sglang-deploy
    # Still this boot (the mark is there): a start is the restart's own, nothing put back.
    assert boot.check("m", w.inst.state_dir, reloads.append, m.unverified_dir, put_back)[0] == boot.GO
    Path(m.unverified_dir, "m").unlink()  # what a boot does to /run
    status, said = boot.check(
        "m", w.inst.state_dir, lambda: reloads.append("daemon-reload"), m.unverified_dir, put_back
    )
    assert status == boot.PUT_BACK and reloads == ["daemon-reload"]
    assert w.live() == w.files["good"]
    assert "never verified" in said and Store(w.inst).latest()["generation"] in said
    failed = Path(w.inst.kg_dir, known_good.FAILED_DIR)
    assert {p.name: p.read_text() for p in failed.iterdir()} == {Path(k).name: v for k, v in w.files["new"].items()}
    # Restart=on-failure's next start: the known-good files, let through.
    assert (
        boot.check("m", w.inst.state_dir, lambda: pytest.fail("reloaded twice"), m.unverified_dir, put_back)[0]
        == boot.GO
    )
    assert boot.put_backs("m", put_back)["count"] == 1  # the refused start, for verify to allow
    # The next deploy stages the new configuration again, and its restart proceeds.
    stage_as_deploy(w.inst, w.files["new"])
    assert restart.restart(w.machine())["outcome"] == REST


def test_a_mark_a_killed_run_left_is_ended_by_the_next_run_that_holds_the_lock(tmp_path, handlers):
    w = build(tmp_path)
    m = w.machine()
    phases.promote(m)  # the worker SIGKILLed here, no boot: the mark stays, the unverified files live
    marker = Path(m.unverified_dir, "m")
    assert marker.exists()
    res = operate.rollback(w.machine("rollback"))  # the operator's rollback, under the lock
    assert res["outcome"] == outcomes.ROLLED_BACK and not marker.exists()
    boot.mark("m", m.unverified_dir)  # another killed run's
    assert restart.restart(w.machine(check_mode=True))["outcome"] == outcomes.WOULD_RESTART
    assert marker.exists()  # check mode changes nothing
    # A refusal after the lock ends it too (the guard then holds the next start to the known-good files).
    w.host.foreign = True
    assert restart.restart(w.machine())["outcome"] == outcomes.GPUS_NOT_CLEAN
    assert not marker.exists()


def test_status_names_the_instances_restart_workers_running_ended_uncollected_or_killed(tmp_path, monkeypatch):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import job

    w = build(tmp_path, new=None)
    m = w.machine()
    jobs_dir = boot.beside(m.ports.lock_dir, job.JOBS_DIR)
    journal = tmp_path / "bin"
    journal.mkdir()  # journalctl answering for the scope units: the worker's last lines
    (journal / "journalctl").write_text('#!/bin/sh\nfor a; do u="$a"; done\necho "phase start"; echo "job of $u"\n')
    (journal / "journalctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{journal}:{os.environ['PATH']}")

    def made(name: str, ns: int, pid: int, unit: str | None = None) -> job.Job:
        j = job.Job(os.path.join(jobs_dir, f"{name}-{ns}-{pid}"))
        os.makedirs(j.dir)
        Path(j.pid_file).write_text(str(pid))
        if unit:
            Path(j.unit_file).write_text(unit)
        return j

    running = made("m", 3_000_000_000, os.getpid(), "sglang-deploy-job-m-3000000000-1.scope")  # this pid runs
    job.write_json(running.progress, {"seq": 4, "phase": "start", "step": "loading weights"})
    ended = made("m", 1_000_000_000, 999_999_999)
    job.write_json(ended.result, {"ok": False, "res": {"outcome": "rolled_back", "msg": "m: start failed"}})
    lost = made("m", 2_000_000_000, 999_999_999)
    job.write_json(lost.progress, {"seq": 1, "phase": "stop"})
    made("m-2", 1_500_000_000, os.getpid())  # another instance's, whose name begins with this one's
    made("m", 4, 5).remove()  # acknowledged: nothing left
    Path(jobs_dir, "m-5-6").write_text("a file, not a job")  # entries that are no job of new()'s
    os.makedirs(os.path.join(jobs_dir, "m-7-abc"))
    odd = made("m", 2_500_000_000, 999_999_999)  # its files not JSON objects: read as absent, never fatal
    Path(odd.progress).write_text("[1]")
    Path(odd.result).write_text('["not", "a", "result"]')
    out = operate.status(m)
    assert out["errors"] == []
    assert [(j["job"], j["state"]) for j in out["jobs"]] == [
        (ended.dir, "ended"), (lost.dir, "lost"), (odd.dir, "lost"), (running.dir, "running")
    ]  # fmt: skip
    assert out["jobs"][0]["outcome"] == "rolled_back" and out["jobs"][0]["journal"] == []  # no unit: no journal
    assert out["jobs"][3]["journal"] == ["phase start", "job of sglang-deploy-job-m-3000000000-1.scope"]
    msg = out["msg"]
    assert msg.split("; ") == ["m: active/running, profile good", *(job.describe(j) for j in out["jobs"])]
    assert "a restart's worker ended (pid 999999999), its result never collected: rolled_back: m: start failed" in msg
    assert f"a restart's worker (pid 999999999) was killed during stop, without a result: {lost.dir}" in msg
    assert "a restart's worker runs in sglang-deploy-job-m-3000000000-1.scope: start, loading weights" in msg


def test_operator_rollback_after_a_verified_restart_puts_the_generation_before_it_back(tmp_path, handlers):
    w = build(tmp_path)
    assert restart.restart(w.machine())["outcome"] == REST  # new verified and recorded: the newest generation
    serving(w, "new")
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["rollback"]["to_profile"] == "good", res  # not new again: nothing to undo
    serving(w, "good")
    assert w.live() == w.files["good"] and Store(w.inst).latest()["profile"] == "good"  # recorded anew
    # Rolled back once more: the newest not on disk is new's generation (the good one on disk now is skipped).
    assert operate.rollback(w.machine("rollback"))["rollback"]["to_profile"] == "new"


def test_operator_rollback_with_only_the_live_configuration_recorded_is_refused(tmp_path, handlers):
    w = build(tmp_path, new=None)  # one generation: the good files, on disk and running
    res = operate.rollback(w.machine("rollback"))
    gen = Store(w.inst).latest()["generation"]
    assert res["outcome"] == outcomes.REFUSED and res["failure"] == {
        "phase": "restore",
        "cause": f"every known-good generation of m kept in {Store(w.inst).dir} is the configuration on disk now (the "
        f"newest, {gen}, verified): there is no other to roll back to. Nothing was touched.",
    }
    assert w.host.systemctl_calls() == [] and w.lock_free()


def test_operator_rollback_skips_a_damaged_older_generation_and_touches_nothing(tmp_path, handlers):
    w = build(tmp_path)
    assert restart.restart(w.machine())["outcome"] == REST  # generations: good, then new (on disk, serving)
    older = Path(Store(w.inst).records()[0])
    older.write_text(json.dumps({**json.loads(older.read_text()), "files": ["x"]}))  # damaged by hand
    calls = len(w.host.systemctl_calls())
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == outcomes.REFUSED and "there is no other to roll back to" in res["failure"]["cause"]
    assert w.host.systemctl_calls()[calls:] == [] and w.lock_free()  # never stopped nor disabled
    serving(w, "new")


def test_operator_rollback_of_a_contained_instance_starts_the_newest_generation_on_disk(tmp_path, handlers):
    w = build(tmp_path, rollback=False)
    w.host.behave("new", crash_at_start=True)
    assert restart.restart(w.machine())["outcome"] == N  # contained: stopped, the known-good files on disk
    stopped(w)
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["rollback"]["to_profile"] == "good", (res.get("failure"), res.get("contained"))
    serving(w, "good")


def test_operator_rollback_of_a_contained_instance_started_since_by_hand_is_refused(tmp_path, handlers):
    """The containment's note holds only while the unit stays stopped: started by hand, it serves the known-good
    files on disk, and there is no other generation to go back to."""
    w = build(tmp_path, rollback=False)
    w.host.behave("new", crash_at_start=True)
    assert restart.restart(w.machine())["outcome"] == N
    w.host.systemctl("start", UNIT)
    while w.host.show(UNIT)["ActiveState"] != "active":  # the start job runs (the fake's lag: a few reads)
        assert w.host.unit.pending_start, "the start never ran"
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == outcomes.REFUSED and "there is no other to roll back to" in res["failure"]["cause"]
    serving(w, "good")


def test_a_containment_puts_the_known_good_files_back_and_notes_it_for_the_operators_rollback(tmp_path, handlers):
    w = build(tmp_path, rollback=False)
    w.host.behave("new", crash_at_start=True)
    w.host.t = 2000.0
    res = restart.restart(w.machine())
    good = Store(w.inst).latest()
    assert res["outcome"] == N
    assert res["contained"] == {
        "stop": None,
        "files": f"known-good generation {good['generation']} put back, not started",
        "unit_state": f"{w.host.unit.active}/{w.host.unit.sub}",
    }
    note = Path(w.inst.kg_dir, "contained.json")
    assert json.loads(note.read_text())["generation"] == good["generation"] and note.stat().st_mode & 0o777 == 0o600
    assert set(json.loads(note.read_text())) == {"generation", "at"}
    assert w.live() == w.files["good"] and w.host.unit.file_state == "enabled"


def test_a_containment_that_cannot_put_the_files_back_disables_the_unit_and_leaves_no_note(
    tmp_path, monkeypatch, handlers
):
    w = build(tmp_path, rollback=False)
    w.host.behave("new", crash_at_start=True)

    def restore_fails(m):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(phases, "restore", restore_fails)  # the containment's (it imports the phase when it runs)
    res = restart.restart(w.machine())
    assert res["outcome"] == N
    assert res["contained"]["files"] == "failed: OSError: [Errno 30] Read-only file system"
    assert res["contained"]["disable"] == "unit disabled" and w.host.unit.file_state == "disabled"
    assert not Path(w.inst.kg_dir, "contained.json").exists()
    stopped(w)


def test_a_containment_restores_the_callers_sigterm_handler_and_says_unknown_without_systemd(world, handlers):
    world.host.inject("show", "timeout", 0)
    res: dict = {}
    world.machine().contain(res)
    assert signal.getsignal(signal.SIGTERM) is failure.sigterm
    assert res["outcome"] == N and res["contained"]["unit_state"] == "unknown"


def test_operator_rollback_of_a_verified_generation_that_now_crashes_puts_the_one_before_it_back(tmp_path, handlers):
    """The newest generation verified, then crash-loops (no containment stopped it): starting it again would fail
    again, rollback after rollback. The generation before it is wanted."""
    w = build(tmp_path)
    assert restart.restart(w.machine())["outcome"] == REST
    w.host.behave("new", crash_at_start=True)
    server = w.host.unit.server
    w.host.crash(CRASH_AT_START)  # Restart=on-failure: activating/auto-restart, new's files on disk
    server.close()  # the dead server's port is free again
    check = operate.rollback(w.machine("rollback", check_mode=True))
    assert check["outcome"] == outcomes.WOULD_ROLL_BACK and check["rollback"]["to_profile"] == "good"
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["rollback"]["to_profile"] == "good", (res.get("failure"), res.get("contained"))
    serving(w, "good")


def test_operator_rollback_to_a_generation_whose_software_is_gone_is_refused_before_anything_is_stopped(
    tmp_path, handlers
):
    w = build(tmp_path)
    assert restart.restart(w.machine())["outcome"] == REST
    calls = len(w.host.systemctl_calls())
    (tmp_path / "venv-good" / "bin" / "python").unlink()  # its software generation removed by hand
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == outcomes.REFUSED and res["changed"] is False and res["failure"]["phase"] == "restore"
    gen = json.loads(Path(Store(w.inst).records()[0]).read_text())["generation"]
    assert res["failure"]["cause"] == (
        f"known-good generation {gen} of m runs {tmp_path}/venv-good/bin/python, which is not on this host (its "
        "software generation was removed?): deploy it again, or restart with the configuration you want. Nothing "
        "was touched."
    )
    assert w.host.systemctl_calls()[calls:] == [] and w.live() == w.files["new"] and w.lock_free()
    serving(w, "new")


def test_operator_rollback_whose_restore_fails_before_writing_is_refused_and_the_unit_still_serves(
    tmp_path, handlers, monkeypatch
):
    w = build(tmp_path)
    assert restart.restart(w.machine())["outcome"] == REST
    calls = len(w.host.systemctl_calls())

    def denied(name, directory=boot.UNVERIFIED_DIR):
        raise PermissionError(13, "Permission denied", directory)

    monkeypatch.setattr(boot, "mark", denied)
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == outcomes.REFUSED and res["failure"]["phase"] == "restore" and res["changed"] is False
    assert "Permission denied" in res["failure"]["cause"] and "contained" not in res
    assert res["rollback"]["outcome"] == "not attempted: nothing was touched"
    assert w.host.systemctl_calls()[calls:] == [] and w.live() == w.files["new"]
    serving(w, "new")


def test_operator_rollback_not_recorded_says_the_next_start_puts_the_newest_back(tmp_path, handlers, monkeypatch):
    w = build(tmp_path)
    assert restart.restart(w.machine())["outcome"] == REST

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Store, "record", full)
    res = operate.rollback(w.machine("rollback"))
    assert res["outcome"] == R and res["known_good"]["recorded"] is False
    assert res["msg"] == (
        f"m: rolled back to generation {res['rollback']['to_generation']} (profile good): serving. Not recorded as "
        "known-good (OSError: [Errno 28] No space left on device): the next start or boot puts the newest recorded "
        "generation back; run rollback again once the cause is fixed."
    )
    serving(w, "good")
    # As said: the guard, at the next start, holds the unit to the newest recorded generation (new).
    status, _ = boot.check("m", w.inst.state_dir, reload=lambda: None, directory=w.machine().unverified_dir)
    assert status == boot.PUT_BACK and w.live() == w.files["new"]


# ---------------------------------------------------------------------------- what mutation testing found unchecked (#31)


def test_operator_rollback_to_a_generation_recorded_without_a_command_line_says_it_runs_no_program(tmp_path, handlers):
    w = build(tmp_path, new=None, known_good=False)
    good = Store(replace(w.inst, argv=w.argv["good"], profile="good"))
    good.record(good.snapshot(), [], {"ok": True, "checks": []})  # no main process's argv was read
    for path, content in w.files["new"].items():  # another configuration on disk: the recorded one is the target
        Path(path).write_text(content)
    res = operate.rollback(w.machine("rollback"))
    gen = Store(w.inst).latest()["generation"]
    assert res["outcome"] == outcomes.REFUSED and res["failure"] == {
        "phase": "restore",
        "cause": f"known-good generation {gen} of m runs no program, which is not on this host (its software "
        "generation was removed?): deploy it again, or restart with the configuration you want. Nothing was touched.",
    }
    assert w.host.systemctl_calls() == [] and w.lock_free()


def phase_call(w: World, configured: Instance, phase: str, **kw) -> dict:
    """One phase of a multi-node group on this node as its own module call: the instance built afresh from the
    play's parameters (`configured`: the new profile), not the one an earlier phase's rollback changed."""
    return restart.restart(Machine(replace(configured), replace(w.settings, phase=phase, **kw), w.host.ports()))


def test_a_groups_last_rollback_phase_names_the_known_good_profile_not_the_configured_one(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    configured = replace(w.inst)
    for phase in ("stop", "start", "rollback_stop", "rollback_start"):
        phase_call(w, configured, phase)
    done = phase_call(w, configured, "rollback_confirm")
    assert (done["outcome"], done["profile"], done["rollback"]["to_profile"]) == (R, "good", "good")
    serving(w, "good")


def test_a_groups_rollback_stop_whose_gpu_wait_fails_is_contained_with_the_known_good_files_back(tmp_path, handlers):
    """The new configuration ran here; the rollback's GPU wait fails: the unit stays stopped and the known-good files
    go back on disk, not started (a boot starts them), as the containment says."""
    w = build(tmp_path, nnodes=2, node_rank=0)
    restart.restart(w.machine(phase="stop"))
    restart.restart(w.machine(phase="start"))
    serving(w, "new")
    w.host.inject("wait_clean", "dirty", 0)
    res = restart.restart(w.machine(phase="rollback_stop"))
    good = Store(w.inst).latest()
    assert res["outcome"] == N and res["failure"]["phase"] == "gpus"
    assert res["contained"] == {
        "stop": None,
        "files": f"known-good generation {good['generation']} put back, not started",
        "unit_state": "inactive/dead",
    }
    assert res["msg"].endswith(
        f"; {UNIT} is stopped (inactive/dead). known-good generation {good['generation']} put back, not started."
    )
    assert len(w.host.systemctl_calls("stop")) == 3  # the group's stop, the rollback's, the containment's: once each
    stopped(w)
    assert w.live() == w.files["good"]


def test_a_groups_last_phase_after_a_rollback_stop_failed_elsewhere_puts_the_known_good_files_back(tmp_path, handlers):
    """Another node's rollback stop failed: restart.yml skips the group's rollback start and runs its last phase,
    which contains this node, stopped with the new files still on disk: the known-good ones go back."""
    w = build(tmp_path, nnodes=2, node_rank=0)
    for phase in ("stop", "start", "rollback_stop"):
        restart.restart(w.machine(phase=phase))
    assert w.live() == w.files["new"]
    res = restart.restart(w.machine(phase="rollback_confirm", group_ok=False, group_why="rank 1 on b failed"))
    good = Store(w.inst).latest()
    assert res["outcome"] == N and res["rollback"]["why"] == "the group's rollback failed: rank 1 on b failed"
    assert res["contained"] == {
        "stop": None,
        "files": f"known-good generation {good['generation']} put back, not started",
        "unit_state": "inactive/dead",
    }
    assert len(w.host.systemctl_calls("stop")) == 3  # the group's stop, the rollback's, the containment's: once each
    stopped(w)
    assert w.live() == w.files["good"]


def deadlines(monkeypatch) -> list[tuple[str, float | None]]:
    """Each HTTP request the module sends: its URL and the timeout its connection is given (None: none)."""
    seen: list[tuple[str, float | None]] = []
    real = http.OPENER.open

    def opened(req, data=None, timeout=socket._GLOBAL_DEFAULT_TIMEOUT):
        seen.append((req.full_url, timeout))
        return real(req, data, timeout)

    monkeypatch.setattr(http.OPENER, "open", opened)
    return seen


def test_status_gives_the_server_5_s_to_answer_health_and_server_info(tmp_path, monkeypatch):
    """A server that hangs must not hang status (no deadline), nor a loaded one be called unhealthy after the
    client's 2 s default, nor /server_info hold it for the client's 30 s."""
    w = build(tmp_path, new=None)
    w.host.unit.server.b = Behaviour(server_info="no_states", accept=3.25)  # the accept length from /metrics too
    seen = deadlines(monkeypatch)
    out = operate.status(w.machine())
    assert (out["health"], out["accept_length"], out["errors"]) == (True, 3.25, [])
    base = w.inst.base
    assert seen == [(f"{base}/health", 5), (f"{base}/server_info", 5), (f"{base}/metrics", 10)]


def test_a_rank_above_0_gives_rank_0_10_s_to_answer_health(tmp_path, monkeypatch, handlers):
    w = build(tmp_path, nnodes=2, node_rank=1)
    seen = deadlines(monkeypatch)
    res, _ = confirmed_after(w, lambda h: None)
    assert res["outcome"] == outcomes.VERIFIED, res.get("failure")
    assert seen == [(f"http://127.0.0.2:{w.inst.port}/health", 10)]


def test_a_reporting_start_shows_the_servers_newest_journal_line(world, handlers):
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import progress

    m = world.machine()
    path = world.tmp / "progress.json"
    m.progress = progress.Reporter(str(path), clock=world.host.clock)
    res = restart.restart(m)
    assert res["outcome"] == REST, res.get("failure")
    assert json.loads(path.read_text())["last_line"] == "server_args=ServerArgs(...)"  # its own, not systemd's


def test_a_reporting_rank_above_0_reads_its_journal_once_more_when_its_start_ends(tmp_path, monkeypatch, handlers):
    """Rank 1's start ends 2 s after its process's first line, whenever the journal was last read: what the rank
    logged since (here its weights loading) is read then, the step and line the controller is shown."""
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import progress

    monkeypatch.setattr(machine.LoadFollower, "READ_S", 60.0)  # reads rarer than the 2 s: the first, then the last
    w = build(tmp_path, nnodes=2, node_rank=1)
    restart.restart(w.machine(phase="stop"))
    h, show = w.host, w.host.show
    line = "[2026-12-02 10:00:00 TP1] Load weight begin. avail mem=139.50 GB"
    polls = []

    def loading_show(unit_name):
        props = show(unit_name)
        if h.unit.active == "active":
            polls.append(h.t)
            if len(polls) == 5:  # 0.4 s after its first line
                h.journals[h.unit.invocation].append(line)
        return props

    m = w.machine(phase="start")
    m.ports.show = loading_show
    m.progress = progress.Reporter(None, clock=h.clock)
    res = restart.restart(m)
    assert res["outcome"] == outcomes.STARTED, res.get("failure")
    d = m.progress.doc
    assert (d["phase"], d["step"], d["detail"], d["last_line"]) == ("start", progress.WEIGHTS, "", line)


def test_a_rank_above_0_is_judged_on_its_journal_as_journalctl_answers(tmp_path, monkeypatch, handlers):
    """The start reads the rank's own lines through unit.journal_since, here from a journalctl that answers as
    journalctl does: one invocation's lines (one process's with _PID=), the last -n of them, the cursor of the
    last one with --show-cursor, and a cursor it never gave refused ("Failed to seek to cursor", exit 1)."""
    w = build(tmp_path, nnodes=2, node_rank=1)
    restart.restart(w.machine(phase="stop"))
    h, run, refused = w.host, subprocess.run, []

    def journalctl(args, **kw):
        if args[0] != "journalctl":
            return run(args, **kw)
        fields = dict(a.split("=", 1) for a in args if a.startswith("_"))
        inv = fields["_SYSTEMD_INVOCATION_ID"]
        entries = list(enumerate(h.journals[inv]))
        if "_PID" in fields:  # the main process's own: systemd's line from it before its exec too, not the gate's
            entries = [(i, x) for i, x in entries if x != GATE_LINE and int(fields["_PID"]) == h.unit.pid]
        after = next((a.split("=", 1)[1] for a in args if a.startswith("--after-cursor=")), None)
        if after is not None:
            if not after.startswith(f"s={inv};i="):
                refused.append(after)
                return subprocess.CompletedProcess(args, 1, "", "Failed to seek to cursor: Invalid argument\n")
            entries = [(i, x) for i, x in entries if i > int(after.rsplit("=", 1)[1])]
        elif "-n" in args:
            entries = entries[-int(args[args.index("-n") + 1]) :]
        out = [x for _, x in entries]
        if entries and "--show-cursor" in args:
            out.append(f"-- cursor: s={inv};i={entries[-1][0]}")
        return subprocess.CompletedProcess(args, 0, "".join(x + "\n" for x in out), "")

    monkeypatch.setattr(unit.subprocess, "run", journalctl)
    m = w.machine(phase="start")
    m.ports = replace(m.ports, journal_since=unit.journal_since)
    res = restart.restart(m)
    assert res["outcome"] == outcomes.STARTED, res.get("failure")
    assert res["phases"][-1]["detail"]["running_after_s"] >= 2.0 and refused == []


def test_the_start_asks_a_loading_server_for_health_every_tenth_of_a_second(tmp_path, handlers):
    """While the main process runs, the wait on it (0.1 s) is the poll's interval: a server loading for the whole
    1 s ready timeout is asked ten times, not five (a wait, then a sleep, each poll)."""
    w = build(tmp_path, rollback=False, ready_timeout=1.0)
    w.host.behave("new", health=503)
    res = restart.restart(w.machine())
    assert res["failure"]["phase"] == "start" and res["failure"]["cause"].startswith(f"{UNIT} not ready after 1s")
    (loading,) = [s for s in SERVERS if s.b.health == 503]
    assert loading.requests.count("/health") == 10


def test_a_systemctl_that_fails_saying_nothing_is_reported_without_adding_words(world, handlers):
    real = world.host.systemctl

    def mute_enable(*args, timeout=None):
        if args[0] == "enable":  # exit status 1, nothing on stderr
            return subprocess.CompletedProcess(["systemctl", *args], 1, "", "")
        return real(*args, timeout=timeout)

    world.host.systemctl = mute_enable
    res = restart.restart(world.machine())
    assert res["outcome"] == REST and res["known_good"]["enabled"] is False
    assert res["known_good"]["enable_error"] == f"UnitError: systemctl enable {UNIT} failed: "


def test_the_gpu_wait_says_how_long_it_waited_to_the_millisecond(world, handlers):
    """The driver frees the stopped server's memory 0.25 s after the stop (no process listed meanwhile): the wait
    polls every 0.1 s and finds the GPUs clean at its fourth poll, 0.3 s on."""
    h, real, freed = world.host, world.host.gpus, []
    h.hook("stop", lambda h: freed.append(h.t + 0.25))
    h.gpus = lambda dirty=False: real(dirty=dirty or (bool(freed) and h.t < freed[0]))
    res = restart.restart(world.machine())
    assert res["outcome"] == REST, res.get("failure")
    gpus = next(p for p in res["phases"] if p["phase"] == outcomes.GPUS)
    assert gpus["detail"] == {"waited_s": 0.3, "polls": 4, "stopped": {}, "stopped_processes": []}


def test_a_server_dying_on_its_first_generation_with_nothing_in_its_journal_is_said_to_have_died(world, handlers):
    world.host.behave("new", generate_fault="crash")
    world.host.journal = lambda unit, invocation=None: []
    res = restart.restart(world.machine())
    f = res["failure"]
    assert f["phase"] == "generate" and f["journal_tail"] == [] and res["outcome"] == R
    assert f["cause"].startswith(f"the server died on its first generation ({world.inst.base}/generate: "), f
    assert f["cause"].endswith(")")


def test_an_operation_refused_by_a_groups_lease_is_told_the_phase_of_the_run_that_holds_it(tmp_path, handlers):
    w = build(tmp_path, nnodes=2, node_rank=0)
    now = 1_800_000_000.0
    group(w, "stop", wall=lambda: now, lease_s=300)
    group(w, "start", wall=lambda: now, lease_s=300)
    single = restart.restart(Machine(w.inst, w.settings, replace(w.host.ports(), wall=lambda: now)))
    assert single["outcome"] == outcomes.LOCKED
    assert single["lock"]["holder"]["group_lease"] == {
        "token": TOKEN,
        "expires": now + 300,
        "expires_at": "2027-01-15T08:05:00Z",
        "expires_in_s": 300.0,
        "phase": "start",
        "path": str(lease_file(w)),
    }
    assert operate.status(w.machine())["lock"]["group_lease"]["phase"] == "start"


def test_a_rollback_retargets_the_machine_never_the_instance_or_the_settings(world, handlers):
    """The known-good generation a failed restart puts back is the machine's target: it is what the rollback
    verifies (drift judged against it) and records (its profile, its software), while the Instance stays the
    rendered one and the Settings the ones given."""
    world.host.behave("new", crash_at_start=True)
    m = world.machine()
    configured, settings = list(m.inst.argv), replace(m.s)
    res = restart.restart(m)
    assert res["outcome"] == R and res["rollback"]["to_profile"] == "good"
    assert m.inst.argv == configured and m.inst.profile == "new" and m.s == settings
    assert m.target.profile == "good" and m.target.argv == world.argv["good"] and m.target.record is not None
    assert m.running.argv == world.argv["good"] and m.running.name == m.inst.name
    assert m.verified["ok"]  # verified as the known-good one: no drift against the rendered "new"
    summary = {k: res["rollback"][k] for k in ("attempted", "to_generation", "to_profile", "config_hash")}
    assert (
        summary
        == m.target.summary()
        == {
            "attempted": True,
            "to_generation": m.target.record["generation"],
            "to_profile": "good",
            "config_hash": m.target.record["config_hash"],
        }
    )


def test_a_machine_built_for_a_restart_refuses_the_operators_rollback_before_taking_the_lock(world):
    with pytest.raises(ValueError, match="action='rollback'"):
        operate.rollback(world.machine())
    assert world.lock_free() and world.host.systemctl_calls() == []
