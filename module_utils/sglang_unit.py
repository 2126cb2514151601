"""systemd, journal and HTTP helpers for one SGLang instance, used on the GPU host."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.request

UNIT_PROPS = ("ActiveState", "SubState", "MainPID", "NRestarts", "ExecMainStatus", "ExecMainCode", "InvocationID",
              "ExecMainExitTimestampMonotonic")  # fmt: skip


def systemctl(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False, timeout=timeout)


def show(unit: str) -> dict:
    out = systemctl("show", unit, "--property=" + ",".join(UNIT_PROPS)).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    for key in ("MainPID", "NRestarts", "ExecMainStatus", "ExecMainExitTimestampMonotonic"):
        props[key] = int(props.get(key) or 0)
    return props


def has_failed(props: dict) -> bool:
    """The unit's start failed or its process exited (auto-restart counts as failed)."""
    return props.get("ActiveState") in ("failed", "inactive", "deactivating") or props.get("SubState") in ("auto-restart", "failed", "dead")


def journal(unit: str, invocation: str | None = None, lines: int = 80) -> list[str]:
    args = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines)]
    args += [f"_SYSTEMD_INVOCATION_ID={invocation}"] if invocation else ["-u", unit]
    out = subprocess.run(args, capture_output=True, text=True, check=False, timeout=30)
    return out.stdout.splitlines()


def journal_since(unit: str, since_epoch: float, lines: int = 80) -> list[str]:
    args = ["journalctl", "--no-pager", "-o", "cat", "-n", str(lines), "-u", unit, f"--since=@{since_epoch:.3f}"]
    return subprocess.run(args, capture_output=True, text=True, check=False, timeout=30).stdout.splitlines()


def traceback_of(lines: list[str]) -> list[str]:
    """The last traceback in the log, from its first line to the exception line."""
    start = None
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line:
            start = i
    if start is None:
        return []
    out = []
    for line in lines[start:]:
        out.append(line)
        if len(out) > 1 and EXCEPTION_LINE.match(line):
            break
    return out


EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(?:Error|Exception|Interrupt)\b:?.*$")


def cause_of(lines: list[str]) -> str | None:
    """The line that says why: a traceback's last line, SGLang's argparse error, the GPU gate's refusal."""
    tb = traceback_of(lines)
    if len(tb) > 1 and EXCEPTION_LINE.match(tb[-1]):
        return tb[-1].strip()
    for line in reversed(lines):
        m = re.search(r"Main process exited, code=\w+, status=\d+/(\w+)", line)
        if m and m.group(1) == "SYS":
            return m.group(0) + " (a system call the unit's SystemCallFilter denies)"
    for pattern in (r"error: .*", r"sglang-gpu-gate: .*refusing.*", r"sglang-gpu-gate: (?!GPUs \[[\d, ]*\] clean).*",
                    r"Main process exited, code=\w+, status=.*"):
        for line in reversed(lines):
            m = re.search(pattern, line)
            if m:
                return m.group(0).strip()
    return None


class HttpError(RuntimeError):
    pass


def request(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError, ConnectionError) as exc:
        raise HttpError(f"{url}: {getattr(exc, 'reason', exc)}") from exc


def get_json(url: str, timeout: float = 30.0) -> dict:
    code, data = request(url, timeout=timeout)
    if code != 200:
        raise HttpError(f"{url}: HTTP {code}")
    return json.loads(data)


def generate(base: str, prompt: str, max_new_tokens: int, timeout: float = 120.0) -> dict:
    """One /generate request; {text, completion_tokens, seconds, accept_length}."""
    t0 = time.monotonic()
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
    code, data = request(f"{base}/generate", body, timeout=timeout)
    seconds = time.monotonic() - t0
    if code != 200:
        raise HttpError(f"{base}/generate: HTTP {code}: {data[:300].decode(errors='replace')}")
    out = json.loads(data)
    meta = out.get("meta_info") or {}
    text = out.get("text") or ""
    if not text or not meta.get("completion_tokens"):
        raise HttpError(f"{base}/generate answered without generating: {data[:300].decode(errors='replace')}")
    return {"text": text, "completion_tokens": int(meta["completion_tokens"]), "seconds": seconds,
            "accept_length": meta.get("spec_accept_length")}  # fmt: skip


def metric(text: str, name: str) -> float | None:
    """The first sample of a Prometheus series (any labels)."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", text, re.M)
    return float(m.group(1)) if m else None


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []
