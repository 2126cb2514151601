"""The all-reduce worker of the NCCL preflight: run on the host with the ml-env venv's python.

    python nccl_worker.py [--backend nccl|gloo] [--nprocs N] [--min-bytes B] [--max-bytes B] [--budget-s S]

Prints one JSON document (``report``) on stdout and exits 0 when every rank measured, 1 when not.
The parent starts one process per GPU (``--backend nccl``, the GPUs of CUDA_VISIBLE_DEVICES) or
``--nprocs`` CPU processes (``--backend gloo``), each this same file with ``--rank``; they meet on
127.0.0.1 (MASTER_ADDR/MASTER_PORT, no torchrun). Each rank all-reduces sizes from min-bytes,
doubling, up to max-bytes: warm-up, then timed iterations (CUDA events on GPUs), with the
iteration count chosen so a size takes about ``--per-size-s``; the slowest rank's time counts.
The parent kills every rank at the budget (default 30 s, NCCL init and torch's import included)
and the sizes measured by then are reported (``truncated``).

It runs under the environment it is given (the instance's NCCL_*/GLOO_* variables), with
NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING added so that NCCL's own lines say
what it did: per size the algorithm and protocol rank 0 chose ("AllReduce: N Bytes -> Algo
RING proto SIMPLE"), the transports (P2P, SHM, NET), and, when NCCL refuses a value, its
WARN line: ``nccl_message``. A rank's Python exception is reported as its last line, never
as a traceback. NCCL_DEBUG changes what NCCL prints, not what it chooses.

Stdlib only at import: torch is imported inside the rank's function, so the parsing and
arithmetic below are importable (and unit-tested) where torch is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
GB = 1e9  # nccl-tests' GB/s are 10^9 bytes per second

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md): busbw = algbw x factor(n).
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}

# Older NCCL prints the algorithm and protocol as numbers (src/include/nccl_common.h).
ALGO_NAMES = ["TREE", "RING", "COLLNET_DIRECT", "COLLNET_CHAIN", "NVLS", "NVLS_TREE", "PAT"]
PROTO_NAMES = ["LL", "LL128", "SIMPLE"]

_TUNING = re.compile(r"AllReduce: +(\d+) Bytes -> Algo (\w+) proto (\w+)")
_TUNING_OLD = re.compile(r"NCCL INFO +(\d+) Bytes -> Algo (\d+) proto (\d+)")
_TRANSPORT = re.compile(r"via ((?:P2P|SHM|NET|NVLS|CollNet)[\w/]*)")
_VERSION = re.compile(r"NCCL version ([\w.+-]+)")
_WARN = re.compile(r"NCCL WARN (.*)")
_ENV_SET = re.compile(r"NCCL INFO (\w+) set by environment to (.*)")
_CHANNELS = re.compile(r"(\d+) coll channels")
_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,TUNING"}


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes/s): the buffer's size over the time of one operation."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds / GB


def busbw_gbps(algbw: float, nranks: int, op: str = "all_reduce") -> float:
    """Bus bandwidth in GB/s, nccl-tests' definition: algbw x 2(n-1)/n for all-reduce (0 for one rank)."""
    if nranks < 1:
        raise ValueError(f"nranks must be at least 1, got {nranks}")
    return algbw * BUS_FACTORS[op](nranks)


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """min_bytes, doubling, up to max_bytes (inclusive)."""
    if not 0 < min_bytes <= max_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    out = [min_bytes]
    while out[-1] * 2 <= max_bytes:
        out.append(out[-1] * 2)
    return out


def _algo(name: str, names: list[str]) -> str:
    """A name as NCCL prints it now (RING, SIMPLE), from a name or an older release's number."""
    if name.isdigit():
        return names[int(name)] if int(name) < len(names) else name
    return name.upper()


def parse_nccl_log(text: str) -> dict:
    """What NCCL's own INFO/WARN lines say: version, transports, channels, per-size algo/proto, WARN messages."""
    chosen: dict[int, dict[str, int]] = {}
    for m in [*_TUNING.finditer(text), *_TUNING_OLD.finditer(text)]:
        key = f"{_algo(m.group(2), ALGO_NAMES)}/{_algo(m.group(3), PROTO_NAMES)}"
        per_size = chosen.setdefault(int(m.group(1)), {})
        per_size[key] = per_size.get(key, 0) + 1
    algo = {}
    for nbytes, counts in chosen.items():
        a, p = max(counts, key=counts.get).split("/")
        algo[nbytes] = {"algorithm": a, "protocol": p}
    warns: list[str] = []
    env_set: list[str] = []
    last_env = None
    for line in text.splitlines():
        env = _ENV_SET.search(line)
        if env:
            last_env = f"{env.group(1)}={env.group(2).strip().rstrip('.')}"
            if last_env not in env_set:
                env_set.append(last_env)
        warn = _WARN.search(line)
        if warn:
            # NCCL 2.28's parser names the value, not the variable: the ENV line just before it does.
            msg = warn.group(1).strip() + (f" (NCCL had just read {last_env})" if last_env else "")
            if msg not in warns:
                warns.append(msg)
        if "Init START" in line:
            last_env = None
    version = _VERSION.search(text)
    channels = _CHANNELS.findall(text)
    return {
        "nccl_version": version.group(1) if version else None,
        "transports": sorted(set(_TRANSPORT.findall(text))),
        "channels": int(channels[-1]) if channels else None,
        "algo": algo,
        "warnings": warns,
        "env_set": env_set,
    }


def last_line(text: str) -> str:
    """The last non-empty line of an exception's text or a log (what a rank reports instead of a traceback)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def nccl_message(error: str, warns: list[str]) -> str | None:
    """NCCL's own words about a failure: its WARN line(s), else the "Last error" torch copies from NCCL."""
    if warns:
        return "; ".join(warns[:3])
    m = re.search(r"Last error:\s*(.+)", error or "", re.S)
    if m:
        return " ".join(m.group(1).split())
    return None


def table(results: list[dict], nranks: int, op: str = "all_reduce") -> list[dict]:
    """Rows of the report, one per size: bytes, iters, time_us (slowest rank, per operation), algbw, busbw."""
    rows = []
    for r in results:
        alg = algbw_gbps(r["bytes"], r["seconds"])
        rows.append(
            {
                "bytes": r["bytes"],
                "iters": r["iters"],
                "time_us": round(r["seconds"] * 1e6, 2),
                "algbw_gbps": round(alg, 3),
                "busbw_gbps": round(busbw_gbps(alg, nranks, op), 3),
            }
        )
    return rows


def report(
    args: argparse.Namespace, nranks: int, ranks: list[dict], logs: str, elapsed: float, timed_out: bool, env: dict
) -> dict:
    """The one JSON document: rank 0's measurements, NCCL's words, every rank's outcome."""
    parsed = parse_nccl_log(logs)
    rank0 = next((r for r in ranks if r.get("rank") == 0 and r.get("results") is not None), None)
    rows = table(rank0["results"], nranks) if rank0 else []
    for row in rows:
        row.update(parsed["algo"].get(row["bytes"], {"algorithm": None, "protocol": None}))
    errors = [r["error"] for r in ranks if r.get("error")]
    failed = [r for r in ranks if r.get("rc") != 0]
    error = errors[0] if errors else None
    if error is None and timed_out and not rows:
        error = f"no size measured within the budget of {args.budget_s:g}s (a rank hung: rendezvous or NCCL init?)"
    elif error is None and failed:
        error = f"rank {failed[0].get('rank')} exited {failed[0].get('rc')}: {failed[0].get('tail') or 'no output'}"
    want = sizes(args.min_bytes, args.max_bytes)
    return {
        "ok": error is None and bool(rows),
        "backend": args.backend,
        "world_size": nranks,
        "op": "all_reduce",
        "dtype": args.dtype,
        "sizes": rows,
        "truncated": len(rows) < len(want),
        "sum_ok": rank0.get("sum_ok") if rank0 else None,
        "error": error,
        "nccl_message": nccl_message(error or "", parsed["warnings"]) if error else None,
        "nccl_warnings": parsed["warnings"],
        "nccl_env": parsed["env_set"],
        "nccl_version": parsed["nccl_version"] or (rank0 or {}).get("nccl_version"),
        "transports": parsed["transports"],
        "channels": parsed["channels"],
        "torch": (rank0 or {}).get("torch"),
        "env": {k: v for k, v in sorted(env.items()) if k.startswith(("NCCL_", "GLOO_", "CUDA_VISIBLE", "TORCH_"))},
        "elapsed_s": round(elapsed, 2),
        "budget_s": args.budget_s,
        "timed_out": timed_out,
        "ranks": [{k: v for k, v in r.items() if k != "results"} for r in ranks],
    }


def _rank(args: argparse.Namespace) -> int:  # pragma: no cover - needs torch (and GPUs for nccl)
    """One rank: init, all-reduce every size, write {results, sum_ok, ...} to args.result."""
    out: dict = {"rank": args.rank}
    try:
        import torch
        import torch.distributed as dist

        out["torch"] = torch.__version__
        device = _init_group(torch, dist, args, out)
        _measure(torch, dist, args, device, out)
        check = torch.full((1024,), float(args.rank + 1), dtype=torch.float32, device=device)
        dist.all_reduce(check)
        out["sum_ok"] = bool((check == args.world * (args.world + 1) / 2).all().item())
        dist.destroy_process_group()
        rc = 0
    except Exception as exc:  # reported as one line; NCCL's own WARN line is read from its log by the parent
        text = last_line(str(exc)) or repr(exc)
        out["error"] = f"{type(exc).__name__}: {text}"
        out["error_text"] = str(exc)[-2000:]
        rc = 1
    with open(args.result, "w") as f:
        json.dump(out, f)
    return rc


def _init_group(torch, dist, args: argparse.Namespace, out: dict):  # pragma: no cover - needs torch
    """Join the process group (nccl: on the rank's GPU, its NCCL version in `out`); the device the rank works on."""
    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)
        device = torch.device("cuda", args.rank)
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        dist.init_process_group("nccl", rank=args.rank, world_size=args.world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
    return device


def _measure(torch, dist, args: argparse.Namespace, device, out: dict) -> None:  # pragma: no cover - needs torch
    """All-reduce every size: a warm-up sets the iteration count, the timed run the time; out["results"] grows."""
    gpu = args.backend == "nccl"
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    buf = torch.zeros(args.max_bytes // elem, dtype=dtype, device=device)
    results = []
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        view = buf[: nbytes // elem]
        once = _slowest(torch, dist, device, _timed(torch, dist, view, args.warmup, gpu) / max(args.warmup, 1))
        iters = int(min(args.max_iters, max(args.min_iters, args.per_size_s // max(once, 1e-6))))
        seconds = _slowest(torch, dist, device, _timed(torch, dist, view, iters, gpu) / iters)
        results.append({"bytes": nbytes, "iters": iters, "seconds": seconds})
        out["results"] = results  # what is measured so far survives a kill at the budget
        with open(args.result, "w") as f:
            json.dump(out, f)


def _slowest(torch, dist, device, seconds: float) -> float:  # pragma: no cover - needs torch
    """The largest of every rank's `seconds`: the slowest rank's time is the size's."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(torch, dist, view, n: int, gpu: bool) -> float:  # pragma: no cover - needs torch
    """Seconds of n all-reduces of `view` after a barrier: CUDA events on a GPU, the wall clock on a CPU."""
    dist.barrier()
    if gpu:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            dist.all_reduce(view)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(view)
    return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_count() -> int:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else nvidia-smi's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([g for g in visible.split(",") if g.strip()])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([ln for ln in out.splitlines() if ln.startswith("GPU ")])


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def launch(args: argparse.Namespace) -> dict:
    """Start every rank, wait for them within the budget, and build the report."""
    start = time.monotonic()
    nranks = args.nprocs or (_gpu_count() if args.backend == "nccl" else 2)
    tmp = tempfile.mkdtemp(prefix="nccl-preflight-")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "PYTHONUNBUFFERED": "1"}
    if args.backend == "nccl":
        env.update(_DEBUG_ENV)
    procs = []
    for rank in range(nranks):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--world", str(nranks)]
        cmd += ["--result", os.path.join(tmp, f"rank{rank}.json"), *args.passthrough]
        log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")  # noqa: SIM115 - closed below
        procs.append(
            (rank, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log)
        )
    deadline = start + args.budget_s
    first_failure = None
    while any(p.poll() is None for _, p, _ in procs) and time.monotonic() < deadline:
        if first_failure is None and any(p.poll() not in (None, 0) for _, p, _ in procs):
            first_failure = time.monotonic()  # peers of a failed rank may wait forever for it
            deadline = min(deadline, first_failure + args.grace_s)
        time.sleep(0.05)
    timed_out = any(p.poll() is None for _, p, _ in procs)
    for _, p, _ in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    ranks, logs = [], ""
    for rank, p, log in procs:
        log.seek(0)
        text = log.read()
        log.close()
        logs += text
        r = _read_json(os.path.join(tmp, f"rank{rank}.json")) or {"rank": rank}
        r["rc"] = p.returncode
        if p.returncode != 0 and not r.get("error"):
            r["tail"] = last_line(text)
        if p.returncode == -signal.SIGKILL and not r.get("error") and timed_out:
            r["killed"] = "at the budget" if first_failure is None else "after a peer failed"
        ranks.append(r)
    shutil.rmtree(tmp, ignore_errors=True)
    out = report(args, nranks, ranks, logs, time.monotonic() - start, timed_out, env)
    if args.keep_log:
        out["log"] = logs[-args.keep_log :]
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    p.add_argument("--nprocs", type=int, default=0, help="ranks (default: the visible GPUs; 2 for gloo)")
    p.add_argument("--min-bytes", type=int, default=MIB)
    p.add_argument("--max-bytes", type=int, default=1024 * MIB)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-iters", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=50)
    p.add_argument("--per-size-s", type=float, default=0.15, help="aim for about this much timed work per size")
    p.add_argument("--budget-s", type=float, default=30.0, help="all ranks killed after this (everything included)")
    p.add_argument("--grace-s", type=float, default=5.0, help="how long the others may run after a rank failed")
    p.add_argument("--keep-log", type=int, default=0, help="keep this many characters of the ranks' output")
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    keys = ("backend", "min_bytes", "max_bytes", "dtype", "warmup", "min_iters", "max_iters", "per_size_s")
    args.passthrough = [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    return args


def main(argv: list[str] | None = None) -> int:
    # Run as a script from plugins/module_utils/sglang_deploy/, its folder would shadow the stdlib (http.py) for torch.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.rank is not None:
        return _rank(args)
    out = launch(args)
    print(json.dumps(out, indent=1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
