"""From ansible-runner's event stream to what happened on each host: no I/O, no presentation.

A Tracker is fed every event (live, or replayed from a recorded stream) and knows, per
host, the phase it is in and since when, what each SGLang instance's module reported
(sglang_server: outcome, phases, failure with its traceback, verification, tok/s, accept
length), and why a task failed. exit_code() maps all of it to driver/exitcodes.py.

Everything is read from structured fields: the module a task runs and its role for the
phase, a result's ``outcome`` and ``phases`` (names from plugins/module_utils/sglang_deploy/outcomes.py)
for what happened. Task names and the files tasks live in are free to change.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, progress
from driver import exitcodes

PROFILE_LINE = re.compile(r"^\w+day \d+ \w+ \d{4} ")

# A host's phases, as the progress display and the summary name them.
# The driver's own last line in a run's recorded stream (events.jsonl): how the run ended, as ansible-runner said
# (status, rc), whether it was interrupted, and the exit code the driver gave. A replayed stream carries the outcome it
# must map to (tests/driver/test_replay.py). Not an Ansible event: handle() passes over it.
RESULT = "sglang_deploy_result"


def result_event(runner_status: str | None, rc: int | None, interrupted: bool, exit_code: int) -> dict:
    return {
        "event": RESULT,
        "runner_status": runner_status,
        "rc": rc,
        "interrupted": interrupted,
        "exit_code": exit_code,
    }


# The fact a playbook sets with its own account of the run (playbooks/rollout.yml: where every replica stands and
# what the router lists); shown under the summary and kept in --json as "report".
REPORT_FACT = "sglang_rollout_report"
# The fact playbooks/status.yml sets with what every gateway thinks of each instance (one row per instance and
# gateway: host, instance, gateway, listed, healthy, status, in_flight, circuit, why); --json's "gateways".
VIEW_FACT = "sglang_gateway_view"
WAITING, PLAY, VALIDATE, CONFIGURE, PATCH = "waiting", "play", "validate", "configure", "patch"
SERVER_MODULE = "sglang_server"  # its phase is the command's own (restart, rollback, verify, status)
# The modules that say which phase a host is in wherever they run (short names: see module_of).
MODULE_PHASES = {
    "validate_argument_spec": VALIDATE,  # Ansible's check of a role's arguments
    "sglang_validate": VALIDATE,
    "sglang_stage": CONFIGURE,
    "sglang_patch": PATCH,
    "gpu_state": outcomes.GPUS,
    "sglang_state": "state",  # the deployed state against the desired one (deploy's first call, status --drift)
}
ROLE_PHASES = {"gpu_node": "node", "cuda": "cuda", "ml_env": "ml-env", "sglang": "sglang"}
# deploy's roles as its summary names them, each with its result (the service role writes the configuration; the
# routers' role runs in router.yml, which deploy.yml imports).
DEPLOY_ROLES = {**ROLE_PHASES, "sglang_service": "service", "sglang_router": "router"}
# The task Ansible runs first when a play's role begins (its argument check, named by ansible-core for the entry
# point): a role another includes (tasks_from) checks another entry point, and its handlers none.
ROLE_ENTRY = "Validating arguments against arg spec 'main'"
# A deploy's host whose state matched its desired one (sglang_state's check): no role ran, nothing changed.
STATE_MODULE = "sglang_state"  # in MODULE_PHASES
CURRENT = "none: current (as its last complete deploy left it)"
# Ansible's modules that change a host: in a role not named above (sglang_service), writing the configuration.
WRITING_MODULES = frozenset({"template", "copy", "file", "systemd_service", "systemd"})
# An instance whose restart or rollback was never begun: the driver's first Ctrl-C came before its turn
# (roles/sglang_service/tasks/server.yml skips the item once the run's cancel file exists).
NOT_BEGUN = "not begun (interrupted)"
WAITS = {
    "restart": "stop, clean GPUs, start, ready (model load, CUDA graphs), generate, verify",
    "rollback": "stop, clean GPUs, start the last-known-good, ready, generate, verify",
    "verify": "health_generate, generation, accept length, tok/s",
    "status": "unit, GPUs, health",
}


# The driver's own event: a detached restart's progress, read from the run's progress/ directory (written by
# plugins/action/sglang_server.py) and recorded in the stream like Ansible's events.
PROGRESS = "sglang_progress"
# What "no change" compares: a load that says nothing new for the stall time is flagged (driver/display.py).
PROGRESS_KEYS = ("phase", "step", "detail", "last_line", "done")


def progress_event(host: str, instance: str, doc: dict) -> dict:
    created = dt.datetime.fromtimestamp(doc.get("received") or 0, tz=dt.UTC).isoformat()
    return {"event": PROGRESS, "created": created, "event_data": {"host": host, "instance": instance, **doc}}


def timestamp(event: dict) -> float:
    created = event.get("created")
    if not created:
        return 0.0
    t = dt.datetime.fromisoformat(created)
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.timestamp()


@dataclass
class Failure:
    code: int
    task: str
    message: str
    task_uuid: str = ""  # the task whose item failed: forgiven when the task's own end says its errors are ignored


@dataclass
class HostState:
    name: str
    phase: str = WAITING
    phase_since: float = 0.0
    task: str = ""
    started: float = 0.0
    finished: float = 0.0
    status: str = "running"  # running, ok, failed, unreachable
    failures: list[Failure] = field(default_factory=list)
    instances: dict[str, dict] = field(default_factory=dict)
    # A detached restart's progress per instance (PROGRESS events), and when what it says last changed.
    progress: dict[str, dict] = field(default_factory=dict)
    progress_changed: dict[str, float] = field(default_factory=dict)
    # deploy: each role that ran, in order, with its tasks changed and whether one failed; the roles begun.
    roles: dict[str, dict] = field(default_factory=dict)
    begun: set[str] = field(default_factory=set)
    # deploy: the host's deployed state was current (sglang_state), so the deploy ended it there, no role run.
    current: bool = False

    @property
    def duration(self) -> float:
        return max(0.0, (self.finished or self.phase_since) - self.started) if self.started else 0.0


def role_of(data: dict) -> str | None:
    """deploy's name for the role a task belongs to (sglang.deploy.cuda or cuda: "cuda"), None for another."""
    return DEPLOY_ROLES.get((data.get("role") or "").rsplit(".", 1)[-1])


def roles_of(h: HostState) -> str:
    """deploy's roles as the summary says them, in the order they ran: "node ok, cuda 2 changed, ml-env failed"."""

    def said(r: dict) -> str:
        return "failed" if r["failed"] else f"{r['changed']} changed" if r["changed"] else "ok"

    if h.current and not h.roles:
        return CURRENT
    return ", ".join(f"{name} {said(r)}" for name, r in h.roles.items())


def module_of(data: dict) -> str:
    """The short name of the module a task runs: ansible.builtin.copy and a collection's copy are both copy."""
    action = data.get("resolved_action") or data.get("task_action") or ""
    return action.rsplit(".", 1)[-1]


def phase_of(command: str, data: dict) -> str:
    """The phase a task stands for, from its module and role; PLAY when neither says (the caller keeps the
    phase the host is in: includes, facts and checks belong to the phase they lead into)."""
    module = module_of(data)
    role = data.get("role") or ""
    if module == SERVER_MODULE:
        return command if command in WAITS else "restart"
    if module in MODULE_PHASES:
        return MODULE_PHASES[module]
    if role in ROLE_PHASES:
        return ROLE_PHASES[role]
    if role and module in WRITING_MODULES:
        return CONFIGURE
    return PLAY


def refused_setting(data: dict) -> bool:
    """A failure that means "a setting was refused" from a module that returns no outcome: Ansible's check of
    the role's arguments, or sglang_validate listing the problems it found (it fails with none listed when
    SGLang's parser could not run at all, which is no verdict on the configuration)."""
    module = module_of(data)
    if module == "validate_argument_spec":
        return True
    return module == "sglang_validate" and bool((data.get("res") or {}).get("problems"))


