"""sglang_deploy.validate (plugins/modules/sglang_validate.py is its adapter): the checks that need no
SGLang, the host's checks, the kept parser verdicts, and the parser script against a stand-in
SGLang (the real parser runs on lab nodes in tests/e2e/test_validate.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
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

REPO = Path(__file__).resolve().parents[1]

ORIGINS = {
    "--speculative-algorithm": "sglang_profiles.p.flags.speculative_algorithm",
    "--speculative-num-draft-tokens": "sglang_profiles.p.flags.speculative_num_draft_tokens",
    "--tp": "sglang_profiles.p.flags.tp",
}
OPTIONS = {"options": ["--tp-size", "--cuda-graph-max-bs-decode", "--cuda-graph-max-bs-prefill", "--model-path"]}


def draft(tmp_path: Path, arch: str) -> str:
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(d)


def messages(problems):
    return [p["message"] for p in problems]


def test_an_abbreviated_flag_is_refused_with_its_full_name_and_origin():
    (p,) = instance_checks.check_parser(OPTIONS, ["--tp", "8"], ORIGINS)
    assert (
        p["message"]
        == "--tp is an abbreviation of --tp-size: write the flag in full (set by sglang_profiles.p.flags.tp)"
    )


def test_a_renamed_flag_that_is_now_a_prefix_is_called_ambiguous():
    (p,) = instance_checks.check_parser(OPTIONS, ["--cuda-graph-max-bs", "128"], {})
    assert p["message"].startswith(
        "--cuda-graph-max-bs is ambiguous (--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill)"
    )


def test_an_unknown_flag():
    (p,) = instance_checks.check_parser(OPTIONS, ["--speculative-algo", "EAGLE3"], {})
    assert "--speculative-algo is not a flag of the installed SGLang" in p["message"]


def test_a_parser_error_names_the_variable():
    (p,) = instance_checks.check_parser(
        {**OPTIONS, "error": "argument --tp-size: invalid int value: 'x'"},
        ["--tp-size", "x"],
        {"--tp-size": "sglang_instances[0].flags.tp_size"},
    )
    assert (
        p["message"]
        == "SGLang's parser: argument --tp-size: invalid int value: 'x' (set by sglang_instances[0].flags.tp_size)"
    )
    assert p["key"] == "sglang_instances[0].flags.tp_size"


def test_eagle3_draft_served_as_eagle(tmp_path):
    args = {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle3")}
    (p,) = instance_checks.check_speculative(args, ORIGINS)
    assert "is an EAGLE-3 model (LlamaForCausalLMEagle3) but --speculative-algorithm is EAGLE" in p["message"]
    assert "accept length 1.0" in p["message"]
    assert p["key"] == "sglang_profiles.p.flags.speculative_algorithm"


def test_eagle_draft_served_as_eagle3(tmp_path):
    args = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle")}
    (p,) = instance_checks.check_speculative(args, ORIGINS)
    assert "is an EAGLE model (LlamaForCausalLMEagle) but --speculative-algorithm is EAGLE3" in p["message"]


def test_matching_draft_passes(tmp_path):
    args = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle3"),
        "speculative_num_steps": 2,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 3,
    }
    assert instance_checks.check_speculative(args, ORIGINS) == []


def test_a_draft_is_required():
    (p,) = instance_checks.check_speculative({"speculative_algorithm": "EAGLE3"}, ORIGINS)
    assert "needs a draft model" in p["message"]


def test_topk1_draft_tokens_must_be_steps_plus_one(tmp_path):
    args = {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": draft(tmp_path, "LlamaForCausalLMEagle3"),
        "speculative_num_steps": 2,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 5,
    }
    (p,) = instance_checks.check_speculative(args, ORIGINS)
    assert "draft tokens are steps + 1 = 3, but --speculative-num-draft-tokens is 5" in p["message"]
    assert p["key"] == "sglang_profiles.p.flags.speculative_num_draft_tokens"


def test_parallelism_must_match_the_instances_gpus():
    assert instance_checks.check_parallel({"tp_size": 4}, [0, 1, 2, 3], 8, {}) == []
    (p,) = instance_checks.check_parallel({"tp_size": 8}, [0, 1, 2, 3], 8, {})
    assert (
        "tp 8 x dp 1 x pp 1 = 8 GPUs over 1 node(s) needs 8 GPU(s) on this node, but the instance is given 4"
        in p["message"]
    )
    assert instance_checks.check_parallel({"tp_size": 8, "nnodes": 2}, [0, 1, 2, 3], 8, {}) == []
    (p,) = instance_checks.check_parallel({"tp_size": 2}, [7, 8], 8, {})
    assert p["message"] == "GPUs [8] are given to the instance but the host has 8 (0-7)"


def test_paths_are_checked_as_the_service_user_sees_them():
    # pytest's tmp_path sits in a 0700 directory: make one that only our chmod decides.
    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))
    model = tmp_path / "model"
    model.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(model, 0o700)
    (p,) = instance_checks.check_paths({"model_path": str(model)}, "nobody", {"--model-path": "sglang_model_path"})
    assert p["message"] == f"--model-path {model}: {model} is not readable by nobody (set by sglang_model_path)"
    os.chmod(model, 0o755)
    assert instance_checks.check_paths({"model_path": str(model)}, "nobody", {}) == []
    (p,) = instance_checks.check_paths(
        {"model_path": str(tmp_path / "absent")}, "nobody", {"--model-path": "sglang_model_path"}
    )
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
        (
            {"SGLANG_ENABLE_SPEC_V2": "True"},
            ["SGLANG_ENABLE_SPEC_V2 is not an environment variable of the installed SGLang"],
        ),
        ({"SGLANG_KNOWN": "1", "CUDA_VISIBLE_DEVICES": "0"}, []),
    ],
)
def test_environment(env, expected):
    got = messages(v.check_env(env, ["SGLANG_KNOWN"], {}))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.startswith(e)


def test_a_free_port_passes_and_a_held_one_names_its_holder():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert host_checks.check_port(port, "sglang-main.service", "sglang_instances[0].port") == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        (p,) = host_checks.check_port(port, "sglang-main.service", "sglang_instances[0].port")
        assert p["message"].startswith(f"port {port} is already in use by pid {os.getpid()} (")
        assert "choose another port (sglang_instances[0].port) or stop that process" in p["message"]
        # Held by the instance's own unit: fine.
        me = procinfo.socket_holders(procinfo.listening_inodes(port))[os.getpid()][0]
        assert host_checks.check_port(port, me, "x") == []


# ---------------------------------------------------------------- the host's checks
def record(i: int, name: str, port: int, gpus: list[int], **extra) -> dict:
    """An instance record as render.yml sets it in _sglang_service_instances."""
    rec = {
        "name": name,
        "unit": f"sglang-{name}.service",
        "port": port,
        "gpus": gpus,
        "profile": "p",
        "server_argv": ["--model-path", "/srv/m", "--port", str(port), "--tp-size", str(len(gpus))],
        "origins": {
            "--port": f"sglang_instances[{i}].port",
            "--model-path": "sglang_model_path",
            "--tp-size": f"sglang_instances[{i}].gpus (one tensor-parallel rank per GPU)",
        },
        "env": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))},
        "env_origins": {"CUDA_VISIBLE_DEVICES": f"sglang_instances[{i}].gpus"},
        "python": sys.executable,
    }
    rec.update(extra)
    return rec


def test_instances_sharing_a_name_port_or_gpu_are_refused_naming_the_variable():
    (p,) = host_checks.check_distinct([record(0, "a", 30000, [0]), record(1, "a", 30001, [1])])
    assert p["key"] == "sglang_instances[1].name"
    assert p["message"] == (
        "sglang_instances[1].name is 'a', as is sglang_instances[0].name: "
        "each instance needs its own name, port and GPUs"
    )
    (p,) = host_checks.check_distinct([record(0, "a", 30000, [0]), record(1, "b", 30000, [1])])
    assert p["key"] == "sglang_instances[1].port"
    assert p["message"].startswith("sglang_instances[1].port is 30000, as is sglang_instances[0].port")
    (p,) = host_checks.check_distinct([record(0, "a", 30000, [0, 1, 2, 3]), record(1, "b", 30001, [3, 4, 5, 6])])
    assert p["key"] == "sglang_instances[1].gpus"
    assert p["message"].startswith(
        "sglang_instances[1].gpus: GPU(s) [3] are also given to a (sglang_instances[0].gpus)"
    )
    assert host_checks.check_distinct([record(0, "a", 30000, [0, 1]), record(1, "b", 30001, [2, 3])]) == []


def test_shm_smaller_than_the_minimum_names_sglang_service_min_shm_mib(tmp_path):
    problems, size = host_checks.check_shm(1, str(tmp_path))
    assert problems == [] and size >= 1
    (p,), size2 = host_checks.check_shm(size + 1, str(tmp_path))
    assert size2 == size
    assert p["key"] == "sglang_service_min_shm_mib"
    assert p["message"].startswith(f"{tmp_path} is {size} MiB, less than sglang_service_min_shm_mib ({size + 1}); ")
    assert "or lower sglang_service_min_shm_mib" in p["message"]


def test_the_gpu_count_is_the_lines_nvidia_smi_prints():
    class Proc:
        returncode, stdout, stderr = 0, "0\n1\n2\n\n", ""

    assert host_checks.count_gpus(run=lambda *a, **k: Proc()) == 3
    Proc.returncode, Proc.stderr = 9, "NVIDIA-SMI has failed because it couldn't communicate with the driver"
    with pytest.raises(v.ValidateError, match="nvidia-smi failed \\(exit 9\\): NVIDIA-SMI has failed"):
        host_checks.count_gpus(run=lambda *a, **k: Proc())


def test_a_gpu_the_host_lacks_names_the_instances_gpus_variable():
    (p,) = instance_checks.check_gpus([6, 7, 8], 8, "sglang_instances[2].gpus")
    assert p == {
        "check": "parallelism",
        "key": "sglang_instances[2].gpus",
        "message": "GPUs [8] are given to the instance but the host has 8 (0-7)",
    }


# ---------------------------------------------------------------- validate_host: one call per host
OPTION_LIST = ["--model-path", "--port", "--tp-size", "--host"]


class FakeParser:
    """SGLang's parser stand-in: counts its runs; accepts every argv made of OPTION_LIST."""

    def __init__(self, error=None):
        self.runs: list[tuple[str, list]] = []
        self.error = error

    def __call__(self, python, argvs):
        self.runs.append((python, argvs))
        out = []
        for argv in argvs:
            args = {
                "model_path": argv[argv.index("--model-path") + 1],
                "tp_size": int(argv[argv.index("--tp-size") + 1]),
            }
            out.append(
                {
                    "error": self.error,
                    "args": None if self.error else args,
                    "options": OPTION_LIST,
                    "env_names": ["SGLANG_KNOWN"],
                }
            )
        return out


