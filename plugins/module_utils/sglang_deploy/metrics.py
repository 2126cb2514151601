"""An instance's operations as Prometheus metrics, through node_exporter's textfile collector (issue #34).

Each restart, rollback and verify ends by writing what it measured into ``<dir>/sglang_deploy_<instance>.prom``
on the host (dir: node_exporter's --collector.textfile.directory, Debian's /var/lib/prometheus/node-exporter),
atomically (durable.write_atomic: node_exporter reads the old file or the new one, never half; the temporary
name does not end in .prom, which the collector would read). Written on the host by the module, they outlive the
controller: a run whose controller died still shows how it ended.

The instance is the label ``sglang_instance``: Prometheus' own ``instance`` is the scrape target's (node_exporter's
host:port) and would overwrite it. Counters are kept in the file itself: each write reads the previous one's.
docs/monitoring.md lists every metric (METRICS is its one source: tests/test_metrics.py holds the two equal).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import time

# Relative: sglang-gpu-metrics runs this file on the hosts as the package sglang_deploy (roles/sglang_monitoring).
from . import durable, outcomes

PREFIX = "sglang_deploy_"
# name: (type, labels beyond sglang_instance, help)
METRICS = {
    "sglang_deploy_operation_timestamp_seconds": (
        "gauge",
        ("operation",),
        "When the instance's last operation of this kind (restart, rollback, verify) ended, in Unix time.",
    ),
    "sglang_deploy_operation_outcome": (
        "gauge",
        ("operation", "outcome"),
        "1 for the outcome the instance's last operation of this kind ended with (restarted, rolled_back, "
        "not_recovered, verified, verify_failed, ...), the only series of that operation.",
    ),
    "sglang_deploy_operation_duration_seconds": (
        "gauge",
        ("operation",),
        "How long the instance's last operation of this kind took, from its lock to its end.",
    ),
    "sglang_deploy_restart_downtime_seconds": (
        "gauge",
        (),
        "How long the last restart or rollback left the instance not serving (its stop to its verified start).",
    ),
    "sglang_deploy_rollbacks_total": (
        "counter",
        (),
        "Restarts that failed and put the last-known-good configuration back, serving (outcome rolled_back).",
    ),
    "sglang_deploy_not_recovered_total": (
        "counter",
        (),
        "Restarts or rollbacks that left the instance not serving (outcome not_recovered).",
    ),
    "sglang_deploy_verified_tokens_per_second": (
        "gauge",
        ("profile",),
        "Output tokens per second the last verification measured under load, and the profile it ran.",
    ),
    "sglang_deploy_verified_accept_length": (
        "gauge",
        ("profile",),
        "Average speculative accept length the last verification measured (1.0: no draft token accepted).",
    ),
    "sglang_deploy_accept_length_floor": (
        "gauge",
        (),
        "The accept length below which verification fails (sglang_service_verify_accept_length_min).",
    ),
    "sglang_deploy_baseline_tokens_per_second": (
        "gauge",
        ("profile",),
        "The profile's baseline tokens per second (its `baseline`), which verification compares against.",
    ),
    "sglang_deploy_regression_threshold_ratio": (
        "gauge",
        (),
        "The fraction below the baseline that counts as a regression (sglang_service_verify_regression_threshold).",
    ),
    "sglang_deploy_rollout_gateways_healthy": (
        "gauge",
        (),
        "How many gateways listed the instance healthy when the last rollout that reached it ended (0: out of all).",
    ),
    "sglang_deploy_known_good_info": (
        "gauge",
        ("generation", "config_hash", "profile"),
        "1 for the instance's newest known-good generation: what a failed restart or a boot puts back.",
    ),
}
COUNTERS = {name for name, (kind, _, _) in METRICS.items() if kind == "counter"}
OPERATIONS = ("restart", "rollback", "verify")  # sglang_server's, written by recorded()
# Operations the playbooks run around sglang_server, written by record_outcome() (the sglang_metrics module).
PLAYBOOK_OPERATIONS = ("rollout",)
SAMPLE = re.compile(r"^(?P<name>[a-z_]+)\{(?P<labels>.*)\} (?P<value>\S+)$")
LABEL = re.compile(r'(?P<key>[a-z_]+)="(?P<value>(?:[^"\\]|\\.)*)"')


def path(directory: str, instance: str) -> str:
    return os.path.join(directory, f"sglang_deploy_{instance}.prom")


def escape(value: object) -> str:
    """A label value as the exposition format quotes it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


Key = tuple[str, tuple[tuple[str, str], ...]]  # (name, sorted labels)


def parse(text: str) -> dict[Key, float]:
    """The samples of a file this module wrote (comments and anything else skipped)."""
    samples: dict[Key, float] = {}
    for line in text.split("\n"):  # not splitlines(): it also splits at \x85 or \u2028, which a label value may hold
        m = SAMPLE.match(line)
        if not m or m["name"] not in METRICS:
            continue
        labels = tuple(sorted((k, unescape(v)) for k, v in LABEL.findall(m["labels"])))
        try:
            samples[(m["name"], labels)] = float(m["value"])
        except ValueError:
            continue
    return samples


