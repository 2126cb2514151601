"""The server's HTTP API: health, a generation, server_info, metrics; authenticated when it has an API key.

Every error a server can cause here (refused or dropped connection, a truncated body,
malformed JSON, an unexpected shape) is raised as HttpError, so callers handle one kind.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from .secret_rule import Redactor, clip, patterns


class HttpError(RuntimeError):
    """``cause``: the error underneath when the server did not answer (ConnectionRefusedError: nothing listens
    there; TimeoutError, ConnectionResetError, ...), else None."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


# The server is on this host: never through an http_proxy from the environment.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(url: str, body: dict | None = None, timeout: float = 30.0, api_key: str | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        except (OSError, http.client.HTTPException):
            return exc.code, b""
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        # URLError/OSError: refused, reset, timed out; HTTPException: IncompleteRead, BadStatusLine, a dropped
        # connection mid-response; ValueError: a malformed URL.
        reason = getattr(exc, "reason", None)
        cause = reason if isinstance(reason, BaseException) else exc
        raise HttpError(f"{url}: {type(exc).__name__}: {getattr(exc, 'reason', exc)}", cause=cause) from exc


def json_of(url: str, data: bytes, redact=patterns) -> dict:
    try:
        out = json.loads(data)
    except ValueError as exc:
        raise HttpError(f"{url}: not JSON ({exc}): {clip(data.decode(errors='replace'), 200, redact)!r}") from exc
    if not isinstance(out, dict):
        raise HttpError(f"{url}: expected a JSON object, got {type(out).__name__}")
    return out


def get_json(url: str, timeout: float = 30.0, api_key: str | None = None) -> dict:
    code, data = request(url, timeout=timeout, api_key=api_key)
    if code != 200:
        raise HttpError(f"{url}: HTTP {code}")
    return json_of(url, data, Redactor([api_key]).text)


def generate(base: str, prompt: str, max_new_tokens: int, timeout: float = 120.0, api_key: str | None = None) -> dict:
    """One /generate request; {text, completion_tokens, seconds, accept_length}."""
    t0 = time.monotonic()
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
    }
    code, data = request(f"{base}/generate", body, timeout=timeout, api_key=api_key)
    seconds = time.monotonic() - t0
    redact = Redactor([api_key]).text  # a server may echo the key it was sent: masked before a body is cut
    if code != 200:
        raise HttpError(f"{base}/generate: HTTP {code}: {clip(data.decode(errors='replace'), 300, redact)}")
    out = json_of(f"{base}/generate", data, redact)
    meta = out.get("meta_info") if isinstance(out.get("meta_info"), dict) else {}
    text = out.get("text") or ""
    try:
        tokens = int(meta.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        tokens = 0
    if not isinstance(text, str) or not text or not tokens:
        raise HttpError(
            f"{base}/generate answered without generating: {clip(data.decode(errors='replace'), 300, redact)}"
        )
    return {
        "text": text,
        "completion_tokens": tokens,
        "seconds": seconds,
        "accept_length": meta.get("spec_accept_length"),
    }


# The longest event line first_token reads (a generation's first event is a few hundred bytes).
MAX_EVENT = 1 << 16


class Stalled(HttpError):
    """No token within the stall time: the server took the request and generates nothing (or too slowly to tell)."""


def first_token(base: str, prompt: str, max_new_tokens: int, stall_s: float, api_key: str | None = None) -> float:
    """Seconds until a streamed /generate's first token (its first ``data:`` event with text). Stalled when none
    came within stall_s, however the server dawdles (headers or bytes trickling in: a watchdog shuts the socket at
    the deadline; the request is given up, and SGLang aborts a stream whose client left); HttpError for any other
    answer (refused, a connection not made within stall_s, a status not 200, a stream that ends without a token)."""
    t0 = time.monotonic()
    url = f"{base}/generate"
    parts = urllib.parse.urlsplit(base)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=stall_s)
    body = json.dumps(
        {
            "text": prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True},
        }
    )
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    redact = Redactor([api_key]).text
    try:
        conn.connect()  # a worker that cannot be reached is no stall: the health check's to judge
    except OSError as exc:
        conn.close()
        raise HttpError(f"{url}: {type(exc).__name__}: {exc}", cause=exc) from exc
    cut = threading.Event()
    timer = threading.Timer(max(0.0, stall_s - (time.monotonic() - t0)), _cut, (conn, cut))
    timer.start()
    try:
        conn.request("POST", "/generate", body, headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise HttpError(f"{url}: HTTP {resp.status}")
        _await_token(resp, url, stall_s, cut, redact)
        return time.monotonic() - t0
    except (OSError, http.client.HTTPException) as exc:
        if cut.is_set() or isinstance(exc, TimeoutError):
            raise Stalled(f"{url}: no token in {stall_s:g} s", cause=exc) from exc
        raise HttpError(f"{url}: {type(exc).__name__}: {exc}", cause=exc) from exc
    finally:
        timer.cancel()
        conn.close()


def _cut(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    """first_token's watchdog, at the stall time: `cut` set, the socket shut."""
    cut.set()
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)  # every read now returns at once
    except (OSError, AttributeError):
        pass


def _await_token(resp: http.client.HTTPResponse, url: str, stall_s: float, cut: threading.Event, redact) -> None:
    """Read the stream's events until one carries text. Stalled once the watchdog has cut it; HttpError for a
    stream that ends first or an event that is not JSON."""
    while True:
        line = resp.readline(MAX_EVENT)
        if cut.is_set():
            raise Stalled(f"{url}: no token in {stall_s:g} s")
        if not line:
            raise HttpError(f"{url}: the stream ended without a token")
        data = line.strip()[len(b"data:") :].strip() if line.startswith(b"data:") else b""
        if not data or data == b"[DONE]":
            continue
        try:
            doc = json.loads(data)
            text = doc.get("text") if isinstance(doc, dict) else None
        except (ValueError, RecursionError):
            raise HttpError(f"{url}: not an event: {clip(data.decode(errors='replace'), 200, redact)}") from None
        if text:
            return


def healthy(base: str, timeout: float = 2.0, api_key: str | None = None) -> bool:
    try:
        return request(f"{base}/health", timeout=timeout, api_key=api_key)[0] == 200
    except HttpError:
        return False


def metric(text: str, name: str) -> float | None:
    """The first sample of a Prometheus series (any labels)."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)", text, re.M)
    try:
        return float(m.group(1)) if m else None
    except ValueError:
        return None


def server_accept_length(base: str, info: dict, api_key: str | None = None) -> float | None:
    """The server's average accept length: /server_info's internal state, else /metrics."""
    states = info.get("internal_states") or [{}]
    if isinstance(states, list) and states and isinstance(states[0], dict):
        value = states[0].get("avg_spec_accept_length")
        if value is not None:
            try:
                return float(value)
            except (TypeError, ValueError):
                return None
    try:
        code, data = request(f"{base}/metrics", timeout=10, api_key=api_key)
        return metric(data.decode(errors="replace"), "sglang:spec_accept_length") if code == 200 else None
    except HttpError:
        return None