@pytest.fixture
def model(tmp_path):
    """A model directory every user can read (tmp_path itself sits in a 0700 directory)."""
    d = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(d, 0o755)
    yield str(d)
    shutil.rmtree(d)


@pytest.fixture
def venv(tmp_path):
    """A virtualenv with an SGLang distribution (METADATA, RECORD), and its python."""
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\n")
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


def host(records, state_dir=None, parser=None, gpus=8, **kw):
    return v.validate_host(
        records,
        "nobody",
        state_dir=str(state_dir) if state_dir else None,
        gpu_counter=lambda: gpus,
        parser=parser or FakeParser(),
        **kw,
    )


def two_instances(model, python, **extra):
    a, b = free_port(), free_port()
    return [
        record(
            0,
            "a",
            a,
            [0, 1],
            python=str(python),
            server_argv=["--model-path", model, "--port", str(a), "--tp-size", "2"],
            **extra,
        ),
        record(
            1,
            "b",
            b,
            [2, 3],
            python=str(python),
            server_argv=["--model-path", model, "--port", str(b), "--tp-size", "2"],
            **extra,
        ),
    ]


def test_one_parser_run_checks_every_instance_of_the_host(model, venv):
    parser = FakeParser()
    res = host(two_instances(model, venv), parser=parser)
    assert res.get("failed") is not True, res
    assert len(parser.runs) == 1 and len(parser.runs[0][1]) == 2
    assert [(i["name"], i["parsed"], i["cached"]) for i in res["instances"]] == [("a", True, False), ("b", True, False)]
    assert res["host_gpus"] == 8 and res["installed"] is True and "outcome" not in res


