"""Configuration checks, before anything running is touched: every instance of a host, with the
installed SGLang's own parser, and the host itself (validate_host, what sglang_validate returns).

Per instance: the exact argument vector through SGLang's parser (misspelt, renamed and abbreviated
flags, bad values), speculative decoding against the draft's config.json, parallelism against the
instance's GPUs, the model paths as the service user sees them (instance_checks), the NCCL_* and
SGLANG_* environment (here: its tables are what an operator extends), and the port. Per host:
distinct names, ports and GPUs, the GPUs the host has, /dev/shm (host_checks), whether SGLang is
installed. Every problem names the variable that produced it and what to do.

SGLang's parser run (an import of SGLang, seconds) is the slow part: a successful verdict is kept
on the host under <state_dir>/validated/, keyed by everything it depends on (sglang_parser), and
reused while nothing of that changed. The checks that depend on the moment (paths, port, GPUs,
/dev/shm, the draft's config.json) run every time, on the parser's cached output.

No Ansible here: plugins/modules/sglang_validate.py is the adapter.
"""

from __future__ import annotations

import os
import re
import time

from .host_checks import check_distinct, check_port, check_shm, count_gpus, where
from .instance_checks import check_gpus, check_parallel_sizes, check_parser, check_paths, check_speculative
from .outcomes import INVALID_CONFIG
from .problems import ValidateError, problem
from .render import RECORD_KEYS
from .sglang_parser import CACHE_DIR, VerdictCache, cache_key, installation_identity, run_parser

# ---------------------------------------------------------------- per instance: its environment
# NCCL variables this project knows, with the values NCCL accepts where they are a fixed set.
NCCL_CHOICES = {
    "NCCL_PROTO": {"LL", "LL128", "Simple"},
    "NCCL_ALGO": {"Ring", "Tree", "CollnetDirect", "CollnetChain", "NVLS", "NVLSTree", "PAT"},
    "NCCL_P2P_LEVEL": {"LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5"},
    "NCCL_SHM_DISABLE": {"0", "1"},
    "NCCL_P2P_DISABLE": {"0", "1"},
    "NCCL_IB_DISABLE": {"0", "1"},
    "NCCL_NVLS_ENABLE": {"0", "1"},
    "NCCL_CUMEM_ENABLE": {"0", "1"},
    "NCCL_DEBUG": {"VERSION", "WARN", "INFO", "TRACE"},
}
NCCL_NUMERIC = frozenset(
    [
        "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_BUFFSIZE",
        "NCCL_NTHREADS",
        "NCCL_MIN_CTAS",
        "NCCL_MAX_CTAS",
        "NCCL_NET_GDR_LEVEL",
        "NCCL_IB_TIMEOUT",
        "NCCL_IB_RETRY_CNT",
        "NCCL_SOCKET_NTHREADS",
        "NCCL_NSOCKS_PERTHREAD",
    ]
)
NCCL_FREE = frozenset(
    [
        "NCCL_SOCKET_IFNAME",
        "NCCL_IB_HCA",
        "NCCL_DEBUG_SUBSYS",
        "NCCL_DEBUG_FILE",
        "NCCL_TOPO_FILE",
        "NCCL_NET",
        "NCCL_IB_GID_INDEX",
        "NCCL_CROSS_NIC",
        "NCCL_NET_GDR_READ",
        "NCCL_GRAPH_FILE",
        "NCCL_LAUNCH_MODE",
    ]
)


def _check_nccl(name, value, key):
    if name in NCCL_CHOICES:
        values = [v for v in value.lstrip("^").split(",") if v] if name in ("NCCL_PROTO", "NCCL_ALGO") else [value]
        bad = [v for v in values if v not in NCCL_CHOICES[name]]
        if bad or not values:
            choices = ", ".join(sorted(NCCL_CHOICES[name]))
            return [
                problem(
                    "env", key, f"{name}={value}: {', '.join(bad) or 'empty'} is not one of {choices} (set by {key})"
                )
            ]
    elif name in NCCL_NUMERIC:
        if not re.fullmatch(r"\d+", value):
            return [problem("env", key, f"{name}={value}: a whole number is expected (set by {key})")]
    elif name not in NCCL_FREE:
        message = (
            f"{name} is not an NCCL variable this project knows (set by {key}): misspelt? "
            "Add it to NCCL_FREE in plugins/module_utils/sglang_deploy/validate.py if it is real"
        )
        return [problem("env", key, message)]
    return []


def check_env(env, env_names, env_origins):
    """NCCL_* against what NCCL accepts; SGLANG_* against the installed SGLang's registry (when known)."""
    problems = []
    for name, value in env.items():
        key = env_origins.get(name, name)
        if name.startswith("NCCL_"):
            problems += _check_nccl(name, str(value), key)
        elif name.startswith(("SGLANG_", "SGL_")) and env_names is not None and name not in env_names:
            message = (
                f"{name} is not an environment variable of the installed SGLang (sglang/srt/environ.py) "
                f"(set by {key}): misspelt, or removed in this release"
            )
            problems.append(problem("env", key, message))
    return problems


# ---------------------------------------------------------------- the host, all its instances at once
def _check_instance(i, inst, parse, host_gpus, service_user):
    """Every check of one instance; `parse` is the parser's output (None: SGLang not installed)."""
    argv, origins = inst["server_argv"], inst.get("origins") or {}
    problems = []
    args = {}
    if parse is not None:
        problems += check_parser(parse, argv, origins)
        args = (parse.get("args") or {}) if not parse.get("error") else {}
    if args:
        problems += check_speculative(args, origins)
        problems += check_parallel_sizes(args, inst["gpus"], origins)
        problems += check_paths(args, service_user, origins)
    env_names = parse.get("env_names") if parse is not None else None
    problems += check_env(inst.get("env") or {}, env_names, inst.get("env_origins") or {})
    if host_gpus is not None:
        problems += check_gpus(inst["gpus"], host_gpus, where(inst, i, "gpus"))
    if inst.get("port"):
        problems += check_port(int(inst["port"]), inst.get("unit"), where(inst, i, "port"))
    return problems


def _host_checks(instances, min_shm_mib, shm_path, gpu_counter, check_mode, variants=False):
    """Distinct names/ports/GPUs (not for variants: other configurations of one instance), /dev/shm, the host's
    GPU count: (problems, notes, shm_mib, host_gpus)."""
    problems, notes, shm_mib, host_gpus = [] if variants else check_distinct(instances), [], None, None
    if min_shm_mib:
        found, shm_mib = check_shm(int(min_shm_mib), shm_path)
        problems += found
    try:
        host_gpus = gpu_counter()
    except FileNotFoundError as exc:
        if not check_mode:
            raise ValidateError("no nvidia-smi on the host: install the NVIDIA driver first (the cuda role)") from exc
        notes.append("the NVIDIA driver is not installed yet (check mode): the GPUs are checked once it is")
    return problems, notes, shm_mib, host_gpus


def _installed(instances, check_mode):
    """{python: whether it exists}, problems, notes. Check mode on a fresh node: not installed *yet*."""
    installed, problems, notes = {}, [], []
    for py in sorted({inst["python"] for inst in instances}):
        installed[py] = os.path.exists(py)
        if installed[py]:
            continue
        if check_mode:
            venv = os.path.dirname(os.path.dirname(py))
            notes.append(
                f"SGLang is not installed in {venv} yet (check mode); "
                "the configuration is checked by SGLang's parser once it is"
            )
        else:
            message = (
                f"no {py}: install SGLang first (the sglang role, before sglang_service) or set sglang_service_venv"
            )
            problems.append(problem("install", "sglang_service_venv", message))
    return installed, problems, notes


