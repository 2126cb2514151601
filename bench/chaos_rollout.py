"""Chaos rollouts on a lab of their own: N rollouts under load, each with one fault drawn from a catalogue and
injected at a random moment, the rollout's invariants checked after each (issue #29, docs/rollout.md).

    .venv/bin/python bench/chaos_rollout.py --runs N --seed S [--replicas 3] [--out docs/bench/chaos-rollout.json]

The bench starts its own lab (lab/lab.py, name `sgd-chaos`: --replicas + 1 nodes, 2 simulated GPUs each) and tears it
down at the end, also on errors. lab-node1..N are the replicas, each serving one instance `ro` (the stand-in, port
30010); the real sglang-router (roles/sglang_router, playbooks/router.yml) runs on the last node, in front of them,
with bench/loadgen.py beside it (3 workers, half the requests streamed) sending a steady load through the router
during each rollout. Before it starts a lab it waits (polling every 30 s, at most --wait-max seconds) until
`podman ps` shows at most one other lab's containers: the other labs on this machine run end-to-end tests.

Each run: a new configuration (every replica's env gets LAB_ROLLOUT=<ns>) rolled by `python -m driver rollout --json`
(its ledger: SGLANG_DEPLOY_LEDGER, a file of the bench's), with ONE fault drawn with random.Random(seed); before the
runs, a calibration (run 0): one rollout with no fault, checked the same way (the control, and the first measure of
a whole rollout's time). The catalogue:

    ctrl-c-once     SIGINT to the driver
    ctrl-c-twice    SIGINT, once the driver says it was interrupted, SIGINT again
    sigterm         SIGTERM to the driver
    ssh-blocked     a replica's sshd stopped and its sessions killed for 10-30 s, then started again
    pause           a replica's container paused (podman pause) for 10-30 s
    router-restart  systemctl restart sglang-router.service on the router's node
    metrics-slow    one replica's /metrics made slow or 503 (the stand-in's LAB_STANDIN_METRICS): it serves so when
                    the rollout begins (restarted so before the run, so that its drain reads it) and its new
                    configuration keeps it (the restarted one has it too)
    ip-alias        before the run, one replica re-registered in the router under its IP address (DELETE by id,
                    POST http://<ip>:port), as an operator's curl would
    canary-crash    the canary's new configuration has LAB_STANDIN_FAULT=crash-first-decode
    node-killed     a non-canary replica's container killed (podman kill); brought back after the run (podman start,
                    lab.up for its SSH port, `python -m driver restart --limit <node>`, back into the router)

the timed faults at a random moment: a delay after the driver starts (a drawn fraction, 2-95 %, of a whole
rollout's time on this lab: the median of the bench's runs so far that rolled every replica, 60 s before one did),
or 0-3 s after a drawn replica leaves the router. Every run's draw is made before the lab starts: the seed alone
says which faults, targets and moments. The router's /workers is sampled every 0.2 s during the run (a sampler on
the router's node, read in a thread). After each run, the invariants:

    (1) every replica serving (/health 200 from the router's node) and listed healthy by the router, or reported by
        the driver as out with a reason (its --json document's hosts and rows, its 'left' lines, the last play's
        list); a killed node only out of rotation;
    (2) requests lost (loadgen's failed + truncated) only where the fault allows: node-killed at most those in flight
        when it died (started before the kill, at most the load's concurrency); router-restart those started while
        the router did not answer (its own outage, which no rollout hides) or in flight when it went; every other
        fault 0;
    (3) at most --max-unavailable replicas out of the router or unhealthy at once (+1 where the fault itself takes
        one out: node-killed, pause, ssh-blocked), and at most --max-fail + 1 failed replicas;
    (4) the exit code the fault's table expects (EXPECTED below; router-restart only recorded);
    (5) the ledger's rows of the run complete (exit_code and finished_at set; the rollout's code the process's own).

A violation is reported and the bench goes on; it exits 1 if any run had one (2: the bench itself failed in a run,
or the machine was never quiet enough). Between runs every replica is put back to the baseline configuration (the
driver's restart of those not serving it) and into the router, alone under its name. The driver is killed after
300 s (a violation). Results: --out (JSON: the seed, the command line, per run the fault, its moment, the exit code,
the load with its failures (those while the router itself did not answer counted apart), the router's timeline,
every check, the restore); the driver's ledger stays under /tmp (--ledger DIR to choose), each run's events.jsonl
with it. On this project's 2-core machine the lab's set-up (4 nodes up, deploy.yml on 3, the router) takes 8-16
minutes and a run 1-2.5 minutes with its restore.

To debug the bench: --only FAULT,... draws from part of the catalogue; --keep-lab leaves the lab up at the end and
--reuse-lab takes it again (restored first) instead of setting one up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "lab"), str(REPO)]
import lab as labmod  # noqa: E402  (lab/lab.py: the lab's Lab, up, down)

try:
    from driver.interrupts import FIRST as INTERRUPTED_SAID
except ImportError:  # the driver is being changed: its first interrupt's message starts so
    INTERRUPTED_SAID = "interrupted:"

VENV_BIN = Path(sys.executable).parent
LAB_NAME = "sgd-chaos"
GPUS = 2  # simulated GPUs a node: fewer processes and less memory than the lab's 8
RO = {"name": "ro", "port": 30010, "gpus": [0, 1]}
ROUTER_PORT = 30100
KEY = "lab-chaos-router-key"
ROUTER_VARS = labmod.router_vars(ROUTER_PORT, 29100, KEY)
# The canary gate, loose: tok/s measured on a loaded 2-core machine jitters (as tests/e2e/test_rollout.py).
GATE = json.dumps({"sglang_rollout_canary_threshold": 0.5})
DRIVER_LIMIT_S = 300.0
CONCURRENCY = 3
SAMPLE_S = 0.2
GRACE_S = 30.0  # after the run, how long the router may take to see a replica that serves again (its health check)

FAULTS = (
    "ctrl-c-once",
    "ctrl-c-twice",
    "sigterm",
    "ssh-blocked",
    "pause",
    "router-restart",
    "metrics-slow",
    "ip-alias",
    "canary-crash",
    "node-killed",
)
TIMED = {"ctrl-c-once", "ctrl-c-twice", "sigterm", "ssh-blocked", "pause", "router-restart", "node-killed"}
TAKES_ONE_OUT = {"node-killed", "pause", "ssh-blocked"}  # the fault itself takes a replica out: one more allowed
# Exit codes each fault may end with (invariant 4), when injected. Interrupts: 130, or 6 when a server was left
# down (added at the check); node-killed: 8 (0 allowed too when the node died after its own turn was over: nothing
# of the run was to touch it again); ssh-blocked and pause: 8 when the blip hit an SSH step, else 0; metrics-slow:
# 0, 1 (the drain failed the step) or 3 (refused before anything left the router: its drain cannot be watched);
# router-restart: recorded only (None).
EXPECTED: dict[str, set[int] | None] = {
    "ctrl-c-once": {130},
    "ctrl-c-twice": {130},
    "sigterm": {130},
    "ssh-blocked": {0, 8},
    "pause": {0, 8},
    "router-restart": None,
    "metrics-slow": {0, 1, 3},
    "ip-alias": {0},
    "canary-crash": {5},
    "node-killed": {8},
    "none": {0},  # the calibration: a rollout with no fault
}
# A replica's row that says it ended well (anything else is a reason the driver gave).
GOOD_RESULTS = {"restarted", "unchanged", "staged", None}
INTERRUPTS = {"ctrl-c-once", "ctrl-c-twice", "sigterm"}
# Words of a 'left' line (the driver's stderr after an interruption, or its put-back) that say a replica is out or down.
OUT_WORDS = ("unreachable", "failed", "interrupted", "not_recovered", "stays out", "not serving", "abandoned", "down")


def now() -> float:
    return time.time()  # wall clock: the lab's containers share this kernel's, so their times compare with ours


# ------------------------------------------------------------------------------------------------ processes


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, 124, "", f"timed out after {timeout:g} s")


def pexec(container: str, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return podman("exec", container, *cmd, timeout=timeout)


def descendants(pid: int) -> list[int]:
    """Every process below pid (from /proc), deepest last."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a process this bench started and to everything below it, each by its id."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class Watched:
    """A process in the background (its own session) whose stdout and stderr are read as they come."""

    def __init__(self, argv: list[str], env: dict | None = None):
        self.started = now()
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the bench's own Ctrl-C is not the driver's
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=lambda s=s, into=into: into.extend(iter(s.readline, "")), daemon=True)
            for s, into in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for r in self.readers:
            r.start()
        self.ended: float | None = None
        self.timed_out = False

    def said(self, text: str) -> bool:
        return text in "".join(self.err)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            kill_tree(self.proc)
            code = self.proc.returncode
        self.ended = now()
        for r in self.readers:
            r.join(10)
        return code