def test_every_refusal_carries_outcome_invalid_config_and_names_its_variable(model, venv, tmp_path):
    records = two_instances(model, venv)
    records[1]["gpus"] = [2, 9]
    records[1]["env"]["NCCL_ALGO"] = "Rign"
    records[1]["env_origins"]["NCCL_ALGO"] = "sglang_server_env.NCCL_ALGO"
    res = host(records, min_shm_mib=10**9, shm_path=str(tmp_path))
    assert res["failed"] is True
    assert res["outcome"] == INVALID_CONFIG
    keys = {(p["instance"], p["key"]) for p in res["problems"]}
    assert keys == {
        (None, "sglang_service_min_shm_mib"),
        ("b", "sglang_instances[1].gpus"),
        ("b", "sglang_server_env.NCCL_ALGO"),
    }
    assert "b: GPUs [9] are given to the instance but the host has 8 (0-7)" in res["msg"]
    assert "less than sglang_service_min_shm_mib (1000000000)" in res["msg"]


def test_sglang_not_installed_fails_naming_sglang_service_venv(model, tmp_path):
    absent = tmp_path / "nowhere" / "bin" / "python"
    parser = FakeParser()
    res = host(two_instances(model, absent), parser=parser)
    assert res["outcome"] == INVALID_CONFIG
    (p,) = res["problems"]
    assert p["key"] == "sglang_service_venv"
    assert p["message"] == (
        f"no {absent}: install SGLang first (the sglang role, before sglang_service) or set sglang_service_venv"
    )
    assert parser.runs == []


