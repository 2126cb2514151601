"""The one place that runs Ansible: a playbook through ansible-runner, events to a callback."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.progress import PROGRESS_DIR_ENV
from driver import paths

# Event fields the driver never needs; dropped before events are handed on or recorded.
_BULKY = ("stdout",)
# How often, at most, ansible-runner asks cancelled() while ansible-playbook prints nothing.
POLL_S = 0.5


@dataclass
class Job:
    playbook: str
    inventory: str | None = None
    limit: str | None = None
    extravars: list[str] | None = None  # each as ansible-playbook's -e takes it (k=v, JSON, @file)
    check: bool = False
    verbosity: int = 0
    env: dict[str, str] | None = None  # more environment for ansible-playbook (SGLANG_DEPLOY_CANCEL_FILE)
    scrub: Callable[[dict], dict] | None = None  # applied to each event before it is recorded or handed on
    # Where plugins/action/sglang_server.py writes each detached restart's progress (created 0700 here); each
    # change becomes a progress event (driver/events.py PROGRESS), recorded and handed on like Ansible's.
    progress_dir: Path | None = None
    stall_s: float = 300.0  # a progress unchanged this long (not done) is flagged once: an event with stalled_s


@dataclass
class Outcome:
    status: str  # successful, failed, canceled, timeout
    rc: int


def run(
    job: Job, on_event: Callable[[dict], None], cancelled: Callable[[], bool], record: Path | None = None
) -> Outcome:
    """Run job.playbook; call on_event for every event; stop when cancelled() says so.

    cancelled() is asked on every line of output and at least every POLL_S seconds; when it says so,
    ansible-runner kills ansible-playbook's process group. With record, every event is also appended to that
    file (created 0600) as one JSON line (a replayable stream).
    """
    import ansible_runner  # heavy: kept off the CLI's start-up path

    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open_private(record)) if record else None
        # 0700 (mkdtemp), removed however the run ends (an exception, KeyboardInterrupt): it holds the -e files.
        private = Path(tempfile.mkdtemp(prefix="sglang-deploy-runner-"))
        stack.callback(shutil.rmtree, private, ignore_errors=True)
        cmdline = extravars_args(job.extravars or [], private / "extravars")
        if job.check:
            cmdline += ["--check", "--diff"]
        return _run(ansible_runner, job, cmdline, private, sink, on_event, cancelled)


def extravars_args(extravars: list[str], directory: Path) -> list[str]:
    """ansible-playbook's -e arguments, each value in a file of its own (0600, in directory, made 0700) given as
    -e @file: a value on a command line is readable by every local user (/proc/PID/cmdline) for the whole run.

    Each file holds what Ansible would have read from the argument (ansible.utils.vars.load_extra_vars): YAML or
    JSON as written; key=value pairs as Ansible's own parse_kv splits them, in JSON. Files are given in order,
    so later ones win as later -e do. An @file of the operator's own stays as it is: a path."""
    from ansible.parsing.splitter import parse_kv

    directory.mkdir(mode=0o700)
    out = []
    for i, ev in enumerate(extravars):
        if not ev:
            continue  # Ansible skips an empty -e
        if ev.startswith(
            "@"
        ):  # ansible-playbook runs in its own directory: the operator's relative path, made absolute
            out += ["-e", "@" + str(Path(ev[1:]).expanduser().resolve())]
            continue
        # YAML/JSON as written; '/' or '.' too, which Ansible refuses (a file needs '@') and still refuses from it.
        content = ev if ev[0] in "[{/." else json.dumps(parse_kv(ev))
        path = directory / f"{i:03d}.vars"
        with open(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "w", encoding="utf-8") as fh:
            fh.write(content)
        out += ["-e", f"@{path}"]
    return out


def open_private(path: Path):
    """path opened for appending, created 0600 (the run's directory is 0700 as well)."""
    return open(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600), "a", encoding="utf-8")


def _run(ansible_runner, job: Job, cmdline: list[str], private: Path, sink, on_event, cancelled) -> Outcome:
    """ansible-runner's run of job in private: each event (the progress files' too) slimmed, recorded, handed on."""
    pump = Pump(job.progress_dir, job.stall_s) if job.progress_dir else None

    def handler(event: dict) -> bool:
        # Task output is in event_data; keep stdout only where it is all there is (errors, warnings).
        slim = event if event.get("event") == "verbose" else {k: v for k, v in event.items() if k not in _BULKY}
        if job.scrub:
            slim = job.scrub(slim)
        if sink:
            sink.write(json.dumps(slim, default=str) + "\n")
            sink.flush()
        on_event(slim)
        return False  # runner need not keep the event's file: the stream is recorded above

    def cancel() -> bool:
        if pump:
            for event in pump.poll():
                handler(event)
        return cancelled()

    # ansible-runner reads its settings from this file only (a settings= argument is dropped without it).
    (private / "env").mkdir(mode=0o700)
    (private / "env" / "settings").write_text(json.dumps({"pexpect_timeout": POLL_S}), encoding="utf-8")
    collection = paths.collection()  # the checkout, or the installed collection (driver/paths.py)
    envvars = playbook_env(job, collection)
    r = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(collection),
        playbook=str(collection / job.playbook),
        inventory=inventory_arg(job.inventory),
        limit=job.limit,
        cmdline=shlex.join(cmdline) or None,
        envvars={**envvars, **operators_ansible_env(envvars["ANSIBLE_COLLECTIONS_PATH"])},
        verbosity=job.verbosity or None,
        event_handler=handler,
        cancel_callback=cancel,
        quiet=True,
        suppress_env_files=True,
    )
    if pump:
        for event in pump.poll():  # the last answers, written as ansible-playbook ended
            handler(event)
    return Outcome(status=r.status, rc=r.rc if r.rc is not None else 1)


