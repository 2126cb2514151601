"""A secret-named variable of an instance's environment (sglang_server_env, a profile's env, the instance's env:
HF_TOKEN) reaches the sglang_server module in its instance record and its env file's content: the module's result
holds none of it, invocation.module_args included, from its first failure on (#30)."""

from __future__ import annotations

import json

import pytest

from support.modules import instance_record, run_module

SECRET = "hf_ENVSECRET12345"


@pytest.mark.parametrize("early", [True, False], ids=["failing-at-once", "status"])
def test_a_secret_named_env_value_is_in_no_module_result(tmp_path, early):
    inst = instance_record(tmp_path, env={"HF_TOKEN": SECRET, "NCCL_ALGO": "Ring"})
    args = {
        "action": "status",
        "instance": inst,
        "env_content": f'HF_TOKEN="{SECRET}"\nNCCL_ALGO="Ring"\n',
        "state_dir": str(tmp_path / "state"),
        **({"gpu_interval": 1.0} if early else {}),  # refused before anything is read
    }
    rc, res = run_module("sglang_server", args, tmp_path)
    assert (rc != 0) == early, res
    text = json.dumps(res)
    assert SECRET not in text
    env = res["invocation"]["module_args"]["instance"]["env"]
    assert env["NCCL_ALGO"] == "Ring" and env["HF_TOKEN"] != SECRET, "masked, the rest kept"
