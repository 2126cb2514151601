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


def every_module_args(tmp_path, inst: dict) -> dict[str, dict]:
    """Each other module that takes rendered instance records, with arguments it refuses or that fail fast."""
    return {
        "sglang_collect": {"instance": inst, "budget_s": 0},
        "sglang_rendezvous": {"step": "check", "instance": inst, "host": "h", "timeout_s": 0},
        "sglang_stage": {"instance": inst, "unit_content": "", "env_content": f'HF_TOKEN="{SECRET}"\n'},
        "sglang_validate": {"instances": [inst], "service_user": "no-such-user-here"},
        "sglang_tune": {"plan": {"combinations": []}, "records": [inst], "service_user": "no-such-user-here"},
    }


@pytest.mark.parametrize("module", list(every_module_args(None, {})))
def test_no_module_taking_an_instance_record_returns_its_secret_named_env_value(tmp_path, module):
    inst = instance_record(tmp_path, env={"HF_TOKEN": SECRET, "NCCL_ALGO": "Ring"})
    rc, res = run_module(module, every_module_args(tmp_path, inst)[module], tmp_path)
    assert rc == 1 and res["failed"], res  # a failure: the result that says most
    assert SECRET not in json.dumps(res), res
    args = res["invocation"]["module_args"]
    record = args["instance"] if "instance" in args else (args.get("instances") or args["records"])[0]
    assert record["env"]["NCCL_ALGO"] == "Ring" and record["env"]["HF_TOKEN"] != SECRET, "masked, the rest kept"


def test_a_short_value_of_a_secret_named_flag_is_not_masked_all_over_the_result(tmp_path):
    """HF_HUB_DISABLE_IMPLICIT_TOKEN=1 is a Hugging Face switch, not a secret: as a no_log value, every 1 in the
    result (a GPU index, a count) became a mask."""
    inst = instance_record(tmp_path, env={"HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "HF_TOKEN": SECRET})
    rc, res = run_module("sglang_collect", {"instance": inst, "budget_s": 0}, tmp_path)
    assert rc == 1 and SECRET not in json.dumps(res)
    assert res["invocation"]["module_args"]["instance"]["gpus"] == [0, 1], (
        res
    )  # not [0, "VALUE_SPECIFIED_IN_NO_LOG..."]