def playbook_env(job: Job, collection: Path) -> dict[str, str]:
    """ansible-playbook's environment: the project's config, collection and roles by path (it runs in
    ansible-runner's private directory), this Python's ansible-playbook, then the job's own variables."""
    envvars = {
        # The checkout's ansible.cfg; installed, the copy of it the wheel carries.
        "ANSIBLE_CONFIG": str(paths.ansible_cfg()),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        # ansible-runner runs from its private dir: name the project's plugin paths outright.
        "ANSIBLE_ROLES_PATH": str(collection / "roles"),
        # The collection sglang.deploy the driver belongs to (a checkout's collections/, whose
        # ansible_collections/sglang/deploy is a symlink onto it; or the site-packages it is installed in), ahead of
        # any other copy.
        "ANSIBLE_COLLECTIONS_PATH": os.pathsep.join(
            [str(paths.collections_path()), "~/.ansible/collections", "/usr/share/ansible/collections"]
        ),
        # The ansible-playbook of this Python's environment (.venv), whether on PATH or not.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **(job.env or {}),
        **({PROGRESS_DIR_ENV: str(job.progress_dir)} if job.progress_dir else {}),
    }
    default = paths.default_inventory()
    if not job.inventory and default:
        envvars["ANSIBLE_INVENTORY"] = str(default)
    return envvars


class Pump:
    """The progress files of a run (one per host and instance) read when they change: progress events; and
    once per stall, the same progress flagged with stalled_s when it has not changed for stall_s."""

    def __init__(self, directory: Path, stall_s: float = 300.0, clock: Callable[[], float] = time.time):
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir = directory
        self.stall_s = stall_s
        self.clock = clock
        self.seen: dict[str, int] = {}
        self.docs: dict[str, dict] = {}
        self.changed: dict[str, float] = {}
        self.flagged: set[str] = set()

    def poll(self) -> list[dict]:
        from driver.events import PROGRESS_KEYS, progress_event

        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                mtime = path.stat().st_mtime_ns
                if self.seen.get(path.name) == mtime:
                    continue
                doc = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # replaced as it was read: the next poll reads it
            self.seen[path.name] = mtime
            before = self.docs.get(path.name)
            if before is None or any(before.get(k) != doc.get(k) for k in PROGRESS_KEYS):
                self.changed[path.name] = self.clock()
                self.flagged.discard(path.name)
            self.docs[path.name] = doc
            out.append(progress_event(*self.names(path.name), doc))
        now = self.clock()
        for name, doc in self.docs.items():
            if doc.get("done") or name in self.flagged or now - self.changed[name] < self.stall_s:
                continue
            self.flagged.add(name)
            stalled = {**doc, "stalled_s": round(now - self.changed[name], 1), "received": now}
            out.append(progress_event(*self.names(name), stalled))
        return out

    @staticmethod
    def names(file_name: str) -> tuple[str, str]:
        host, _, instance = file_name[: -len(".json")].rpartition(".")
        return host, instance


def operators_ansible_env(ours: str) -> dict[str, str]:
    """The operator's ANSIBLE_* for ansible-playbook, which runs in the collection's directory, not theirs: relative
    paths (ANSIBLE_INVENTORY's sources, ANSIBLE_CONFIG) made absolute as the driver's own check read them; their
    collections path after the driver's, never instead of it (their copy of sglang.deploy would run the hosts' side
    while the driver reads the results as its own copy writes them)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("ANSIBLE_")}
    if env.get("ANSIBLE_INVENTORY"):
        env["ANSIBLE_INVENTORY"] = ",".join(
            str(Path(s).expanduser().resolve()) if s and os.path.exists(os.path.expanduser(s)) else s
            for s in env["ANSIBLE_INVENTORY"].split(",")
        )
    if env.get("ANSIBLE_CONFIG"):
        env["ANSIBLE_CONFIG"] = str(Path(env["ANSIBLE_CONFIG"]).expanduser().resolve())
    for key in ("ANSIBLE_COLLECTIONS_PATH", "ANSIBLE_COLLECTIONS_PATHS"):
        if env.get(key):
            env[key] = ours + os.pathsep + env[key]
    return env


def inventory_arg(inventory: str | None) -> str | None:
    """-i for ansible-playbook, which runs in its own directory: a path made absolute; a host list as is."""
    if not inventory:
        return None
    return inventory if "," in inventory else str(Path(inventory).resolve())
