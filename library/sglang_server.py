#!/usr/bin/python
"""Ansible module: restart one SGLang instance safely, verify it, roll back, report status."""

from __future__ import annotations

DOCUMENTATION = r"""
module: sglang_server
short_description: Safe restart, verification and status of one SGLang systemd instance
description:
  - C(restart) runs on the host, in one call, polling as it goes (no Ansible round trips):
    preflight (only this unit's processes on its GPUs) -> stop the unit (every process of
    it) -> wait for clean GPUs -> start -> wait until ready, failing fast when the unit fails
    or exits (reported with the journal tail and its traceback) -> a real generation with a
    fixed prompt -> verify -> record the running configuration as last-known-good.
    When any step after the stop fails, the last-known-good unit and environment are put
    back and started, verified and reported (unless I(rollback=false)).
  - C(verify) checks a running instance (see the checks in the return value).
  - C(status) reports unit state, running profile, drift, GPU memory, health and the
    speculative accept length, without load.
  - C(rollback) puts the last-known-good unit and environment back and restarts them as
    C(restart) does (stop, clean GPUs, start, ready, generate, verify).
options:
  action:
    type: str
    choices: [restart, verify, status, rollback]
    required: true
  name: {type: str, required: true, description: Instance name.}
  unit: {type: str, description: Unit name (default sglang-NAME.service).}
  port: {type: int, required: true}
  gpus: {type: list, elements: int, required: true}
  service_user: {type: str, default: sglang}
  expected_argv: {type: list, elements: str, required: true, description: The ExecStart argv the configuration renders.}
  profile: {type: str, required: true, description: The profile the configuration names.}
  profiles_argv: {type: dict, default: {}, description: Profile name to rendered argv, to name what is running.}
  config_files: {type: list, elements: path, default: [], description: The unit and environment files (recorded, restored).}
  state_dir: {type: path, default: /var/lib/sglang}
  ready_timeout: {type: float, default: 900}
  gpu_timeout: {type: float, default: 120}
  gpu_interval: {type: float, default: 0.1}
  max_used_mib: {type: int, default: 1024}
  stop_policy: {type: str, choices: [none, own, force], default: own}
  rollback: {type: bool, default: true}
  prompt: {type: str, default: "The capital of France is"}
  max_new_tokens: {type: int, default: 16}
  accept_length_min: {type: float, default: 1.5}
  load_requests: {type: int, default: 4}
  load_max_new_tokens: {type: int, default: 64}
  baseline_tokens_per_s: {type: float, description: The profile's recorded output tokens/s.}
  no_spec_tokens_per_s: {type: float, description: Output tokens/s without speculation (the yardstick).}
  regression_threshold: {type: float, default: 0.1, description: Fraction below a baseline that counts as a regression.}
  regression_action: {type: str, choices: [warn, fail], default: warn}
  patch_manifest: {type: path, description: SGLang's patch manifest, checked against the installed files.}
  nnodes: {type: int, default: 1, description: Nodes the instance spans (one model over several nodes).}
  node_rank: {type: int, default: 0, description: This node's rank; only rank 0 serves HTTP.}
  phase:
    type: str
    choices: [all, stop, start, confirm]
    default: all
    description:
      - C(all) is the whole restart with rollback (one node). An instance spanning nodes restarts in
        three tasks so that every rank is down before any starts - C(stop) (preflight, stop, clean
        GPUs) on all its nodes, then C(start) (rank 0 also waits until ready, generates and verifies),
        then C(confirm) (ranks above 0 check they still run and record known-good). No automatic
        rollback across nodes - a failure stops the instance on the failing node and is reported.
author: sglang-deploy
"""

RETURN = r"""
outcome:
  description: >-
    restart: restarted, gpus_not_clean (nothing touched), rolled_back (the new configuration
    failed; the last-known-good one serves), not_recovered. verify: verified or verify_failed.
    status: status.
  type: str
  returned: always
phases:
  description: Each step with its seconds and result.
  type: list
  returned: restart
failure:
  description: What failed - phase, cause (the traceback's last line, the flag error, the offenders), journal_tail, traceback.
  type: dict
  returned: on failure
rollback:
  description: The rollback's phases, outcome and verification.
  type: dict
  returned: when a rollback ran
verify:
  description: checks (name, ok, severity, detail), running_profile, tokens_per_s, accept_length.
  type: dict
  returned: restart, verify
"""