# ------------------------------------------------------------------------------------------------ the fleet

ROUTER_API = r"""
import json, sys, urllib.request as u
from concurrent.futures import ThreadPoolExecutor
op = u.build_opener(u.ProxyHandler({}))
base, key, action, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
h = {"Authorization": "Bearer " + key, "Content-Type": "application/json"}
if action == "list":
    print(json.dumps(json.load(op.open(u.Request(base + "/workers", headers=h), timeout=10))["workers"]))
elif action == "add":
    r = op.open(u.Request(base + "/workers", data=json.dumps({"url": args[0]}).encode(), headers=h), timeout=10)
    print(json.dumps(r.status))
elif action == "delete":
    r = op.open(u.Request(base + "/workers/" + args[0], headers=h, method="DELETE"), timeout=10)
    print(json.dumps(r.status))
elif action == "health":
    def one(url):
        try:
            return op.open(url + "/health", timeout=3).status
        except u.HTTPError as e:
            return e.code
        except Exception as e:
            return type(e).__name__
    with ThreadPoolExecutor(len(args)) as pool:
        print(json.dumps(dict(zip(args, pool.map(one, args)))))
"""

SAMPLER = r"""
import json, os, sys, time, urllib.request as u
op = u.build_opener(u.ProxyHandler({}))
base, key, stop, every = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
end = time.time() + 900
while not os.path.exists(stop) and time.time() < end:
    t = time.time()
    try:
        r = op.open(u.Request(base + "/workers", headers={"Authorization": "Bearer " + key}), timeout=1.0)
        ws = [[w.get("url"), bool(w.get("is_healthy")), w.get("id")] for w in json.load(r)["workers"]]
        print(json.dumps({"t": t, "w": ws}), flush=True)
    except Exception as e:
        print(json.dumps({"t": t, "err": (type(e).__name__ + ": " + str(e))[:160]}), flush=True)
    time.sleep(max(0.0, every - (time.time() - t)))
"""


class Fleet:
    """The lab, its replicas and router, their inventories and the bench's ledger."""

    def __init__(self, lab: labmod.Lab, replicas: int, ledger: Path):
        self.lab = lab
        self.replicas = [f"lab-node{i}" for i in range(1, replicas + 1)]
        self.router = f"lab-node{replicas + 1}"
        self.nodes = [*self.replicas, self.router]
        self.containers = {n: f"{lab.name}-node{n.removeprefix('lab-node')}" for n in self.nodes}
        self.ledger = ledger
        self.baseline = lab.state / "chaos-baseline.yml"
        self.ips: dict[str, str] = {}

    @staticmethod
    def url(node: str) -> str:
        return f"http://{node}:{RO['port']}"

    def write_inventory(self, name: str, envs: dict[str, dict] | None = None) -> Path:
        """The lab's inventory with the replicas' instance (env per replica), the router's group and settings."""
        doc = yaml.safe_load(self.lab.inventory.read_text(encoding="utf-8"))
        hosts = doc["all"]["children"]["sglang_nodes"]["hosts"]
        for h in self.replicas:
            env = (envs or {}).get(h) or {}
            hosts[h]["sglang_instances"] = [{**RO, **({"env": env} if env else {})}]
        hosts[self.router]["sglang_instances"] = []
        hosts[self.router].update(ROUTER_VARS)
        doc["all"]["children"]["sglang_replicas"] = {"hosts": {h: None for h in self.replicas}}
        doc["all"]["children"]["sglang_routers"] = {"hosts": {self.router: None}}
        path = self.lab.state / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        return path

    def write_baseline(self) -> Path:
        return self.write_inventory(self.baseline.name)

    # --- commands on the controller

    def env(self) -> dict[str, str]:
        return {
            **{k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_CONFIG"},
            "SGLANG_DEPLOY_LEDGER": str(self.ledger),
            "COLUMNS": "200",
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_FORCE_COLOR": "0",
        }

    def driver_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "driver", *args, "--json"]

    def driver(self, *args: str, timeout: float = DRIVER_LIMIT_S) -> tuple[int, dict | None, str]:
        """python -m driver ARGS --json, waited for (killed at timeout): (exit code, its document, its stderr)."""
        w = Watched(self.driver_argv(*args), env=self.env())
        code = w.wait(timeout)
        return code, parse_doc("".join(w.out)), "".join(w.err)

    def playbook(self, playbook: str, inventory: Path, *extra: str, timeout: float = 2400) -> tuple[int, str]:
        cmd = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), playbook, *extra]
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return 124, f"{' '.join(cmd)}: timed out after {timeout:g} s"
        return proc.returncode, proc.stdout[-4000:] + proc.stderr[-2000:]

    # --- the router, asked on its node

    def router_api(self, action: str, *args: str, timeout: float = 30):
        p = pexec(
            self.containers[self.router],
            *("python3", "-c", ROUTER_API, f"http://127.0.0.1:{ROUTER_PORT}", KEY, action, *args),
            timeout=timeout,
        )
        if p.returncode != 0:
            raise RuntimeError(f"router {action} {' '.join(args)}: {(p.stderr or p.stdout).strip()[-300:]}")
        return json.loads(p.stdout)

    def workers(self) -> list[dict] | None:
        """The router's workers, or None when it does not answer."""
        try:
            return self.router_api("list")
        except (RuntimeError, ValueError):
            return None

    def health(self) -> dict[str, object]:
        """Each replica's own /health, asked from the router's node: {node: 200 or what happened}."""
        try:
            got = self.router_api("health", *(self.url(n) for n in self.replicas))
        except (RuntimeError, ValueError) as exc:
            return {n: f"not asked: {exc}" for n in self.replicas}
        return {n: got.get(self.url(n)) for n in self.replicas}

    def resolve_ips(self) -> dict[str, str]:
        for n in self.replicas:
            p = pexec(self.containers[self.router], "getent", "hosts", n, timeout=30)
            if p.returncode == 0 and p.stdout.split():
                self.ips[n] = p.stdout.split()[0]
        return self.ips

    def node_of(self, url: str) -> str | None:
        try:
            parts = urlsplit(url)
        except ValueError:
            return None
        if parts.port != RO["port"]:
            return None
        host = parts.hostname or ""
        if host in self.replicas:
            return host
        return next((n for n, ip in self.ips.items() if ip == host), None)

    def states(self, listing: list) -> dict[str, str]:
        """{replica: in | unhealthy | out} from the router's list ([url, healthy, id] or its own dicts)."""
        st = dict.fromkeys(self.replicas, "out")
        for w in listing:
            url, healthy = (w["url"], w.get("is_healthy")) if isinstance(w, dict) else (w[0], w[1])
            node = self.node_of(url)
            if node is None:
                continue
            if healthy:
                st[node] = "in"
            elif st[node] == "out":
                st[node] = "unhealthy"
        return st

    def instance_env(self, node: str) -> str:
        p = pexec(self.containers[node], "cat", "/etc/sglang/ro.env", timeout=30)
        return p.stdout if p.returncode == 0 else f"unreadable: {p.stderr.strip()[:200]}"

    def container_state(self, node: str) -> str:
        p = podman("inspect", "-f", "{{.State.Status}}", self.containers[node], timeout=30)
        return p.stdout.strip() or "unknown"


def parse_doc(stdout: str) -> dict | None:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