def classify(data: dict) -> int:
    """The exit code a failed task stands for: the module's outcome where it reports one."""
    res = data.get("res") or {}
    if res.get("unreachable"):
        return exitcodes.UNREACHABLE
    if res.get("outcome") in exitcodes.OUTCOME_CODES:
        return exitcodes.OUTCOME_CODES[res["outcome"]]
    if refused_setting(data):
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
        self.report: list[str] = []  # a playbook's own account, line by line (REPORT_FACT: where each replica stands)
        self.gateway_view: list[dict] = []  # VIEW_FACT's rows

    def host(self, name: str) -> HostState:
        if name not in self.hosts:
            self.hosts[name] = HostState(name=name)
        return self.hosts[name]

    def handle(self, event: dict) -> None:
        """Feed one event: Ansible's own output, the end of the play, or a host's task starting or ending."""
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        now = timestamp(event)
        if now:
            self.first = self.first or now
            self.last = max(self.last, now)
        if kind == "verbose" and event.get("stdout", "").strip():
            if not PROFILE_LINE.match(event["stdout"]):  # the task timer's lines say nothing here
                self.messages.append(event["stdout"].rstrip())
        elif kind == PROGRESS:
            self.on_progress(self.host(data["host"]), data, now)
        elif kind == "playbook_on_stats":
            self.on_stats(data, now)
        elif data.get("host"):
            self.on_host_event(kind, self.host(data["host"]), data, now)

    @staticmethod
    def on_progress(h: HostState, data: dict, now: float) -> None:
        name = data.get("instance") or "?"
        before = h.progress.get(name) or {}
        if any(before.get(k) != data.get(k) for k in PROGRESS_KEYS) or name not in h.progress_changed:
            h.progress_changed[name] = now
        h.progress[name] = data

    def on_stats(self, data: dict, now: float) -> None:
        """The play is over: every host still running ended well."""
        self.stats = {k: data.get(k) or {} for k in ("ok", "failures", "dark", "changed", "skipped")}
        for h in self.hosts.values():
            if h.status == "running":
                h.status = "ok"
            h.finished = h.finished or now

    def on_host_event(self, kind: str, h: HostState, data: dict, now: float) -> None:
        res = data.get("res") or {}
        role = h.roles.get(role_of(data) or "") if self.command == "deploy" else None
        if role is not None and kind == "runner_on_ok" and res.get("changed"):
            role["changed"] += 1
        elif (
            role is not None and kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors")
        ):
            role["failed"] = True
        if kind == "runner_on_ok" and module_of(data) == STATE_MODULE and res.get("current") and not h.roles:
            h.current = True  # the check, before any role (the record after them says current too)
        if kind == "runner_on_start":
            self.on_start(h, data, now)
        elif kind in ("runner_item_on_ok", "runner_item_on_failed", "runner_on_ok"):
            record_instance(h, res, module_of(data))
            report = (res.get("ansible_facts") or {}).get(REPORT_FACT)
            if kind == "runner_on_ok" and isinstance(report, list):
                self.report = [str(line) for line in report]
            view = (res.get("ansible_facts") or {}).get(VIEW_FACT)
            if kind == "runner_on_ok" and isinstance(view, list):
                self.gateway_view = [row for row in view if isinstance(row, dict)]
            if kind == "runner_item_on_failed" and not data.get("ignore_errors"):
                self.fail(h, data, now)
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            record_instance(h, res, module_of(data))
            if not res.get("results") or not h.failures:  # a loop task's items said why, unless none did
                self.fail(h, data, now)
        elif kind == "runner_on_failed":
            self.forgive(h, data.get("task_uuid") or "")
        elif kind == "runner_item_on_skipped" and module_of(data) == SERVER_MODULE:
            record_not_begun(h, res)
        elif kind == "runner_on_unreachable":
            record_instance(h, res, module_of(data))  # a status's instances asked before the host went
            if res.get("results") and h.failures:
                return  # a loop task's summary of the items already recorded
            h.status = "unreachable"
            h.failures.append(Failure(exitcodes.UNREACHABLE, data.get("task") or "", message_of(res)))
            h.finished = now

    def on_start(self, h: HostState, data: dict, now: float) -> None:
        """A task starts on a host: its module or role may move the host into another phase."""
        h.started = h.started or now
        phase = phase_of(self.command, data)
        if phase == PLAY and h.phase != WAITING:
            phase = h.phase  # includes, facts and checks: still the phase they lead into
        if self.command == "deploy":
            phase = self.deploy_phase(h, data, phase)
        if phase != h.phase:
            h.phase, h.phase_since = phase, now
        h.task = data.get("task") or ""

    @staticmethod
    def deploy_phase(h: HostState, data: dict, phase: str) -> str:
        """deploy's phase: a role's from its beginning (its main argument check) on, and the modules' (validate,
        configure, patch) inside it. The tasks of a role another includes (cuda's pip install runs ml_env's), its
        handlers at the play's end and the other entry points' checks stay in the phase the host is in."""
        role = role_of(data)
        if role:
            h.roles.setdefault(role, {"changed": 0, "failed": False})
        if module_of(data) == "validate_argument_spec":
            if role and role not in h.begun and (data.get("task") or "").startswith(ROLE_ENTRY):
                h.begun.add(role)
                return role
            return h.phase
        if phase in DEPLOY_ROLES.values():
            return h.phase  # a role's phase is entered at its beginning only
        return phase

    def fail(self, h: HostState, data: dict, now: float) -> None:
        code = classify(data)
        h.status = {exitcodes.UNREACHABLE: "unreachable", exitcodes.DRIFTED: outcomes.DRIFTED}.get(code, "failed")
        h.finished = now
        h.failures.append(
            Failure(code, data.get("task") or "", message_of(data.get("res") or {}), data.get("task_uuid") or "")
        )

    @staticmethod
    def forgive(h: HostState, task_uuid: str) -> None:
        """A loop task whose failures are ignored (ignore_errors: a multi-node phase before the last, whose failed
        rank the group's later phases roll back): ansible-runner's item events do not say so, only the task's own
        end does. Its items' failures are no failures of the host; its results stand."""
        if not task_uuid:
            return
        h.failures = [f for f in h.failures if f.task_uuid != task_uuid]
        if not h.failures and h.status == "failed":
            h.status, h.finished = "running", 0.0

    # ------------------------------------------------------------------ results

    def exit_code(self, runner_status: str | None = None, rc: int | None = None, interrupted: bool = False) -> int:
        """The most serious way any host ended; an interruption outranks all but a server left down (6) and a
        host lost (8) (exitcodes.SEVERITY)."""
        codes = [f.code for h in self.hosts.values() for f in h.failures]
        if interrupted or runner_status == "canceled":
            return exitcodes.worst([*codes, exitcodes.INTERRUPTED])
        if codes:
            return exitcodes.worst(codes)
        if rc not in (0, None) or runner_status in ("failed", "timeout"):
            return exitcodes.FAILED
        return exitcodes.OK

    def rows(self) -> list[dict]:
        """One row per host and instance: host, instance, phase, result, duration, tok/s, accept length, detail."""
        rows = []
        for h in sorted(self.hosts.values(), key=lambda x: x.name):
            rows += [instance_row(h, name, res) for name, res in sorted(h.instances.items())]
            if not h.instances or unexplained_failure(h):
                rows.append(host_row(h))
        return rows

    def measurements(self) -> list[dict]:
        """What the ledger keeps per instance."""
        out = []
        for h in self.hosts.values():
            for name, res in h.instances.items():
                v = res.get("verify") or {}
                kg = res.get("known_good") or {}
                out.append(
                    {
                        "host": h.name,
                        "instance": name,
                        "outcome": res.get("outcome"),
                        "profile": res.get("profile") or res.get("configured_profile"),
                        "running_profile": v.get("running_profile") or res.get("running_profile"),
                        "config_hash": kg.get("config_hash"),
                        "downtime_s": res.get("downtime_s"),
                        "tokens_per_s": v.get("tokens_per_s"),
                        "accept_length": v.get("accept_length") if v else res.get("accept_length"),
                        **step_seconds(res.get("steps") or []),
                    }
                )
        return out

    def result(self, exit_code: int) -> dict:
        return {
            "command": self.command,
            "exit_code": exit_code,
            "meaning": exitcodes.MEANING.get(exit_code, "?"),
            "duration_s": round(self.last - self.first, 1) if self.first else 0.0,
            "hosts": {
                h.name: {
                    "status": h.status,
                    "phase": h.phase,
                    **({"role_results": h.roles} if self.command == "deploy" else {}),
                    "task": h.task,
                    "failures": [{"code": f.code, "task": f.task, "message": f.message} for f in h.failures],
                    "instances": h.instances,
                }
                for h in self.hosts.values()
            },
            "rows": self.rows(),
            "messages": self.messages[-40:],
            "report": self.report,
            "gateways": self.gateway_view,
        }

    def left_in(self, abandoned: bool = True) -> list[str]:
        """After an interruption: what each host was doing, and what that means for its servers; then what
        each instance's restart, rollback, verify or status ended in (not begun: never touched).

        abandoned: ansible-playbook was stopped (a second Ctrl-C), so a host still running was cut off there;
        otherwise the playbook ran to its end and every host's own result stands."""
        lines = []
        for h in sorted(self.hosts.values(), key=lambda x: x.name):
            if h.status != "running":
                lines.append(f"{h.name}: {h.status} (phase {h.phase})")
            elif h.phase in ("restart", "rollback"):
                lines.append(
                    f"{h.name}: interrupted during '{h.task}' ({h.phase}): the module goes on on the host and "
                    "finishes its restart or rollback; check with `python -m driver status`"
                )
            elif abandoned:
                lines.append(f"{h.name}: interrupted in phase {h.phase} ('{h.task}'); running servers were not touched")
            else:
                lines.append(f"{h.name}: {h.status} (phase {h.phase})")
            for name, res in sorted(h.instances.items()):
                if res.get("outcome") not in (outcomes.STAGED, outcomes.UNCHANGED, outcomes.INVALID_CONFIG):
                    lines.append(f"  {h.name}/{name}: {res.get('outcome')}")
        return lines


def unexplained_failure(h: HostState) -> bool:
    """A host failed, yet no instance's result says so (a task after the modules that reported, such as
    sglang_stage's "staged"): the host's own row must show the failure, or the summary reads all green."""
    failing = (res.get("outcome") in exitcodes.OUTCOME_CODES for res in h.instances.values())
    return bool(h.failures) and not any(failing)


def host_row(h: HostState) -> dict:
    """A host's row without an instance: where it got to and its last failure."""
    f = h.failures[-1] if h.failures else None
    return {
        "host": h.name,
        "instance": "",
        "phase": h.phase,
        "roles": roles_of(h),
        "result": h.status,
        "seconds": round(h.duration, 1),
        "tokens_per_s": None,
        "accept_length": None,
        "detail": f.message if f else "",
    }


def record_instance(h: HostState, res: dict, module: str = "") -> None:
    """Keep an instance's result: whatever module reported on it (validate, stage, server), the latest wins; a
    status of every instance in one task (plugins/action/sglang_server.py, render) lists each under `instances`."""
    each = res.get("instances") if module == SERVER_MODULE and isinstance(res.get("instances"), list) else [res]
    for one in each:
        if isinstance(one, dict) and one.get("instance") and one.get("outcome"):
            h.instances[one["instance"]] = one