import hashlib
import json
import os
import shutil
import signal
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_gpu import NvidiaSmiError, format_offender, may_stop, snapshot, wait_clean
from ansible.module_utils.sglang_unit import (
    HttpError, cause_of, cmdline, generate, get_json, has_failed, journal, metric, request, show, systemctl,
    traceback_of,
)  # fmt: skip


class Failed(Exception):
    def __init__(self, phase: str, cause: str, **details):
        super().__init__(cause)
        self.phase, self.cause, self.details = phase, cause, details


class Instance:
    def __init__(self, p: dict):
        self.p = p
        self.name = p["name"]
        self.unit = p["unit"] or f"sglang-{self.name}.service"
        self.base = f"http://127.0.0.1:{p['port']}"
        self.kg_dir = os.path.join(p["state_dir"], "known-good", self.name)
        self.serves_http = p["node_rank"] == 0  # the other ranks of a multi-node instance have no HTTP server

    # ------------------------------------------------------------------ pieces

    def running(self, props: dict) -> tuple[list[str], str | None]:
        """The main process's argv, and the profile it is: the configured one, another known one, or None."""
        argv = cmdline(props["MainPID"]) if props["MainPID"] else []
        if argv and argv == self.p["expected_argv"]:
            return argv, self.p["profile"]
        return argv, next((name for name, a in self.p["profiles_argv"].items() if a == argv), None)

    def failure_from_journal(self, phase: str, props: dict, fallback: str) -> Failed:
        detected = time.monotonic()
        lines: list[str] = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # journald may lag the exit by a few ms
            lines = journal(self.unit, props.get("InvocationID") or None)
            if lines:
                break
            time.sleep(0.05)
        cause = cause_of(lines) or fallback
        exit_info = f"{props.get('ExecMainCode', '?')}/{props.get('ExecMainStatus', '?')}"
        timing = {}
        exited = props.get("ExecMainExitTimestampMonotonic") or 0
        if exited:  # CLOCK_MONOTONIC in microseconds, the clock of time.monotonic()
            timing = {"exit_to_detect_s": round(detected - exited / 1e6, 3), "exit_to_report_s": round(time.monotonic() - exited / 1e6, 3)}
        return Failed(phase, cause, journal_tail=lines[-40:], traceback=traceback_of(lines),
                      unit_state=f"{props.get('ActiveState')}/{props.get('SubState')}", exit=exit_info, **timing)  # fmt: skip

    def preflight(self) -> dict:
        """Refuse before touching anything when a process of another unit/user holds the GPUs."""
        snap = snapshot()
        foreign = [
            proc for proc in snap["processes"]
            if proc["gpu"] in self.p["gpus"] and proc.get("unit") != self.unit
            and not may_stop(proc, self.p["stop_policy"], self.unit, self.p["service_user"])
        ]  # fmt: skip
        if foreign:
            raise Failed("preflight", "GPUs held by processes outside this service: " +
                         "; ".join(format_offender(x) for x in foreign) +
                         ". Nothing was stopped. Stop them, or rerun with stop policy 'force'.",
                         offenders=foreign)  # fmt: skip
        return {"processes": len([x for x in snap["processes"] if x["gpu"] in self.p["gpus"]])}

    def stop(self) -> dict:
        out = systemctl("stop", self.unit)
        if out.returncode != 0:
            raise Failed("stop", f"systemctl stop {self.unit} failed: {out.stderr.strip()}")
        props = show(self.unit)
        if props["MainPID"]:
            raise Failed("stop", f"{self.unit} still has main pid {props['MainPID']} after stop")
        return {"state": f"{props['ActiveState']}/{props['SubState']}"}

    def wait_gpus(self) -> dict:
        p = self.p
        res = wait_clean(p["gpus"], p["gpu_timeout"], p["gpu_interval"], p["max_used_mib"], p["stop_policy"],
                         self.unit, p["service_user"])  # fmt: skip
        if not res["clean"]:
            raise Failed("gpus", res["message"], offenders=res["offenders"], busy=res["busy"])
        return {"waited_s": round(res["waited_s"], 3), "polls": res["polls"], "stopped": res["stopped"]}

    def start_and_wait_ready(self) -> dict:
        systemctl("reset-failed", self.unit)
        before = show(self.unit).get("InvocationID")
        out = systemctl("start", "--no-block", self.unit)
        if out.returncode != 0:
            raise Failed("start", f"systemctl start {self.unit} failed: {out.stderr.strip()}")
        started = time.monotonic()
        deadline = started + self.p["ready_timeout"]
        running_since = None
        while True:
            props = show(self.unit)
            # Until the start job runs, the unit is still the stopped one (same invocation).
            if props.get("InvocationID") != before and has_failed(props):
                raise self.failure_from_journal("start", props, f"{self.unit} exited while starting")
            if props["ActiveState"] == "active" and not self.serves_http:
                # A rank above 0: running, and still running a moment later, is all it can show alone.
                running_since = running_since or time.monotonic()
                if time.monotonic() - running_since >= 2.0:
                    return {"main_pid": props["MainPID"], "running_after_s": round(time.monotonic() - started, 3)}
            elif props["ActiveState"] == "active":
                try:
                    code, _ = request(f"{self.base}/health", timeout=2)
                except HttpError:
                    code = None
                if code == 200:
                    return {"main_pid": props["MainPID"], "ready_after_s": round(time.monotonic() - started, 3)}
            if time.monotonic() >= deadline:
                lines = journal(self.unit, props.get("InvocationID") or None)
                raise Failed("ready", f"{self.unit} not ready after {self.p['ready_timeout']:g}s (unit "
                              f"{props['ActiveState']}/{props['SubState']}; /health never answered 200). "
                              f"Last log line: {lines[-1] if lines else 'none'}",
                              journal_tail=lines[-40:], traceback=traceback_of(lines))  # fmt: skip
            time.sleep(0.1)

    def generation(self) -> dict:
        try:
            return generate(self.base, self.p["prompt"], self.p["max_new_tokens"])
        except HttpError as exc:
            # The seed's failure: the server loaded, then died on its first decode.
            deadline = time.monotonic() + 2.0
            props = show(self.unit)
            while time.monotonic() < deadline and not has_failed(props):
                time.sleep(0.05)
                props = show(self.unit)
            if has_failed(props):
                raise self.failure_from_journal("generate", props, f"the server died on its first generation ({exc})")
            raise Failed("generate", f"generation failed: {exc}")

    # ------------------------------------------------------------------ verify

    def verify(self) -> dict:
        p = self.p
        checks: list[dict] = []

        def check(name: str, ok: bool, detail: str, severity: str = "fail") -> None:
            checks.append({"name": name, "ok": bool(ok), "severity": "ok" if ok else severity, "detail": detail})

        props = show(self.unit)
        check("unit", props["ActiveState"] == "active" and props["SubState"] == "running" and props["NRestarts"] == 0,
              f"{self.unit} {props['ActiveState']}/{props['SubState']}, restarted {props['NRestarts']} times since started")  # fmt: skip
        running, profile = self.running(props)
        check("drift", running == p["expected_argv"],
              f"running profile {profile}" if running == p["expected_argv"] else
              f"running command line differs from the rendered configuration: {drift_summary(p['expected_argv'], running)}; "
              f"running profile: {profile or 'none of the known profiles (launched by hand?)'}")  # fmt: skip
        snap = snapshot()
        mine = [x for x in snap["processes"] if x["gpu"] in p["gpus"]]
        strangers = [x for x in mine if x.get("unit") != self.unit]
        check("gpu_processes", not strangers,
              f"{len(mine)} processes of {self.unit} on GPUs {p['gpus']}" if not strangers else
              "not the service's: " + "; ".join(format_offender(x) for x in strangers))  # fmt: skip
        gpu_mem = {g["index"]: g["memory_used_mib"] for g in snap["gpus"] if g["index"] in p["gpus"]}
        if not self.serves_http:
            if p["patch_manifest"]:
                check(*patch_check(p["patch_manifest"]))
            return finish({"checks": checks, "running_profile": profile, "gpu_memory_mib": gpu_mem,
                           "tokens_per_s": None, "accept_length": None, "node_rank": p["node_rank"]})  # fmt: skip
        try:
            code, _ = request(f"{self.base}/health_generate", timeout=60)
            check("health_generate", code == 200, f"/health_generate HTTP {code}")
        except HttpError as exc:
            check("health_generate", False, str(exc))
        result = {"checks": checks, "running_profile": profile, "gpu_memory_mib": gpu_mem,
                  "tokens_per_s": None, "accept_length": None}  # fmt: skip
        try:
            gen = generate(self.base, p["prompt"], p["max_new_tokens"])
            check("generate", True, f"{gen['completion_tokens']} tokens: {gen['text'][:60]!r}")
        except HttpError as exc:
            check("generate", False, str(exc))
            return finish(result)
        expected_algo = flag_value(p["expected_argv"], "--speculative-algorithm")
        try:
            info = get_json(f"{self.base}/server_info")
        except (HttpError, ValueError) as exc:
            info = {}
            check("server_info", False, str(exc))
        if expected_algo:
            got = info.get("speculative_algorithm")
            check("speculative_algorithm", str(got).upper() == expected_algo.upper(),
                  f"server reports speculative_algorithm {got}, configured {expected_algo}")  # fmt: skip
        if p["load_requests"] > 0:
            try:
                runs = [generate(self.base, p["prompt"], p["load_max_new_tokens"]) for _ in range(p["load_requests"])]
            except HttpError as exc:
                check("load", False, f"the measuring load failed: {exc}")
                return finish(result)
            tok_s = sum(r["completion_tokens"] for r in runs) / sum(r["seconds"] for r in runs)
            result["tokens_per_s"] = round(tok_s, 1)
            if expected_algo:
                accepts = [r["accept_length"] for r in runs if r["accept_length"] is not None]
                accept = sum(accepts) / len(accepts) if accepts else server_accept_length(self.base, info)
                result["accept_length"] = round(accept, 3) if accept is not None else None
                check("accept_length", accept is not None and accept > p["accept_length_min"],
                      f"average accept length {accept if accept is None else round(accept, 2)} over {len(runs)} requests "
                      f"(threshold {p['accept_length_min']}; 1.0 means no draft token is ever accepted: an "
                      f"EAGLE/EAGLE3 mix-up or a draft that does not fit the target)")  # fmt: skip
            base = p["baseline_tokens_per_s"]
            if base:
                ok = tok_s >= base * (1 - p["regression_threshold"])
                check("throughput_vs_profile_baseline", ok,
                      f"{tok_s:.1f} tok/s against the profile's baseline {base:g} ({(tok_s / base - 1) * 100:+.1f} %)",
                      p["regression_action"])  # fmt: skip
            nospec = p["no_spec_tokens_per_s"]
            if expected_algo and nospec:
                check("throughput_vs_no_speculation", tok_s >= nospec,
                      f"{tok_s:.1f} tok/s with speculation against {nospec:g} without ({(tok_s / nospec - 1) * 100:+.1f} %)",
                      p["regression_action"])  # fmt: skip
        if p["patch_manifest"]:
            check(*patch_check(p["patch_manifest"]))
        return finish(result)

    # ------------------------------------------------------------------ known-good

    def config_snapshot(self) -> dict[str, str]:
        files = {}
        for path in self.p["config_files"]:
            with open(path, encoding="utf-8") as fh:
                files[path] = fh.read()
        return files

    def known_good(self) -> dict | None:
        path = os.path.join(self.kg_dir, "record.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)

    def record_known_good(self, verify: dict) -> dict:
        files = self.config_snapshot()
        record = {
            "instance": self.name, "unit": self.unit, "profile": self.p["profile"], "argv": self.p["expected_argv"],
            "files": files, "config_hash": config_hash(files), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "tokens_per_s": verify.get("tokens_per_s"), "accept_length": verify.get("accept_length"),
            "checks": verify.get("checks"),
        }  # fmt: skip
        os.makedirs(self.kg_dir, mode=0o700, exist_ok=True)
        write_atomic(os.path.join(self.kg_dir, "record.json"), json.dumps(record, indent=1, sort_keys=True), 0o600)
        return {"path": self.kg_dir, "config_hash": record["config_hash"], "profile": record["profile"]}

    def restore(self, record: dict) -> None:
        failed_dir = os.path.join(self.kg_dir, "failed")
        os.makedirs(failed_dir, mode=0o700, exist_ok=True)
        for path, content in record["files"].items():
            if os.path.exists(path):
                shutil.copy2(path, os.path.join(failed_dir, os.path.basename(path)))
            write_atomic(path, content, 0o600 if path.endswith(".env") else 0o644)
        out = systemctl("daemon-reload")
        if out.returncode != 0:
            raise Failed("rollback", f"systemctl daemon-reload failed: {out.stderr.strip()}")


# ---------------------------------------------------------------------- helpers


def finish(result: dict) -> dict:
    result["ok"] = all(c["ok"] or c["severity"] == "warn" for c in result["checks"])
    result["warnings"] = [c["detail"] for c in result["checks"] if not c["ok"] and c["severity"] == "warn"]
    result["failed_checks"] = [f"{c['name']}: {c['detail']}" for c in result["checks"] if not c["ok"] and c["severity"] == "fail"]
    return result


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def flags_of(argv: list[str]) -> dict[str, str]:
    """--flag -> its value(s) as one string ("" for a switch); words before the first flag under ""."""
    out: dict[str, list[str]] = {"": []}
    key = ""
    for arg in argv:
        if arg.startswith("--"):
            key, _, value = arg.partition("=")
            out[key] = [value] if value else []
        else:
            out.setdefault(key, []).append(arg)
    return {k: " ".join(v) for k, v in out.items()}


def drift_summary(expected: list[str], running: list[str]) -> str:
    """What differs, flag by flag: '--speculative-num-steps: configured 2, running 3'."""
    if not running:
        return "no main process"
    exp, run = flags_of(expected), flags_of(running)
    diffs = []
    for key in list(exp) + [k for k in run if k not in exp]:
        if exp.get(key) != run.get(key):
            what = key or "program"
            diffs.append(f"{what}: configured {exp[key]!r}, not running" if key not in run else
                         f"{what}: not configured, running {run[key]!r}" if key not in exp else
                         f"{what}: configured {exp[key]!r}, running {run[key]!r}")  # fmt: skip
    return "; ".join(diffs) or "same flags in another order"


def server_accept_length(base: str, info: dict) -> float | None:
    states = info.get("internal_states") or [{}]
    if states and states[0].get("avg_spec_accept_length") is not None:
        return float(states[0]["avg_spec_accept_length"])
    try:
        code, data = request(f"{base}/metrics", timeout=10)
        return metric(data.decode(), "sglang:spec_accept_length") if code == 200 else None
    except HttpError:
        return None


def patch_check(manifest_path: str) -> tuple[str, bool, str]:
    if not os.path.exists(manifest_path):
        return "patches", True, f"no patch manifest at {manifest_path} (no patch series applied)"
    with open(manifest_path, encoding="utf-8") as fh:
        manifest = json.load(fh)
    bad = []
    for rel, sums in manifest.get("files", {}).items():
        path = os.path.join(manifest["site_packages"], rel)
        try:
            with open(path, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
        except OSError:
            digest = None
        if digest != sums.get("after"):
            bad.append(rel)
    names = ", ".join(p.get("name", "?") for p in manifest.get("patches", []))
    if bad:
        return "patches", False, f"installed files differ from the patch manifest: {bad} (reinstall: deploy.yml)"
    return "patches", True, f"{len(manifest.get('files', {}))} patched files match the manifest ({names})"


def config_hash(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.encode() + b"\0" + files[path].encode() + b"\0")
    return h.hexdigest()[:16]


def write_atomic(path: str, content: str, mode: int) -> None:
    tmp = f"{path}.sglang-deploy.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(content)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def clear_pending(state_dir: str, name: str) -> None:
    path = os.path.join(state_dir, "restart-pending")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as fh:
        left = [n for n in fh.read().split() if n != name]
    if left:
        write_atomic(path, "\n".join(left) + "\n", 0o644)
    else:
        os.unlink(path)


# ---------------------------------------------------------------------- restart


def attempt(inst: Instance, phases: list[dict], label: str = "", steps: tuple[str, ...] = ("stop", "gpus", "start", "generate", "verify")) -> dict | None:
    """stop -> clean GPUs -> start -> ready -> generation -> verify (those of `steps`); raises Failed."""
    actions = {"stop": inst.stop, "gpus": inst.wait_gpus, "start": inst.start_and_wait_ready, "generate": inst.generation}
    if not inst.serves_http:
        steps = tuple(s for s in steps if s != "generate")
    for name, step in ((n, actions[n]) for n in steps if n in actions):
        t0 = time.monotonic()
        try:
            detail = step()
        except Failed as exc:
            phases.append({"phase": label + name, "seconds": round(time.monotonic() - t0, 3), "ok": False, "detail": exc.cause})
            raise
        phases.append({"phase": label + name, "seconds": round(time.monotonic() - t0, 3), "ok": True,
                       "detail": {k: v for k, v in detail.items() if k != "text"}})  # fmt: skip
    if "verify" not in steps:
        return None
    t0 = time.monotonic()
    verify = inst.verify()
    phases.append({"phase": label + "verify", "seconds": round(time.monotonic() - t0, 3), "ok": verify["ok"],
                   "detail": verify["failed_checks"] or "all checks passed"})  # fmt: skip
    if not verify["ok"]:
        raise Failed("verify", "verification failed: " + "; ".join(verify["failed_checks"]), verify=verify)
    return verify


def restart(module: AnsibleModule, inst: Instance) -> dict:
    p = inst.p
    phases: list[dict] = []
    t_start = time.monotonic()
    res: dict = {"changed": False, "instance": inst.name, "unit": inst.unit, "profile": p["profile"], "phases": phases}
    t0 = time.monotonic()
    try:
        detail = inst.preflight()
        phases.append({"phase": "preflight", "seconds": round(time.monotonic() - t0, 3), "ok": True, "detail": detail})
    except Failed as exc:
        phases.append({"phase": "preflight", "seconds": round(time.monotonic() - t0, 3), "ok": False, "detail": exc.cause})
        res.update(outcome="gpus_not_clean", failure={"phase": exc.phase, "cause": exc.cause, **exc.details})
        return res
    if module.check_mode:
        res.update(outcome="would_restart")
        return res
    res["changed"] = True
    if p["phase"] != "all":
        return restart_phase(inst, res, phases, t_start)
    try:
        verify = attempt(inst, phases)
        res.update(outcome="restarted", verify=verify, known_good=inst.record_known_good(verify))
        clear_pending(p["state_dir"], inst.name)
        return res
    except Failed as exc:
        res["failure"] = {"phase": exc.phase, "cause": exc.cause, **exc.details}
        res["verify"] = exc.details.get("verify")
    finally:
        res["downtime_s"] = round(time.monotonic() - t_start, 3)
    record = inst.known_good()
    if not p["rollback"] or record is None or record["files"] == inst.config_snapshot():
        why = ("rollback is off" if not p["rollback"] else
               "no last-known-good configuration is recorded" if record is None else
               "the failed configuration is the last-known-good one")  # fmt: skip
        systemctl("stop", inst.unit)  # no crash loop on the GPUs
        res.update(outcome="not_recovered", rollback={"attempted": False, "why": why})
        return res
    rb_phases: list[dict] = []
    rollback = {"attempted": True, "to_profile": record["profile"], "config_hash": record["config_hash"], "phases": rb_phases}
    res["rollback"] = rollback
    try:
        inst.restore(record)
        inst.p = {**p, "expected_argv": record["argv"], "profile": record["profile"]}
        rollback["verify"] = attempt(inst, rb_phases, "rollback-")
        rollback["outcome"] = "serving"
        res["outcome"] = "rolled_back"
    except Failed as exc:
        systemctl("stop", inst.unit)
        rollback.update(outcome="failed", failure={"phase": exc.phase, "cause": exc.cause, **exc.details})
        res["outcome"] = "not_recovered"
    res["downtime_s"] = round(time.monotonic() - t_start, 3)
    return res


def rollback(module: AnsibleModule, inst: Instance) -> dict:
    """Operator-asked rollback: the last-known-good configuration back, restarted and verified."""
    record = inst.known_good()
    res: dict = {"changed": False, "instance": inst.name, "unit": inst.unit, "profile": inst.p["profile"], "phases": []}
    if inst.p["nnodes"] > 1:
        res.update(outcome="not_recovered", changed=False, failure={"phase": "rollback", "cause": (
            f"{inst.name} spans {inst.p['nnodes']} nodes: rolling its ranks back one node at a time would start them out "
            "of step. Put the known-good settings back in group_vars and run restart (all its nodes in one batch).")})  # fmt: skip
        return res
    if record is None:
        res.update(outcome="not_recovered", failure={"phase": "rollback", "cause": f"no last-known-good configuration of "
                   f"{inst.name} is recorded in {inst.kg_dir}: a restart records one when it succeeds"})  # fmt: skip
        return res
    res["rollback"] = {"attempted": True, "to_profile": record["profile"], "config_hash": record["config_hash"]}
    if module.check_mode:
        res["outcome"] = "would_roll_back"
        return res
    t0 = time.monotonic()
    res["changed"] = True
    try:
        inst.restore(record)
        inst.p = {**inst.p, "expected_argv": record["argv"], "profile": record["profile"]}
        res["verify"] = attempt(inst, res["phases"])
        res.update(outcome="rolled_back", profile=record["profile"], known_good=inst.record_known_good(res["verify"]))
        res["rollback"]["outcome"] = "serving"
    except Failed as exc:
        systemctl("stop", inst.unit)
        res.update(outcome="not_recovered", failure={"phase": exc.phase, "cause": exc.cause, **exc.details})
        res["rollback"]["outcome"] = "failed"
    res["downtime_s"] = round(time.monotonic() - t0, 3)
    return res


def restart_phase(inst: Instance, res: dict, phases: list[dict], t_start: float) -> dict:
    """One phase of the restart of an instance spanning nodes (no rollback across nodes)."""
    phase = inst.p["phase"]
    steps = {"stop": ("stop", "gpus"), "start": ("start", "generate", "verify"), "confirm": ("verify",)}[phase]
    if phase == "start" and not inst.serves_http:
        steps = ("start",)  # verified in the confirm phase, once rank 0 has served
    if phase == "confirm" and inst.serves_http:
        res.update(outcome="restarted", changed=False)  # rank 0 verified and recorded in its start phase
        return res
    try:
        verify = attempt(inst, phases, steps=steps)
    except Failed as exc:
        systemctl("stop", inst.unit)
        res.update(outcome="not_recovered", failure={"phase": exc.phase, "cause": exc.cause, **exc.details},
                   rollback={"attempted": False, "why": f"instance spans {inst.p['nnodes']} nodes: no automatic rollback across nodes"})  # fmt: skip
        return res
    finally:
        res["downtime_s"] = round(time.monotonic() - t_start, 3)
    res["outcome"] = "stopped" if phase == "stop" else "restarted"
    if verify is not None and (phase == "confirm" or inst.serves_http):
        res.update(verify=verify, known_good=inst.record_known_good(verify))
        clear_pending(inst.p["state_dir"], inst.name)
    elif phase == "start":
        res["outcome"] = "started"
    return res


def status(inst: Instance) -> dict:
    p = inst.p
    props = show(inst.unit)
    running, profile = inst.running(props)
    out = {"changed": False, "outcome": "status", "instance": inst.name, "unit": inst.unit,
           "state": f"{props['ActiveState']}/{props['SubState']}", "restarts": props["NRestarts"],
           "main_pid": props["MainPID"], "running_profile": profile, "configured_profile": p["profile"],
           "drift": bool(running) and running != p["expected_argv"]}  # fmt: skip
    snap = snapshot()
    out["gpu_memory_mib"] = {g["index"]: g["memory_used_mib"] for g in snap["gpus"] if g["index"] in p["gpus"]}
    if not inst.serves_http:
        out.update(health=None, accept_length=None)
    else:
        http_status(inst, out)
    record = inst.known_good()
    out["known_good"] = {k: record.get(k) for k in ("profile", "config_hash", "recorded_at", "tokens_per_s", "accept_length")} if record else None
    return out


def http_status(inst: Instance, out: dict) -> None:
    try:
        code, _ = request(f"{inst.base}/health", timeout=5)
        out["health"] = code == 200
        info = get_json(f"{inst.base}/server_info", timeout=5) if code == 200 else {}
        accept = server_accept_length(inst.base, info) if info.get("speculative_algorithm") else None
        out["accept_length"] = round(accept, 3) if accept is not None else None
    except (HttpError, ValueError):
        out.update(health=False, accept_length=None)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            action=dict(type="str", choices=["restart", "verify", "status", "rollback"], required=True),
            name=dict(type="str", required=True),
            unit=dict(type="str"),
            port=dict(type="int", required=True),
            gpus=dict(type="list", elements="int", required=True),
            service_user=dict(type="str", default="sglang"),
            expected_argv=dict(type="list", elements="str", required=True),
            profile=dict(type="str", required=True),
            profiles_argv=dict(type="dict", default={}),
            config_files=dict(type="list", elements="path", default=[]),
            state_dir=dict(type="path", default="/var/lib/sglang"),
            ready_timeout=dict(type="float", default=900.0),
            gpu_timeout=dict(type="float", default=120.0),
            gpu_interval=dict(type="float", default=0.1),
            max_used_mib=dict(type="int", default=1024),
            stop_policy=dict(type="str", choices=["none", "own", "force"], default="own"),
            rollback=dict(type="bool", default=True),
            prompt=dict(type="str", default="The capital of France is"),
            max_new_tokens=dict(type="int", default=16),
            accept_length_min=dict(type="float", default=1.5),
            load_requests=dict(type="int", default=4),
            load_max_new_tokens=dict(type="int", default=64),
            baseline_tokens_per_s=dict(type="float"),
            no_spec_tokens_per_s=dict(type="float"),
            regression_threshold=dict(type="float", default=0.1),
            regression_action=dict(type="str", choices=["warn", "fail"], default="warn"),
            patch_manifest=dict(type="path"),
            nnodes=dict(type="int", default=1),
            node_rank=dict(type="int", default=0),
            phase=dict(type="str", choices=["all", "stop", "start", "confirm"], default="all"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not 0 < p["gpu_interval"] <= 0.25:
        module.fail_json(msg=f"gpu_interval is {p['gpu_interval']}: poll at least every 0.25 s")
    inst = Instance(p)
    if p["action"] in ("restart", "rollback"):
        # A dropped SSH connection (Ctrl-C on the controller) must not leave a half-done restart.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        if p["action"] == "status":
            module.exit_json(**status(inst))
        if p["action"] == "verify":
            v = inst.verify()
            res = {"changed": False, "outcome": "verified" if v["ok"] else "verify_failed", "instance": inst.name,
                   "profile": p["profile"], "verify": v}  # fmt: skip
            if not v["ok"]:
                module.fail_json(msg=f"{inst.name}: verification failed: " + "; ".join(v["failed_checks"]), **res)
            module.exit_json(**res)
        res = rollback(module, inst) if p["action"] == "rollback" else restart(module, inst)
    except NvidiaSmiError as exc:
        module.fail_json(msg=str(exc), outcome="gpus_not_clean", instance=inst.name)
    if res["outcome"] in ("restarted", "would_restart", "stopped", "started", "would_roll_back"):
        module.exit_json(**res)
    if p["action"] == "rollback" and res["outcome"] == "rolled_back":
        module.exit_json(**res)
    msg = f"{inst.name}: {res['failure']['phase']} failed: {res['failure']['cause']}"
    if p["action"] == "rollback":
        if (res.get("rollback") or {}).get("outcome") == "failed":
            msg += f"; {inst.unit} is stopped."
        module.fail_json(msg=msg, **res)
    if res["outcome"] == "rolled_back":
        msg += f". Rolled back to the last-known-good configuration (profile {res['rollback']['to_profile']}): serving."
    elif res["outcome"] == "not_recovered":
        rb = res.get("rollback") or {}
        msg += (f". Rollback failed too: {rb['failure']['cause']}" if rb.get("attempted") else f". Not rolled back: {rb.get('why')}")
        msg += f"; {inst.unit} is stopped."
    module.fail_json(msg=msg, **res)


if __name__ == "__main__":
    main()
