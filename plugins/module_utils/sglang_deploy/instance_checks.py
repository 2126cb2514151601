"""The checks of one instance's configuration on SGLang's parser output: its flags (misspelt, renamed and
abbreviated), speculative decoding against the draft's config.json, parallelism against the instance's GPUs (and
the GPUs against the host's), and its model paths as the service user sees them.

Each answers a list of problems naming the variable that set the flag (problems.problem); validate runs them.
"""

from __future__ import annotations

import json
import os
import pwd
import re

from .problems import flag_origin, problem

SPEC_NEEDS_DRAFT = {"EAGLE", "EAGLE3"}


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