def _parse_all(instances, installed, service_user, store, patch_manifest, parser, touch):
    """The parser's output per instance index (from the cache where it holds the key; one parser run
    per python for the rest), the cache keys, and the indices served from the cache."""
    identities, keys, parses, cached, to_parse = {}, {}, {}, set(), {}
    for i, inst in enumerate(instances):
        py = inst["python"]
        if not installed[py]:
            continue
        if store is not None and py not in identities:
            identities[py] = installation_identity(py, patch_manifest)
        if identities.get(py) is not None:
            env, port = inst.get("env") or {}, inst.get("port")
            keys[i] = cache_key(identities[py], py, inst["server_argv"], env, inst["gpus"], port, service_user)
            parses[i] = store.load(keys[i], touch=touch)
        if parses.get(i) is not None:
            cached.add(i)
        else:
            to_parse.setdefault(py, []).append(i)
    for py, idxs in to_parse.items():
        for i, out in zip(idxs, parser(py, [instances[i]["server_argv"] for i in idxs]), strict=True):
            parses[i] = out
    return parses, keys, cached


def validate_host(
    instances,
    service_user,
    min_shm_mib=0,
    state_dir=None,
    patch_manifest=None,
    cache=True,
    check_mode=False,
    gpu_counter=count_gpus,
    parser=run_parser,
    shm_path="/dev/shm",
    variants=False,
):
    """Check every instance of the host and the host; the module's result. With variants, the records are other
    configurations of the same instances (autotune's combinations): not checked against one another, and each
    problem names its record's profile.

    On a refusal: failed, outcome INVALID_CONFIG, msg (every problem, each naming its variable) and
    problems [{check, key, message, instance}]. Always: instances [{name, unit, profile, parsed,
    cached}], installed, host_gpus, shm_mib, seconds. Raises ValidateError when the checks could not
    run (nvidia-smi or SGLang's parser failing). Check mode reads the cache but writes nothing.
    """
    t0 = time.monotonic()
    _check_records(instances)
    found, notes, shm_mib, host_gpus = _host_checks(instances, min_shm_mib, shm_path, gpu_counter, check_mode, variants)
    installed, missing, waiting = _installed(instances, check_mode)
    problems = [dict(p, instance=None) for p in found + missing]
    notes += waiting
    store = VerdictCache(os.path.join(state_dir, CACHE_DIR)) if cache and state_dir else None
    parses, keys, cached = _parse_all(instances, installed, service_user, store, patch_manifest, parser, not check_mode)

    reports = []
    for i, inst in enumerate(instances):
        parse = parses.get(i)
        found = _check_instance(i, inst, parse, host_gpus, service_user)
        problems += [
            dict(p, instance=inst["name"], **({"profile": inst.get("profile")} if variants else {})) for p in found
        ]
        verdict_ok = parse is not None and not parse.get("error") and not check_parser(parse, inst["server_argv"], {})
        if i in keys and i not in cached and verdict_ok and not check_mode:
            store.store(keys[i], parse, inst["name"])
        report = {"name": inst["name"], "unit": inst.get("unit"), "profile": inst.get("profile")}
        reports.append(dict(report, parsed=parse is not None, cached=i in cached))

    result = {
        "changed": False,
        "problems": problems,
        "instances": reports,
        "installed": all(installed.values()),
        "host_gpus": host_gpus,
        "shm_mib": shm_mib,
        "seconds": round(time.monotonic() - t0, 3),
    }
    return _verdict(result, notes, len(instances), len(cached))


def _check_records(instances):
    """Only rendered instance records are checked (render.RECORD_KEYS): anything else is refused before any check."""
    for i, inst in enumerate(instances):
        lacking = [k for k in RECORD_KEYS if k not in inst]
        if lacking:
            raise ValidateError(f"instances[{i}] lacks {', '.join(lacking)}: not a rendered instance record")


def _verdict(result, notes, count, from_cache):
    """`result` with its msg: a refusal (INVALID_CONFIG, every problem) when it has problems, else the summary."""
    problems = result["problems"]
    if problems:
        messages = [f"{p['instance']}: {p['message']}" if p["instance"] else p["message"] for p in problems]
        result.update(failed=True, outcome=INVALID_CONFIG, msg="; ".join(messages))
    else:
        summary = f"{count} instance(s) valid ({from_cache} parser verdict(s) from the cache)"
        result["msg"] = "; ".join([summary, *notes])
    return result
