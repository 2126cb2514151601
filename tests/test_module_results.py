"""The library modules' own result paths that their logic's test files do not reach, as Ansible runs them:
sglang_validate's success and contained errors, sglang_collect's argument and write failures."""

from __future__ import annotations

import os
import socket
import sys

from support.modules import instance_record, run_module


def validate_record(port: int, python: str) -> dict:
    """One instance as render.yml records it for sglang_validate."""
    return {
        "name": "a",
        "unit": "sglang-a.service",
        "port": port,
        "gpus": [0],
        "profile": "p",
        "server_argv": ["--model-path", "/srv/m", "--port", str(port)],
        "origins": {"--port": "sglang_instances[0].port", "--model-path": "sglang_model_path"},
        "env": {},
        "env_origins": {},
        "python": python,
    }


def bare_env(tmp_path) -> dict:
    """No nvidia-smi, no SGLang: a fresh node's PATH."""
    (tmp_path / "nobin").mkdir(exist_ok=True)
    return {**os.environ, "PATH": str(tmp_path / "nobin")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_validate_in_check_mode_on_a_fresh_node_passes_saying_what_waits(tmp_path):
    python = str(tmp_path / "venv" / "bin" / "python")
    args = {"instances": [validate_record(free_port(), python)], "service_user": "nobody"}
    rc, out = run_module("sglang_validate", args, tmp_path, env=bare_env(tmp_path), check_mode=True)
    assert rc == 0 and out["changed"] is False and out["problems"] == [], out
    assert out["installed"] is False and out["host_gpus"] is None
    assert out["msg"].startswith("1 instance(s) valid (0 parser verdict(s) from the cache); ")
    assert "the NVIDIA driver is not installed yet (check mode)" in out["msg"]
    assert f"SGLang is not installed in {tmp_path / 'venv'} yet (check mode)" in out["msg"]
    assert out["instances"] == [
        {"name": "a", "unit": "sglang-a.service", "profile": "p", "parsed": False, "cached": False}
    ]


def test_validate_fails_when_its_checks_cannot_run(tmp_path):
    args = {"instances": [validate_record(free_port(), sys.executable)], "service_user": "nobody"}
    rc, out = run_module("sglang_validate", args, tmp_path, env=bare_env(tmp_path))
    assert rc == 1 and out["problems"] == []
    assert out["msg"] == "no nvidia-smi on the host: install the NVIDIA driver first (the cuda role)"
    rc, out = run_module("sglang_validate", {"instances": [{"name": "a"}], "service_user": "x"}, tmp_path)
    assert (
        rc == 1 and out["msg"] == "instances[0] lacks port, gpus, server_argv, python: not a rendered instance record"
    )


def test_validate_contains_an_unexpected_error_as_a_result(tmp_path):
    """A record whose port is not a number reaches no check that expects it: a failed result, not a traceback."""
    record = {**validate_record(0, str(tmp_path / "none")), "port": "http"}
    rc, out = run_module(
        "sglang_validate",
        {"instances": [record], "service_user": "x"},
        tmp_path,
        env=bare_env(tmp_path),
        check_mode=True,
    )
    assert rc == 1 and out["problems"] == []
    assert out["msg"] == "sglang_validate: unexpected ValueError: invalid literal for int() with base 10: 'http'"


def test_collect_refuses_a_budget_or_a_keep_it_cannot_honour(tmp_path):
    record = instance_record(tmp_path)
    rc, out = run_module("sglang_collect", {"instance": record, "budget_s": 0}, tmp_path)
    assert rc == 1 and out["msg"] == "budget_s (0.0) must be above 0 and keep (5) at least 1"
    rc, out = run_module("sglang_collect", {"instance": record, "keep": 0}, tmp_path)
    assert rc == 1 and out["msg"] == "budget_s (10.0) must be above 0 and keep (0) at least 1"


def test_collect_fails_only_when_no_bundle_can_be_written(tmp_path):
    (tmp_path / "blocker").write_text("a file where the bundles' directory should be")
    args = {"instance": instance_record(tmp_path), "out_dir": str(tmp_path / "blocker" / "evidence"), "budget_s": 2}
    rc, out = run_module("sglang_collect", args, tmp_path, env=bare_env(tmp_path))
    assert rc == 1 and out["msg"].startswith("no evidence bundle written: ") and "blocker" in out["msg"]
    assert "path" not in out
