"""Verify's checks on a running instance: each one a name, ok, severity and a detail saying why.

unit (active, never restarted), drift (the running command line is the rendered one, flag by
flag; the running profile named), gpu_processes (only the service's processes on its GPUs),
health_generate, generate, speculative_algorithm, accept_length, throughput against the
profile's and the no-speculation baselines, and the patch manifest of the software it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from . import boot, http
from .gpu import format_offender
from .instance import Instance, masked
from .secret_rule import clip
from .unit import state


@dataclass
class Thresholds:
    prompt: str = "The capital of France is"
    max_new_tokens: int = 16
    accept_length_min: float = 1.5
    load_requests: int = 4
    load_max_new_tokens: int = 64
    baseline_tokens_per_s: float | None = None
    no_spec_tokens_per_s: float | None = None
    regression_threshold: float = 0.1
    regression_action: str = "warn"


class Checks:
    def __init__(self) -> None:
        self.items: list[dict] = []

    def add(self, name: str, ok: bool, detail: str, severity: str = "fail") -> None:
        self.items.append({"name": name, "ok": bool(ok), "severity": "ok" if ok else severity, "detail": detail})

    def result(self, **extra) -> dict:
        out = {"checks": self.items, **extra}
        out["ok"] = all(c["ok"] or c["severity"] == "warn" for c in self.items)
        out["warnings"] = [c["detail"] for c in self.items if not c["ok"] and c["severity"] == "warn"]
        out["failed_checks"] = [
            f"{c['name']}: {c['detail']}" for c in self.items if not c["ok"] and c["severity"] == "fail"
        ]
        return out


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
    """What differs, flag by flag: '--speculative-num-steps: configured '2', running '3''."""
    if not running:
        return "no main process"
    exp, run = flags_of(masked(expected)), flags_of(masked(running))
    diffs = []
    for key in list(exp) + [k for k in run if k not in exp]:
        if exp.get(key) != run.get(key):
            what = key or "program"
            if key not in run:
                diffs.append(f"{what}: configured {exp[key]!r}, not running")
            elif key not in exp:
                diffs.append(f"{what}: not configured, running {run[key]!r}")
            else:
                diffs.append(f"{what}: configured {exp[key]!r}, running {run[key]!r}")
    return "; ".join(diffs) or "same flags in another order"


def patch_check(manifest_path: str | None) -> tuple[str, bool, str]:
    if not manifest_path or not os.path.exists(manifest_path):
        return "patches", True, f"no patch manifest at {manifest_path} (no patch series applied)"
    try:
        with open(manifest_path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        return "patches", False, f"the patch manifest {manifest_path} cannot be read: {exc}"
    bad = []
    for rel, sums in (manifest.get("files") or {}).items():
        try:
            with open(os.path.join(manifest["site_packages"], rel), "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
        except (OSError, KeyError):
            digest = None
        if digest != (sums or {}).get("after"):
            bad.append(rel)
    names = ", ".join(p.get("name", "?") for p in manifest.get("patches", []))
    if bad:
        return "patches", False, f"installed files differ from the patch manifest: {bad} (reinstall: deploy.yml)"
    return "patches", True, f"{len(manifest.get('files', {}))} patched files match the manifest ({names})"


def manifest_of(inst: Instance, default: str | None) -> str | None:
    """The patch manifest of the software the unit runs (inside its generation), else the configured one."""
    if inst.venv:
        inside = os.path.join(inst.venv, "sglang-deploy", "patches.json")
        if os.path.exists(inside):
            return inside
    return default


def verify(inst: Instance, t: Thresholds, ports, patch_manifest: str | None = None) -> dict:
    """Every check on the running instance; never raises for what the server does."""
    c = Checks()
    props = ports.show(inst.unit)
    # Starts the boot guard refused (an unverified configuration replaced by the known-good one) are no crash.
    guard = boot.put_backs(inst.name, boot.beside(ports.lock_dir, boot.PUT_BACK_DIR))
    by_guard = (
        f" ({guard['count']} by the boot guard, which put back known-good generation {guard['generation']})"
        if guard["count"]
        else ""
    )
    c.add(
        "unit",
        props["ActiveState"] == "active" and props["SubState"] == "running" and props["NRestarts"] <= guard["count"],
        f"{inst.unit} {state(props)}, restarted {props['NRestarts']} times since started{by_guard}",
    )
    running = ports.cmdline(props["MainPID"]) if props["MainPID"] else []
    profile = inst.profile_of(running)
    same = bool(running) and masked(running) == masked(inst.argv)
    c.add(
        "drift",
        same,
        f"running profile {profile}"
        if same
        else f"running command line differs from the rendered configuration: {drift_summary(inst.argv, running)}; "
        f"running profile: {profile or 'none of the known profiles (launched by hand?)'}",
    )
    snap = ports.snapshot()
    mine = [x for x in snap["processes"] if x["gpu"] in inst.gpus]
    strangers = [x for x in mine if x.get("unit") != inst.unit]
    c.add(
        "gpu_processes",
        not strangers,
        f"{len(mine)} processes of {inst.unit} on GPUs {inst.gpus}"
        if not strangers
        else "not the service's: " + "; ".join(format_offender(x) for x in strangers),
    )
    gpu_mem = {g["index"]: g["memory_used_mib"] for g in snap["gpus"] if g["index"] in inst.gpus}
    extra = {"running_profile": profile, "gpu_memory_mib": gpu_mem, "tokens_per_s": None, "accept_length": None}
    if inst.serves_http:
        http_checks(inst, t, c, extra)
    c.add(*patch_check(manifest_of(inst, patch_manifest)))
    if not inst.serves_http:
        extra["node_rank"] = inst.node_rank
    return c.result(**extra)


def http_checks(inst: Instance, t: Thresholds, c: Checks, extra: dict) -> None:
    key = inst.api_key()
    try:
        code, _ = http.request(f"{inst.base}/health_generate", timeout=60, api_key=key)
        c.add("health_generate", code == 200, f"/health_generate HTTP {code}")
    except http.HttpError as exc:
        c.add("health_generate", False, str(exc))
    try:
        gen = http.generate(inst.base, t.prompt, t.max_new_tokens, api_key=key)
        c.add("generate", True, f"{gen['completion_tokens']} tokens: {clip(gen['text'], 60)!r}")
    except http.HttpError as exc:
        c.add("generate", False, str(exc))
        return
    expected_algo = flag_value(inst.argv, "--speculative-algorithm")
    try:
        info = http.get_json(f"{inst.base}/server_info", api_key=key)
    except http.HttpError as exc:
        info = {}
        c.add("server_info", False, str(exc))
    if expected_algo:
        got = info.get("speculative_algorithm")
        c.add(
            "speculative_algorithm",
            str(got).upper() == expected_algo.upper(),
            f"server reports speculative_algorithm {got}, configured {expected_algo}",
        )
    if t.load_requests > 0:
        load_checks(inst, t, c, extra, info, expected_algo, key)


def load_checks(inst: Instance, t: Thresholds, c: Checks, extra: dict, info: dict, algo: str | None, key) -> None:
    try:
        runs = [http.generate(inst.base, t.prompt, t.load_max_new_tokens, api_key=key) for _ in range(t.load_requests)]
    except http.HttpError as exc:
        c.add("load", False, f"the measuring load failed: {exc}")
        return
    seconds = sum(r["seconds"] for r in runs) or 1e-9
    tok_s = sum(r["completion_tokens"] for r in runs) / seconds
    extra["tokens_per_s"] = round(tok_s, 1)
    if algo:
        accepts = [float(r["accept_length"]) for r in runs if isinstance(r["accept_length"], (int, float))]
        accept = sum(accepts) / len(accepts) if accepts else http.server_accept_length(inst.base, info, key)
        extra["accept_length"] = round(accept, 3) if accept is not None else None
        c.add(
            "accept_length",
            accept is not None and accept > t.accept_length_min,
            f"average accept length {accept if accept is None else round(accept, 2)} over {len(runs)} requests "
            f"(threshold {t.accept_length_min}; 1.0 means no draft token is ever accepted: an "
            f"EAGLE/EAGLE3 mix-up or a draft that does not fit the target)",
        )
    if t.baseline_tokens_per_s:
        base = t.baseline_tokens_per_s
        c.add(
            "throughput_vs_profile_baseline",
            tok_s >= base * (1 - t.regression_threshold),
            f"{tok_s:.1f} tok/s against the profile's baseline {base:g} ({(tok_s / base - 1) * 100:+.1f} %)",
            t.regression_action,
        )
    if algo and t.no_spec_tokens_per_s:
        nospec = t.no_spec_tokens_per_s
        c.add(
            "throughput_vs_no_speculation",
            tok_s >= nospec,
            f"{tok_s:.1f} tok/s with speculation against {nospec:g} without ({(tok_s / nospec - 1) * 100:+.1f} %)",
            t.regression_action,
        )
