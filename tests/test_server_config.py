"""plugins/filter/sglang_config.py: group_vars -> exact argv and environment, with origins."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.filter.sglang_config import ConfigError, server_config

REPO = Path(__file__).resolve().parents[1]

GROUP_VARS = yaml.safe_load((REPO / "group_vars" / "all.yml").read_text())
PROFILES = {
    name: {
        **p,
        "flags": {
            k: (v.replace("{{ sglang_draft_model_path }}", "/d") if isinstance(v, str) else v)
            for k, v in p["flags"].items()
        },
    }
    for name, p in GROUP_VARS["sglang_profiles"].items()
}
ALL8 = [0, 1, 2, 3, 4, 5, 6, 7]
INSTANCE = {"name": "main", "port": 30000, "gpus": ALL8}


def render(profile="eagle3_topk1", instance=None, **kw):
    return server_config(instance or INSTANCE, PROFILES, profile, "/m", GROUP_VARS["sglang_server_flags"], {}, **kw)


def test_the_topk1_profile_renders_the_seeds_command_line():
    cfg = render()
    assert cfg["argv"] == [
        "--model-path",
        "/m",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--attention-backend",
        "flashinfer",
        "--cuda-graph-max-bs-decode",
        "128",
        "--disable-custom-all-reduce",
        "--enable-flashinfer-allreduce-fusion",
        "--enable-metrics",
        "--mem-fraction-static",
        "0.88",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "3",
        "--speculative-num-steps",
        "2",
        "--tp-size",
        "8",
        "--trust-remote-code",
    ]
    assert cfg["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert cfg["origins"]["--speculative-num-steps"] == "sglang_profiles.eagle3_topk1.flags.speculative_num_steps"
    assert cfg["origins"]["--mem-fraction-static"] == "sglang_server_flags.mem_fraction_static"
    assert cfg["origins"]["--tp-size"].startswith("sglang_instances[0].gpus")


def test_the_5tok_profile_keeps_the_benchmarked_steps_and_its_nccl_env():
    cfg = render("eagle3_5tok_cuda_graph")
    argv = cfg["argv"]
    assert argv[argv.index("--speculative-num-steps") + 1] == "3"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "5"
    assert argv[argv.index("--speculative-eagle-topk") + 1] == "4"
    assert cfg["env"]["NCCL_PROTO"] == "LL" and cfg["env"]["NCCL_BUFFSIZE"] == "16777216"
    assert cfg["env_origins"]["NCCL_ALGO"] == "sglang_profiles.eagle3_5tok_cuda_graph.env.NCCL_ALGO"


def test_the_baseline_has_no_speculation():
    assert not any(a.startswith("--speculative") for a in render("baseline_no_spec")["argv"])


def test_instance_flags_override_the_profile_and_say_so():
    inst = {**INSTANCE, "flags": {"speculative_num_steps": 4, "speculative_num_draft_tokens": 5}}
    cfg = render(instance=inst)
    assert cfg["argv"][cfg["argv"].index("--speculative-num-steps") + 1] == "4"
    assert cfg["origins"]["--speculative-num-steps"] == "sglang_instances[0].flags.speculative_num_steps"


def test_two_tp4_instances_on_one_host():
    a = render(instance={"name": "a", "port": 30000, "gpus": [0, 1, 2, 3]})
    b = render(instance={"name": "b", "port": 30001, "gpus": [4, 5, 6, 7]}, instance_index=1)
    assert a["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and b["env"]["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert a["argv"][a["argv"].index("--tp-size") + 1] == "4" == b["argv"][b["argv"].index("--tp-size") + 1]
    assert b["origins"]["--port"] == "sglang_instances[1].port"


@pytest.mark.parametrize(
    "profile,instance,message",
    [
        ("nope", INSTANCE, "sglang_profile 'nope' is not in sglang_profiles"),
        ("eagle3_topk1", {**INSTANCE, "gpus": []}, "sglang_instances[0] (main) has no gpus"),
        ("eagle3_topk1", {**INSTANCE, "port": None}, "sglang_instances[0].port is not set"),
        (
            "eagle3_topk1",
            {**INSTANCE, "flags": {"port": 1}},
            "sglang_instances[0].flags.port: --port is set from sglang_instances[0].port",
        ),
        (
            "eagle3_topk1",
            {**INSTANCE, "flags": {"--tp": 2}},
            "sglang_instances[0].flags.--tp: write flags as snake_case keys",
        ),
        (
            "eagle3_topk1",
            {**INSTANCE, "env": {"CUDA_VISIBLE_DEVICES": "0"}},
            "CUDA_VISIBLE_DEVICES comes from sglang_instances[0].gpus",
        ),
    ],
)
def test_bad_settings_name_the_variable(profile, instance, message):
    with pytest.raises(ConfigError) as exc:
        render(profile, instance=instance)
    assert message in str(exc.value)


def test_a_profile_with_an_unknown_key_is_refused():
    with pytest.raises(ConfigError, match=r"sglang_profiles.x: unknown keys \['flag'\]"):
        server_config(INSTANCE, {"x": {"flag": {}}}, "x", "/m")


def test_one_model_over_two_nodes():
    inst = {
        "name": "big",
        "port": 30000,
        "gpus": ALL8,
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "gpu-node-03.example.internal:5000",
    }
    cfg = render(instance=inst)
    argv = cfg["argv"]
    assert argv[:12] == [
        "--model-path",
        "/m",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "gpu-node-03.example.internal:5000",
    ]
    assert argv[argv.index("--tp-size") + 1] == "16"
    assert cfg["origins"]["--node-rank"] == "sglang_instances[0].node_rank"


@pytest.mark.parametrize(
    "inst,message",
    [
        (
            {"nnodes": 2, "dist_init_addr": "a:1"},
            "sglang_instances[0].node_rank is not set, but sglang_instances[0].nnodes is 2",
        ),
        ({"nnodes": 2, "node_rank": 0}, "sglang_instances[0].dist_init_addr is not set"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "a:1"}, "sglang_instances[0].node_rank is 2, not in 0..1"),
    ],
)
def test_multi_node_settings_are_checked(inst, message):
    with pytest.raises(ConfigError) as exc:
        render(instance={**INSTANCE, **inst})
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "layer,where",
    [("instance", "sglang_instances[0].env.HF_TOKEN"), ("common", "sglang_server_env.HF_TOKEN")],
)
def test_a_secret_named_env_value_is_refused_for_the_secrets_file(layer, where):
    """The env file is recorded in every known-good generation and rolled back: a token there would be kept in
    plain text up to sglang_service_known_good_keep times, and an old one put back by a rollback."""
    env = {"HF_TOKEN": "hf_abcdefgh12345", "NCCL_DEBUG": "WARN"}
    with pytest.raises(ConfigError) as exc:
        if layer == "instance":
            render(instance={**INSTANCE, "env": env})
        else:
            server_config(INSTANCE, PROFILES, "eagle3_topk1", "/m", GROUP_VARS["sglang_server_flags"], env)
    assert str(exc.value).startswith(f"{where}: a secret in the instance's env file")
    assert "sglang_service_secret_env.HF_TOKEN" in str(exc.value) and "hf_abcdefgh12345" not in str(exc.value)
    # Unset, or names that only look alike, are configuration as before.
    cfg = render(instance={**INSTANCE, "env": {"HF_TOKEN": "", "SGLANG_MAX_TOKENS": "4096", "NCCL_DEBUG": "WARN"}})
    assert cfg["env"]["SGLANG_MAX_TOKENS"] == "4096" and cfg["env"]["HF_TOKEN"] == ""
