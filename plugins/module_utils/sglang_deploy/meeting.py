"""How the ranks meet in the rendezvous's second step (rendezvous.meet): the hello on dist_init_addr's port and
the gloo all-reduce every rank runs.

The hello's wire format: rank 0 listens and sends its banner (``SGLANG-RDV 1 <instance>``), a rank answers one
line (``HELLO <instance> <rank> <host>``) and rank 0 ``OK`` (or ``NO``); where the instance's own server holds the
port, a connect and close is the proof. The all-reduce: nccl_worker's rank mode with gloo on CPU, 1 MiB.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time

from . import nccl_worker
from .nccl import worker_source
from .secret_rule import clip

MIB = nccl_worker.MIB
BANNER = "SGLANG-RDV 1"


def serve_hello(port: int, family: int, instance: str, want: set[int], timeout_s: float, clock=time.monotonic) -> dict:
    """Rank 0: listen on `port` (all addresses, as torch's store does) until every rank in `want` said hello,
    or `timeout_s`. Per connection: send the banner, read ``HELLO <instance> <rank> <host>``, answer ``OK``,
    wait for the peer to close (the TIME_WAIT stays on its side). {joined: {rank: host}, missing, error}."""
    joined: dict[int, str] = {}
    try:
        srv = socket.socket(family, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        srv.listen(64)
    except OSError as exc:
        return {
            "joined": joined,
            "missing": sorted(want),
            "error": f"cannot listen on port {port}: {exc.strerror or exc}",
        }
    deadline = clock() + timeout_s
    with srv:
        srv.settimeout(0.2)
        while set(joined) < want and clock() < deadline:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                continue
            with conn:
                conn.settimeout(3)
                try:
                    conn.sendall(f"{BANNER} {instance}\n".encode())
                    words = _readline(conn).split()
                    if len(words) == 4 and words[0] == "HELLO" and words[1] == instance and words[2].isdigit():
                        joined[int(words[2])] = words[3]
                        conn.sendall(b"OK\n")
                        conn.recv(16)  # the peer closes first
                    else:
                        conn.sendall(b"NO\n")
                except OSError:
                    continue
    return {"joined": joined, "missing": sorted(want - set(joined)), "error": None}


def _readline(conn: socket.socket, limit: int = 512) -> str:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < limit:
        chunk = conn.recv(limit - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


def say_hello(
    addrs: list[str],
    port: int,
    instance: str,
    rank: int,
    host: str,
    timeout_s: float,
    banner: bool = True,
    connect=socket.create_connection,
    clock=time.monotonic,
    sleep=time.sleep,
) -> dict:
    """Rank > 0: connect to rank 0 at `addrs`:`port` until it answers or `timeout_s`, retrying (rank 0's module
    may start later). With `banner`, expect rank 0's listener and exchange one line each way; without (the
    instance's own server holds the port), a connect and close is the proof. {ok, address, error, attempts}."""
    deadline = clock() + timeout_s
    last, answer, attempts = "no attempt", None, 0
    while True:
        for addr in addrs:
            attempts += 1
            try:
                with connect((addr, port), timeout=max(0.5, min(3.0, deadline - clock()))) as conn:
                    if not banner:
                        return {"ok": True, "address": addr, "error": None, "attempts": attempts}
                    conn.settimeout(max(1.0, min(5.0, deadline - clock())))
                    try:
                        first = _readline(conn)
                    except TimeoutError:
                        first = ""
                    if not first:
                        answer = answer or "a process answers there without a word: not rank 0's check"
                        continue
                    if not first.startswith(BANNER):
                        answer = f"something else answers there (it said {clip(first, 60)!r}, not rank 0's check)"
                        continue
                    if first.split()[-1] != instance:
                        answer = f"rank 0's check there is for instance {first.split()[-1]}, not {instance}: two instances share dist_init_addr?"
                        continue
                    conn.sendall(f"HELLO {instance} {rank} {host}\n".encode())
                    if _readline(conn) == "OK":
                        return {"ok": True, "address": addr, "error": None, "attempts": attempts}
                    answer = "rank 0's check refused this rank"
            except OSError as exc:
                last = exc.strerror or str(exc) or type(exc).__name__
        if clock() >= deadline:
            # What a listener said beats a later refusal or timeout: it names the wrong process or instance.
            return {"ok": False, "address": None, "error": answer or last, "attempts": attempts}
        sleep(0.25)


def run_allreduce(
    python: str,
    env: dict,
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    run=subprocess.run,
    base_env: dict | None = None,
) -> dict:
    """One rank of a gloo all-reduce on CPU (nccl_worker's rank mode, 1 MiB) under the instance's environment
    with MASTER_ADDR/MASTER_PORT, killed after `timeout_s`. {ok, error, timed_out, sizes, sum_ok, seconds, command}."""
    if base_env is None:
        base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    wenv = {**base_env, **{k: str(v) for k, v in env.items()}}
    # CPU only: never touch the GPUs a running server holds.
    wenv.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglang-rdv-") as tmp:
        worker, result = os.path.join(tmp, "nccl_worker.py"), os.path.join(tmp, "rank.json")
        with open(worker, "w") as f:
            f.write(worker_source())
        cmd = [python, worker, "--backend", "gloo", "--rank", str(rank), "--world", str(world), "--result", result]
        cmd += ["--min-bytes", str(MIB), "--max-bytes", str(MIB), "--warmup", "1", "--min-iters", "2"]
        cmd += ["--max-iters", "10", "--per-size-s", "0.05"]
        out = {"ok": False, "error": None, "timed_out": False, "sizes": [], "sum_ok": None, "command": cmd}
        try:
            res = run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=wenv, cwd=tmp)
            rc, text = res.returncode, (res.stdout or "") + (res.stderr or "")
        except subprocess.TimeoutExpired:
            rc, text, out["timed_out"] = None, "", True
        except OSError as exc:
            rc, text = None, ""
            out["error"] = f"could not run {python}: {exc}"
        try:
            with open(result) as f:
                got = json.load(f)
        except (OSError, ValueError):
            got = {}
    out["seconds"] = round(time.monotonic() - start, 2)
    out["sizes"] = nccl_worker.table(got.get("results") or [], world)
    out["sum_ok"] = got.get("sum_ok")
    if out["error"] is None and not out["timed_out"]:
        out["error"] = got.get("error") or (f"exit {rc}: {nccl_worker.last_line(text) or 'no output'}" if rc else None)
    out["ok"] = rc == 0 and out["error"] is None and out["sum_ok"] is True
    if rc == 0 and out["sum_ok"] is not True and out["error"] is None:
        out["error"] = "the all-reduce gave wrong sums"
    return out
