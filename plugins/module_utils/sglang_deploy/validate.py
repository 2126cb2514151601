"""Configuration checks, before anything running is touched: every instance of a host, with the
installed SGLang's own parser, and the host itself.

Per instance: the exact argument vector through SGLang's parser (misspelt, renamed and abbreviated
flags, bad values), speculative decoding against the draft's config.json, parallelism against the
instance's GPUs, the model paths as the service user sees them, the NCCL_* and SGLANG_* environment,
and the port. Per host: distinct names, ports and GPUs, the GPUs the host has, /dev/shm, whether
SGLang is installed. Every problem names the variable that produced it and what to do.

SGLang's parser run (an import of SGLang, seconds) is the slow part: a successful verdict is kept
on the host under <state_dir>/validated/, keyed by everything it depends on (cache_key), and
reused while nothing of that changed. The checks that depend on the moment (paths, port, GPUs,
/dev/shm, the draft's config.json) run every time, on the parser's cached output.

No Ansible here: plugins/modules/sglang_validate.py is the adapter.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import pwd
import re
import stat
import subprocess
import time

from .durable import write_atomic
from .outcomes import INVALID_CONFIG
from .patch import PatchError, dist_info, installed_version
from .secret_rule import clip

# Runs under the virtualenv's Python: SGLang's own parser and environment registry, once for
# every argv given (one import of SGLang for all the host's instances).
PARSE = r"""
import argparse, json, sys
real_stdout, sys.stdout = sys.stdout, sys.stderr  # whatever SGLang prints must not spoil the answer
from sglang.srt.server_args import ServerArgs

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)

req = json.load(sys.stdin)
parser = Parser(prog="sglang.launch_server", allow_abbrev=False)
ServerArgs.add_cli_args(parser)
options = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
try:
    from sglang.srt.environ import envs
    env_names = sorted(n for n in dir(envs) if n.isupper())
except Exception:  # an SGLang without the registry
    env_names = None
results = []
for argv in req["argvs"]:
    out = {"error": None, "args": None}
    try:
        ns = parser.parse_args(argv)
        out["args"] = {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, type(None), list))}
    except ValueError as exc:
        out["error"] = str(exc)
    if out["error"] is None and out["args"].get("speculative_algorithm"):
        try:
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
            SpeculativeAlgorithm.from_string(out["args"]["speculative_algorithm"])
        except ValueError as exc:
            out["error"] = "argument --speculative-algorithm: " + str(exc)
        except Exception:  # registry not importable here: the parser's verdict stands
            pass
    results.append(out)
json.dump({"options": options, "env_names": env_names, "results": results}, real_stdout)
"""
PARSE_TIMEOUT_S = 600

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

SPEC_NEEDS_DRAFT = {"EAGLE", "EAGLE3"}
DISTINCT = "each instance needs its own name, port and GPUs"
RECORD_KEYS = ("name", "port", "gpus", "server_argv", "python")

# The parser verdicts kept on the host.
CACHE_DIR = "validated"
CACHE_KEEP = 64
# Part of every cache key: a change to the parser script, or to what the key covers, starts afresh.
CACHE_SCHEMA = hashlib.sha256(("1\0" + PARSE).encode("utf-8")).hexdigest()[:16]


class ValidateError(Exception):
    """The checks could not run (the host, not the configuration): the message says why."""


def problem(check, key, message):
    return {"check": check, "key": key, "message": message}


def flag_origin(flag, origins):
    return origins.get(flag, "the rendered command line")


# ---------------------------------------------------------------- per instance, on the parser's output
def check_parser(result, argv, origins):
    """SGLang's parser verdict, plus abbreviations (SGLang itself accepts --tp for --tp-size)."""
    problems = []
    options = set(result.get("options") or [])
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        if flag in options:
            continue
        key = flag_origin(flag, origins)
        longer = sorted(o for o in options if o.startswith(flag))
        if len(longer) == 1:
            message = f"{flag} is an abbreviation of {longer[0]}: write the flag in full (set by {key})"
        elif len(longer) > 1:
            message = f"{flag} is ambiguous ({', '.join(longer[:6])}): write the flag in full (set by {key})"
        else:
            message = (
                f"{flag} is not a flag of the installed SGLang (set by {key}); "
                "it may be misspelt or renamed: see `python -m sglang.launch_server --help`"
            )
        problems.append(problem("flags", key, message))
    if result.get("error") and not problems:
        m = re.search(r"argument (--[\w-]+)", result["error"])
        key = flag_origin(m.group(1), origins) if m else "the rendered command line"
        problems.append(problem("flags", key, f"SGLang's parser: {result['error']} (set by {key})"))
    return problems