def record_not_begun(h: HostState, res: dict) -> None:
    """An instance's server action skipped by its condition, which is the run's cancel file: never begun."""
    item = res.get(res.get("ansible_loop_var") or "item")
    name = item.get("name") if isinstance(item, dict) else None
    if name and res.get("skip_reason") == "Conditional result was False":
        h.instances[name] = {"instance": name, "outcome": NOT_BEGUN, "profile": item.get("profile")}


def step_seconds(steps: list[dict]) -> dict:
    """The seconds a restart's start spent loading weights (target and draft) and capturing CUDA graphs, from
    its progress steps (sglang_deploy.progress); none without steps (a restart that reported none)."""
    own = [s for s in steps if s.get("phase") == outcomes.START]
    if not own:
        return {"load_s": None, "capture_s": None}

    def total(names) -> float:
        return round(sum(s.get("seconds") or 0 for s in own if s.get("step") in names), 3)

    return {
        "load_s": total((progress.WEIGHTS, progress.DRAFT_WEIGHTS)),
        "capture_s": total((progress.GRAPHS, progress.DRAFT_GRAPHS)),
    }


def instance_row(h: HostState, name: str, res: dict) -> dict:
    """One instance's row in the summary, from its module's result."""
    v = res.get("verify") or (res.get("rollback") or {}).get("verify") or {}
    seconds = res.get("downtime_s")
    if res.get("outcome") == NOT_BEGUN:
        return {**host_row(h), "instance": name, "result": NOT_BEGUN, "seconds": None, "detail": ""}
    return {
        "host": h.name,
        "instance": name,
        "phase": phase_reached(h, res),
        "roles": roles_of(h),
        "result": res.get("outcome"),
        "seconds": seconds if seconds is not None else round(h.duration, 1),
        "tokens_per_s": v.get("tokens_per_s") or (res.get("known_good") or {}).get("tokens_per_s"),
        "accept_length": v.get("accept_length") or res.get("accept_length"),
        "detail": detail_of(res, v),
        **({"steps": res["steps"]} if res.get("steps") else {}),
    }