def render(samples: dict[Key, float], table: dict | None = None) -> str:
    """The exposition format: each metric of `table` (METRICS) with its HELP and TYPE once, its samples sorted (a
    stable file)."""
    lines = []
    for name, (kind, _, text) in (METRICS if table is None else table).items():
        mine = sorted((labels, v) for (n, labels), v in samples.items() if n == name)
        if not mine:
            continue
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for labels, value in mine:
            body = ",".join(f'{k}="{escape(v)}"' for k, v in labels)
            lines.append(f"{name}{{{body}}} {number(value)}" if body else f"{name} {number(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))


def samples_of(
    instance: str, operation: str, res: dict, thresholds: dict, now: float, whole: bool = True
) -> dict[Key, float]:
    """What one operation's result says, as samples (each labelled with the instance). whole=False: the result is
    the last phase of a multi-node group's restart, whose duration and downtime this call did not see (left out)."""
    out: dict[Key, float] = {}

    def put(name: str, value, **labels) -> None:
        if value is None:
            return
        try:
            value = float(value)
        except (TypeError, ValueError):
            return
        if value != value:  # NaN: nothing measured
            return
        out[(name, tuple(sorted({"sglang_instance": instance, **{k: str(v) for k, v in labels.items()}}.items())))] = (
            value
        )

    put("sglang_deploy_operation_timestamp_seconds", now, operation=operation)
    put("sglang_deploy_operation_outcome", 1, operation=operation, outcome=res.get("outcome") or "unknown")
    phases = (res.get("phases") or []) if whole else []
    put("sglang_deploy_operation_duration_seconds", sum(p.get("seconds") or 0 for p in phases) if phases else None,
        operation=operation)  # fmt: skip
    if operation != "verify" and whole:
        put("sglang_deploy_restart_downtime_seconds", res.get("downtime_s"))
    verify = res.get("verify") or {}
    profile = verify.get("running_profile") or res.get("profile") or ""
    put("sglang_deploy_verified_tokens_per_second", verify.get("tokens_per_s"), profile=profile)
    put("sglang_deploy_verified_accept_length", verify.get("accept_length"), profile=profile)
    put("sglang_deploy_accept_length_floor", thresholds.get("accept_length_min"))
    put("sglang_deploy_baseline_tokens_per_second", thresholds.get("baseline_tokens_per_s"), profile=profile)
    put("sglang_deploy_regression_threshold_ratio", thresholds.get("regression_threshold"))
    if operation == "rollout":
        put("sglang_deploy_rollout_gateways_healthy", res.get("gateways_healthy"))
    good = res.get("known_good") or {}
    if good.get("generation"):
        put("sglang_deploy_known_good_info", 1, generation=good["generation"],
            config_hash=good.get("config_hash") or "", profile=good.get("profile") or "")  # fmt: skip
    return out


def update(
    before: dict[Key, float], instance: str, operation: str, res: dict, thresholds: dict, now: float, whole: bool = True
):
    """The file's samples after one operation: its own series replaced (one outcome per operation, one known-good
    generation, one verified profile), the counters carried on and counted up."""
    new = samples_of(instance, operation, res, thresholds, now, whole)
    replaced = {name for name, _ in new} | ({"sglang_deploy_operation_outcome"} if operation else set())
    if not whole:  # an earlier restart's duration and downtime would pass for this one's
        replaced |= {"sglang_deploy_operation_duration_seconds", "sglang_deploy_restart_downtime_seconds"}
    if operation == "rollout":  # an earlier rollout's count of gateways would pass for this one's
        replaced.add("sglang_deploy_rollout_gateways_healthy")

    def stale(key: Key) -> bool:
        name, labels = key
        if name in COUNTERS or name not in replaced:
            return False
        op = dict(labels).get("operation")
        return op is None or op == operation

    after = {k: v for k, v in before.items() if not stale(k)}
    after.update(new)
    outcome = res.get("outcome") if operation in OPERATIONS else None  # a rollout's restart counted itself
    for name, counted in (
        # a restart that failed and put the known-good back; an operator's rollback ends rolled_back too, by design
        ("sglang_deploy_rollbacks_total", outcome == outcomes.ROLLED_BACK and operation == "restart"),
        ("sglang_deploy_not_recovered_total", outcome == outcomes.NOT_RECOVERED),
    ):
        key = (name, (("sglang_instance", instance),))
        after[key] = before.get(key, 0.0) + (1.0 if counted else 0.0)
    return after


def write(
    directory: str | None, instance: str, operation: str, res: dict, thresholds: dict, whole: bool = True
) -> str | None:
    """Record one operation in the instance's file; what was written (its path), or None where there is no
    textfile collector (no directory). An OSError is the caller's to report: metrics never fail an operation."""
    if not directory or not os.path.isdir(directory):
        return None
    target = path(directory, instance)
    # One writer at a time per instance (a verify from another controller as a restart ends: the instance's own
    # lock is let go before this write); the lock file's name is no .prom, which node_exporter would read.
    with _locked(os.path.join(directory, f".sglang_deploy_{instance}.lock")):
        after = update(read(target), instance, operation, res, thresholds, time.time(), whole)
        durable.write_atomic(target, render(after), mode=0o644)  # node_exporter reads it as its own user
    return target


def read(target: str) -> dict[Key, float]:
    """The previous write's samples: nothing where there is none; a FIFO, a device or a link there is never opened
    (O_NONBLOCK, O_NOFOLLOW: an open that would hang or follow fails), and bytes not UTF-8 are replaced."""
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{target} is not a regular file")
        return parse(fh.read(1 << 20).decode("utf-8", errors="replace"))


@contextlib.contextmanager
def _locked(lock_path: str):
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def recorded(name: str, action, directory: str | None, thresholds: dict, whole: bool = True):
    """sglang_server's action (machine -> result), its end written here for restart, rollback and verify with a
    directory (None: check mode, a multi-node phase that is not the group's end, or none set; whole=False: the
    group's end, see samples_of); a failure to write is said in the result (metrics_error, and a warning), never
    the action's failure: the operation ended as it did."""

    def run(machine):
        res = action(machine)
        if name not in OPERATIONS or directory is None:
            return res
        try:
            return res | {"metrics": write(directory, machine.inst.name, name, res, thresholds, whole)}
        except Exception as exc:  # whatever it is: said, never raised
            why = f"the metrics were not written: {type(exc).__name__}: {exc}"
            return res | {"metrics": None, "metrics_error": why, "warnings": [*(res.get("warnings") or []), why]}

    return run


def record_outcome(directory: str, instance: str, operation: str, outcome: str, gateways_healthy: int | None) -> dict:
    """Where an operation of the playbooks (PLAYBOOK_OPERATIONS: a rollout) left the instance, written as recorded()
    writes sglang_server's: {"metrics": path or None} and, where the write failed, metrics_error (never raised)."""
    if operation not in PLAYBOOK_OPERATIONS:
        raise ValueError(f"operation {operation!r} is not one the playbooks record ({', '.join(PLAYBOOK_OPERATIONS)})")
    res = {"outcome": outcome, "gateways_healthy": gateways_healthy}
    try:
        return {"metrics": write(directory, instance, operation, res, {})}
    except Exception as exc:  # whatever it is: said, never raised
        return {"metrics": None, "metrics_error": f"the metrics were not written: {type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------------- the GPUs, whoever holds them

# Hyphens: no instance's file (sglang_deploy_<instance>.prom) can be this one, whatever the instance is named.
GPU_FILE = "sglang-deploy-gpus.prom"
# name: (type, labels, help); written every few seconds by sglang-gpu-metrics (roles/sglang_monitoring).
GPU_METRICS = {
    "sglang_deploy_gpu_memory_used_bytes": (
        "gauge",
        ("gpu", "unit"),
        "GPU memory held by compute processes, per GPU and per systemd unit (none: a process no unit owns, or a "
        "login session's: started by hand).",
    ),
    "sglang_deploy_gpu_read_ok": (
        "gauge",
        (),
        "1 when the last reading of nvidia-smi succeeded, 0 when it failed (the memory series are then absent).",
    ),
    "sglang_deploy_gpu_read_timestamp_seconds": ("gauge", (), "When the GPUs were last read, in Unix time."),
}
MIB = 1 << 20


def gpu_samples(snap: dict | None, now: float) -> dict[Key, float]:
    """A reading of the GPUs (gpu.snapshot(); None: nvidia-smi failed) as samples: each compute process's memory
    summed per GPU and unit, a unit of none for a process no unit owns or a login session's (gpu.owned_by_no_unit's
    rule, inlined: this module must not import gpu)."""
    out: dict[Key, float] = {
        ("sglang_deploy_gpu_read_ok", ()): 0.0 if snap is None else 1.0,
        ("sglang_deploy_gpu_read_timestamp_seconds", ()): now,
    }
    for proc in (snap or {}).get("processes") or []:
        if proc.get("gpu") is None or proc.get("used_mib") is None:
            continue
        unit = proc.get("unit") or ""
        if not unit or re.fullmatch(r"session-[^/]+\.scope", unit):
            unit = "none"
        key = ("sglang_deploy_gpu_memory_used_bytes", (("gpu", str(proc["gpu"])), ("unit", unit)))
        out[key] = out.get(key, 0.0) + float(proc["used_mib"]) * MIB
    return out


def write_gpus(directory: str, snap: dict | None) -> str:
    """The host's GPU file, replaced whole (a process gone is a series gone)."""
    target = os.path.join(directory, GPU_FILE)
    durable.write_atomic(target, render(gpu_samples(snap, time.time()), GPU_METRICS), mode=0o644)
    return target