def draft_architectures(path):
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            return json.load(fh).get("architectures") or []
    except (OSError, ValueError):
        return None


def _check_draft_kind(algo, draft, key):
    archs = draft_architectures(draft)
    if not archs:
        return []
    is_eagle3 = any(a.endswith("Eagle3") for a in archs)
    is_eagle = any(a.endswith("Eagle") for a in archs)
    if algo == "EAGLE" and is_eagle3:
        return [
            problem(
                "speculative",
                key,
                f"the draft at {draft} is an EAGLE-3 model ({', '.join(archs)}) but --speculative-algorithm is EAGLE "
                f"(set by {key}): use EAGLE3. Served under EAGLE it accepts no draft token (accept length 1.0)",
            )
        ]
    if algo == "EAGLE3" and is_eagle and not is_eagle3:
        return [
            problem(
                "speculative",
                key,
                f"the draft at {draft} is an EAGLE model ({', '.join(archs)}) but --speculative-algorithm is EAGLE3 "
                f"(set by {key}): use EAGLE",
            )
        ]
    return []


def check_speculative(args, origins):
    algo = args.get("speculative_algorithm")
    if not algo:
        return []
    key = flag_origin("--speculative-algorithm", origins)
    draft = args.get("speculative_draft_model_path")
    if algo not in SPEC_NEEDS_DRAFT:
        if draft:
            where = flag_origin("--speculative-draft-model-path", origins)
            return [
                problem("speculative", where, f"--speculative-draft-model-path is set but {algo} takes no draft model")
            ]
        return []
    if not draft:
        message = (
            f"--speculative-algorithm {algo} needs a draft model: set --speculative-draft-model-path "
            "(sglang_draft_model_path)"
        )
        problems = [problem("speculative", key, message)]
    else:
        problems = _check_draft_kind(algo, draft, key)
    steps = args.get("speculative_num_steps")
    topk = args.get("speculative_eagle_topk")
    tokens = args.get("speculative_num_draft_tokens")
    for name, value in (("steps", steps), ("topk", topk), ("tokens", tokens)):
        if value is not None and int(value) < 1:
            problems.append(problem("speculative", key, f"speculative {name} must be at least 1, not {value}"))
    if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
        where = flag_origin("--speculative-num-draft-tokens", origins)
        message = (
            f"with --speculative-eagle-topk 1 the draft tokens are steps + 1 = {steps + 1}, but "
            f"--speculative-num-draft-tokens is {tokens}: SGLang would silently run {steps + 1}, not the "
            f"configuration you benchmarked (set by {where})"
        )
        problems.append(problem("speculative", where, message))
    if topk is not None and topk > 1 and steps is not None and tokens is not None and tokens <= 1:
        message = "with topk > 1, --speculative-num-draft-tokens must be at least 2"
        problems.append(problem("speculative", key, message))
    return problems


def check_parallel_sizes(args, gpus, origins):
    tp = int(args.get("tp_size") or 1)
    dp = int(args.get("dp_size") or 1)
    pp = int(args.get("pp_size") or 1)
    nnodes = int(args.get("nnodes") or 1)
    want = tp * dp * pp
    per_node = want // nnodes if want % nnodes == 0 else None
    if per_node is not None and per_node == len(gpus):
        return []
    message = (
        f"tp {tp} x dp {dp} x pp {pp} = {want} GPUs over {nnodes} node(s) needs {want / nnodes:g} GPU(s) on this "
        f"node, but the instance is given {len(gpus)} ({gpus}): fix --tp-size (or dp/pp) or the instance's gpus"
    )
    return [problem("parallelism", flag_origin("--tp-size", origins), message)]


