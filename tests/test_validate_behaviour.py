"""What validation tells the operator and the programs that read its result (issue #31: the behaviours behind the
mutants tests/test_sglang_validate.py let survive in sglang_deploy/validate.py).

Every problem is a record a program reads whole: its check (flags, speculative, parallelism, paths, env, port, host,
install), its key (the variable to change, or the instance's field when none is known) and its message, word for
word. The module's result is read by the deploy and restart playbooks and by autotune (changed, failed, outcome,
msg, problems, instances, installed, host_gpus, shm_mib, seconds). Around them: the thresholds each check holds
at, below and above; which permission bits a service user is judged by (owner, group, other; a directory on the
way searched, the last one read); who holds a port, by its unit; nvidia-smi and SGLang's parser as they fail; and
the kept parser verdicts: what their key covers, what is read back, what is kept, pruned and refused.
"""

from __future__ import annotations

import builtins
import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import (
    host_checks,
    instance_checks,
    procinfo,
    sglang_parser,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import validate as v
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.outcomes import INVALID_CONFIG

ADVICE = (
    "NCCL shares buffers through it: enlarge it (for example `size=` in the /dev/shm line of /etc/fstab) "
    "or lower sglang_service_min_shm_mib"
)
DISTINCT = "each instance needs its own name, port and GPUs"
SPEC = "sglang_profiles.p.flags.speculative_algorithm"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: files owned by another user")


def problem(check, key, message, **extra):
    return {"check": check, "key": key, "message": message, **extra}


@pytest.fixture
def world():
    """A directory every user can search (pytest's tmp_path sits in a 0700 one): only our chmods decide."""
    d = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


def df_mib(path: str) -> int:
    """The size `df --block-size=1M` reports for path's filesystem."""
    out = subprocess.run(["df", "--block-size=1M", "--output=size", path], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


# ---------------------------------------------------------------- SGLang's parser verdict, and the flags it knows
OPTIONS = ["--model-path", "--speculative-algorithm", "--speculative-num-steps", "--tp-size"]


def test_every_flag_of_the_command_line_is_checked_whatever_comes_before_it():
    """Values, flags written with `=` (a value may hold one too) and known flags before it hide nothing."""
    argv = ["--model-path", "/m", "--tp", "2", "--tp-size=2", "--model-path=/srv/m=v2", "--specalgo", "EAGLE3"]
    assert instance_checks.check_parser({"options": OPTIONS}, argv, {"--tp": "sglang_profiles.p.flags.tp"}) == [
        problem(
            "flags",
            "sglang_profiles.p.flags.tp",
            "--tp is an abbreviation of --tp-size: write the flag in full (set by sglang_profiles.p.flags.tp)",
        ),
        problem(
            "flags",
            "the rendered command line",
            "--specalgo is not a flag of the installed SGLang (set by the rendered command line); "
            "it may be misspelt or renamed: see `python -m sglang.launch_server --help`",
        ),
    ]


def test_known_flags_in_either_spelling_pass():
    argv = ["--tp-size=2", "--model-path", "/m", "--speculative-algorithm", "EAGLE3"]
    assert instance_checks.check_parser({"options": OPTIONS}, argv, {}) == []


def test_an_ambiguous_flag_names_at_most_six_of_its_candidates():
    options = [f"--cuda-graph-{c}" for c in "abcdefgh"]
    assert instance_checks.check_parser({"options": options}, ["--cuda", "1"], {}) == [
        problem(
            "flags",
            "the rendered command line",
            "--cuda is ambiguous (--cuda-graph-a, --cuda-graph-b, --cuda-graph-c, --cuda-graph-d, --cuda-graph-e, "
            "--cuda-graph-f): write the flag in full (set by the rendered command line)",
        )
    ]


def test_a_parser_error_naming_no_flag_is_set_by_the_rendered_command_line():
    result = {"options": OPTIONS, "error": "unrecognized arguments: extra"}
    assert instance_checks.check_parser(
        result, ["--model-path", "/m", "extra"], {"--model-path": "sglang_model_path"}
    ) == [
        problem(
            "flags",
            "the rendered command line",
            "SGLang's parser: unrecognized arguments: extra (set by the rendered command line)",
        )
    ]


def test_a_parser_error_naming_a_flag_is_set_by_that_flags_variable():
    result = {"options": OPTIONS, "error": "argument --tp-size: invalid int value: 'x'"}
    assert instance_checks.check_parser(result, ["--tp-size", "x"], {"--tp-size": "sglang_instances[0].gpus"}) == [
        problem(
            "flags",
            "sglang_instances[0].gpus",
            "SGLang's parser: argument --tp-size: invalid int value: 'x' (set by sglang_instances[0].gpus)",
        )
    ]


# ---------------------------------------------------------------- speculative decoding
def draft(root: Path, *archs: str, name: str = "draft") -> str:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": list(archs)}))
    return str(d)


def spec(algo, draft_path=None, steps=None, topk=None, tokens=None):
    return {
        "speculative_algorithm": algo,
        "speculative_draft_model_path": draft_path,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": tokens,
    }


ORIGINS = {
    "--speculative-algorithm": SPEC,
    "--speculative-draft-model-path": "sglang_draft_model_path",
    "--speculative-num-draft-tokens": "sglang_profiles.p.flags.speculative_num_draft_tokens",
    "--tp-size": "sglang_instances[0].gpus (one tensor-parallel rank per GPU)",
}


def test_an_eagle3_draft_served_as_eagle_names_every_architecture(tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle3", "Qwen2ForCausalLMEagle3")
    assert instance_checks.check_speculative(spec("EAGLE", d), ORIGINS) == [
        problem(
            "speculative",
            SPEC,
            f"the draft at {d} is an EAGLE-3 model (LlamaForCausalLMEagle3, Qwen2ForCausalLMEagle3) but "
            f"--speculative-algorithm is EAGLE (set by {SPEC}): use EAGLE3. Served under EAGLE it accepts no draft "
            "token (accept length 1.0)",
        )
    ]


def test_an_eagle_draft_served_as_eagle3(tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle", "MistralForCausalLMEagle")
    assert instance_checks.check_speculative(spec("EAGLE3", d), ORIGINS) == [
        problem(
            "speculative",
            SPEC,
            f"the draft at {d} is an EAGLE model (LlamaForCausalLMEagle, MistralForCausalLMEagle) but "
            f"--speculative-algorithm is EAGLE3 (set by {SPEC}): use EAGLE",
        )
    ]


def test_a_draft_of_its_algorithms_kind_passes_and_an_unknown_kind_is_not_guessed(tmp_path):
    assert (
        instance_checks.check_speculative(spec("EAGLE", draft(tmp_path, "LlamaForCausalLMEagle", name="e")), ORIGINS)
        == []
    )
    assert (
        instance_checks.check_speculative(spec("EAGLE3", draft(tmp_path, "LlamaForCausalLMEagle3", name="e3")), ORIGINS)
        == []
    )
    assert (
        instance_checks.check_speculative(spec("EAGLE", draft(tmp_path, "LlamaForCausalLM", name="plain")), ORIGINS)
        == []
    )
    assert instance_checks.check_speculative(spec("EAGLE3", draft(tmp_path, name="none")), ORIGINS) == []
    assert instance_checks.check_speculative(spec("EAGLE3", str(tmp_path / "absent")), ORIGINS) == []


def test_a_draft_given_to_an_algorithm_without_one_names_the_drafts_variable(tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle3")
    assert instance_checks.check_speculative(spec("NGRAM", d), ORIGINS) == [
        problem(
            "speculative",
            "sglang_draft_model_path",
            "--speculative-draft-model-path is set but NGRAM takes no draft model",
        )
    ]
    assert instance_checks.check_speculative(spec("NGRAM"), ORIGINS) == []
    assert instance_checks.check_speculative(spec(None, d), ORIGINS) == []


def test_eagle_without_a_draft_says_which_variable_sets_one():
    assert instance_checks.check_speculative(spec("EAGLE3"), ORIGINS) == [
        problem(
            "speculative",
            SPEC,
            "--speculative-algorithm EAGLE3 needs a draft model: set --speculative-draft-model-path "
            "(sglang_draft_model_path)",
        )
    ]


def test_steps_topk_and_draft_tokens_are_each_at_least_one(tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle3")
    assert instance_checks.check_speculative(spec("EAGLE3", d, steps=0, topk=0, tokens=0), ORIGINS) == [
        problem("speculative", SPEC, "speculative steps must be at least 1, not 0"),
        problem("speculative", SPEC, "speculative topk must be at least 1, not 0"),
        problem("speculative", SPEC, "speculative tokens must be at least 1, not 0"),
    ]
    assert instance_checks.check_speculative(spec("EAGLE3", d, steps=1, topk=1, tokens=2), ORIGINS) == []


def test_with_topk_1_the_draft_tokens_must_be_steps_plus_one(tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle3")
    key = "sglang_profiles.p.flags.speculative_num_draft_tokens"
    assert instance_checks.check_speculative(spec("EAGLE3", d, steps=3, topk=1, tokens=5), ORIGINS) == [
        problem(
            "speculative",
            key,
            "with --speculative-eagle-topk 1 the draft tokens are steps + 1 = 4, but --speculative-num-draft-tokens "
            f"is 5: SGLang would silently run 4, not the configuration you benchmarked (set by {key})",
        )
    ]
    assert instance_checks.check_speculative(spec("EAGLE3", d, steps=3, topk=1, tokens=4), ORIGINS) == []


@pytest.mark.parametrize(
    ("steps", "topk", "tokens", "refused"),
    [
        (3, 2, 1, True),  # topk above 1, one draft token
        (3, 2, 2, False),  # two draft tokens: the least topk > 1 takes
        (3, 2, 5, False),
        (None, 2, 1, False),  # steps not set: SGLang chooses the tokens itself
        (3, None, 1, False),  # topk not set
        (None, None, 1, False),
        (None, 2, 5, False),
    ],
)
def test_with_topk_above_1_there_must_be_at_least_two_draft_tokens(tmp_path, steps, topk, tokens, refused):
    d = draft(tmp_path, "LlamaForCausalLMEagle3")
    expected = [problem("speculative", SPEC, "with topk > 1, --speculative-num-draft-tokens must be at least 2")]
    assert instance_checks.check_speculative(spec("EAGLE3", d, steps, topk, tokens), ORIGINS) == (
        expected if refused else []
    )


def test_topk_1_with_one_draft_token_is_only_the_steps_problem(tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle3")
    assert instance_checks.check_speculative(spec("EAGLE3", d, steps=0, topk=1, tokens=1), ORIGINS) == [
        problem("speculative", SPEC, "speculative steps must be at least 1, not 0")
    ]


# ---------------------------------------------------------------- parallelism and the instance's GPUs
@pytest.mark.parametrize(
    ("args", "gpus"),
    [
        ({}, [0]),  # no parallelism given: one GPU
        ({"tp_size": None, "dp_size": None, "pp_size": None, "nnodes": None}, [3]),
        ({"tp_size": 2, "dp_size": 2}, [0, 1, 2, 3]),
        ({"tp_size": 2, "pp_size": 2}, [0, 1, 2, 3]),
        ({"tp_size": 8, "nnodes": 2}, [0, 1, 2, 3]),
    ],
)
def test_tp_dp_and_pp_over_the_nodes_are_the_instances_gpus(args, gpus):
    assert instance_checks.check_parallel_sizes(args, gpus, ORIGINS) == []


@pytest.mark.parametrize(
    ("args", "gpus", "says"),
    [
        ({"tp_size": 2, "dp_size": 2}, [0, 1], "tp 2 x dp 2 x pp 1 = 4 GPUs over 1 node(s) needs 4 GPU(s)"),
        ({"tp_size": 2, "pp_size": 2}, [0, 1], "tp 2 x dp 1 x pp 2 = 4 GPUs over 1 node(s) needs 4 GPU(s)"),
        ({"tp_size": 3, "nnodes": 2}, [0], "tp 3 x dp 1 x pp 1 = 3 GPUs over 2 node(s) needs 1.5 GPU(s)"),
        ({"tp_size": 4, "nnodes": 2}, [0], "tp 4 x dp 1 x pp 1 = 4 GPUs over 2 node(s) needs 2 GPU(s)"),
        ({}, [0, 1], "tp 1 x dp 1 x pp 1 = 1 GPUs over 1 node(s) needs 1 GPU(s)"),
    ],
)
def test_parallelism_other_than_the_instances_gpus_is_refused_naming_tp_sizes_variable(args, gpus, says):
    assert instance_checks.check_parallel_sizes(args, gpus, ORIGINS) == [
        problem(
            "parallelism",
            ORIGINS["--tp-size"],
            f"{says} on this node, but the instance is given {len(gpus)} ({gpus}): "
            "fix --tp-size (or dp/pp) or the instance's gpus",
        )
    ]


def test_gpus_the_host_lacks_or_lists_twice_name_the_instances_gpus():
    assert instance_checks.check_gpus([0], 0) == [
        problem(
            "parallelism",
            "sglang_instances[].gpus",
            "GPUs [0] are given to the instance but the host has none (nvidia-smi lists no GPU)",
        )
    ]
    assert instance_checks.check_parallel({"tp_size": 2}, [1, 1], 8, {}) == [
        problem("parallelism", "sglang_instances[].gpus", "a GPU is listed twice in [1, 1]")
    ]
    assert instance_checks.check_parallel({"tp_size": 2}, [1, 1], 8, {}, "sglang_instances[3].gpus") == [
        problem("parallelism", "sglang_instances[3].gpus", "a GPU is listed twice in [1, 1]")
    ]
    assert instance_checks.check_gpus([0, 1, 2, 3], 4) == []


# ---------------------------------------------------------------- the model paths as the service user sees them
PATH_ORIGINS = {"--model-path": "sglang_model_path", "--speculative-draft-model-path": "sglang_draft_model_path"}


def test_the_model_and_the_draft_are_both_checked(world):
    model, drafted = world / "model", world / "draft"
    args = {"model_path": str(model), "speculative_draft_model_path": str(drafted)}
    assert instance_checks.check_paths(args, "nobody", PATH_ORIGINS) == [
        problem("paths", "sglang_model_path", f"--model-path {model} does not exist (set by sglang_model_path)"),
        problem(
            "paths",
            "sglang_draft_model_path",
            f"--speculative-draft-model-path {drafted} does not exist (set by sglang_draft_model_path)",
        ),
    ]
    assert instance_checks.check_paths({"speculative_draft_model_path": str(drafted)}, "nobody", {}) == [
        problem(
            "paths",
            "the rendered command line",
            f"--speculative-draft-model-path {drafted} does not exist (set by the rendered command line)",
        )
    ]
    drafted.mkdir(mode=0o700)
    model.mkdir(mode=0o755)
    assert instance_checks.check_paths(args, "nobody", PATH_ORIGINS) == [
        problem(
            "paths",
            "sglang_draft_model_path",
            f"--speculative-draft-model-path {drafted}: {drafted} is not readable by nobody "
            "(set by sglang_draft_model_path)",
        )
    ]
    assert instance_checks.check_paths(args, "no-such-user-31", PATH_ORIGINS)[0] == problem(
        "paths",
        "sglang_model_path",
        f"--model-path {model}: user no-such-user-31 does not exist (set by sglang_model_path)",
    )


def test_a_user_that_does_not_exist_reads_nothing(world):
    assert instance_checks.readable_by(str(world), "no-such-user-31") == (False, "user no-such-user-31 does not exist")


def test_a_path_that_is_not_there_is_said_so_even_for_root(world):
    absent = world / "absent" / "model"
    for user in ("nobody", "root"):
        assert instance_checks.readable_by(str(absent), user) == (
            False,
            f"{world / 'absent'}: No such file or directory",
        )


def mkfile(path: Path, mode: int, owner: str | None = None, group: str | None = None) -> str:
    path.write_text("weights")
    if owner or group:
        os.chown(path, pwd.getpwnam(owner).pw_uid if owner else -1, grp.getgrnam(group).gr_gid if group else -1)
    os.chmod(path, mode)
    return str(path)


def test_a_file_is_read_and_every_directory_on_the_way_searched(world):
    """A model file (a GGUF) needs r, not x; a directory on the way needs x, not r (0711, as home directories)."""
    assert instance_checks.readable_by(mkfile(world / "m.gguf", 0o644), "nobody") == (True, "")
    searchable = world / "home"
    searchable.mkdir()
    os.chmod(searchable, 0o711)
    assert instance_checks.readable_by(mkfile(searchable / "m.gguf", 0o644), "nobody") == (True, "")
    assert instance_checks.readable_by(str(searchable), "nobody") == (False, f"{searchable} is not readable by nobody")
    x_only = mkfile(world / "x.gguf", 0o711)
    assert instance_checks.readable_by(x_only, "nobody") == (False, f"{x_only} is not readable by nobody")
    closed = world / "closed"
    closed.mkdir()
    os.chmod(closed, 0o700)
    (closed / "model").mkdir()
    assert instance_checks.readable_by(str(closed / "model"), "nobody") == (
        False,
        f"{closed} is not searchable by nobody",
    )


def test_the_first_directory_under_the_root_is_searched_too(world, monkeypatch):
    """/srv (here /tmp, as stat reports it) closed to others hides every model under it."""
    top = "/" + str(world).split("/")[1]
    model = world / "model"
    model.mkdir()
    real = os.stat

    def closed_top(path, *a, **kw):
        st = real(path, *a, **kw)
        if os.fspath(path) == top:
            return os.stat_result((st.st_mode & ~0o077, *tuple(st)[1:]))
        return st

    monkeypatch.setattr(os, "stat", closed_top)
    assert instance_checks.readable_by(str(model), "nobody") == (False, f"{top} is not searchable by nobody")


@as_root
def test_the_owner_is_judged_by_the_owners_bits(world):
    assert instance_checks.readable_by(mkfile(world / "mine", 0o600, owner="nobody"), "nobody") == (True, "")
    others_only = mkfile(world / "not-mine-to-read", 0o044, owner="nobody")
    assert instance_checks.readable_by(others_only, "nobody") == (False, f"{others_only} is not readable by nobody")


@as_root
def test_a_member_of_the_files_group_is_judged_by_the_groups_bits(world):
    nogroup = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    assert instance_checks.readable_by(mkfile(world / "group-reads", 0o640, group=nogroup), "nobody") == (True, "")
    group_not = mkfile(world / "group-does-not", 0o604, group=nogroup)
    assert instance_checks.readable_by(group_not, "nobody") == (False, f"{group_not} is not readable by nobody")
    other_group = mkfile(world / "another-group", 0o640, group="root")
    assert instance_checks.readable_by(other_group, "nobody") == (False, f"{other_group} is not readable by nobody")


@as_root
def test_root_reads_whatever_another_user_closed_and_no_other_user_does(world):
    private = world / "private"
    private.mkdir()
    os.chown(private, pwd.getpwnam("nobody").pw_uid, pwd.getpwnam("nobody").pw_gid)
    os.chmod(private, 0o700)
    assert instance_checks.readable_by(str(private), "root") == (True, "")
    user = pwd.getpwuid(1).pw_name  # daemon: uid 1
    assert instance_checks.readable_by(str(private), user) == (False, f"{private} is not readable by {user}")


# ---------------------------------------------------------------- the environment
@pytest.mark.parametrize(
    ("env", "origins", "expected"),
    [
        ({"NCCL_ALGO": "Ring,Tree"}, {}, []),
        ({"NCCL_PROTO": "^LL128"}, {}, []),
        ({"NCCL_BUFFSIZE": "4194304"}, {}, []),
        ({"NCCL_SOCKET_IFNAME": "eth0"}, {}, []),
        (
            {"NCCL_SHM_DISABLE": "0,1"},
            {},
            [
                problem(
                    "env", "NCCL_SHM_DISABLE", "NCCL_SHM_DISABLE=0,1: 0,1 is not one of 0, 1 (set by NCCL_SHM_DISABLE)"
                )
            ],
        ),
        (
            {"NCCL_ALGO": "XRing"},
            {"NCCL_ALGO": "sglang_server_env.NCCL_ALGO"},
            [
                problem(
                    "env",
                    "sglang_server_env.NCCL_ALGO",
                    "NCCL_ALGO=XRing: XRing is not one of CollnetChain, CollnetDirect, NVLS, NVLSTree, PAT, Ring, Tree "
                    "(set by sglang_server_env.NCCL_ALGO)",
                )
            ],
        ),
        (
            {"NCCL_PROTO": "^"},
            {},
            [problem("env", "NCCL_PROTO", "NCCL_PROTO=^: empty is not one of LL, LL128, Simple (set by NCCL_PROTO)")],
        ),
        (
            {"NCCL_PROTO": "LL,Simpel,LL129"},
            {},
            [
                problem(
                    "env",
                    "NCCL_PROTO",
                    "NCCL_PROTO=LL,Simpel,LL129: Simpel, LL129 is not one of LL, LL128, Simple (set by NCCL_PROTO)",
                )
            ],
        ),
        (
            {"NCCL_BUFFSIZE": "4M"},
            {"NCCL_BUFFSIZE": "sglang_server_env.NCCL_BUFFSIZE"},
            [
                problem(
                    "env",
                    "sglang_server_env.NCCL_BUFFSIZE",
                    "NCCL_BUFFSIZE=4M: a whole number is expected (set by sglang_server_env.NCCL_BUFFSIZE)",
                )
            ],
        ),
        (
            {"NCCL_PROTOCOL": "LL"},
            {"NCCL_PROTOCOL": "sglang_server_env.NCCL_PROTOCOL"},
            [
                problem(
                    "env",
                    "sglang_server_env.NCCL_PROTOCOL",
                    "NCCL_PROTOCOL is not an NCCL variable this project knows (set by sglang_server_env.NCCL_PROTOCOL): "
                    "misspelt? Add it to NCCL_FREE in plugins/module_utils/sglang_deploy/validate.py if it is real",
                )
            ],
        ),
        (
            {"SGL_ENABLE_JIT": "1"},
            {},
            [
                problem(
                    "env",
                    "SGL_ENABLE_JIT",
                    "SGL_ENABLE_JIT is not an environment variable of the installed SGLang (sglang/srt/environ.py) "
                    "(set by SGL_ENABLE_JIT): misspelt, or removed in this release",
                )
            ],
        ),
        (
            {"SGLANG_UNKNOWN": "1", "NCCL_ALGO": "Rign"},
            {"SGLANG_UNKNOWN": "sglang_server_env.SGLANG_UNKNOWN"},
            [
                problem(
                    "env",
                    "sglang_server_env.SGLANG_UNKNOWN",
                    "SGLANG_UNKNOWN is not an environment variable of the installed SGLang (sglang/srt/environ.py) "
                    "(set by sglang_server_env.SGLANG_UNKNOWN): misspelt, or removed in this release",
                ),
                problem(
                    "env",
                    "NCCL_ALGO",
                    "NCCL_ALGO=Rign: Rign is not one of CollnetChain, CollnetDirect, NVLS, NVLSTree, PAT, Ring, Tree "
                    "(set by NCCL_ALGO)",
                ),
            ],
        ),
    ],
)
def test_each_environment_problem_names_its_variable(env, origins, expected):
    assert v.check_env(env, ["SGLANG_KNOWN"], origins) == expected


# ---------------------------------------------------------------- the port, and who holds it
HOLDER = (
    "import socket, sys; s = socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET); "
    "sys.argv[3] == 'share' and s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); "
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


class Holder:
    """A process listening on a port, with a command line longer than a message shows (ending in a byte that is
    not UTF-8), in the cgroup its test gives it (/proc/<pid>/cgroup as the module reads it). With share, on a port
    others may listen on too (SO_REUSEPORT): `port`, or one of its own."""

    def __init__(self, address: str, cgroup: str, tmp_path: Path, monkeypatch, port: int = 0, share: bool = False):
        self.argv = [sys.executable, "-c", HOLDER, address, str(port), "share" if share else "alone"]
        self.argv += ["--padding", "p" * 150]
        self.proc = subprocess.Popen([*self.argv, b"\xff"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.pid = self.proc.pid
        self.cmd = " ".join([*self.argv, "\ufffd"])
        fake = tmp_path / f"cgroup-{self.pid}"
        fake.write_text(cgroup)
        self.denied: set[str] = set()
        real = getattr(procinfo, "open", builtins.open)  # another holder's /proc/<pid>/cgroup too

        def proc_open(path, *a, **kw):
            if path in self.denied:
                raise PermissionError(13, "Permission denied", path)
            return real(fake if path == f"/proc/{self.pid}/cgroup" else path, *a, **kw)

        monkeypatch.setattr(procinfo, "open", proc_open, raising=False)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()


# A hybrid host: the unified hierarchy's line (the last) says the unit; others name other units.
IN_UNIT = (
    "11:memory:/system.slice/other-agent.service\n"
    "1:name=systemd:/user.slice/user-0.slice/session-4.scope\n"
    "0::/system.slice/sglang-other.service\n"
)


@pytest.fixture
def holder(tmp_path, monkeypatch):
    made = []

    def make(address="127.0.0.1", cgroup=IN_UNIT, **kw):
        made.append(Holder(address, cgroup, tmp_path, monkeypatch, **kw))
        return made[-1]

    yield make
    for h in made:
        h.close()


def in_use(h: Holder, unit: str, origin: str) -> dict:
    return problem(
        "port",
        origin,
        f"port {h.port} is already in use by pid {h.pid} ({unit}: {h.cmd[:120]}): "
        f"choose another port ({origin}) or stop that process",
    )


def test_a_held_port_names_the_holders_pid_unit_and_command_line(holder):
    h = holder()
    assert host_checks.check_port(h.port, "sglang-a.service", "sglang_profiles.p.flags.port") == [
        in_use(h, "sglang-other.service", "sglang_profiles.p.flags.port")
    ]
    assert host_checks.check_port(h.port, "sglang-other.service", "x") == []  # the instance's own unit: fine


def test_every_holder_of_the_port_but_the_instances_own_unit_is_named_by_pid(holder):
    """Processes of three units listening on one port (SO_REUSEPORT): the other units' two, in pid order, each
    with its unit and command line; the instance's own is not named."""
    first = holder(share=True)
    second = holder(cgroup="0::/system.slice/third.service\n", port=first.port, share=True)
    holder(cgroup="0::/system.slice/sglang-a.service\n", port=first.port, share=True)  # the instance's own
    a, b = sorted([(first, "sglang-other.service"), (second, "third.service")], key=lambda hu: hu[0].pid)
    assert host_checks.check_port(first.port, "sglang-a.service", "sglang_instances[0].port") == [
        problem(
            "port",
            "sglang_instances[0].port",
            f"port {first.port} is already in use by pid {a[0].pid} ({a[1]}: {a[0].cmd[:120]}); "
            f"pid {b[0].pid} ({b[1]}: {b[0].cmd[:120]}): choose another port (sglang_instances[0].port) or stop "
            "that process",
        )
    ]


def test_a_holder_in_no_unit_is_named_with_a_question_mark(holder):
    h = holder(cgroup="1:name=systemd:/\n0::/\n")
    assert host_checks.check_port(h.port, "sglang-a.service", "sglang_instances[0].port") == [
        in_use(h, "?", "sglang_instances[0].port")
    ]
    assert host_checks.check_port(h.port, None, "sglang_instances[0].port") == [
        in_use(h, "?", "sglang_instances[0].port")
    ]


def ipv6() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6(), reason="no IPv6 loopback on this host")
def test_a_port_held_on_ipv6_only_is_seen_even_without_the_ipv4_table(holder):
    h = holder("::1")
    assert host_checks.check_port(h.port, "sglang-a.service", "p") == [in_use(h, "sglang-other.service", "p")]
    h.denied.add("/proc/net/tcp")
    assert host_checks.check_port(h.port, "sglang-a.service", "p") == [in_use(h, "sglang-other.service", "p")]


# ---------------------------------------------------------------- the host's instances against one another
def bare(name, port, gpus, **extra):
    """An instance record with no origins: each field is named by its place in sglang_instances."""
    return {"name": name, "unit": f"sglang-{name}.service", "port": port, "gpus": gpus, **extra}


def test_instances_sharing_a_name_a_port_or_gpus_name_their_places():
    problems = host_checks.check_distinct(
        [bare("a", 30000, [0, 1]), bare("b", 30001, [2]), bare("a", 30000, [1, 2, 3])]
    )
    assert problems == [
        problem(
            "host",
            "sglang_instances[2].name",
            f"sglang_instances[2].name is 'a', as is sglang_instances[0].name: {DISTINCT}",
        ),
        problem(
            "host",
            "sglang_instances[2].port",
            f"sglang_instances[2].port is 30000, as is sglang_instances[0].port: {DISTINCT}",
        ),
        problem(
            "host",
            "sglang_instances[2].gpus",
            f"sglang_instances[2].gpus: GPU(s) [1] are also given to a (sglang_instances[0].gpus): {DISTINCT}",
        ),
        problem(
            "host",
            "sglang_instances[2].gpus",
            f"sglang_instances[2].gpus: GPU(s) [2] are also given to b (sglang_instances[1].gpus): {DISTINCT}",
        ),
    ]


def test_a_port_or_gpus_set_by_another_variable_are_named_by_it():
    def placed(name, port, gpus, i):
        return bare(
            name,
            port,
            gpus,
            origins={"--port": f"sglang_profiles.{name}.flags.port"},
            env_origins={"CUDA_VISIBLE_DEVICES": f"sglang_server_env_{i}.CUDA_VISIBLE_DEVICES"},
        )

    problems = host_checks.check_distinct([placed("a", 30000, [0], 0), placed("b", 30000, [0], 1)])
    assert problems == [
        problem(
            "host",
            "sglang_profiles.b.flags.port",
            f"sglang_profiles.b.flags.port is 30000, as is sglang_profiles.a.flags.port: {DISTINCT}",
        ),
        problem(
            "host",
            "sglang_server_env_1.CUDA_VISIBLE_DEVICES",
            "sglang_server_env_1.CUDA_VISIBLE_DEVICES: GPU(s) [0] are also given to a "
            f"(sglang_server_env_0.CUDA_VISIBLE_DEVICES): {DISTINCT}",
        ),
    ]


# ---------------------------------------------------------------- /dev/shm
def test_shm_is_its_size_as_df_reports_it_and_passes_at_its_minimum(tmp_path):
    size = df_mib(str(tmp_path))
    assert host_checks.check_shm(size, str(tmp_path)) == ([], size)
    assert host_checks.check_shm(size + 1, str(tmp_path)) == (
        [
            problem(
                "host",
                "sglang_service_min_shm_mib",
                f"{tmp_path} is {size} MiB, less than sglang_service_min_shm_mib ({size + 1}); {ADVICE}",
            )
        ],
        size,
    )


def test_shm_is_dev_shm_unless_told():
    assert host_checks.check_shm(1) == ([], df_mib("/dev/shm"))


def test_no_shm_at_all_is_a_problem_of_the_minimums_variable(tmp_path):
    absent = tmp_path / "absent"
    assert host_checks.check_shm(1, str(absent)) == (
        [problem("host", "sglang_service_min_shm_mib", f"{absent}: No such file or directory; {ADVICE}")],
        None,
    )


# ---------------------------------------------------------------- nvidia-smi
NVIDIA_SMI = """#!/bin/sh
if [ "$*" != "--query-gpu=index --format=csv,noheader" ]; then
  echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2
  exit 2
fi
%s
"""


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that answers only the query count_gpus should make."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda body: executable(bin_dir / "nvidia-smi", NVIDIA_SMI % body)


def test_the_gpus_are_the_lines_of_nvidia_smis_index_query(smi):
    smi("printf '0\\n1\\n2\\n\\n'")
    assert host_checks.count_gpus() == 3


def test_a_failing_nvidia_smi_says_its_exit_and_the_end_of_what_it_said(smi, tmp_path):
    said = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. " + "lost " * 120 + "END"
    (tmp_path / "said").write_text(said)
    smi(f"cat {tmp_path / 'said'} >&2\nexit 9")
    with pytest.raises(v.ValidateError) as e:
        host_checks.count_gpus()
    assert str(e.value) == f"nvidia-smi failed (exit 9): {said[-500:]}: the host's GPUs could not be counted"


def test_a_hung_nvidia_smi_is_given_up_on_after_its_time_limit(smi):
    """Time runs 600 times faster here: nvidia-smi's minute is a tenth of a second."""
    smi("exec sleep 5")
    with pytest.raises(v.ValidateError) as e:
        host_checks.count_gpus(run=lambda argv, **kw: subprocess.run(argv, **{**kw, "timeout": kw["timeout"] / 600}))
    assert str(e.value) == "nvidia-smi did not answer within 60 s: the host's GPUs could not be counted"


# ---------------------------------------------------------------- SGLang's parser as it fails
def test_a_failing_parser_says_the_end_of_its_traceback(tmp_path):
    said = "Traceback (most recent call last):\n" + "  File x, line 1, in y\n" * 120 + "ImportError: no sglang"
    (tmp_path / "said").write_text(said)
    py = executable(tmp_path / "python", f"#!/bin/sh\ncat {tmp_path / 'said'} >&2\nexit 1\n")
    with pytest.raises(v.ValidateError) as e:
        sglang_parser.run_parser(py, [["--tp-size", "2"]])
    assert str(e.value) == f"could not run SGLang's parser with {py}: {said[-2000:]}"


def test_a_parser_answering_no_json_says_the_end_of_its_answer(tmp_path):
    said = "SGLang says hello on stdout. " * 40 + "and no JSON"
    (tmp_path / "said").write_text(said)
    py = executable(tmp_path / "python", f"#!/bin/sh\ncat {tmp_path / 'said'}\n")
    with pytest.raises(v.ValidateError) as e:
        sglang_parser.run_parser(py, [["--tp-size", "2"]])
    assert str(e.value) == f"SGLang's parser under {py} answered no JSON: {said[-500:]}"


def test_a_hung_parser_is_given_up_on_after_its_time_limit(tmp_path):
    py = executable(tmp_path / "python", "#!/bin/sh\nexec sleep 5\n")
    with pytest.raises(v.ValidateError) as e:
        sglang_parser.run_parser(py, [["--tp-size", "2"]], timeout=0.2)
    assert str(e.value).startswith(f"could not run SGLang's parser with {py}: Command ")
    assert str(e.value).endswith("timed out after 0.2 seconds")


# ---------------------------------------------------------------- the key of a kept verdict
KEY = dict(
    identity={"venv": "/opt/ml-env", "version": "0.5.23", "record_sha256": "r", "patch_manifest_sha256": None},
    python="/opt/ml-env/bin/python",
    argv=["--port", 30000],
    env={"NCCL_ALGO": "Ring", "SGLANG_KNOWN": 1},
    gpus=["0", 1],
    port="30000",
    service_user="sglang",
)


def test_the_key_is_a_stored_name_that_stays_the_same_from_one_release_to_the_next(monkeypatch):
    """The verdicts one release kept are found by the next while the schema (the parser script) is the same: the
    key is sha256 of the inputs as canonical JSON, pinned here by value."""
    monkeypatch.setattr(sglang_parser, "CACHE_SCHEMA", "0123456789abcdef")
    assert sglang_parser.cache_key(**KEY) == "7e15c97e8a1e8ed43d53cc5aa4ab1528ce64fef7185220db1ce577190b18b88d"


def test_the_key_does_not_depend_on_the_order_the_environment_is_listed_in():
    reordered = {
        **KEY,
        "env": dict(reversed(list(KEY["env"].items()))),
        "identity": dict(reversed(list(KEY["identity"].items()))),
    }
    assert sglang_parser.cache_key(**reordered) == sglang_parser.cache_key(**KEY)


def test_the_key_follows_the_names_of_the_environment_and_an_instance_without_a_port():
    assert sglang_parser.cache_key(
        **{**KEY, "env": {"NCCL_PROTO": "Ring", "SGLANG_KNOWN": 1}}
    ) != sglang_parser.cache_key(**KEY)
    assert sglang_parser.cache_key(**{**KEY, "port": None}) != sglang_parser.cache_key(**{**KEY, "port": 0})


# ---------------------------------------------------------------- the kept verdicts on disk
def test_a_kept_verdict_says_its_key_instance_time_and_the_parsers_output(tmp_path):
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"))
    before = time.time()
    assert cache.store("a" * 64, {"error": None, "args": {"tp_size": 2}}, "main") is True
    assert cache.store("b" * 64, {"error": None}) is True
    after = time.time()
    doc = json.loads((tmp_path / "validated" / f"{'a' * 64}.json").read_text())
    assert before <= doc.pop("stored") <= after
    assert doc == {"key": "a" * 64, "instance": "main", "parse": {"error": None, "args": {"tp_size": 2}}}
    doc = json.loads((tmp_path / "validated" / f"{'b' * 64}.json").read_text())
    assert (doc["instance"], doc["parse"]) == ("", {"error": None})


def test_reading_a_verdict_marks_it_recently_used(tmp_path):
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"))
    cache.store("a" * 64, {"error": None})
    path = cache._path("a" * 64)
    os.utime(path, (1000, 1000))
    assert cache.load("a" * 64, touch=False) == {"error": None}
    assert os.stat(path).st_mtime == 1000
    assert cache.load("a" * 64) == {"error": None}
    assert os.stat(path).st_mtime > time.time() - 60


def test_a_file_that_is_not_the_keys_verdict_is_not_read(tmp_path):
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"))
    cache.store("a" * 64, {"error": None})
    shutil.copy(cache._path("a" * 64), cache._path("b" * 64))  # another key's verdict under this key's name
    assert cache.load("b" * 64) is None
    for doc in ([{"key": "c" * 64}], {"key": "c" * 64, "parse": ["not", "a", "verdict"]}, "text"):
        Path(cache._path("c" * 64)).write_text(json.dumps(doc))
        assert cache.load("c" * 64) is None


@as_root
def test_a_directory_another_user_owns_or_a_link_is_not_written_to(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "validated").symlink_to(target)
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"))
    assert cache.store("a" * 64, {"error": None}) is False
    assert list(target.iterdir()) == []
    owned = tmp_path / "state" / "validated"
    owned.mkdir(parents=True, mode=0o700)
    os.chown(owned, pwd.getpwnam("nobody").pw_uid, -1)
    assert sglang_parser.VerdictCache(str(owned)).store("a" * 64, {"error": None}) is False
    assert list(owned.iterdir()) == []


def test_a_verdict_that_cannot_be_kept_says_so(tmp_path):
    (tmp_path / "validated").write_text("a file where the directory should be")
    assert sglang_parser.VerdictCache(str(tmp_path / "validated")).store("a" * 64, {"error": None}) is False


def test_the_newest_are_kept_by_their_last_use_not_their_names(tmp_path):
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"), keep=2)
    for key, mtime in (("c" * 64, 1000), ("b" * 64, 2000)):
        cache.store(key, {"error": None})
        os.utime(cache._path(key), (mtime, mtime))
    cache.store("a" * 64, {"error": None})
    assert sorted(p.name[0] for p in (tmp_path / "validated").iterdir()) == ["a", "b"]


def test_a_verdict_gone_while_pruning_stops_nothing(tmp_path, monkeypatch):
    """Another run removed a verdict between the listing and its stat (here: a link to nothing, listed first)."""
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"), keep=1)
    cache.store("b" * 64, {"error": None})
    os.utime(cache._path("b" * 64), (1000, 1000))
    (tmp_path / "validated" / f"{'0' * 64}.json").symlink_to(tmp_path / "gone")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: sorted(real(p)))
    cache.store("c" * 64, {"error": None})
    assert sorted(p.name[0] for p in (tmp_path / "validated").iterdir()) == ["0", "c"]


# ---------------------------------------------------------------- validate_host: the module's result
FLAGS = {
    "--model-path": str,
    "--port": int,
    "--host": str,
    "--tp-size": int,
    "--dp-size": int,
    "--pp-size": int,
    "--nnodes": int,
    "--speculative-algorithm": str,
    "--speculative-draft-model-path": str,
    "--speculative-num-steps": int,
    "--speculative-eagle-topk": int,
    "--speculative-num-draft-tokens": int,
}
ALGORITHMS = {"EAGLE", "EAGLE3", "NGRAM", "STANDALONE"}


class Parser:
    """SGLang's parser as the PARSE script runs it, in small: it runs under `python` (one that is not there fails as
    run_parser does), answers one verdict per argv, and refuses an unknown speculative algorithm after parsing (the
    arguments kept). `abbrev`: it takes an unambiguous prefix for its flag, as argparse does by default (SGLang's own
    launch_server). `short`: it answers one verdict fewer than it was asked for."""

    def __init__(self, abbrev=False, short=False):
        self.abbrev, self.short = abbrev, short
        self.runs: list[tuple[str, list]] = []

    def __call__(self, python, argvs):
        if not isinstance(python, str) or not os.access(python, os.X_OK):
            raise v.ValidateError(f"could not run SGLang's parser with {python}: [Errno 2] No such file or directory")
        self.runs.append((python, [list(a) for a in argvs]))
        out = [self.verdict(list(a)) for a in argvs]
        return out[:-1] if self.short else out

    def verdict(self, argv):
        args = {f[2:].replace("-", "_"): None for f in FLAGS}
        error, i = None, 0
        while i < len(argv):
            flag, eq, value = argv[i].partition("=")
            longer = [f for f in FLAGS if f.startswith(flag)]
            if flag not in FLAGS and self.abbrev and len(longer) == 1:
                flag = longer[0]
            if flag not in FLAGS:
                error, i = error or f"unrecognized arguments: {argv[i]}", i + 1
                continue
            if not eq:
                i += 1
                value = argv[i] if i < len(argv) else None
            i += 1
            try:
                args[flag[2:].replace("-", "_")] = FLAGS[flag](value)
            except (TypeError, ValueError):
                error = error or f"argument {flag}: invalid {FLAGS[flag].__name__} value: {value!r}"
        out = {"error": error, "args": None if error else args, "options": sorted(FLAGS), "env_names": ["SGLANG_KNOWN"]}
        algo = args["speculative_algorithm"]
        if not error and algo and algo not in ALGORITHMS:
            out["error"] = f"argument --speculative-algorithm: Unknown speculative algorithm name: {algo}"
        return out


@pytest.fixture
def venv(tmp_path):
    """A virtualenv with an SGLang distribution, beside an older Python's site-packages without it; its python and
    python3 (a link to it)."""
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    python = executable(root / "bin" / "python", "#!/bin/sh\n")
    (root / "bin" / "python3").symlink_to("python")
    (root / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    info = root / "lib" / "python3.12" / "site-packages" / "sglang-0.5.23.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.23\n")
    (info / "RECORD").write_text("sglang/__init__.py,sha256=AAAA,1\n")
    return python


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inst(name, python, model, gpus, port=None, **extra):
    port = port or free_port()
    return {
        "name": name,
        "unit": f"sglang-{name}.service",
        "port": port,
        "gpus": gpus,
        "profile": "p",
        "server_argv": ["--model-path", str(model), "--port", str(port), "--tp-size", str(len(gpus))],
        "python": str(python),
        **extra,
    }


def host(records, parser=None, gpus=4, user="nobody", **kw):
    return v.validate_host(records, user, gpu_counter=lambda: gpus, parser=parser or Parser(), **kw)


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic: 100.0 at the start of the run, 101.23456 ever after."""
    times = iter([100.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(times, 101.23456))


def test_a_passing_hosts_result_whole(world, venv, tmp_path, clock):
    records = [inst("a", venv, world, [0, 1]), inst("b", venv, world, [2, 3])]
    assert host(records, min_shm_mib=1, shm_path=str(tmp_path)) == {
        "changed": False,
        "problems": [],
        "instances": [
            {"name": "a", "unit": "sglang-a.service", "profile": "p", "parsed": True, "cached": False},
            {"name": "b", "unit": "sglang-b.service", "profile": "p", "parsed": True, "cached": False},
        ],
        "installed": True,
        "host_gpus": 4,
        "shm_mib": df_mib(str(tmp_path)),
        "seconds": 1.235,
        "msg": "2 instance(s) valid (0 parser verdict(s) from the cache)",
    }


def test_a_refusing_hosts_result_whole(world, venv, tmp_path, clock):
    records = [inst("a", venv, world, [0, 1]), inst("b", venv, world, [3, 4])]
    size = df_mib(str(tmp_path))
    shm = f"{tmp_path} is {size} MiB, less than sglang_service_min_shm_mib ({size + 1}); {ADVICE}"
    gpu = "GPUs [4] are given to the instance but the host has 4 (0-3)"
    assert host(records, min_shm_mib=size + 1, shm_path=str(tmp_path)) == {
        "changed": False,
        "failed": True,
        "outcome": INVALID_CONFIG,
        "problems": [
            problem("host", "sglang_service_min_shm_mib", shm, instance=None),
            problem("parallelism", "sglang_instances[1].gpus", gpu, instance="b"),
        ],
        "instances": [
            {"name": "a", "unit": "sglang-a.service", "profile": "p", "parsed": True, "cached": False},
            {"name": "b", "unit": "sglang-b.service", "profile": "p", "parsed": True, "cached": False},
        ],
        "installed": True,
        "host_gpus": 4,
        "shm_mib": size,
        "seconds": 1.235,
        "msg": f"{shm}; b: {gpu}",
    }


def test_check_mode_on_a_fresh_nodes_result_whole(world, tmp_path, clock):
    """Neither the NVIDIA driver nor SGLang installed yet: a pass, its message the summary and then each note."""

    def no_nvidia_smi():
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    absent = tmp_path / "nowhere" / "bin" / "python"
    parser = Parser()
    res = v.validate_host(
        [inst("a", absent, world, [0])], "nobody", check_mode=True, gpu_counter=no_nvidia_smi, parser=parser
    )
    assert res == {
        "changed": False,
        "problems": [],
        "instances": [{"name": "a", "unit": "sglang-a.service", "profile": "p", "parsed": False, "cached": False}],
        "installed": False,
        "host_gpus": None,
        "shm_mib": None,
        "seconds": 1.235,
        "msg": "1 instance(s) valid (0 parser verdict(s) from the cache); the NVIDIA driver is not installed yet "
        f"(check mode): the GPUs are checked once it is; SGLang is not installed in {tmp_path / 'nowhere'} yet "
        "(check mode); the configuration is checked by SGLang's parser once it is",
    }
    assert parser.runs == []


def test_by_default_instances_are_kept_apart_and_shm_is_not_checked(world, venv):
    port = free_port()
    res = host([inst("a", venv, world, [0], port), inst("b", venv, world, [1], port)])
    assert res["shm_mib"] is None
    assert res["problems"] == [
        problem(
            "host",
            "sglang_instances[1].port",
            f"sglang_instances[1].port is {port}, as is sglang_instances[0].port: {DISTINCT}",
            instance=None,
        )
    ]
    assert host([inst("a", venv, world, [0])], min_shm_mib=1)["shm_mib"] == df_mib("/dev/shm")


def test_the_host_problems_are_all_reported(world, venv, tmp_path):
    port = free_port()
    absent = tmp_path / "no-shm"
    res = host([inst("a", venv, world, [0], port), inst("a", venv, world, [1])], min_shm_mib=1, shm_path=str(absent))
    assert res["problems"] == [
        problem(
            "host",
            "sglang_instances[1].name",
            f"sglang_instances[1].name is 'a', as is sglang_instances[0].name: {DISTINCT}",
            instance=None,
        ),
        problem("host", "sglang_service_min_shm_mib", f"{absent}: No such file or directory; {ADVICE}", instance=None),
    ]


def test_variants_of_one_instance_are_not_checked_against_one_another_and_name_their_profile(world, venv):
    good = inst("a", venv, world, [0, 1], profile="tp2")
    bad = dict(good, profile="tp4", server_argv=[*good["server_argv"][:-1], "4"])
    res = host([good, bad], variants=True)
    assert res["problems"] == [
        problem(
            "parallelism",
            "the rendered command line",
            "tp 4 x dp 1 x pp 1 = 4 GPUs over 1 node(s) needs 4 GPU(s) on this node, but the instance is given 2 "
            "([0, 1]): fix --tp-size (or dp/pp) or the instance's gpus",
            instance="a",
            profile="tp4",
        )
    ]
    assert [r["profile"] for r in res["instances"]] == ["tp2", "tp4"]


def test_every_python_is_checked_for_and_the_installed_ones_parsed(world, venv, tmp_path):
    absent = tmp_path / "zz" / "bin" / "python"
    parser = Parser()
    res = host([inst("a", absent, world, [0]), inst("b", venv, world, [1])], parser)
    assert res["problems"] == [
        problem(
            "install",
            "sglang_service_venv",
            f"no {absent}: install SGLang first (the sglang role, before sglang_service) or set sglang_service_venv",
            instance=None,
        )
    ]
    assert [(r["name"], r["parsed"]) for r in res["instances"]] == [("a", False), ("b", True)]
    assert res["installed"] is False
    assert [py for py, _ in parser.runs] == [venv]


def test_each_python_runs_its_own_instances_argvs(world, venv):
    python3 = str(Path(venv).parent / "python3")
    records = [inst("a", venv, world, [0]), inst("b", python3, world, [1]), inst("c", venv, world, [2])]
    parser = Parser()
    host(records, parser)
    assert parser.runs == [
        (venv, [records[0]["server_argv"], records[2]["server_argv"]]),
        (python3, [records[1]["server_argv"]]),
    ]


def test_a_parser_answering_fewer_verdicts_than_asked_is_an_error_not_a_pass(world, venv):
    with pytest.raises(ValueError):
        host([inst("a", venv, world, [0]), inst("b", venv, world, [1])], Parser(short=True))


def test_every_check_of_an_instance_is_reported_in_order(world, venv, tmp_path):
    """A verdict that took --tp for --tp-size (argparse's default): the abbreviation, and every check on its
    arguments, each naming its variable; a verdict with a problem of its own is not kept."""
    state = tmp_path / "state"
    state.mkdir()
    absent = world / "absent"
    b = inst("b", venv, absent, [2, 7], env={"SGLANG_UNKNOWN": "1", "SGLANG_KNOWN": "1"})
    b["server_argv"] = [*b["server_argv"][:4], "--tp", "4", "--speculative-algorithm", "EAGLE3"]
    b["origins"] = {
        "--tp": "sglang_profiles.p.flags.tp",
        "--speculative-algorithm": SPEC,
        "--model-path": "sglang_model_path",
    }
    res = host([inst("a", venv, world, [0, 1]), b], Parser(abbrev=True), state_dir=str(state))
    assert res["problems"] == [
        problem(
            "flags",
            "sglang_profiles.p.flags.tp",
            "--tp is an abbreviation of --tp-size: write the flag in full (set by sglang_profiles.p.flags.tp)",
            instance="b",
        ),
        problem(
            "speculative",
            SPEC,
            "--speculative-algorithm EAGLE3 needs a draft model: set --speculative-draft-model-path "
            "(sglang_draft_model_path)",
            instance="b",
        ),
        problem(
            "parallelism",
            "the rendered command line",
            "tp 4 x dp 1 x pp 1 = 4 GPUs over 1 node(s) needs 4 GPU(s) on this node, but the instance is given 2 "
            "([2, 7]): fix --tp-size (or dp/pp) or the instance's gpus",
            instance="b",
        ),
        problem(
            "paths",
            "sglang_model_path",
            f"--model-path {absent} does not exist (set by sglang_model_path)",
            instance="b",
        ),
        problem(
            "env",
            "SGLANG_UNKNOWN",
            "SGLANG_UNKNOWN is not an environment variable of the installed SGLang (sglang/srt/environ.py) "
            "(set by SGLANG_UNKNOWN): misspelt, or removed in this release",
            instance="b",
        ),
        problem(
            "parallelism",
            "sglang_instances[1].gpus",
            "GPUs [7] are given to the instance but the host has 4 (0-3)",
            instance="b",
        ),
    ]
    assert [json.loads(p.read_text())["instance"] for p in (state / "validated").iterdir()] == ["a"]


def test_a_verdict_refusing_the_algorithm_is_the_only_problem_its_arguments_give(world, venv, tmp_path):
    d = draft(tmp_path, "LlamaForCausalLMEagle3")
    a = inst("a", venv, world, [0, 1], origins={"--speculative-algorithm": SPEC})
    a["server_argv"] = [
        *a["server_argv"][:-1],
        "4",
        "--speculative-algorithm",
        "EAGEL",
        "--speculative-draft-model-path",
        d,
    ]
    assert host([a])["problems"] == [
        problem(
            "flags",
            SPEC,
            f"SGLang's parser: argument --speculative-algorithm: Unknown speculative algorithm name: EAGEL (set by {SPEC})",
            instance="a",
        )
    ]


def test_a_port_held_by_the_instances_own_unit_passes_and_by_another_names_the_instances_port(world, venv, holder):
    h = holder()
    other = inst("x", venv, world, [0])
    own = inst("a", venv, world, [1], h.port, unit="sglang-other.service")
    assert host([other, own])["problems"] == []
    assert host([other, inst("b", venv, world, [1], h.port)])["problems"] == [
        dict(in_use(h, "sglang-other.service", "sglang_instances[1].port"), instance="b")
    ]


# ---------------------------------------------------------------- validate_host: the kept verdicts
def one(venv, world, **extra):
    return [inst("a", venv, world, [0, 1], 30123, env={"NCCL_ALGO": "Ring"}, **extra)]


def rerun(venv, world, tmp_path, change):
    """The parser's runs after a first run kept the verdict and `change` changed one thing."""
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    manifest = tmp_path / "patches.json"
    manifest.write_text('{"version": "0.5.23"}')
    records = one(venv, world)
    kw = {"state_dir": str(state), "patch_manifest": str(manifest), "user": "nobody"}
    host(records, **kw)
    same = Parser()
    assert [r["cached"] for r in host(records, same, **kw)["instances"]] == [True]
    assert same.runs == []
    change(records, kw, manifest)
    again = Parser()
    res = host(records, again, **kw)
    assert res["problems"] == []
    return again.runs, res


def record_changed(venv):
    info = Path(venv).parent.parent / "lib" / "python3.12" / "site-packages" / "sglang-0.5.23.dist-info"
    (info / "RECORD").write_text("sglang/__init__.py,sha256=BBBB,1\n")


CHANGES = {
    "environment": lambda r, kw, m: r[0].update(env={"NCCL_ALGO": "Tree"}),
    "port": lambda r, kw, m: r[0].update(port=30124),
    "service user": lambda r, kw, m: kw.update(user="daemon"),
    "patch manifest": lambda r, kw, m: m.write_text('{"version": "0.5.23", "patches": ["p"]}'),
    "python": lambda r, kw, m: r[0].update(python=str(Path(r[0]["python"]).parent / "python3")),
    "installed files": lambda r, kw, m: record_changed(r[0]["python"]),
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_a_kept_verdict_is_not_used_once_anything_it_depends_on_changed(world, venv, tmp_path, what):
    runs, res = rerun(venv, world, tmp_path, CHANGES[what])
    assert [argv for _, argvs in runs for argv in argvs] == [one(venv, world)[0]["server_argv"]]
    assert [r["cached"] for r in res["instances"]] == [False]


def test_a_run_marks_the_verdicts_it_used_and_check_mode_marks_nothing(world, venv, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    records = one(venv, world)
    host(records, state_dir=str(state))
    (kept,) = (state / "validated").iterdir()
    os.utime(kept, (1000, 1000))
    assert [r["cached"] for r in host(records, state_dir=str(state), check_mode=True)["instances"]] == [True]
    assert kept.stat().st_mtime == 1000
    assert [r["cached"] for r in host(records, state_dir=str(state))["instances"]] == [True]
    assert kept.stat().st_mtime > time.time() - 60


def test_a_kept_verdicts_directory_others_can_search_is_closed_again(tmp_path):
    d = tmp_path / "validated"
    d.mkdir()
    os.chmod(d, 0o701)
    cache = sglang_parser.VerdictCache(str(d))
    assert cache.load("a" * 64) is None  # not trusted as it is
    assert cache.store("a" * 64, {"error": None}) is True
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert cache.load("a" * 64) == {"error": None}