def phase_reached(h: HostState, res: dict) -> str:
    """The last phase the module reached (rollback phases come prefixed outcomes.ROLLBACK_PREFIX): where a
    restart stopped is what the operator asks first. Without phases, the host's own."""
    phases = res.get("phases") or []
    if not phases:
        return h.phase
    return phases[-1].get("phase") or h.phase


def detail_of(res: dict, v: dict) -> str:
    """What the operator reads next to the outcome: who holds the lock, the cause, or verification."""
    outcome = res.get("outcome")
    if outcome == outcomes.LOCKED and (res.get("lock") or {}).get("holder"):
        return lock_detail(res["lock"]["holder"])
    if res.get("failure"):
        return failure_detail(res["failure"], res.get("rollback") or {})
    if outcome == outcomes.STATUS:
        return (
            f"{res.get('state')}, profile {res.get('running_profile') or '?'}"
            f"{' (DRIFT)' if res.get('drift') else ''}, health {res.get('health')}"
        )
    if v.get("failed_checks"):
        return "; ".join(v["failed_checks"])
    if outcome not in outcomes.SUCCESS and outcome != outcomes.ROLLED_BACK:
        return message_of(res)  # a refusal without a failure record (invalid_config): the module's message
    return "; ".join(v.get("warnings") or []) or (f"profile {v.get('running_profile')}" if v else "")


def lock_detail(holder: dict) -> str:
    """Who holds the instance's lock, so the operator can find that operation instead of guessing."""
    return (
        f"held by pid {holder.get('pid')} ({holder.get('command')}) from controller {holder.get('controller')}"
        f" since {when(holder.get('since'))}"
    )


def when(since) -> str:
    """A lock's start as UTC ISO 8601 when it comes as seconds since the epoch; as given otherwise."""
    if isinstance(since, (int, float)) and not isinstance(since, bool):
        return dt.datetime.fromtimestamp(since, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(since)


def failure_detail(failure: dict, rollback: dict) -> str:
    """The failed phase and its cause, then what the rollback did (or why there was none)."""
    detail = f"{failure.get('phase')}: {failure.get('cause')}"
    if rollback.get("attempted"):
        target = rollback.get("to_profile") or f"generation {rollback.get('to_generation')}"
        detail += f" -> rollback to {target}: {rollback.get('outcome')}"
    elif rollback.get("why"):
        detail += f" -> not rolled back: {rollback['why']}"
    return detail