def check_gpus(gpus, host_gpus, key="sglang_instances[].gpus"):
    """The instance's GPUs exist on the host, each listed once."""
    problems = []
    missing = [g for g in gpus if g < 0 or g >= host_gpus]
    if missing:
        has = f"{host_gpus} (0-{host_gpus - 1})" if host_gpus else "none (nvidia-smi lists no GPU)"
        problems.append(problem("parallelism", key, f"GPUs {missing} are given to the instance but the host has {has}"))
    if len(set(gpus)) != len(gpus):
        problems.append(problem("parallelism", key, f"a GPU is listed twice in {gpus}"))
    return problems


def check_parallel(args, gpus, host_gpus, origins, gpus_key="sglang_instances[].gpus"):
    return check_parallel_sizes(args, gpus, origins) + check_gpus(gpus, host_gpus, gpus_key)


def readable_by(path, user):
    """Whether `user` can read `path` (every directory on the way searchable)."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return False, f"user {user} does not exist"
    groups = set(os.getgrouplist(user, pw.pw_gid))
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        p = os.sep.join(parts[:i]) or os.sep
        try:
            st = os.stat(p)
        except OSError as exc:
            return False, f"{p}: {exc.strerror}"
        need = 0o4 if i == len(parts) else 0o1
        if i == len(parts) and os.path.isdir(p):
            need = 0o5
        if pw.pw_uid == 0:
            continue
        if st.st_uid == pw.pw_uid:
            mode = (st.st_mode >> 6) & 0o7
        elif st.st_gid in groups:
            mode = (st.st_mode >> 3) & 0o7
        else:
            mode = st.st_mode & 0o7
        if mode & need != need:
            return False, f"{p} is not {'readable' if i == len(parts) else 'searchable'} by {user}"
    return True, ""


def check_paths(args, user, origins):
    problems = []
    for flag, dest in (
        ("--model-path", "model_path"),
        ("--speculative-draft-model-path", "speculative_draft_model_path"),
    ):
        path = args.get(dest)
        if not path:
            continue
        key = flag_origin(flag, origins)
        if not os.path.exists(path):
            problems.append(problem("paths", key, f"{flag} {path} does not exist (set by {key})"))
            continue
        ok, why = readable_by(path, user)
        if not ok:
            problems.append(problem("paths", key, f"{flag} {path}: {why} (set by {key})"))
    return problems


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


def listening_inodes(port):
    """Socket inodes listening on TCP `port` (IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(f[9])
        except OSError:
            continue
    return inodes


def socket_holders(inodes):
    """{pid: (unit, command line)} of the processes holding any of the socket inodes."""
    wanted = {f"socket:[{i}]" for i in inodes}
    holders = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                continue
            with open(f"/proc/{pid}/cgroup", encoding="utf-8") as fh:
                cgroup = fh.read()
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        units = re.findall(r"/([^/\n]+\.(?:service|scope))", cgroup)
        holders[int(pid)] = (units[-1] if units else "?", cmd)
    return holders


def check_port(port, unit, origin):
    """The port is free, or held by the instance's own unit."""
    inodes = listening_inodes(port)
    if not inodes:
        return []
    holders = socket_holders(inodes)
    others = {pid: h for pid, h in holders.items() if h[0] != unit}
    if holders and not others:
        return []
    who = "; ".join(f"pid {pid} ({u}: {clip(cmd, 120)})" for pid, (u, cmd) in sorted(others.items()))
    message = f"port {port} is already in use by {who or 'a process not visible here'}: "
    return [problem("port", origin, message + f"choose another port ({origin}) or stop that process")]


# ---------------------------------------------------------------- per host
def where(inst, i, field):
    """The variable an instance's field came from (sglang_instances[i].port), for messages."""
    if field == "port":
        return (inst.get("origins") or {}).get("--port") or f"sglang_instances[{i}].port"
    if field == "gpus":
        return (inst.get("env_origins") or {}).get("CUDA_VISIBLE_DEVICES") or f"sglang_instances[{i}].gpus"
    return f"sglang_instances[{i}].{field}"


def check_distinct(instances):
    """The host's instances have distinct names, ports and GPUs."""
    problems = []
    names, ports, gpus = {}, {}, {}
    for i, inst in enumerate(instances):
        name, port = inst["name"], inst["port"]
        if name in names:
            j = names[name]
            message = f"{where(inst, i, 'name')} is {name!r}, as is {where(instances[j], j, 'name')}: {DISTINCT}"
            problems.append(problem("host", where(inst, i, "name"), message))
        names.setdefault(name, i)
        if port in ports:
            j = ports[port]
            message = f"{where(inst, i, 'port')} is {port}, as is {where(instances[j], j, 'port')}: {DISTINCT}"
            problems.append(problem("host", where(inst, i, "port"), message))
        ports.setdefault(port, i)
        shared = {}
        for g in inst["gpus"]:
            if g in gpus and gpus[g] != i:
                shared.setdefault(gpus[g], []).append(g)
            gpus.setdefault(g, i)
        for j, gs in sorted(shared.items()):
            message = (
                f"{where(inst, i, 'gpus')}: GPU(s) {gs} are also given to {instances[j]['name']} "
                f"({where(instances[j], j, 'gpus')}): {DISTINCT}"
            )
            problems.append(problem("host", where(inst, i, "gpus"), message))
    return problems


def check_shm(min_mib, path="/dev/shm"):
    """([problem], size in MiB or None): /dev/shm holds NCCL's buffers between a host's GPUs."""
    advice = (
        "NCCL shares buffers through it: enlarge it (for example `size=` in the /dev/shm line of /etc/fstab) "
        "or lower sglang_service_min_shm_mib"
    )
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return [problem("host", "sglang_service_min_shm_mib", f"{path}: {exc.strerror}; {advice}")], None
    size = math.ceil(st.f_blocks * st.f_frsize / (1 << 20))  # as `df --block-size=1M` rounds
    if size >= min_mib:
        return [], size
    message = f"{path} is {size} MiB, less than sglang_service_min_shm_mib ({min_mib}); {advice}"
    return [problem("host", "sglang_service_min_shm_mib", message)], size


def count_gpus(run=subprocess.run):
    """The number of GPUs nvidia-smi lists; FileNotFoundError when there is no nvidia-smi."""
    try:
        proc = run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
    except subprocess.TimeoutExpired as exc:
        raise ValidateError("nvidia-smi did not answer within 60 s: the host's GPUs could not be counted") from exc
    if proc.returncode != 0:
        why = clip((proc.stderr or proc.stdout).strip(), 500, last=True)
        raise ValidateError(f"nvidia-smi failed (exit {proc.returncode}): {why}: the host's GPUs could not be counted")
    return sum(1 for line in proc.stdout.splitlines() if line.strip())


# ---------------------------------------------------------------- SGLang's parser, and its verdicts kept
def run_parser(python, argvs, timeout=PARSE_TIMEOUT_S):
    """One run of SGLang's parser for every argv: a list of {error, args, options, env_names}."""
    try:
        proc = subprocess.run(
            [python, "-c", PARSE],
            input=json.dumps({"argvs": argvs}),
            text=True,
            capture_output=True,
            check=False,
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValidateError(f"could not run SGLang's parser with {python}: {exc}") from exc
    if proc.returncode != 0:
        raise ValidateError(
            f"could not run SGLang's parser with {python}: {clip(proc.stderr.strip(), 2000, last=True)}"
        )
    try:
        out = json.loads(proc.stdout)
    except ValueError as exc:
        raise ValidateError(
            f"SGLang's parser under {python} answered no JSON: {clip(proc.stdout.strip(), 500, last=True)}"
        ) from exc
    return [{**r, "options": out["options"], "env_names": out["env_names"]} for r in out["results"]]


def sha256_of(path):
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError:
        return None


def installation_identity(python, patch_manifest=None, package="sglang"):
    """What identifies the SGLang installation `python` runs: the virtualenv (links resolved), the
    version, the hash of its dist-info RECORD and of the patch manifest; None when not found."""
    venv = os.path.dirname(os.path.dirname(python))
    for site in sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))):
        try:
            info = dist_info(site, package)
            version = installed_version(info)
        except (PatchError, OSError):
            continue
        record = sha256_of(os.path.join(info, "RECORD"))
        if record is None:
            return None
        return {
            "venv": os.path.realpath(venv),
            "version": version,
            "record_sha256": record,
            "patch_manifest_sha256": sha256_of(patch_manifest) if patch_manifest else None,
        }
    return None


