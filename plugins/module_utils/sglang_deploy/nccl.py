"""The NCCL preflight: how fast an instance's GPUs all-reduce, against a floor that says how fast they should.

- Bus bandwidth as nccl-tests defines it (doc/PERFORMANCE.md): algbw = bytes / time,
  busbw = algbw x 2(n-1)/n for all-reduce; the arithmetic lives in ``nccl_worker`` (it runs
  alone on the host) and is re-exported here.
- ``parse_topo`` reads ``nvidia-smi topo -m`` (the GPU x GPU matrix: NV#, PIX, PXB, PHB,
  NODE, SYS), ``parse_nvlink_status`` reads ``nvidia-smi nvlink --status``.
- ``derive_floor`` turns the topology of the instance's GPUs into a floor with the reasoning
  as text; a floor the operator sets replaces it (0: measure and report, judge nothing).
- ``judge`` compares the worker's report with the floor; ``preflight`` does it all on a host
  (nvidia-smi, the worker under the venv's python with the instance's environment).

No Ansible imports: the module ``plugins/modules/nccl_preflight.py`` is a thin adapter over ``preflight``.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import tempfile

from . import nccl_worker
from .nccl_worker import MIB, algbw_gbps, busbw_gbps, sizes

__all__ = ["algbw_gbps", "busbw_gbps", "derive_floor", "judge", "parse_nvlink_status", "parse_topo", "preflight"]

# NVLink 3 (A100) and 4 (H100, H200) links carry 25 GB/s per direction each (NVIDIA's figures:
# 18 links = 900 GB/s bidirectional on H100/H200, 12 = 600 GB/s on A100). nvidia-smi's
# `nvlink --status` prints the signalling rate, 26.562 GB/s, for the same links.
NVLINK_GBPS_PER_LINK = 25.0
# The floor is this fraction of the links' per-direction peak. nccl-tests' all-reduce busbw on
# NVLink reaches about 80 % of it at large sizes (HGX H100 without NVLS: about 360 of 450 GB/s);
# half leaves room for a preflight that stops at 1 GiB instead of 16 GB and for NVLS being off,
# and still fails a PCIe or host-memory fallback (about 10 to 50 GB/s) or lost links by far.
NVLINK_FRACTION = 0.5
# PCIe 4.0 x16 carries 32 GB/s per direction (5.0: 64). A quarter of 4.0 x16: traffic through
# host memory (P2P off, or across sockets) still passes it; a broken or x1-trained link does not.
PCIE_X16_GEN4_GBPS = 32.0
PCIE_FRACTION = 0.25
# Azure/azurehpc-health-checks, conf/nd96isr_h200_v5.conf: `check_nccl_allreduce 431.0 1 16G`.
AZURE_H200_8GPU_GBPS = 431.0
# Below this, all-reduce time is mostly latency: busbw there says little about the links.
MIN_JUDGED_BYTES = 64 * MIB

_NV = re.compile(r"NV(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi 580 underlines the header, also into a pipe
_PCIE = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
_LINK = re.compile(r"^\s*Link (\d+): (.*)$")
_GPU_HEAD = re.compile(r"^GPU (\d+):")
_GBPS = re.compile(r"([\d.]+) GB/s")


def worker_source() -> str:
    """The worker's source, to write beside nothing on the host (works from AnsiballZ's zip too)."""
    return inspect.getsource(nccl_worker)


def parse_topo(text: str) -> dict:
    """`nvidia-smi topo -m`: {gpus, pairs: [{a, b, link}], nics, cpu_affinity, numa_affinity}.

    Tab- or space-separated, with or without ANSI underlining of the header, with or without NIC columns, with a leading "NVIDIA Topology:"
    line (sglang.check_env's) and the legend; only GPU rows are read. ValueError when no
    GPU matrix is found.
    """
    lines = _ANSI.sub("", text).splitlines()
    header = next((ln for ln in lines if re.match(r"^\s+GPU0\b", ln)), None)
    if header is None:
        raise ValueError("no GPU matrix in the topology (expected nvidia-smi topo -m output)")
    cols = []
    for tok in header.split():
        if tok == "CPU":
            break
        cols.append(tok)
    gpus, cells, cpu, numa = [], {}, {}, {}
    for ln in lines:
        toks = ln.split()
        if not toks or not re.fullmatch(r"GPU\d+", toks[0]) or ln.startswith((" ", "\t")):
            continue
        g = int(toks[0][3:])
        row = toks[1 : 1 + len(cols)]
        if len(row) < len(cols):
            raise ValueError(f"topology row {toks[0]} has {len(row)} cells for {len(cols)} columns: {ln.strip()}")
        gpus.append(g)
        cells[g] = dict(zip(cols, row, strict=True))
        rest = toks[1 + len(cols) :]
        cpu[g] = rest[0] if rest else None
        numa[g] = rest[1] if len(rest) > 1 else None
    pairs = []
    for a in gpus:
        for b in gpus:
            if a < b:
                link = cells[a].get(f"GPU{b}")
                if link is None:
                    raise ValueError(f"topology has no GPU{a}/GPU{b} cell")
                pairs.append({"a": a, "b": b, "link": link})
    nics = [c for c in cols if not re.fullmatch(r"GPU\d+", c)]
    return {"gpus": gpus, "pairs": pairs, "nics": nics, "cpu_affinity": cpu, "numa_affinity": numa}


def parse_nvlink_status(text: str) -> dict[int, dict]:
    """`nvidia-smi nvlink --status`: {gpu: {links, active, inactive, gbps: [per active link]}}."""
    out: dict[int, dict] = {}
    gpu = None
    for ln in text.splitlines():
        head = _GPU_HEAD.match(ln)
        if head:
            gpu = int(head.group(1))
            out[gpu] = {"links": 0, "active": 0, "inactive": 0, "gbps": []}
            continue
        link = _LINK.match(ln)
        if link and gpu is not None:
            out[gpu]["links"] += 1
            speed = _GBPS.search(link.group(2))
            if speed:
                out[gpu]["active"] += 1
                out[gpu]["gbps"].append(float(speed.group(1)))
            else:
                out[gpu]["inactive"] += 1
    return out


def _link(topo: dict, a: int, b: int) -> str:
    lo, hi = min(a, b), max(a, b)
    return next(p["link"] for p in topo["pairs"] if p["a"] == lo and p["b"] == hi)


def _gbps(x: float) -> str:
    """A figure for a message: 328, 26.8, 0.01."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def derive_floor(
    topo: dict | None, gpus: list[int] | None = None, nvlink: dict | None = None, operator_floor: float | None = None
) -> dict:
    """{floor_gbps, basis, gpus, link, peak_gbps, reasoning: [lines]} for all-reduce busbw on `gpus`.

    basis: operator (the operator's floor; 0 means report only), nvlink, pcie, single-gpu
    (floor None: no all-reduce, nothing to check) or unknown (no topology and no operator
    floor: report only). The slowest pair of GPUs sets the floor: a ring is as fast as its
    slowest hop. `nvlink` (parse_nvlink_status) lowers an NV# to the links actually active.
    """
    if gpus is None:
        gpus = list(topo["gpus"]) if topo else []
    gpus = sorted(gpus)
    out = {"floor_gbps": None, "basis": "unknown", "gpus": gpus, "link": None, "peak_gbps": None, "reasoning": []}
    why = out["reasoning"]
    if topo is not None and len(gpus) > 1:
        missing = sorted(set(gpus) - set(topo["gpus"]))
        if missing:
            raise ValueError(f"GPUs {missing} are not in the topology (it has {topo['gpus']})")
    if len(gpus) == 1:
        out["basis"] = "single-gpu"
        why.append(f"1 GPU ({gpus[0]}): tensor parallelism of 1 does no all-reduce; nothing to check.")
        return out
    if topo is not None and len(gpus) > 1:
        links = {(a, b): _link(topo, a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]}
        counts = {k: int(m.group(1)) for k, v in links.items() if (m := _NV.fullmatch(v))}
        if len(counts) == len(links):
            _nvlink_floor(out, links, counts, nvlink)
        else:
            _pcie_floor(out, links)
    elif len(gpus) > 1:
        why.append("No topology: no floor can be derived; the bandwidth is reported, not judged.")
    if len(gpus) == 8 and out["basis"] == "nvlink":
        why.append(
            f"Reference: Azure's H200 node check fails 8 GPUs below {_gbps(AZURE_H200_8GPU_GBPS)} GB/s all-reduce busbw "
            "at 16 GB (azurehpc-health-checks conf/nd96isr_h200_v5.conf), with NVLS (NVLink SHARP) allowed; "
            f"this floor is lower because the preflight stops at 1 GiB and may run with NVLS off."
        )
    if operator_floor is not None:
        derived = out["floor_gbps"]
        out["basis"], out["floor_gbps"] = "operator", float(operator_floor)
        what = "report only, judge nothing" if operator_floor == 0 else f"{_gbps(operator_floor)} GB/s"
        was = f" (derived: {_gbps(derived)} GB/s, for reference)" if derived is not None else ""
        why.insert(0, f"Floor set by the operator: {what}; it replaces the derived one{was}.")
    return out


def _nvlink_floor(out: dict, links: dict, counts: dict, nvlink: dict | None) -> None:
    why = out["reasoning"]
    kinds = sorted(set(links.values()), key=lambda v: int(v[2:]))
    (a, b), n = min(counts.items(), key=lambda kv: kv[1])
    where = "every pair" if len(kinds) == 1 else f"pairs {', '.join(kinds)}, slowest GPU{a}-GPU{b}"
    why.append(f"GPUs {out['gpus']}: {where} linked by {kinds[0]} ({n} bonded NVLinks).")
    if nvlink:
        for g in out["gpus"]:
            st = nvlink.get(g)
            if st is not None and st["links"] and st["active"] < n:
                why.append(f"nvidia-smi nvlink --status: GPU {g} has {st['active']} of {st['links']} links active.")
                n = st["active"]
        if n == 0:
            why.append("No NVLink is active: the GPUs talk over PCIe or host memory.")
            _pcie_floor(out, links, note=False)
            return
    peak = n * NVLINK_GBPS_PER_LINK
    floor = NVLINK_FRACTION * peak
    why.append(
        f"NVLink 3/4 carries {_gbps(NVLINK_GBPS_PER_LINK)} GB/s per link per direction: {n} x "
        f"{_gbps(NVLINK_GBPS_PER_LINK)} = {_gbps(peak)} GB/s, the ceiling of all-reduce bus bandwidth."
    )
    why.append(
        f"Floor: {NVLINK_FRACTION:.0%} of it, {_gbps(floor)} GB/s busbw at the largest size (all-reduce on NVLink "
        "reaches about 80 % at sizes of 256 MiB and up; a fallback to PCIe or host memory, or lost links, "
        "falls far below)."
    )
    out.update(basis="nvlink", link=f"NV{n}", peak_gbps=peak, floor_gbps=floor)


def _pcie_floor(out: dict, links: dict, note: bool = True) -> None:
    why = out["reasoning"]
    slow = {k: v for k, v in links.items() if not _NV.fullmatch(v)} or links
    (a, b), worst = max(slow.items(), key=lambda kv: _PCIE.index(kv[1]) if kv[1] in _PCIE else -1)
    if note:
        kinds = sorted(set(slow.values()), key=lambda v: _PCIE.index(v) if v in _PCIE else -1)
        where = "" if len(kinds) == 1 else f"links {', '.join(kinds)}; the farthest pair, "
        numa = " across NUMA nodes" if worst in ("SYS", "SOC") else ""
        why.append(
            f"GPUs {out['gpus']}: {where}GPU{a}-GPU{b}{',' if where else ''} is {worst} (no NVLink{numa}): the all-reduce ring goes over PCIe."
        )
    floor = PCIE_FRACTION * PCIE_X16_GEN4_GBPS
    why.append(
        f"PCIe 4.0 x16 carries {_gbps(PCIE_X16_GEN4_GBPS)} GB/s per direction (5.0: 64). Floor: "
        f"{PCIE_FRACTION:.0%} of 4.0, {_gbps(floor)} GB/s busbw; set the operator floor for PCIe 5.0 hosts."
    )
    out.update(basis="pcie", link=worst if not _NV.fullmatch(worst) else None)
    out.update(peak_gbps=PCIE_X16_GEN4_GBPS, floor_gbps=floor)


def _size(nbytes: int) -> str:
    return f"{nbytes // (1 << 30)} GiB" if nbytes >= 1 << 30 else f"{nbytes // MIB} MiB"


def judge(result: dict, floor: dict) -> dict:
    """{ok, status (ok|failed|skipped), message, busbw_gbps, at_bytes}: the worker's report against the floor."""
    out = {"ok": False, "status": "failed", "message": "", "busbw_gbps": None, "at_bytes": None}
    if floor["floor_gbps"] is None and floor["basis"] == "single-gpu":
        return {**out, "ok": True, "status": "skipped", "message": floor["reasoning"][0]}
    if not result.get("ok"):
        nccl = result.get("nccl_message")
        what = f"NCCL: {nccl}" if nccl else (result.get("error") or "no result")
        out["message"] = f"all-reduce on GPUs {floor['gpus']} failed: {what}"
        return out
    if result.get("sum_ok") is False:
        out["message"] = "all-reduce gave wrong sums"
        return out
    last = result["sizes"][-1]
    out.update(busbw_gbps=last["busbw_gbps"], at_bytes=last["bytes"])
    how = "/".join(x for x in (last.get("algorithm"), last.get("protocol")) if x)
    via = ", ".join(result.get("transports") or [])
    ctx = f" ({', '.join(x for x in (how, via) if x)})" if how or via else ""
    seen = f"busbw {_gbps(last['busbw_gbps'])} GB/s at {_size(last['bytes'])}{ctx}"
    fl = floor["floor_gbps"]
    if fl is None or fl == 0:
        return {**out, "ok": True, "status": "ok", "message": f"{seen}; no floor, not judged"}
    if last["bytes"] < MIN_JUDGED_BYTES:
        cut = " (the budget ran out)" if result.get("truncated") else ""
        out["message"] = (
            f"{seen}: only sizes up to {_size(last['bytes'])} measured{cut}; at least {_size(MIN_JUDGED_BYTES)} "
            f"is needed to compare with the floor of {_gbps(fl)} GB/s"
        )
        return out
    if last["busbw_gbps"] < fl:
        out["message"] = f"{seen} is below the floor of {_gbps(fl)} GB/s ({floor['basis']}: {floor['link'] or '-'})"
        return out
    return {**out, "ok": True, "status": "ok", "message": f"{seen}, floor {_gbps(fl)} GB/s"}


def _run_text(run, cmd: list[str]) -> str | None:
    """A command's stdout, None when it fails or is missing (the preflight says so in its reasoning)."""
    try:
        res = run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def preflight(
    python: str,
    env: dict[str, str],
    gpus: list[int] | None = None,
    backend: str = "nccl",
    nprocs: int = 0,
    min_bytes: int = MIB,
    max_bytes: int = 1024 * MIB,
    floor_gbps: float | None = None,
    budget_s: float = 30.0,
    topology: str | None = None,
    nvlink_status: str | None = None,
    base_env: dict[str, str] | None = None,
    run=subprocess.run,
) -> dict:
    """The preflight on this host: {ok, status, message, floor, result, topology, command}.

    nccl: the worker gets CUDA_VISIBLE_DEVICES = `gpus` (all the topology's GPUs when None)
    and the floor comes from `nvidia-smi topo -m` (or `topology`, its text) unless
    `floor_gbps` is set. gloo: `nprocs` CPU ranks, judged only against `floor_gbps`. The
    worker runs under `base_env` (default: PATH, HOME, LANG of this process) plus `env`.
    """
    sizes(min_bytes, max_bytes)  # ValueError before anything runs
    topo, status_map = None, None
    if backend == "nccl":
        topo, status_map, gpus, floor = _gpu_floor(gpus, floor_gbps, topology, nvlink_status, run)
    else:
        floor = _cpu_floor(nprocs, floor_gbps)
    out = {"floor": floor, "topology": topo, "nvlink": status_map, "result": None, "command": None}
    if floor["basis"] == "single-gpu":
        return {**out, **judge({}, floor)}
    wenv = _worker_env(env, base_env, gpus if backend == "nccl" else None)
    options = ["--backend", backend, "--min-bytes", str(min_bytes), "--max-bytes", str(max_bytes)]
    options += ["--budget-s", str(budget_s)] + (["--nprocs", str(nprocs)] if nprocs else [])
    out["command"], text, err = _run_worker(python, options, budget_s, wenv, run)
    out["result"] = _worker_report(text, err)
    return {**out, **judge(out["result"], floor)}


def _gpu_floor(
    gpus: list[int] | None, floor_gbps: float | None, topology: str | None, nvlink_status: str | None, run
) -> tuple[dict | None, dict | None, list[int], dict]:
    """(topology, nvlink status, gpus, floor) for nccl: nvidia-smi's when not given; gpus all the topology's if None."""
    topology = topology if topology is not None else _run_text(run, ["nvidia-smi", "topo", "-m"])
    if nvlink_status is None:
        nvlink_status = _run_text(run, ["nvidia-smi", "nvlink", "--status"])
    topo = parse_topo(topology) if topology else None
    status_map = parse_nvlink_status(nvlink_status) if nvlink_status else None
    if gpus is None:
        if topo is None:
            raise ValueError("no GPUs given and no topology to find them in (nvidia-smi topo -m failed)")
        gpus = topo["gpus"]
    return topo, status_map, gpus, derive_floor(topo, gpus, status_map, floor_gbps)


def _cpu_floor(nprocs: int, floor_gbps: float | None) -> dict:
    """The floor for gloo: no topology, so the operator's floor alone (0, report only, when none is set)."""
    floor = derive_floor(None, list(range(nprocs or 2)), None, floor_gbps if floor_gbps is not None else 0)
    floor["reasoning"] = [
        f"gloo on {nprocs or 2} CPU ranks: no GPU topology; judged against the operator's floor alone.",
        *floor["reasoning"][:1],
    ]
    return floor


def _worker_env(env: dict[str, str], base_env: dict[str, str] | None, gpus: list[int] | None) -> dict[str, str]:
    """The worker's environment: base_env (default: PATH, HOME, LANG of this process), env over it, and for nccl
    (gpus given) CUDA_VISIBLE_DEVICES over both."""
    if base_env is None:
        base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    wenv = {**base_env, **{k: str(v) for k, v in env.items()}}
    if gpus is not None:
        wenv["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return wenv


def _run_worker(
    python: str, options: list[str], budget_s: float, wenv: dict[str, str], run
) -> tuple[list[str], str, str]:
    """(command, stdout, stderr) of the worker, its source written to a temporary directory and run there. A worker
    that cannot be run or outlives its budget is no exception: no stdout, and the reason as its stderr."""
    with tempfile.TemporaryDirectory(prefix="nccl-preflight-") as tmp:
        path = os.path.join(tmp, "nccl_worker.py")
        with open(path, "w") as f:
            f.write(worker_source())
        cmd = [python, path, *options]
        try:
            res = run(cmd, capture_output=True, text=True, timeout=budget_s + 30, check=False, env=wenv, cwd=tmp)
            return cmd, res.stdout, res.stderr
        except subprocess.TimeoutExpired:
            return cmd, "", f"the worker did not return within {budget_s + 30:g}s"
        except OSError as exc:
            return cmd, "", f"could not run {python}: {exc}"


def _worker_report(text: str, err: str) -> dict:
    """The worker's JSON report, or a failed one naming the last line it printed."""
    try:
        return json.loads(text)
    except ValueError:
        tail = nccl_worker.last_line(err) or nccl_worker.last_line(text) or "no output"
        return {"ok": False, "error": f"the worker printed no report: {tail}", "nccl_message": None}
