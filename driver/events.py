"""From ansible-runner's event stream to what happened on each host: no I/O, no presentation.

A Tracker is fed every event (live, or replayed from a recorded stream) and knows, per
host, the phase it is in and since when, what each SGLang instance's module reported
(sglang_server: outcome, phases, failure with its traceback, verification, tok/s, accept
length), and why a task failed. exit_code() maps all of it to driver/exitcodes.py.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field

from driver import exitcodes

PROFILE_LINE = re.compile(r"^\w+day \d+ \w+ \d{4} ")
VALIDATION_FILES = ("/validate.yml", "/render.yml", "/preflight.yml")
ROLE_PHASES = {"gpu_node": "node", "cuda": "cuda", "ml_env": "ml-env", "sglang": "sglang"}
WAITS = {
    "restart": "stop, clean GPUs, start, ready (model load, CUDA graphs), generate, verify",
    "rollback": "stop, clean GPUs, start the last-known-good, ready, generate, verify",
    "verify": "health_generate, generation, accept length, tok/s",
    "status": "unit, GPUs, health",
}


def timestamp(event: dict) -> float:
    created = event.get("created")
    if not created:
        return 0.0
    t = dt.datetime.fromisoformat(created)
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.timestamp()


@dataclass
class Failure:
    code: int
    task: str
    message: str


@dataclass
class HostState:
    name: str
    phase: str = "waiting"
    phase_since: float = 0.0
    task: str = ""
    started: float = 0.0
    finished: float = 0.0
    status: str = "running"  # running, ok, failed, unreachable
    failures: list[Failure] = field(default_factory=list)
    instances: dict[str, dict] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return max(0.0, (self.finished or self.phase_since) - self.started) if self.started else 0.0


def phase_of(command: str, data: dict) -> str:
    path = data.get("task_path") or ""
    role = data.get("role") or ""
    if any(f in path for f in VALIDATION_FILES) or (data.get("task") or "").startswith("Validating arguments"):
        return "validate"
    if "/server.yml" in path:
        return command if command in WAITS else "restart"
    if "/configure.yml" in path or "handlers" in path:
        return "configure"
    if role in ROLE_PHASES:
        return ROLE_PHASES[role]
    return "play"


def classify(data: dict) -> int:
    """The exit code a failed task stands for."""
    res = data.get("res") or {}
    if res.get("unreachable"):
        return exitcodes.UNREACHABLE
    if res.get("outcome") in exitcodes.OUTCOME_CODES:
        return exitcodes.OUTCOME_CODES[res["outcome"]]
    path = data.get("task_path") or ""
    if any(f in path for f in VALIDATION_FILES) or (data.get("task") or "").startswith("Validating arguments"):
        return exitcodes.INVALID_CONFIG
    return exitcodes.FAILED


def message_of(res: dict) -> str:
    msg = res.get("msg") or ""
    if isinstance(msg, list):
        msg = "; ".join(map(str, msg))
    if not msg and res.get("stderr"):
        msg = res["stderr"]
    return " ".join(str(msg).split())


class Tracker:
    def __init__(self, command: str):
        self.command = command
        self.hosts: dict[str, HostState] = {}
        self.stats: dict = {}
        self.first = 0.0
        self.last = 0.0
        self.messages: list[str] = []  # output that is no task's: Ansible's own errors and warnings

    def host(self, name: str) -> HostState:
        if name not in self.hosts:
            self.hosts[name] = HostState(name=name)
        return self.hosts[name]

    def handle(self, event: dict) -> None:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        now = timestamp(event)
        if now:
            self.first = self.first or now
            self.last = max(self.last, now)
        name = data.get("host")
        if kind == "verbose" and event.get("stdout", "").strip():
            if not PROFILE_LINE.match(event["stdout"]):  # the task timer's lines say nothing here
                self.messages.append(event["stdout"].rstrip())
            return
        if kind == "playbook_on_stats":
            self.stats = {k: data.get(k) or {} for k in ("ok", "failures", "dark", "changed", "skipped")}
            for h in self.hosts.values():
                if h.status == "running":
                    h.status = "ok"
                h.finished = h.finished or now
            return
        if not name:
            return
        h = self.host(name)
        if kind == "runner_on_start":
            h.started = h.started or now
            phase = phase_of(self.command, data)
            if phase == "play" and h.phase != "waiting":
                phase = h.phase  # includes and the play's own tasks: still the phase they lead into
            if phase != h.phase:
                h.phase, h.phase_since = phase, now
            h.task = data.get("task") or ""
        elif kind in ("runner_item_on_ok", "runner_item_on_failed"):
            res = data.get("res") or {}
            if res.get("instance") and res.get("outcome"):
                h.instances[res["instance"]] = res
            if kind == "runner_item_on_failed" and not data.get("ignore_errors"):
                self.fail(h, data, now)
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            res = data.get("res") or {}
            if not res.get("results"):  # loop tasks: their items said why
                self.fail(h, data, now)
            elif not h.failures:
                self.fail(h, data, now)
        elif kind == "runner_on_unreachable":
            if (data.get("res") or {}).get("results") and h.failures:
                return  # a loop task's summary of the items already recorded
            h.status = "unreachable"
            h.failures.append(Failure(exitcodes.UNREACHABLE, data.get("task") or "", message_of(data.get("res") or {})))
            h.finished = now

    def fail(self, h: HostState, data: dict, now: float) -> None:
        code = classify(data)
        h.status = "unreachable" if code == exitcodes.UNREACHABLE else "failed"
        h.finished = now
        h.failures.append(Failure(code, data.get("task") or "", message_of(data.get("res") or {})))

    # ------------------------------------------------------------------ results

    def exit_code(self, runner_status: str | None = None, rc: int | None = None, interrupted: bool = False) -> int:
        if interrupted or runner_status == "canceled":
            return exitcodes.INTERRUPTED
        codes = [f.code for h in self.hosts.values() for f in h.failures]
        if codes:
            return exitcodes.worst(codes)
        if rc not in (0, None) or runner_status in ("failed", "timeout"):
            return exitcodes.FAILED
        return exitcodes.OK

    def rows(self) -> list[dict]:
        """One row per host and instance: host, instance, phase, result, duration, tok/s, accept length, detail."""
        rows = []
        for h in sorted(self.hosts.values(), key=lambda x: x.name):
            if not h.instances:
                f = h.failures[-1] if h.failures else None
                rows.append({"host": h.name, "instance": "", "phase": h.phase, "result": h.status,
                             "seconds": round(h.duration, 1), "tokens_per_s": None, "accept_length": None,
                             "detail": f.message if f else ""})  # fmt: skip
                continue
            for name, res in sorted(h.instances.items()):
                rows.append(instance_row(h, name, res))
        return rows

    def measurements(self) -> list[dict]:
        """What the ledger keeps per instance."""
        out = []
        for h in self.hosts.values():
            for name, res in h.instances.items():
                v = res.get("verify") or {}
                kg = res.get("known_good") or {}
                out.append({"host": h.name, "instance": name, "outcome": res.get("outcome"),
                            "profile": res.get("profile") or res.get("configured_profile"),
                            "running_profile": v.get("running_profile") or res.get("running_profile"),
                            "config_hash": kg.get("config_hash"),
                            "downtime_s": res.get("downtime_s"), "tokens_per_s": v.get("tokens_per_s"),
                            "accept_length": v.get("accept_length") if v else res.get("accept_length")})  # fmt: skip
        return out

    def result(self, exit_code: int) -> dict:
        return {
            "command": self.command,
            "exit_code": exit_code,
            "meaning": exitcodes.MEANING.get(exit_code, "?"),
            "duration_s": round(self.last - self.first, 1) if self.first else 0.0,
            "hosts": {
                h.name: {"status": h.status, "phase": h.phase, "task": h.task,
                         "failures": [{"code": f.code, "task": f.task, "message": f.message} for f in h.failures],
                         "instances": h.instances}  # fmt: skip
                for h in self.hosts.values()
            },
            "rows": self.rows(),
            "messages": self.messages[-40:],
        }

    def left_in(self) -> list[str]:
        """After an interruption: what each host was doing, and what that means for its servers."""
        lines = []
        for h in sorted(self.hosts.values(), key=lambda x: x.name):
            if h.status != "running":
                lines.append(f"{h.name}: {h.status} (phase {h.phase})")
            elif h.phase in ("restart", "rollback"):
                lines.append(f"{h.name}: interrupted during '{h.task}' ({h.phase}): the module goes on on the host and "
                             "finishes its restart or rollback; check with `python -m driver status`")  # fmt: skip
            else:
                lines.append(f"{h.name}: interrupted in phase {h.phase} ('{h.task}'); running servers were not touched")
        return lines


def instance_row(h: HostState, name: str, res: dict) -> dict:
    v = res.get("verify") or (res.get("rollback") or {}).get("verify") or {}
    failure = res.get("failure") or {}
    rb = res.get("rollback") or {}
    if failure:
        detail = f"{failure.get('phase')}: {failure.get('cause')}"
        if rb.get("attempted"):
            detail += f" -> rollback to {rb.get('to_profile')}: {rb.get('outcome')}"
    elif res.get("outcome") == "status":
        detail = (f"{res.get('state')}, profile {res.get('running_profile') or '?'}"
                  f"{' (DRIFT)' if res.get('drift') else ''}, health {res.get('health')}")  # fmt: skip
    elif v.get("failed_checks"):
        detail = "; ".join(v["failed_checks"])
    else:
        detail = "; ".join(v.get("warnings") or []) or (f"profile {v.get('running_profile')}" if v else "")
    phases = res.get("phases") or []
    reached = phases[-1]["phase"] if phases else h.phase
    seconds = res.get("downtime_s")
    return {"host": h.name, "instance": name, "phase": reached, "result": res.get("outcome"),
            "seconds": seconds if seconds is not None else round(h.duration, 1),
            "tokens_per_s": v.get("tokens_per_s") or (res.get("known_good") or {}).get("tokens_per_s"),
            "accept_length": v.get("accept_length") or res.get("accept_length"), "detail": detail}  # fmt: skip