def cache_key(identity, python, argv, env, gpus, port, service_user):
    """sha256 of everything SGLang's parser verdict depends on."""
    blob = {
        "schema": CACHE_SCHEMA,
        "software": identity,
        "python": python,
        "argv": [str(a) for a in argv],
        "env": {str(k): str(v) for k, v in env.items()},
        "gpus": [int(g) for g in gpus],
        "port": int(port) if port is not None else None,
        "user": service_user,
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


class VerdictCache:
    """Successful parser verdicts, one file per key: the directory 0700 and the files 0600, owned
    by the user the module runs as (root); the newest `keep` kept. A directory someone else owns or
    can write is not trusted: nothing is read from it or written to it."""

    def __init__(self, directory, keep=CACHE_KEEP):
        self.directory = directory
        self.keep = keep

    def _path(self, key):
        return os.path.join(self.directory, f"{key}.json")

    def _trusted(self):
        try:
            st = os.lstat(self.directory)
        except OSError:
            return False
        return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077

    def load(self, key, touch=True):
        """The parser's output kept for `key`, or None; `touch` marks it recently used (kept by prune)."""
        if not self._trusted():
            return None
        try:
            with open(self._path(key), encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("parse"), dict):
            return None
        if touch:
            try:
                os.utime(self._path(key))
            except OSError:
                pass
        return data["parse"]

    def store(self, key, parse, name=""):
        """Keep a successful verdict; False when it could not be kept (the cache is only a shortcut)."""
        try:
            if not os.path.isdir(os.path.dirname(self.directory)):
                return False  # no state directory yet (the gpu_node role makes it): nothing to keep it in
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.lstat(self.directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                return False
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(self.directory, 0o700)
            doc = {"key": key, "instance": name, "stored": time.time(), "parse": parse}
            write_atomic(self._path(key), json.dumps(doc), 0o600)
            self.prune()
        except OSError:
            return False
        return True

    def prune(self):
        entries = []
        for entry in os.listdir(self.directory):
            if entry.endswith(".json"):
                try:
                    entries.append((os.stat(os.path.join(self.directory, entry)).st_mtime, entry))
                except OSError:
                    continue
        for _, entry in sorted(entries, reverse=True)[self.keep :]:
            try:
                os.unlink(os.path.join(self.directory, entry))
            except OSError:
                pass


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
    for i, inst in enumerate(instances):
        lacking = [k for k in RECORD_KEYS if k not in inst]
        if lacking:
            raise ValidateError(f"instances[{i}] lacks {', '.join(lacking)}: not a rendered instance record")
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
    if problems:
        messages = [f"{p['instance']}: {p['message']}" if p["instance"] else p["message"] for p in problems]
        result.update(failed=True, outcome=INVALID_CONFIG, msg="; ".join(messages))
    else:
        summary = f"{len(instances)} instance(s) valid ({len(cached)} parser verdict(s) from the cache)"
        result["msg"] = "; ".join([summary, *notes])
    return result