def test_check_mode_on_a_fresh_node_says_sglang_is_not_installed_yet_and_passes(model, tmp_path):
    absent = tmp_path / "nowhere" / "bin" / "python"
    res = host(two_instances(model, absent), check_mode=True)
    assert res.get("failed") is not True, res
    assert f"SGLang is not installed in {tmp_path / 'nowhere'} yet (check mode)" in res["msg"]
    assert res["installed"] is False
    assert [i["parsed"] for i in res["instances"]] == [False, False]


def test_check_mode_without_nvidia_smi_passes_and_says_so(model, venv):
    def no_nvidia_smi():
        raise FileNotFoundError("nvidia-smi")

    res = v.validate_host(
        two_instances(model, venv), "nobody", check_mode=True, gpu_counter=no_nvidia_smi, parser=FakeParser()
    )
    assert res.get("failed") is not True and res["host_gpus"] is None
    assert "the NVIDIA driver is not installed yet (check mode)" in res["msg"]
    with pytest.raises(v.ValidateError, match="no nvidia-smi on the host"):
        v.validate_host(two_instances(model, venv), "nobody", gpu_counter=no_nvidia_smi, parser=FakeParser())


def test_a_record_without_the_rendered_keys_is_an_error_not_a_verdict():
    with pytest.raises(v.ValidateError, match="instances\\[0\\] lacks server_argv, python"):
        host([{"name": "a", "port": 1, "gpus": [0]}])


