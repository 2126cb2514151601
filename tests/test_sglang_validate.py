"""library/sglang_validate.py: the checks that need no SGLang (the parser checks run on
lab nodes with the real SGLang in tests/e2e/test_validate.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "library"))
import sglang_validate as v  # noqa: E402

ORIGINS = {"--speculative-algorithm": "sglang_profiles.p.flags.speculative_algorithm",
           "--speculative-num-draft-tokens": "sglang_profiles.p.flags.speculative_num_draft_tokens",
           "--tp": "sglang_profiles.p.flags.tp"}  # fmt: skip
OPTIONS = {"options": ["--tp-size", "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--model-path"]}


def draft(tmp_path: Path, arch: str) -> str:
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(d)


def messages(problems):
    return [p["message"] for p in problems]


def test_an_abbreviated_flag_is_refused_with_its_full_name_and_origin():
    (p,) = v.check_parser(OPTIONS, ["--tp", "8"], ORIGINS)
    assert p["message"] == "--tp is an abbreviation of --tp-size: write the flag in full (set by sglang_profiles.p.flags.tp)"


def test_a_renamed_flag_that_is_now_a_prefix_is_called_ambiguous():
    (p,) = v.check_parser(OPTIONS, ["--cuda-graph-max-bs", "128"], {})
    assert p["message"].startswith("--cuda-graph-max-bs is ambiguous (--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill)")


def test_an_unknown_flag():
    (p,) = v.check_parser(OPTIONS, ["--speculative-algo", "EAGLE3"], {})
    assert "--speculative-algo is not a flag of the installed SGLang" in p["message"]


def test_a_parser_error_names_the_variable():
    (p,) = v.check_parser({**OPTIONS, "error": "argument --tp-size: invalid int value: 'x'"}, ["--tp-size", "x"],
                          {"--tp-size": "sglang_instances[0].flags.tp_size"})  # fmt: skip
    assert p["message"] == "SGLang's parser: argument --tp-size: invalid int value: 'x' (set by sglang_instances[0].flags.tp_size)"
    assert p["key"] == "sglang_instances[0].flags.tp_size"


def test_eagle3_draft_served_as_eagle(tmp_path):
    args = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle3")}
    (p,) = v.check_speculative(args, ORIGINS)
    assert "is an EAGLE-3 model (LlamaForCausalLMEagle3) but --speculative-algorithm is EAGLE" in p["message"]
    assert "accept length 1.0" in p["message"]
    assert p["key"] == "sglang_profiles.p.flags.speculative_algorithm"


def test_eagle_draft_served_as_eagle3(tmp_path):
    args = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle")}
    (p,) = v.check_speculative(args, ORIGINS)
    assert "is an EAGLE model (LlamaForCausalLMEagle) but --speculative-algorithm is EAGLE3" in p["message"]


def test_matching_draft_passes(tmp_path):
    args = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle3"),
            "speculative_num_steps": 2, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 3}  # fmt: skip
    assert v.check_speculative(args, ORIGINS) == []


def test_a_draft_is_required():
    (p,) = v.check_speculative({"speculative_algorithm": "EAGLE3"}, ORIGINS)
    assert "needs a draft model" in p["message"]


def test_topk1_draft_tokens_must_be_steps_plus_one(tmp_path):
    args = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle3"),
            "speculative_num_steps": 2, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 5}  # fmt: skip
    (p,) = v.check_speculative(args, ORIGINS)
    assert "draft tokens are steps + 1 = 3, but --speculative-num-draft-tokens is 5" in p["message"]
    assert p["key"] == "sglang_profiles.p.flags.speculative_num_draft_tokens"


def test_parallelism_must_match_the_instances_gpus():
    assert v.check_parallel({"tp_size": 4}, [0, 1, 2, 3], 8, {}) == []
    (p,) = v.check_parallel({"tp_size": 8}, [0, 1, 2, 3], 8, {})
    assert "tp 8 x dp 1 x pp 1 = 8 GPUs over 1 node(s) needs 8 GPU(s) on this node, but the instance is given 4" in p["message"]
    assert v.check_parallel({"tp_size": 8, "nnodes": 2}, [0, 1, 2, 3], 8, {}) == []
    (p,) = v.check_parallel({"tp_size": 2}, [7, 8], 8, {})
    assert p["message"] == "GPUs [8] are given to the instance but the host has 8 (0-7)"


def test_paths_are_checked_as_the_service_user_sees_them():
    # pytest's tmp_path sits in a 0700 directory: make one that only our chmod decides.
    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))
    model = tmp_path / "model"
    model.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(model, 0o700)
    (p,) = v.check_paths({"model_path": str(model)}, "nobody", {"--model-path": "sglang_model_path"})
    assert p["message"] == f"--model-path {model}: {model} is not readable by nobody (set by sglang_model_path)"
    os.chmod(model, 0o755)
    assert v.check_paths({"model_path": str(model)}, "nobody", {}) == []
    (p,) = v.check_paths({"model_path": str(tmp_path / "absent")}, "nobody", {"--model-path": "sglang_model_path"})
    assert p["message"] == f"--model-path {tmp_path / 'absent'} does not exist (set by sglang_model_path)"
    shutil.rmtree(tmp_path)


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"NCCL_PROTO": "LL"}, []),
        ({"NCCL_PROTO": "^LL128,Simple"}, []),
        ({"NCCL_ALGO": "Rign"}, ["NCCL_ALGO=Rign: Rign is not one of"]),
        ({"NCCL_P2P_LEVEL": "SYSTEM"}, ["NCCL_P2P_LEVEL=SYSTEM: SYSTEM is not one of"]),
        ({"NCCL_BUFFSIZE": "16M"}, ["NCCL_BUFFSIZE=16M: a whole number is expected"]),
        ({"NCCL_PROTOCOL": "LL"}, ["NCCL_PROTOCOL is not an NCCL variable this project knows"]),
        ({"SGLANG_ENABLE_SPEC_V2": "True"}, ["SGLANG_ENABLE_SPEC_V2 is not an environment variable of the installed SGLang"]),
        ({"SGLANG_KNOWN": "1", "CUDA_VISIBLE_DEVICES": "0"}, []),
    ],
)
def test_environment(env, expected):
    got = messages(v.check_env(env, ["SGLANG_KNOWN"], {}))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.startswith(e)


def test_a_free_port_passes_and_a_held_one_names_its_holder():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert v.check_port(port, "sglang-main.service", "sglang_instances[0].port") == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        (p,) = v.check_port(port, "sglang-main.service", "sglang_instances[0].port")
        assert p["message"].startswith(f"port {port} is already in use by pid {os.getpid()} (")
        assert "choose another port (sglang_instances[0].port) or stop that process" in p["message"]
        # Held by the instance's own unit: fine.
        me = v.socket_holders(v.listening_inodes(port))[os.getpid()][0]
        assert v.check_port(port, me, "x") == []
