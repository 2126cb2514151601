#!/usr/bin/python
"""Validate an SGLang server configuration on its host, before anything running is touched."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_validate
short_description: Check an SGLang server's argument vector and environment with the installed SGLang
description:
  - Parses the exact argument vector with the installed SGLang's own parser (C(ServerArgs.add_cli_args)),
    refusing misspelt, renamed and abbreviated flags and bad values with SGLang's message and the
    variable that produced the flag.
  - Checks speculative decoding (draft path, EAGLE versus EAGLE3 against the draft's C(config.json),
    steps/topk/draft tokens), parallelism against the instance's GPUs, the model paths as the service
    user sees them, and the C(NCCL_*) and C(SGLANG_*) environment.
  - Changes nothing. Every problem is reported, not only the first.
options:
  python:
    description: Python of the virtualenv holding SGLang.
    type: path
    required: true
  argv:
    description: Arguments after C(python -m sglang.launch_server).
    type: list
    elements: str
    required: true
  origins:
    description: Flag (C(--tp-size)) to the variable that produced it, for messages.
    type: dict
    default: {}
  env:
    description: The server's environment.
    type: dict
    default: {}
  env_origins:
    description: Environment name to the variable that produced it.
    type: dict
    default: {}
  gpus:
    description: GPU indices given to the instance.
    type: list
    elements: int
    required: true
  host_gpus:
    description: Number of GPUs the host has.
    type: int
    required: true
  service_user:
    description: User the server runs as (paths must be readable by it).
    type: str
    required: true
  port:
    description: The instance's port; it must be free or held by I(unit).
    type: int
  unit:
    description: The instance's systemd unit (C(sglang-<name>.service)).
    type: str
author: sglang-deploy
"""

import json
import os
import pwd
import re
import subprocess

from ansible.module_utils.basic import AnsibleModule

# Runs under the virtualenv's Python: SGLang's own parser and environment registry.
PARSE = r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)

req = json.load(sys.stdin)
out = {"error": None}
parser = Parser(prog="sglang.launch_server", allow_abbrev=False)
ServerArgs.add_cli_args(parser)
out["options"] = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
try:
    ns = parser.parse_args(req["argv"])
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
try:
    from sglang.srt.environ import envs
    out["env_names"] = sorted(n for n in dir(envs) if n.isupper())
except Exception as exc:  # an SGLang without the registry
    out["env_names"] = None
json.dump(out, sys.stdout)
"""

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
NCCL_NUMERIC = {
    "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_MIN_CTAS", "NCCL_MAX_CTAS",
    "NCCL_NET_GDR_LEVEL", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD",
}
NCCL_FREE = {
    "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE", "NCCL_TOPO_FILE", "NCCL_NET",
    "NCCL_IB_GID_INDEX", "NCCL_CROSS_NIC", "NCCL_NET_GDR_READ", "NCCL_GRAPH_FILE", "NCCL_LAUNCH_MODE",
}

SPEC_NEEDS_DRAFT = {"EAGLE", "EAGLE3"}


def problem(check, key, message):
    return {"check": check, "key": key, "message": message}


def flag_origin(flag, origins):
    return origins.get(flag, "the rendered command line")


def check_parser(result, argv, origins):
    """SGLang's parser verdict, plus abbreviations (SGLang itself accepts --tp for --tp-size)."""
    problems = []
    options = set(result.get("options", []))
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        if flag in options:
            continue
        longer = sorted(o for o in options if o.startswith(flag))
        if len(longer) == 1:
            problems.append(problem("flags", flag_origin(flag, origins),
                                    f"{flag} is an abbreviation of {longer[0]}: write the flag in full "
                                    f"(set by {flag_origin(flag, origins)})"))  # fmt: skip
        elif len(longer) > 1:
            problems.append(problem("flags", flag_origin(flag, origins),
                                    f"{flag} is ambiguous ({', '.join(longer[:6])}): write the flag in full "
                                    f"(set by {flag_origin(flag, origins)})"))  # fmt: skip
        else:
            problems.append(problem("flags", flag_origin(flag, origins),
                                    f"{flag} is not a flag of the installed SGLang (set by {flag_origin(flag, origins)}); "
                                    "it may be misspelt or renamed: see `python -m sglang.launch_server --help`"))  # fmt: skip
    if result.get("error") and not problems:
        m = re.search(r"argument (--[\w-]+)", result["error"])
        flag = m.group(1) if m else None
        key = flag_origin(flag, origins) if flag else "the rendered command line"
        problems.append(problem("flags", key, f"SGLang's parser: {result['error']} (set by {key})"))
    return problems