# ---------------------------------------------------------------- the kept parser verdicts
def test_a_kept_verdict_skips_the_parser_and_a_changed_argv_runs_it(model, venv, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    records = two_instances(model, venv)
    first = FakeParser()
    assert [i["cached"] for i in host(records, state, first)["instances"]] == [False, False]
    second = FakeParser()
    res = host(records, state, second)
    assert res.get("failed") is not True, res
    assert second.runs == []
    assert [i["cached"] for i in res["instances"]] == [True, True]
    assert "2 parser verdict(s) from the cache" in res["msg"]
    records[1]["server_argv"] = records[1]["server_argv"] + ["--host", "127.0.0.1"]
    third = FakeParser()
    res = host(records, state, third)
    assert [i["cached"] for i in res["instances"]] == [True, False]
    assert [argv for _, argvs in third.runs for argv in argvs] == [records[1]["server_argv"]]


def test_checks_of_the_moment_run_on_a_kept_verdict(model, venv, tmp_path):
    import socket

    state = tmp_path / "state"
    state.mkdir()
    records = two_instances(model, venv)
    host(records, state)
    with socket.socket() as s:
        s.bind(("127.0.0.1", records[0]["port"]))
        s.listen()
        res = host(records, state)
        assert [i["cached"] for i in res["instances"]] == [True, True]
        assert res["outcome"] == INVALID_CONFIG
        assert f"a: port {records[0]['port']} is already in use by pid {os.getpid()}" in res["msg"]
    os.chmod(model, 0o700)
    res = host(records, state)
    assert [i["cached"] for i in res["instances"]] == [True, True]
    assert f"--model-path {model}: {model} is not readable by nobody (set by sglang_model_path)" in res["msg"]
    res = host(records, state, gpus=2)
    assert "b: GPUs [2, 3] are given to the instance but the host has 2 (0-1)" in res["msg"]


def test_a_refused_parser_verdict_is_not_kept(model, venv, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    records = two_instances(model, venv)
    res = host(records, state, FakeParser(error="argument --tp-size: invalid int value: 'x'"))
    assert res["outcome"] == INVALID_CONFIG
    again = FakeParser()
    host(records, state, again)
    assert len(again.runs) == 1


def test_check_mode_reads_kept_verdicts_but_keeps_none(model, venv, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    records = two_instances(model, venv)
    host(records, state, check_mode=True)
    assert not (state / "validated").exists()
    host(records, state)
    parser = FakeParser()
    res = host(records, state, parser, check_mode=True)
    assert parser.runs == [] and [i["cached"] for i in res["instances"]] == [True, True]


def test_no_verdict_is_kept_without_an_identifiable_installation(model, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    records = two_instances(model, sys.executable)  # a python without an SGLang dist-info
    host(records, state)
    parser = FakeParser()
    assert [i["cached"] for i in host(records, state, parser)["instances"]] == [False, False]
    assert len(parser.runs) == 1


def test_the_kept_verdicts_are_root_only_0700_and_0600(model, venv, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    host(two_instances(model, venv), state)
    d = state / "validated"
    assert d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == os.geteuid()
    files = list(d.iterdir())
    assert len(files) == 2
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)


def test_a_directory_others_can_write_is_not_trusted(model, venv, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    records = two_instances(model, venv)
    host(records, state)
    os.chmod(state / "validated", 0o777)
    parser = FakeParser()
    assert [i["cached"] for i in host(records, state, parser)["instances"]] == [False, False]
    assert len(parser.runs) == 1
    assert (state / "validated").stat().st_mode & 0o777 == 0o700  # put right by the store that followed


def test_the_cache_keeps_the_64_newest(tmp_path):
    cache = sglang_parser.VerdictCache(str(tmp_path / "validated"))
    for n in range(70):
        assert cache.store(f"{n:064x}", {"error": None}, "x")
        os.utime(cache._path(f"{n:064x}"), (1000 + n, 1000 + n))
    cache.store("f" * 64, {"error": None}, "x")
    kept = sorted(p.name for p in (tmp_path / "validated").iterdir())
    assert len(kept) == 64
    assert f"{0:064x}.json" not in kept and f"{69:064x}.json" in kept and "f" * 64 + ".json" in kept


def test_nothing_is_kept_without_a_state_directory(tmp_path):
    cache = sglang_parser.VerdictCache(str(tmp_path / "absent" / "validated"))
    assert cache.store("0" * 64, {"error": None}) is False
    assert not (tmp_path / "absent").exists()


KEY_INPUTS = dict(
    identity={"venv": "/opt/ml-env", "version": "0.5.23", "record_sha256": "r", "patch_manifest_sha256": "m"},
    python="/opt/ml-env/bin/python",
    argv=["--port", "30000"],
    env={"NCCL_ALGO": "Ring"},
    gpus=[0, 1],
    port=30000,
    service_user="sglang",
)
KEY_CHANGES = {
    "identity": [
        {**KEY_INPUTS["identity"], "version": "0.5.24"},
        {**KEY_INPUTS["identity"], "record_sha256": "r2"},
        {**KEY_INPUTS["identity"], "patch_manifest_sha256": None},
        {**KEY_INPUTS["identity"], "venv": "/opt/b"},
    ],
    "python": ["/opt/other/bin/python"],
    "argv": [["--port", "30001"], ["--port", "30000", "--tp-size", "2"]],
    "env": [{"NCCL_ALGO": "Tree"}, {}, {"NCCL_ALGO": "Ring", "SGLANG_X": "1"}],
    "gpus": [[0, 2], [1, 0]],
    "port": [30001],
    "service_user": ["root"],
}


@pytest.mark.parametrize("name,value", [(k, x) for k, xs in KEY_CHANGES.items() for x in xs])
def test_the_cache_key_changes_when_any_input_changes(name, value):
    base = sglang_parser.cache_key(**KEY_INPUTS)
    assert sglang_parser.cache_key(**KEY_INPUTS) == base
    assert sglang_parser.cache_key(**{**KEY_INPUTS, name: value}) != base


def test_the_installation_identity_follows_version_record_and_patch_manifest(venv, tmp_path):
    manifest = tmp_path / "patches.json"
    manifest.write_text('{"version": "0.5.23"}')
    first = sglang_parser.installation_identity(str(venv), str(manifest))
    assert first["version"] == "0.5.23" and first["venv"] == os.path.realpath(venv.parent.parent)
    info = venv.parent.parent / "lib" / "python3.12" / "site-packages" / "sglang-0.5.23.dist-info"
    (info / "RECORD").write_text("sglang/__init__.py,sha256=BBBB,1\n")
    second = sglang_parser.installation_identity(str(venv), str(manifest))
    assert second["record_sha256"] != first["record_sha256"]
    manifest.write_text('{"version": "0.5.23", "patches": []}')
    assert (
        sglang_parser.installation_identity(str(venv), str(manifest))["patch_manifest_sha256"]
        != second["patch_manifest_sha256"]
    )
    assert sglang_parser.installation_identity(str(tmp_path / "elsewhere" / "bin" / "python")) is None


# ---------------------------------------------------------------- the parser script, against a stand-in SGLang
FAKE_SERVER_ARGS = """
import argparse
print("SGLang says hello on stdout")
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--model-path", type=str)
        parser.add_argument("--tp-size", type=int, default=1)
        parser.add_argument("--cuda-graph-max-bs-decode", type=int)
        parser.add_argument("--cuda-graph-max-bs-prefill", type=int)
"""


def test_the_parser_script_answers_for_every_argv_in_one_run(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (tmp_path / "fake" / "sglang" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "server_args.py").write_text(FAKE_SERVER_ARGS)
    (pkg / "environ.py").write_text("class envs:\n    SGLANG_KNOWN = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    good, bad = sglang_parser.run_parser(sys.executable, [["--tp-size", "2", "--model-path", "/m"], ["--tp-size", "x"]])
    assert good["error"] is None and good["args"]["tp_size"] == 2 and good["args"]["model_path"] == "/m"
    assert bad["error"] == "argument --tp-size: invalid int value: 'x'"
    assert good["env_names"] == ["SGLANG_KNOWN"]
    assert "--cuda-graph-max-bs-decode" in good["options"]
    (p,) = instance_checks.check_parser(good, ["--cuda-graph-max-bs", "8"], {})
    assert p["message"].startswith("--cuda-graph-max-bs is ambiguous")


def test_a_parser_that_cannot_run_is_an_error_naming_the_python(tmp_path):
    with pytest.raises(v.ValidateError, match=f"could not run SGLang's parser with {tmp_path}/none"):
        sglang_parser.run_parser(str(tmp_path / "none"), [[]])


# ---------------------------------------------------------------- the module, as Ansible runs it
def run_module(tmp_path: Path, args: dict, path_dirs=()) -> dict:
    """plugins/modules/sglang_validate.py as Ansible runs it, the package from collections/ (as Ansible ships it)."""
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    code = "import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    env = {
        **os.environ,
        "PATH": os.pathsep.join([*map(str, path_dirs), os.environ["PATH"]]),
        "PYTHONPATH": str(REPO / "collections"),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(REPO / "plugins" / "modules" / "sglang_validate.py"),
            str(args_file),
        ],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    return json.loads(proc.stdout)


def test_the_module_refuses_with_outcome_invalid_config(tmp_path, model):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    absent = str(tmp_path / "venv" / "bin" / "python")
    records = [record(0, "a", free_port(), [0, 1], python=absent), record(1, "b", free_port(), [1, 2], python=absent)]
    res = run_module(tmp_path, {"instances": records, "service_user": "nobody", "min_shm_mib": 0}, [bin_dir])
    assert res["failed"] is True
    assert res["outcome"] == INVALID_CONFIG
    assert {p["key"] for p in res["problems"]} == {"sglang_service_venv", "sglang_instances[1].gpus"}
    assert "b: GPUs [2] are given to the instance but the host has 2 (0-1)" in res["msg"]
    assert res["host_gpus"] == 2