class Sampler:
    """The router's /workers every SAMPLE_S s, asked by a sampler on the router's node, read here in a thread."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.container = fleet.containers[fleet.router]
        self.stop_file = "/tmp/chaos-sampler.stop"
        pexec(self.container, "rm", "-f", self.stop_file)
        self.samples: list[dict] = []
        self.proc = subprocess.Popen(
            [
                *("podman", "exec", self.container, "python3", "-u", "-c", SAMPLER),
                *(f"http://127.0.0.1:{ROUTER_PORT}", KEY, self.stop_file, str(SAMPLE_S)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            try:
                s = json.loads(line)
            except ValueError:
                continue
            s["state"] = None if "err" in s else self.fleet.states(s["w"])
            self.samples.append(s)

    def latest(self) -> dict | None:
        return self.samples[-1] if self.samples else None

    def wait_first(self, timeout: float = 30) -> bool:
        deadline = time.monotonic() + timeout
        while not self.samples and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.samples)

    def stop(self) -> list[dict]:
        pexec(self.container, "touch", self.stop_file, timeout=30)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
        self.reader.join(10)
        return self.samples


class Load:
    """bench/loadgen.py on the router's node, through the router, until stopped."""

    def __init__(self, fleet: Fleet):
        self.container = fleet.containers[fleet.router]
        pexec(self.container, "rm", "-f", "/tmp/chaos-load.stop", "/tmp/chaos-load.ready")
        self.proc = subprocess.Popen(
            [
                *("podman", "exec", self.container, "python3", "/tmp/loadgen.py"),
                *("--url", f"http://127.0.0.1:{ROUTER_PORT}", "--api-key", KEY, "--concurrency", str(CONCURRENCY)),
                *("--stop-file", "/tmp/chaos-load.stop", "--ready-file", "/tmp/chaos-load.ready"),
                *("--duration", "900"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while True:
            p = pexec(self.container, "date", "+%s.%N", "-r", "/tmp/chaos-load.ready", timeout=30)
            if p.returncode == 0 and p.stdout.strip():
                self.t0 = float(p.stdout.strip())  # loadgen's clock (its failures' at_s) starts about then
                return
            if time.monotonic() > deadline or self.proc.poll() is not None:
                kill_tree(self.proc)
                raise RuntimeError("the load generator did not start")
            time.sleep(0.2)

    def stop(self) -> dict | None:
        pexec(self.container, "touch", "/tmp/chaos-load.stop", timeout=30)
        try:
            out, _ = self.proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            return None
        return parse_doc(out)


# ------------------------------------------------------------------------------------------------ faults


def draw(rng: random.Random, fleet: Fleet, max_unavailable: int, faults: tuple[str, ...] = FAULTS) -> dict:
    """One run's fault and moment, drawn (every run's plan is drawn before the lab starts: the seed alone says it)."""
    fault = rng.choice(faults)
    plan: dict = {"fault": fault}
    if fault in TIMED:
        if rng.random() < 0.5:
            # A fraction of a whole rollout's time (measured on this lab as the bench goes: expected_s).
            plan["moment"] = {"kind": "delay", "fraction": round(rng.uniform(0.02, 0.95), 3)}
        else:
            plan["moment"] = {
                "kind": "after-out",
                "replica": rng.choice(fleet.replicas),
                "then_s": round(rng.uniform(0.0, 3.0), 1),
            }
    if fault in ("ssh-blocked", "pause"):
        plan["target"] = rng.choice(fleet.replicas)
        plan["duration_s"] = round(rng.uniform(10.0, 30.0), 1)
    elif fault == "node-killed":
        plan["target"] = rng.choice(fleet.replicas[max_unavailable:] or fleet.replicas[-1:])  # not the canary
    elif fault == "metrics-slow":
        plan["target"] = rng.choice(fleet.replicas)
        plan["value"] = rng.choice(
            [
                f"slow:{rng.uniform(0.5, 4.5):.1f}",  # slower than a read every 0.1 s, within the 5 s read timeout
                f"slow:{rng.uniform(5.5, 9.0):.1f}",  # past the read timeout: no read answers in time
                "503",
                "503-under-load:0",
            ]
        )
    elif fault == "ip-alias":
        plan["target"] = rng.choice(fleet.replicas)
    elif fault == "canary-crash":
        plan["target"] = fleet.replicas[0]
    if fault not in TIMED:
        plan["moment"] = {"kind": "before" if fault in ("ip-alias", "metrics-slow") else "configuration"}
    return plan


def moment_text(plan: dict) -> str:
    m = plan["moment"]
    if m["kind"] == "delay":
        if "delay_s" in m:
            return f"{m['delay_s']} s ({m['fraction']:.0%} of {m['expected_s']} s) after start"
        return f"{m['fraction']:.0%} of a rollout's time after start"
    if m["kind"] == "after-out":
        return f"{m['then_s']} s after {m['replica']} out"
    return m["kind"]


class Injector(threading.Thread):
    """A timed fault: waits for its moment while the driver runs, injects it, reverts it after its duration."""

    def __init__(self, plan: dict, fleet: Fleet, drv: Watched, sampler: Sampler):
        super().__init__(daemon=True)
        self.plan, self.fleet, self.drv, self.sampler = plan, fleet, drv, sampler
        self.events: list[dict] = []
        self.injected_at: float | None = None
        self.abort = threading.Event()

    def note(self, what: str) -> None:
        self.events.append({"t_s": round(now() - self.drv.started, 2), "what": what})

    def run(self) -> None:
        try:
            if self.wait_moment():
                self.inject()
        except Exception as exc:  # the bench's own failure: said in the run's record
            self.note(f"injector error: {type(exc).__name__}: {exc}")

    def wait_moment(self) -> bool:
        m = self.plan["moment"]
        deadline = self.drv.started + DRIVER_LIMIT_S
        if m["kind"] == "delay":
            at = self.drv.started + m["delay_s"]
        else:
            seen = len(self.sampler.samples)
            at = None
            while at is None:
                for s in self.sampler.samples[seen:]:
                    seen += 1
                    if s["t"] >= self.drv.started and s["state"] and s["state"][m["replica"]] == "out":
                        self.note(f"{m['replica']} out of the router (sampled)")
                        at = now() + m["then_s"]
                        break
                if at is None:
                    if not self.drv.running() or now() > deadline or self.abort.is_set():
                        self.note(f"not injected: {m['replica']} never left the router while the driver ran")
                        return False
                    time.sleep(0.05)
        while now() < at:
            if not self.drv.running() or self.abort.is_set():
                self.note("not injected: the driver ended before the moment")
                return False
            time.sleep(0.02)
        if not self.drv.running():
            self.note("not injected: the driver ended before the moment")
            return False
        return True

    def inject(self) -> None:
        fault, f = self.plan["fault"], self.fleet
        target = self.plan.get("target")
        self.injected_at = now()
        if fault in ("ctrl-c-once", "ctrl-c-twice", "sigterm"):
            sig = signal.SIGTERM if fault == "sigterm" else signal.SIGINT
            self.drv.proc.send_signal(sig)
            self.note(f"{signal.Signals(sig).name} to the driver")
            if fault == "ctrl-c-twice":
                deadline = now() + 30
                while not self.drv.said(INTERRUPTED_SAID) and self.drv.running() and now() < deadline:
                    time.sleep(0.05)
                if not self.drv.running():
                    self.note("the driver ended before its interrupt was said: no second SIGINT")
                elif not self.drv.said(INTERRUPTED_SAID):
                    self.note("the driver did not say it was interrupted within 30 s: no second SIGINT")
                else:
                    self.note("the driver said it was interrupted")
                    self.drv.proc.send_signal(signal.SIGINT)
                    self.note("second SIGINT to the driver")
        elif fault == "ssh-blocked":
            p = pexec(f.containers[target], "sh", "-c", "systemctl stop ssh.service; pkill -KILL -x sshd || true")
            self.note(f"sshd stopped on {target} (rc {p.returncode})")
            self.abort.wait(self.plan["duration_s"])
            p = pexec(f.containers[target], "systemctl", "start", "ssh.service")
            self.note(f"sshd started on {target} (rc {p.returncode})")
        elif fault == "pause":
            p = podman("pause", f.containers[target])
            self.note(f"{target} paused (rc {p.returncode} {p.stderr.strip()[:100]})")
            self.abort.wait(self.plan["duration_s"])
            p = podman("unpause", f.containers[target])
            self.note(f"{target} unpaused (rc {p.returncode} {p.stderr.strip()[:100]})")
        elif fault == "router-restart":
            p = pexec(f.containers[f.router], "systemctl", "restart", "sglang-router.service", timeout=180)
            self.note(f"sglang-router restarted (rc {p.returncode} {p.stderr.strip()[:100]})")
        elif fault == "node-killed":
            p = podman("kill", f.containers[target])
            self.note(f"{target} killed (rc {p.returncode} {p.stderr.strip()[:100]})")


# ------------------------------------------------------------------------------------------------ one run


def timeline(samples: list[dict], t0: float) -> list[dict]:
    """The router's view, one entry per change: seconds from the driver's start, each replica's state."""
    out, last = [], object()
    for s in samples:
        state = s["state"] if s["state"] is not None else "router not answering"
        if state != last:
            entry = {"t_s": round(s["t"] - t0, 2)}
            entry.update({"state": state} if isinstance(state, dict) else {"router": state, "err": s.get("err")})
            if isinstance(state, dict):
                entry["listed"] = [w[0] for w in s["w"]]
            out.append(entry)
            last = state
    return out


def router_down_windows(samples: list[dict]) -> list[tuple[float, float]]:
    """The times the router did not answer its /workers: (first failed sample, first answered one after it)."""
    out, start = [], None
    for s in samples:
        if s["state"] is None and start is None:
            start = s["t"]
        elif s["state"] is not None and start is not None:
            out.append((start, s["t"]))
            start = None
    if start is not None:
        out.append((start, samples[-1]["t"]))
    return out


def turn_over_before(samples: list[dict], node: str, t: float, t0: float) -> bool:
    """Whether node left the router after t0 and was back in, healthy, before t (its turn was over)."""
    left = False
    for s in samples:
        if s["t"] < t0 or s["t"] > t or not s["state"]:
            continue
        if s["state"][node] == "out":
            left = True
        elif left and s["state"][node] == "in":
            return True
    return False


def where_lines(events_path: str | None) -> list[str]:
    """The rollout's last play's list (per replica: how it ended, in or out of the router), from its events."""
    if not events_path or not Path(events_path).exists():
        return []
    lines: list[str] = []
    for raw in Path(events_path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            ev = json.loads(raw)
        except ValueError:
            continue
        data = ev.get("event_data") or {}
        if ev.get("event") == "runner_on_ok" and "router's membership" in (data.get("task") or ""):
            msg = (data.get("res") or {}).get("msg")
            lines += [str(m) for m in msg] if isinstance(msg, list) else [str(msg)]
    return lines


def ledger_rows(ledger: Path, after_id: int) -> list[dict]:
    if not ledger.exists():
        return []
    con = sqlite3.connect(f"file:{ledger}?mode=ro", uri=True, timeout=10)
    try:
        con.row_factory = sqlite3.Row
        rows = con.execute(
            "SELECT id, command, exit_code, finished_at, outcome, duration_s, events_path FROM runs WHERE id > ?"
            " ORDER BY id",
            (after_id,),
        ).fetchall()
        return [dict(r) for r in rows]
    finally:
        con.close()


def last_ledger_id(ledger: Path) -> int:
    rows = ledger_rows(ledger, -1)
    return rows[-1]["id"] if rows else 0


def left_lines(doc: dict | None, err: str) -> list[str]:
    if doc and doc.get("left"):
        return [str(x) for x in doc["left"]]
    lines, on = [], False
    for line in err.splitlines():
        if line.startswith("interrupted; hosts were left so:"):
            on = True
        elif on and line.startswith("  "):
            lines.append(line.strip())
        elif on:
            on = False
    return lines


def reported_out(node: str, doc: dict | None, left: list[str], where: list[str]) -> str | None:
    """The driver's reason for a replica out of the router or not serving, if it gave one."""
    if doc:
        h = (doc.get("hosts") or {}).get(node) or {}
        if h.get("status") in ("unreachable", "failed") or h.get("failures"):
            fail = (h.get("failures") or [{}])[-1]
            return f"host {h.get('status')}: {fail.get('task', '')}: {str(fail.get('message', ''))[:160]}"
        for r in doc.get("rows") or []:
            if r.get("host") == node and r.get("result") not in GOOD_RESULTS:
                return f"row {r.get('result')}: {str(r.get('detail', ''))[:160]}"
    url = Fleet.url(node)
    for line in left:
        mine = line.startswith((f"{node}:", f"{node}/")) or url in line
        if mine and any(w in line for w in OUT_WORDS):
            return f"left: {line[:200]}"
    for line in where:
        if line.startswith(f"{node}/") and ("router: out" in line or "NOT healthy" in line):
            return f"last play: {line[:200]}"
    return None


def final_state(fleet: Fleet) -> dict:
    listing = fleet.workers()
    health = fleet.health()
    states = fleet.states(listing) if listing is not None else None
    return {
        "t": now(),
        "health": health,
        "router": listing,
        "states": states,
    }


def check_replicas(
    fleet: Fleet, doc: dict | None, left: list[str], where: list[str], killed: str | None
) -> tuple[list[str], dict, float]:
    """Invariant 1, polled for GRACE_S (the router's health check takes a replica back 2 checks x 5 s after it
    serves again): (violations, the last state seen with the first health read, seconds it took to hold)."""
    t0 = now()
    first = None
    while True:
        st = final_state(fleet)
        first = first or st
        problems = []
        for n in fleet.replicas:
            serving = st["health"].get(n) == 200
            listed = st["states"] is not None and st["states"][n] == "in"
            if serving and listed:
                continue
            why = reported_out(n, doc, left, where)
            if n == killed:
                if st["states"] is not None and st["states"][n] == "in":
                    problems.append(f"(1) {n} killed, yet the router lists it healthy")
                continue
            if why is None:
                problems.append(
                    f"(1) {n}: serving {st['health'].get(n)}, router "
                    f"{st['states'][n] if st['states'] else 'not answering'}, and the driver reported nothing"
                )
        if not problems or now() - t0 > GRACE_S:
            return problems, {**st, "first_health": first["health"]}, round(now() - t0, 1)
        time.sleep(1.0)


def lost_allowed(
    plan: dict, stats: dict, kill_at_load_s: float | None, failed_at: list[float], down: list[tuple[float, float]]
) -> tuple[int, str]:
    """Invariant 2's allowance. node-killed: the failures of requests started before the kill (in flight when the
    node died), at most the load's concurrency. router-restart: the router's own outage, which no rollout can
    hide: the failures of requests started while it did not answer its /workers (``down``, 0.5 s either side, the
    sampler's period and more), and those in flight when it went (started in the 5 s before; at most the load's
    concurrency). Every other fault none. ``failed_at``: every failure's start, on the samples' clock."""
    if plan["fault"] == "router-restart" and down:
        during = sum(1 for x in failed_at if any(a - 0.5 <= x <= b + 0.5 for a, b in down))
        before = sum(1 for x in failed_at if any(a - 5.0 <= x < a - 0.5 for a, _ in down))
        n = during + min(before, CONCURRENCY)
        return n, f"requests started while the router did not answer ({during}) or in flight when it went ({before})"
    if plan["fault"] != "node-killed" or kill_at_load_s is None:
        return 0, "no request may be lost"
    early = [f for f in stats.get("failures", []) if f["at_s"] <= kill_at_load_s + 0.5]
    n = min(len(early), CONCURRENCY)
    return n, f"requests in flight when the node died (started before {kill_at_load_s:.1f} s on loadgen's clock): {n}"


def run_one(fleet: Fleet, plan: dict, index: int, args: argparse.Namespace, expected_s: float) -> dict:
    """One run: the fleet checked and configured for its fault, the rollout under load with the fault injected,
    then the run's record and its five invariants (the module's docstring lists them)."""
    plan = with_delay(plan, expected_s)
    rec: dict = {"index": index, **plan, "events": [], "violations": [], "notes": []}
    rec["start_problems"] = clean(fleet)
    if rec["start_problems"]:
        rec["notes"].append(f"not clean at the start: {rec['start_problems']}")
    envs = configure_run(fleet, plan, rec)
    inventory = fleet.write_inventory("chaos-run.yml", envs)
    first_id = last_ledger_id(fleet.ledger)
    run = roll_under_load(fleet, plan, inventory, args)
    said = record_rollout(fleet, plan, rec, run, first_id)
    final = check_serving(fleet, rec, said)  # (1)
    check_lost(rec, plan, run, said.killed)  # (2)
    check_unavailable(rec, args, run, plan["fault"], said.injected)  # (3)
    check_exit_code(rec, plan, run, said, final)  # (4)
    check_ledger(rec, run, said)  # (5)
    return rec


def with_delay(plan: dict, expected_s: float) -> dict:
    """A delay's moment in seconds: its drawn fraction of a whole rollout's time on this lab so far."""
    if plan["moment"]["kind"] != "delay":
        return plan
    m = plan["moment"]
    return {**plan, "moment": {**m, "expected_s": expected_s, "delay_s": round(m["fraction"] * expected_s, 1)}}


def configure_run(fleet: Fleet, plan: dict, rec: dict) -> dict[str, dict]:
    """Each replica's env for the run's new configuration, and what the fault sets up before the rollout starts."""
    fault, target = plan["fault"], plan.get("target")
    token = str(time.time_ns())
    envs = {h: {"LAB_ROLLOUT": token} for h in fleet.replicas}
    if fault == "canary-crash":
        envs[target]["LAB_STANDIN_FAULT"] = "crash-first-decode"
    if fault == "metrics-slow":
        envs[target]["LAB_STANDIN_METRICS"] = plan["value"]
        slow_metrics(fleet, target, plan["value"], rec)
    fleet.resolve_ips()
    if fault == "ip-alias":
        alias_by_ip(fleet, target, rec)
    return envs


def slow_metrics(fleet: Fleet, target: str, value: str, rec: dict) -> None:
    """metrics-slow: the target restarted with its /metrics slow or 503 before the run, so that the drain reads it."""
    knob = fleet.write_inventory("chaos-knob.yml", {target: {"LAB_STANDIN_METRICS": value}})
    code, _, err = fleet.driver("restart", "-i", str(knob), "--limit", target)
    rec["events"].append({"t_s": None, "what": f"{target} restarted with LAB_STANDIN_METRICS={value}: exit {code}"})
    if code != 0:
        rec["notes"].append(f"the knob's restart failed (exit {code}): {err[-300:]}")
    wait_router_all_in(fleet, 60)


def alias_by_ip(fleet: Fleet, target: str, rec: dict) -> None:
    """ip-alias: the target re-registered in the router under its IP address, as an operator's curl would."""
    ip = fleet.ips.get(target)
    listing = fleet.workers() or []
    for w in listing:
        if w["url"] == fleet.url(target):
            fleet.router_api("delete", w["id"])
    alias = f"http://{ip}:{RO['port']}"
    fleet.router_api("add", alias)
    ok = wait_for(lambda: any(w["url"] == alias and w.get("is_healthy") for w in fleet.workers() or []), 60)
    rec["alias"] = alias
    rec["events"].append({"t_s": None, "what": f"{target} re-registered as {alias} (listed healthy: {ok})"})


@dataclass
class Rollout:
    """One run's rollout as it went: the driver (its exit code, its start and end), the timed fault's injector, the
    load (its statistics: None when it gave none) and the router's samples."""

    drv: Watched
    code: int
    t_end: float
    injector: Injector | None
    load: Load | None
    stats: dict | None
    samples: list[dict]

    @property
    def t0(self) -> float:
        return self.drv.started

    @property
    def injected_at(self) -> float | None:
        return self.injector.injected_at if self.injector else None


def roll_under_load(fleet: Fleet, plan: dict, inventory: Path, args: argparse.Namespace) -> Rollout:
    """`python -m driver rollout` under loadgen's load, the router sampled, a timed fault injected at its moment.
    Whatever fails, nothing of the run's is left running (the exception goes on once all is stopped)."""
    sampler = Sampler(fleet)
    load = drv = injector = None
    stats = None
    try:
        sampler.wait_first()
        load = Load(fleet)
        argv = ["rollout", "-i", str(inventory), "-e", GATE, "--max-unavailable", str(args.max_unavailable)]
        argv += ["--max-fail", str(args.max_fail)]
        drv = Watched(fleet.driver_argv(*argv), env=fleet.env())
        injector = Injector(plan, fleet, drv, sampler) if plan["fault"] in TIMED else None
        if injector:
            injector.start()
        code = drv.wait(DRIVER_LIMIT_S)
    finally:
        if drv is not None and drv.running():  # the bench itself failed: nothing of the driver's is left running
            kill_tree(drv.proc)
        if injector:
            injector.join(90)  # a pause or an SSH blip is reverted after its duration
            if injector.is_alive():
                injector.abort.set()
                injector.join(60)
        if load is not None:
            stats = load.stop()
        samples = sampler.stop()
    return Rollout(drv, code, drv.ended or now(), injector, load, stats, samples)


@dataclass
class Reported:
    """What the run's checks read beside the rollout: the driver's --json document, its 'left' lines, the last
    play's list, the ledger's rows of the run (the rollout's among them), whether the fault was injected, and the
    replica a node-killed fault killed."""

    doc: dict | None
    left: list[str]
    where: list[str]
    rows: list[dict]
    rollout_row: dict | None
    injected: bool
    killed: str | None


def record_rollout(fleet: Fleet, plan: dict, rec: dict, run: Rollout, first_id: int) -> Reported:
    """The run's record: the driver's exit, output and rows, the injection, the ledger, the router's timeline."""
    fault, injector, t0 = plan["fault"], run.injector, run.t0
    rec["driver_s"] = round(run.t_end - t0, 1)
    rec["exit_code"] = run.code
    rec["timed_out"] = run.drv.timed_out
    err = "".join(run.drv.err)
    doc = parse_doc("".join(run.drv.out))
    if injector:
        rec["events"] += injector.events
    injected = fault not in TIMED or (injector is not None and injector.injected_at is not None)
    rec["injected"] = injected
    rec["injected_at_s"] = round(injector.injected_at - t0, 2) if injector and injector.injected_at else None
    rec["stderr_tail"] = err[-1500:]
    rec["rows"] = [
        {k: r.get(k) for k in ("host", "instance", "phase", "result", "detail")} for r in (doc or {}).get("rows", [])
    ]
    rec["hosts"] = {
        h: {"status": v.get("status"), "phase": v.get("phase"), "failures": v.get("failures")}
        for h, v in ((doc or {}).get("hosts") or {}).items()
    }
    left = left_lines(doc, err)
    rec["left"] = left
    rows = ledger_rows(fleet.ledger, first_id)
    rollout_row = next((r for r in rows if r["command"] == "rollout"), None)
    where = where_lines(rollout_row["events_path"] if rollout_row else None)
    rec["last_play"] = where
    rec["timeline"] = timeline(run.samples, t0)
    if fault == "router-restart" and injector and injector.injected_at:
        rec["router_after_restart"] = router_after_restart(run.samples, injector.injected_at, t0)
    killed = plan.get("target") if fault == "node-killed" and injected else None
    return Reported(doc, left, where, rows, rollout_row, injected, killed)


def router_after_restart(samples: list[dict], restarted_at: float, t0: float) -> list[dict]:
    """What the restarted router lists: its first answers after the restart (the unit's --worker-urls only)."""
    gone = next((s["t"] for s in samples if s["t"] >= restarted_at and s["state"] is None), None)
    after = [s for s in samples if s["t"] > (gone or restarted_at) and s["state"] is not None][:5]
    return [{"t_s": round(s["t"] - t0, 2), "listed": [[w[0], w[1]] for w in s["w"]]} for s in after]


def check_serving(fleet: Fleet, rec: dict, said: Reported) -> dict:
    """Invariant (1): every replica serving and in the router, or reported out with a reason. Returns the state
    check_replicas settled on (its first health read tells invariant 4 whether a server was left down)."""
    v1, st, took = check_replicas(fleet, said.doc, said.left, said.where, said.killed)
    rec["final"] = {
        "health_at_end": st["first_health"],
        "health": st["health"],
        "router": [[w["url"], w.get("is_healthy")] for w in st["router"]] if st["router"] is not None else None,
        "settled_in_s": took,
    }
    if said.doc is None:
        v1.append("(1) the driver printed no --json document")
    names = [w["url"] for w in st["router"] or []]
    extra = [u for u in names if u not in {fleet.url(n) for n in fleet.replicas}]
    dup = sorted({u for u in names if names.count(u) > 1})
    if extra or dup:
        rec["notes"].append(f"the router lists, besides the replicas' names: {extra}; duplicates: {dup}")
    rec["violations"] += v1
    return st


def check_lost(rec: dict, plan: dict, run: Rollout, killed: str | None) -> None:
    """Invariant (2): requests lost only where the fault allows (lost_allowed), the load's record beside it."""
    stats, load, t0 = run.stats, run.load, run.t0
    kill_at_load_s = None
    if stats is None:
        rec["violations"].append("(2) no statistics from the load generator")
        rec["load"] = None
        return
    if killed and run.injected_at:
        kill_at_load_s = run.injected_at - load.t0
    # Where the failures fall: while the router itself did not answer (a router-restart's own outage) or not.
    down = router_down_windows(run.samples)
    at = [load.t0 + x for x in stats.get("failed_at_s", [])]
    allowed, why = lost_allowed(plan, stats, kill_at_load_s, at, down)
    rec["load"] = {k: stats.get(k) for k in ("sent", "ok", "failed", "truncated", "not_streamed", "lost", "p99_s")}
    rec["load"]["failures"] = [
        {**f, "at_run_s": round(load.t0 + f["at_s"] - t0, 2)} for f in stats.get("failures", [])[:20]
    ]
    rec["lost_allowed"] = allowed
    rec["lost_allowed_why"] = why
    rec["router_down_windows_s"] = [[round(a - t0, 2), round(b - t0, 2)] for a, b in down]
    rec["load"]["failures_while_router_down"] = sum(1 for x in at if any(a - 0.5 <= x <= b + 0.5 for a, b in down))
    # The failures outside the router's outage, on the run's clock (what a violation is made of), the first 20.
    rec["load"]["failures_outside_router_down_s"] = [
        round(x - t0, 2) for x in at if not any(a - 0.5 <= x <= b + 0.5 for a, b in down)
    ][:20]
    if stats["lost"] > allowed:
        rec["violations"].append(f"(2) {stats['lost']} requests lost, {allowed} allowed ({why})")


def check_unavailable(rec: dict, args: argparse.Namespace, run: Rollout, fault: str, injected: bool) -> None:
    """Invariant (3): at most --max-unavailable replicas out at once (one more where the fault takes one out), and
    the failure budget."""
    t0 = run.t0
    bound = args.max_unavailable + (1 if fault in TAKES_ONE_OUT and injected else 0)
    during = [s for s in run.samples if t0 <= s["t"] <= run.t_end]
    answered = [s for s in during if s["state"]]
    max_out, worst = 0, None
    for s in answered:
        out = sum(1 for v in s["state"].values() if v != "in")
        if out > max_out:
            max_out, worst = out, s
    rec["max_out"] = max_out
    rec["max_out_bound"] = bound
    rec["max_out_at"] = {"t_s": round(worst["t"] - t0, 2), "state": worst["state"]} if worst else None
    rec["samples"] = len(during)
    rec["router_unanswered_s"] = round(SAMPLE_S * (len(during) - len(answered)), 1)
    if max_out > bound:
        rec["violations"].append(
            f"(3) {max_out} replicas out or unhealthy at once at {rec['max_out_at']['t_s']} s, at most {bound} allowed"
        )
    failed_hosts = [h for h, v in rec["hosts"].items() if v["status"] in ("failed", "unreachable")]
    rec["failed_hosts"] = failed_hosts
    if len(failed_hosts) > args.max_fail + 1:
        rec["violations"].append(f"(3) {len(failed_hosts)} replicas failed ({failed_hosts}), budget {args.max_fail}")


def check_exit_code(rec: dict, plan: dict, run: Rollout, said: Reported, final: dict) -> None:
    """Invariant (4): the exit code the fault's table expects (EXPECTED), with the cases that widen it."""
    fault, injected, code = plan["fault"], said.injected, run.code
    expected = EXPECTED[fault] if injected else {0}
    if expected is not None:
        expected = set(expected)
        if fault in INTERRUPTS and injected and any(v != 200 for v in final["first_health"].values()):
            expected.add(6)  # a server left down outranks the interruption
        if fault == "node-killed" and injected and turn_over_before(run.samples, said.killed, run.injected_at, run.t0):
            expected.add(0)  # killed after its own turn: nothing of the run was to touch it again
    rec["expected_codes"] = sorted(expected) if expected is not None else None
    if run.drv.timed_out:
        rec["violations"].append(f"(4) the driver was still running after {DRIVER_LIMIT_S:g} s: killed")
    elif expected is not None and code not in expected:
        rec["violations"].append(f"(4) exit {code}, expected {sorted(expected)}")


def check_ledger(rec: dict, run: Rollout, said: Reported) -> None:
    """Invariant (5): the ledger's rows of the run complete, the rollout's exit code the process's own."""
    rows, rollout_row, code = said.rows, said.rollout_row, run.code
    rec["ledger"] = [{k: r[k] for k in ("id", "command", "exit_code", "finished_at", "outcome")} for r in rows]
    if not rows:
        rec["violations"].append("(5) no ledger row for the run")
    for r in rows:
        if r["exit_code"] is None or not r["finished_at"]:
            rec["violations"].append(f"(5) ledger row {r['id']} ({r['command']}) incomplete: {r}")
    if rollout_row and not run.drv.timed_out and rollout_row["exit_code"] != code:
        rec["violations"].append(f"(5) the ledger says exit {rollout_row['exit_code']}, the driver exited {code}")


def wait_for(fn, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = fn()
        except Exception:
            value = None
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def wait_router_all_in(fleet: Fleet, timeout: float) -> bool:
    want = {fleet.url(n) for n in fleet.replicas}

    def ok() -> bool:
        ws = fleet.workers()
        return ws is not None and sorted(w["url"] for w in ws) == sorted(want) and all(w.get("is_healthy") for w in ws)

    return bool(wait_for(ok, timeout))


def clean(fleet: Fleet) -> list[str]:
    """What keeps the fleet from a clean start: [] when every replica serves the baseline, alone in the router."""
    problems = []
    for n in fleet.nodes:
        if (s := fleet.container_state(n)) != "running":
            problems.append(f"{n}: container {s}")
    health = fleet.health()
    problems += [f"{n}: /health {v}" for n, v in health.items() if v != 200]
    for n in fleet.replicas:
        env = fleet.instance_env(n)
        if "LAB_ROLLOUT" in env or "LAB_STANDIN_" in env or env.startswith("unreadable"):
            problems.append(f"{n}: not the baseline configuration")
    ws = fleet.workers()
    if ws is None:
        problems.append("the router does not answer")
    else:
        urls = sorted(w["url"] for w in ws)
        if urls != sorted(fleet.url(n) for n in fleet.replicas) or not all(w.get("is_healthy") for w in ws):
            problems.append(f"the router lists {[(w['url'], w.get('is_healthy')) for w in ws]}")
    return problems


def restore(fleet: Fleet) -> dict:
    """Every replica back to the baseline configuration, serving, alone in the router under its name."""
    t0 = now()
    out: dict = {"restarted": [], "driver": [], "added": [], "removed": [], "actions": []}
    revived = revive_containers(fleet, out)
    restart_services(fleet, out)
    restart_off_baseline(fleet, revived, out)
    fleet.resolve_ips()
    reregister(fleet, out)
    wait_router_all_in(fleet, 90)
    out["problems"] = clean(fleet)
    out["seconds"] = round(now() - t0, 1)
    return out


def revive_containers(fleet: Fleet, out: dict) -> list[str]:
    """Paused nodes unpaused, stopped ones started (their SSH ports published anew): the nodes started."""
    revived = []
    for n in fleet.nodes:
        state = fleet.container_state(n)
        if state == "paused":
            podman("unpause", fleet.containers[n])
            out["actions"].append(f"{n} unpaused")
        elif state in ("exited", "stopped", "created"):
            podman("start", fleet.containers[n])
            revived.append(n)
            out["actions"].append(f"{n} started")
    if revived:
        labmod.up(fleet.lab, nodes=len(fleet.nodes), gpus=GPUS, timeout=180)  # its SSH port published anew
        fleet.write_baseline()
    return revived


def restart_services(fleet: Fleet, out: dict) -> None:
    """sshd on every replica (ssh-blocked stops it) and the router, if it is not active."""
    for n in fleet.replicas:
        pexec(fleet.containers[n], "systemctl", "start", "ssh.service", timeout=60)
    if (
        pexec(fleet.containers[fleet.router], "systemctl", "is-active", "sglang-router.service").stdout.strip()
        != "active"
    ):
        pexec(fleet.containers[fleet.router], "systemctl", "restart", "sglang-router.service", timeout=180)
        out["actions"].append("sglang-router restarted")


def restart_off_baseline(fleet: Fleet, revived: list[str], out: dict) -> None:
    """The driver's restart, to the baseline, of the replicas not serving it (and of those just revived), up to 4
    tries."""
    for attempt in range(4):
        health = fleet.health()
        need = [
            n
            for n in fleet.replicas
            if (n in revived and attempt == 0)
            or health.get(n) != 200
            or "LAB_ROLLOUT" in (env := fleet.instance_env(n))
            or "LAB_STANDIN_" in env
        ]
        if not need:
            break
        code, _, err = fleet.driver("restart", "-i", str(fleet.baseline), "--limit", ",".join(need))
        out["driver"].append({"limit": need, "exit_code": code, "tail": "" if code == 0 else err[-400:]})
        out["restarted"] = sorted(set(out["restarted"]) | set(need))
        if code != 0:
            time.sleep(10 * (attempt + 1))  # a detached restart still running there holds the lock (9)


def reregister(fleet: Fleet, out: dict) -> None:
    """The router's list made the replicas' names, each once: any other entry or a duplicate removed, any missing
    added."""
    ws = fleet.workers() or []
    seen = set()
    for w in ws:
        if w["url"] not in {fleet.url(n) for n in fleet.replicas} or w["url"] in seen:
            try:
                fleet.router_api("delete", w["id"])
                out["removed"].append(w["url"])
            except RuntimeError as exc:
                out["actions"].append(f"delete {w['url']}: {exc}")
        seen.add(w["url"])
    for n in fleet.replicas:
        if fleet.url(n) not in seen:
            try:
                fleet.router_api("add", fleet.url(n))
                out["added"].append(fleet.url(n))
            except RuntimeError as exc:
                out["actions"].append(f"add {fleet.url(n)}: {exc}")


# ------------------------------------------------------------------------------------------------ the lab


def other_labs(own: str) -> set[str] | None:
    """Groups of running containers not this lab's: <lab>-nodeN grouped by lab, any other container its own; None
    when podman does not answer."""
    p = podman("ps", "--format", "{{.Names}}", timeout=60)
    if p.returncode != 0:
        return None
    names = p.stdout.split()
    groups = set()
    for n in names:
        base, sep, num = n.rpartition("-node")
        groups.add(base if sep and num.isdigit() else n)
    groups.discard(own)
    return groups


def wait_quiet(own: str, max_s: float) -> bool:
    deadline = time.monotonic() + max_s
    while True:
        others = other_labs(own)
        if others is None:
            print("podman ps did not answer: waiting 30 s", flush=True)
        elif len(others) <= 1:
            print(f"other labs running: {sorted(others) or 'none'}: starting", flush=True)
            return True
        if time.monotonic() > deadline:
            print(f"the machine was not quiet within {max_s:g} s ({sorted(others or [])}): not starting", flush=True)
            return False
        if others:
            print(f"{len(others)} other labs running ({sorted(others)}): waiting 30 s", flush=True)
        time.sleep(30)


def set_up(fleet: Fleet) -> None:
    t0 = now()
    labmod.down(fleet.lab)
    labmod.up(fleet.lab, nodes=len(fleet.nodes), gpus=GPUS, timeout=180)
    baseline = fleet.write_baseline()
    print(
        f"lab {fleet.lab.name} up ({len(fleet.nodes)} nodes) in {now() - t0:.0f} s; deploying the replicas", flush=True
    )
    code, out = fleet.playbook("playbooks/deploy.yml", baseline, "--limit", ",".join(fleet.replicas))
    if code:
        raise RuntimeError(f"deploy.yml failed ({code}):\n{out}")
    print(f"deployed in {now() - t0:.0f} s; starting the replicas", flush=True)
    code, _, err = fleet.driver("restart", "-i", str(baseline), "--limit", ",".join(fleet.replicas), timeout=600)
    if code:
        raise RuntimeError(f"the replicas did not start (exit {code}):\n{err[-3000:]}")
    code, out = fleet.playbook("playbooks/router.yml", baseline)
    if code:  # the router's node may need the base node role first
        print("router.yml failed on the bare node: deploying it first", flush=True)
        code, out = fleet.playbook("playbooks/deploy.yml", baseline, "--limit", fleet.router)
        if code:
            raise RuntimeError(f"deploy.yml on the router's node failed ({code}):\n{out}")
        code, out = fleet.playbook("playbooks/router.yml", baseline)
        if code:
            raise RuntimeError(f"router.yml failed ({code}):\n{out}")
    p = podman("cp", str(REPO / "bench" / "loadgen.py"), f"{fleet.containers[fleet.router]}:/tmp/loadgen.py")
    if p.returncode:
        raise RuntimeError(f"podman cp loadgen.py: {p.stderr}")
    if not wait_router_all_in(fleet, 120):
        raise RuntimeError(f"the router does not list every replica healthy: {fleet.workers()}")
    print(f"fleet ready in {now() - t0:.0f} s: {len(fleet.replicas)} replicas behind the router on {fleet.router}")


# ------------------------------------------------------------------------------------------------ main


def line_of(rec: dict, runs: int) -> str:
    load = rec.get("load") or {}
    codes = rec.get("expected_codes")
    code = rec.get("exit_code")
    want = "recorded" if codes is None else "/".join(map(str, codes))
    inj = "" if rec.get("injected", True) else " (not injected)"
    at = f" at {rec['injected_at_s']} s" if rec.get("injected_at_s") is not None else ""
    verdict = "ok" if not rec["violations"] else "VIOLATION: " + "; ".join(rec["violations"])
    if rec.get("bench_error"):
        verdict = f"BENCH ERROR: {rec['bench_error']}"
    return (
        f"#{rec['index']:02d}/{runs} {rec['fault']:<14} {moment_text(rec)}{at}{inj} | exit {code} (want {want}) | "
        f"lost {load.get('lost', '?')}/{load.get('sent', '?')} | max-out {rec.get('max_out', '?')}/"
        f"{rec.get('max_out_bound', '?')} | {rec.get('driver_s', '?')} s | {verdict}"
    )


def summary(results: dict) -> dict:
    runs = [*([results["calibration"]] if results.get("calibration") else []), *results["runs"]]
    by_fault: dict[str, dict] = {}
    for r in runs:
        f = by_fault.setdefault(r["fault"], {"runs": 0, "exit_codes": [], "violations": 0, "lost": 0})
        f["runs"] += 1
        f["exit_codes"].append(r.get("exit_code"))
        f["violations"] += bool(r["violations"])
        f["lost"] += (r.get("load") or {}).get("lost") or 0
    per_invariant: dict[str, int] = {}
    for r in runs:
        for v in r["violations"]:
            per_invariant[v[:3]] = per_invariant.get(v[:3], 0) + 1
    return {
        "runs": len(results["runs"]),  # the calibration (index 0) apart
        "runs_with_violations": [r["index"] for r in runs if r["violations"]],
        "runs_with_bench_errors": [r["index"] for r in runs if r.get("bench_error")],
        "violations_per_invariant": per_invariant,
        "by_fault": by_fault,
        "requests_sent": sum((r.get("load") or {}).get("sent") or 0 for r in runs),
        "requests_lost": sum((r.get("load") or {}).get("lost") or 0 for r in runs),
    }


def main() -> int:
    ap, a = parse_args()
    print(f"seed {a.seed}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a SIGTERM to the bench still tears its lab down
    faults = catalogue(ap, a.only)
    ledger_dir = a.ledger or Path(tempfile.mkdtemp(prefix=f"sgd-chaos-{a.seed}-"))
    ledger_dir.mkdir(parents=True, exist_ok=True)
    lab = labmod.Lab(name=LAB_NAME)
    fleet = Fleet(lab, a.replicas, ledger_dir / "ledger.sqlite3")
    plans = draw_plans(fleet, a, faults)
    results = new_results(a, fleet)
    reuse = a.reuse_lab and len(labmod.lab_containers(lab)) == len(fleet.nodes) and fleet.baseline.exists()
    results["lab"]["reused"] = reuse
    if not reuse and not a.no_wait and not wait_quiet(LAB_NAME, a.wait_max):
        return 2
    try:
        if reuse:
            print(f"reusing the lab {LAB_NAME}: {restore(fleet)}", flush=True)
        else:
            set_up(fleet)
        calibrate(fleet, a, results)
        run_plans(fleet, plans, a, results)
    except BaseException as exc:
        results["aborted"] = f"{type(exc).__name__}: {exc}"
        print(f"bench aborted: {results['aborted']}", file=sys.stderr, flush=True)
        raise
    finally:
        tear_down(fleet, a, results)
    return report(results["summary"], a.out)


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line, its numbers checked; the parser too, for catalogue's error (said after the seed)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--max-unavailable", type=int, default=1, help="the rollout's --max-unavailable (default 1)")
    ap.add_argument("--max-fail", type=int, default=0, help="the rollout's --max-fail (default 0)")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "chaos-rollout.json")
    ap.add_argument("--ledger", type=Path, help="the driver's ledger directory (default: a new one under /tmp, kept)")
    ap.add_argument("--wait-max", type=float, default=2400, help="seconds to wait for the machine to be quiet")
    ap.add_argument("--no-wait", action="store_true", help="start the lab whatever else runs")
    ap.add_argument("--only", help="faults to draw from, comma-separated (default: the whole catalogue)")
    ap.add_argument("--keep-lab", action="store_true", help="leave the lab up at the end (to debug the bench)")
    ap.add_argument("--reuse-lab", action="store_true", help="use the lab a --keep-lab run left, if it is there")
    a = ap.parse_args()
    if a.replicas < 2 or a.runs < 1 or a.max_unavailable < 1:
        ap.error("--replicas at least 2, --runs and --max-unavailable at least 1")
    return ap, a


def catalogue(ap: argparse.ArgumentParser, only: str | None) -> tuple[str, ...]:
    """The faults the runs are drawn from: --only's of the catalogue, or all of it."""
    faults = FAULTS
    if only:
        faults = tuple(f for f in only.split(",") if f in FAULTS)
        if not faults:
            ap.error(f"--only: none of {only} is a fault of the catalogue")
    return faults


def draw_plans(fleet: Fleet, a: argparse.Namespace, faults: tuple[str, ...]) -> list[dict]:
    """Every run's plan, drawn and printed before the lab starts: the seed alone says them."""
    rng = random.Random(a.seed)
    plans = [draw(rng, fleet, a.max_unavailable, faults) for _ in range(a.runs)]
    for i, p in enumerate(plans, 1):
        extra = {k: v for k, v in p.items() if k not in ("fault", "moment")}
        print(f"  plan #{i:02d}: {p['fault']:<14} {moment_text(p)} {json.dumps(extra) if extra else ''}", flush=True)
    return plans


def new_results(a: argparse.Namespace, fleet: Fleet) -> dict:
    """--out's document before any run: the seed, the command line, the lab, the load, the ledger."""
    return {
        "seed": a.seed,
        "command": " ".join(["bench/chaos_rollout.py", *sys.argv[1:]]),
        "replicas": a.replicas,
        "max_unavailable": a.max_unavailable,
        "max_fail": a.max_fail,
        "lab": {"name": LAB_NAME, "nodes": a.replicas + 1, "gpus": GPUS, "router": fleet.router},
        "load": {"concurrency": CONCURRENCY, "stream_ratio": 0.5},
        "driver_limit_s": DRIVER_LIMIT_S,
        "ledger": str(fleet.ledger),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": [],
    }


def write_results(results: dict, out: Path) -> None:
    results["summary"] = summary(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str) + "\n", encoding="utf-8")


def whole_rollout_s(results: dict, replicas: int) -> float:
    """A whole rollout's time on this lab: the median of the runs so far that rolled every replica, the
    calibration's first (60 s before any did)."""
    whole = [
        r["driver_s"]
        for r in [results.get("calibration") or {}, *results["runs"]]
        if r.get("exit_code") == 0
        and len(r.get("rows") or []) == replicas
        and all(x.get("result") == "restarted" for x in r["rows"])
    ]
    return round(sorted(whole)[len(whole) // 2], 1) if whole else 60.0


def calibrate(fleet: Fleet, a: argparse.Namespace, results: dict) -> None:
    """The calibration: one rollout with no fault, checked as every run is (the control; its time is the first
    measure of a whole rollout's, which the drawn delays are fractions of)."""
    cal = run_one(fleet, {"fault": "none", "moment": {"kind": "none"}}, 0, a, whole_rollout_s(results, a.replicas))
    print(line_of(cal, a.runs), flush=True)
    cal["restore"] = restore(fleet)
    results["calibration"] = cal


def run_plans(fleet: Fleet, plans: list[dict], a: argparse.Namespace, results: dict) -> None:
    """Each drawn run, said, the fleet restored after it (but the last), --out written again after each."""
    for i, plan in enumerate(plans, 1):
        try:
            rec = run_one(fleet, plan, i, a, whole_rollout_s(results, a.replicas))
        except Exception as exc:  # the bench's own failure in this run: said, then the fleet is put back
            rec = {"index": i, **plan, "violations": [], "notes": [], "bench_error": f"{type(exc).__name__}: {exc}"}
            print(f"#{i:02d} {plan['fault']}: bench error: {rec['bench_error']}", flush=True)
        print(line_of(rec, a.runs), flush=True)
        for n in rec["notes"]:
            print(f"      note: {n}", flush=True)
        if i < len(plans):
            rec["restore"] = restore(fleet)
            if rec["restore"]["problems"]:
                print(f"      restore left: {rec['restore']['problems']}", flush=True)
        results["runs"].append(rec)
        write_results(results, a.out)


def tear_down(fleet: Fleet, a: argparse.Namespace, results: dict) -> None:
    """--out written a last time, and the lab down (unless --keep-lab), whatever happened."""
    results["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_results(results, a.out)
    if a.keep_lab:
        print(f"lab {LAB_NAME} left up (--keep-lab): python lab/lab.py down with LAB_NAME={LAB_NAME}", flush=True)
    else:
        labmod.down(fleet.lab)
        print(f"lab {LAB_NAME} down", flush=True)
    print(f"results: {a.out}; the driver's ledger: {fleet.ledger}", flush=True)


def report(s: dict, out: Path) -> int:
    """The summary printed; the exit code: 1 for a violation, 2 for a run the bench itself failed in, else 0."""
    print(
        f"summary: {s['runs']} runs, {s['requests_lost']} of {s['requests_sent']} requests lost, "
        f"runs with violations: {s['runs_with_violations'] or 'none'}; per invariant: {s['violations_per_invariant']}"
    )
    for fault, f in sorted(s["by_fault"].items()):
        print(f"  {fault:<14} runs {f['runs']}, exit codes {f['exit_codes']}, with violations {f['violations']}")
    if s["runs_with_bench_errors"]:
        print(f"the bench itself failed in runs {s['runs_with_bench_errors']} (see bench_error in {out})")
    return 1 if s["runs_with_violations"] else 2 if s["runs_with_bench_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