def draft_architectures(path):
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            return json.load(fh).get("architectures") or []
    except (OSError, ValueError):
        return None


def check_speculative(args, origins):
    problems = []
    algo = args.get("speculative_algorithm")
    if not algo:
        return problems
    key = flag_origin("--speculative-algorithm", origins)
    draft = args.get("speculative_draft_model_path")
    if algo in SPEC_NEEDS_DRAFT:
        if not draft:
            problems.append(problem("speculative", key,
                                    f"--speculative-algorithm {algo} needs a draft model: set --speculative-draft-model-path "
                                    "(sglang_draft_model_path)"))  # fmt: skip
        else:
            archs = draft_architectures(draft)
            if archs:
                is_eagle3 = any(a.endswith("Eagle3") for a in archs)
                is_eagle = any(a.endswith("Eagle") for a in archs)
                if algo == "EAGLE" and is_eagle3:
                    problems.append(problem("speculative", key,
                                            f"the draft at {draft} is an EAGLE-3 model ({', '.join(archs)}) but "
                                            f"--speculative-algorithm is EAGLE (set by {key}): use EAGLE3. Served under "
                                            "EAGLE it accepts no draft token (accept length 1.0)"))  # fmt: skip
                if algo == "EAGLE3" and is_eagle and not is_eagle3:
                    problems.append(problem("speculative", key,
                                            f"the draft at {draft} is an EAGLE model ({', '.join(archs)}) but "
                                            f"--speculative-algorithm is EAGLE3 (set by {key}): use EAGLE"))  # fmt: skip
        steps = args.get("speculative_num_steps")
        topk = args.get("speculative_eagle_topk")
        tokens = args.get("speculative_num_draft_tokens")
        for name, value in (("steps", steps), ("topk", topk), ("tokens", tokens)):
            if value is not None and int(value) < 1:
                problems.append(problem("speculative", key, f"speculative {name} must be at least 1, not {value}"))
        if topk == 1 and steps is not None and tokens is not None and tokens != steps + 1:
            problems.append(problem("speculative", flag_origin("--speculative-num-draft-tokens", origins),
                                    f"with --speculative-eagle-topk 1 the draft tokens are steps + 1 = {steps + 1}, "
                                    f"but --speculative-num-draft-tokens is {tokens}: SGLang would silently run "
                                    f"{steps + 1}, not the configuration you benchmarked (set by "
                                    f"{flag_origin('--speculative-num-draft-tokens', origins)})"))  # fmt: skip
        if topk is not None and topk > 1 and steps is not None and tokens is not None and tokens <= 1:
            problems.append(problem("speculative", key, "with topk > 1, --speculative-num-draft-tokens must be at least 2"))
    elif draft:
        problems.append(problem("speculative", flag_origin("--speculative-draft-model-path", origins),
                                f"--speculative-draft-model-path is set but {algo} takes no draft model"))  # fmt: skip
    return problems


def check_parallel(args, gpus, host_gpus, origins):
    problems = []
    tp = int(args.get("tp_size") or 1)
    dp = int(args.get("dp_size") or 1)
    pp = int(args.get("pp_size") or 1)
    nnodes = int(args.get("nnodes") or 1)
    want = tp * dp * pp
    per_node = want // nnodes if want % nnodes == 0 else None
    if per_node is None or per_node != len(gpus):
        problems.append(problem("parallelism", flag_origin("--tp-size", origins),
                                f"tp {tp} x dp {dp} x pp {pp} = {want} GPUs over {nnodes} node(s) needs {want / nnodes:g} "
                                f"GPU(s) on this node, but the instance is given {len(gpus)} ({gpus}): fix --tp-size "
                                "(or dp/pp) or the instance's gpus"))  # fmt: skip
    missing = [g for g in gpus if g < 0 or g >= host_gpus]
    if missing:
        problems.append(problem("parallelism", "sglang_instances[].gpus",
                                f"GPUs {missing} are given to the instance but the host has {host_gpus} (0-{host_gpus - 1})"))  # fmt: skip
    if len(set(gpus)) != len(gpus):
        problems.append(problem("parallelism", "sglang_instances[].gpus", f"a GPU is listed twice in {gpus}"))
    return problems


def readable_by(path, user):
    """Whether `user` can read `path` (every directory on the way searchable)."""
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        return False, f"user {user} does not exist"
    groups = {g for g in os.getgrouplist(user, pw.pw_gid)}
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
    for flag, dest in (("--model-path", "model_path"), ("--speculative-draft-model-path", "speculative_draft_model_path")):
        path = args.get(dest)
        if not path:
            continue
        if not os.path.exists(path):
            problems.append(problem("paths", flag_origin(flag, origins), f"{flag} {path} does not exist (set by {flag_origin(flag, origins)})"))
            continue
        ok, why = readable_by(path, user)
        if not ok:
            problems.append(problem("paths", flag_origin(flag, origins), f"{flag} {path}: {why} (set by {flag_origin(flag, origins)})"))
    return problems


def check_env(env, env_names, env_origins):
    problems = []
    for name, value in env.items():
        key = env_origins.get(name, name)
        value = str(value)
        if name.startswith("NCCL_"):
            if name in NCCL_CHOICES:
                values = [v for v in value.lstrip("^").split(",") if v] if name in ("NCCL_PROTO", "NCCL_ALGO") else [value]
                bad = [v for v in values if v not in NCCL_CHOICES[name]]
                if bad or not values:
                    problems.append(problem("env", key, f"{name}={value}: {', '.join(bad) or 'empty'} is not one of "
                                                        f"{', '.join(sorted(NCCL_CHOICES[name]))} (set by {key})"))  # fmt: skip
            elif name in NCCL_NUMERIC:
                if not re.fullmatch(r"\d+", value):
                    problems.append(problem("env", key, f"{name}={value}: a whole number is expected (set by {key})"))
            elif name not in NCCL_FREE:
                problems.append(problem("env", key, f"{name} is not an NCCL variable this project knows (set by {key}): "
                                                    "misspelt? Add it to NCCL_FREE in library/sglang_validate.py if it is real"))  # fmt: skip
        elif name.startswith(("SGLANG_", "SGL_")) and env_names is not None and name not in env_names:
            problems.append(problem("env", key, f"{name} is not an environment variable of the installed SGLang "
                                                f"(sglang/srt/environ.py) (set by {key}): misspelt, or removed in this release"))  # fmt: skip
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
    inodes = listening_inodes(port)
    if not inodes:
        return []
    holders = socket_holders(inodes)
    others = {pid: h for pid, h in holders.items() if h[0] != unit}
    if holders and not others:
        return []
    who = "; ".join(f"pid {pid} ({u}: {cmd[:120]})" for pid, (u, cmd) in sorted(others.items())) or "a process not visible here"
    return [problem("port", origin, f"port {port} is already in use by {who}: choose another port ({origin}) or stop that process")]


def main():
    module = AnsibleModule(
        argument_spec=dict(
            python=dict(type="path", required=True),
            argv=dict(type="list", elements="str", required=True),
            origins=dict(type="dict", default={}),
            env=dict(type="dict", default={}),
            env_origins=dict(type="dict", default={}),
            gpus=dict(type="list", elements="int", required=True),
            host_gpus=dict(type="int", required=True),
            service_user=dict(type="str", required=True),
            port=dict(type="int"),
            unit=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    proc = subprocess.run([p["python"], "-c", PARSE], input=json.dumps({"argv": p["argv"]}), text=True,
                          capture_output=True, check=False)  # fmt: skip
    if proc.returncode != 0:
        module.fail_json(msg=f"could not run SGLang's parser with {p['python']}: {proc.stderr.strip()[-2000:]}", problems=[])
    result = json.loads(proc.stdout)
    problems = check_parser(result, p["argv"], p["origins"])
    args = result.get("args") or {}
    if args:
        problems += check_speculative(args, p["origins"])
        problems += check_parallel(args, p["gpus"], p["host_gpus"], p["origins"])
        problems += check_paths(args, p["service_user"], p["origins"])
    problems += check_env(p["env"], result.get("env_names"), p["env_origins"])
    if p["port"]:
        problems += check_port(p["port"], p["unit"], p["origins"].get("--port", "the port"))
    if problems:
        module.fail_json(msg="; ".join(x["message"] for x in problems), problems=problems)
    module.exit_json(changed=False, args=args, problems=[])


if __name__ == "__main__":
    main()
