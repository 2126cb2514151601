"""playbooks/validate.yml on lab nodes, with the real SGLang 0.5.23 parser installed by deploy.yml:
good profiles pass and change nothing; each bad configuration fails with a message naming its setting."""

from __future__ import annotations

import json

import pytest

from support.e2e import ansible, podman_exec, recap, refused

pytestmark = pytest.mark.lab
ALL_GPUS = [0, 1, 2, 3, 4, 5, 6, 7]


@pytest.fixture(scope="module")
def with_fleet_model_dirs(deployed):
    the_lab, hosts = deployed
    for h in hosts:
        podman_exec(
            h["container"],
            "sh",
            "-c",
            "mkdir -p /srv/models/target /srv/models/eagle3-draft && "
            'echo \'{"architectures": ["DeepseekV3ForCausalLM"]}\' > /srv/models/target/config.json && '
            'echo \'{"architectures": ["LlamaForCausalLMEagle3"]}\' > /srv/models/eagle3-draft/config.json && '
            "chmod -R a+rX /srv/models",
        )
    return the_lab


def instance(**flags):
    return json.dumps({"sglang_instances": [{"name": "main", "port": 30000, "gpus": ALL_GPUS, "flags": flags}]})


@pytest.mark.parametrize("profile", ["eagle3_topk1", "eagle3_5tok_cuda_graph", "baseline_no_spec"])
def test_every_shipped_profile_passes_and_changes_nothing(with_fleet_model_dirs, profile):
    proc = ansible(
        "ansible-playbook",
        "playbooks/validate.yml",
        "--limit",
        "lab-node1",
        "-e",
        f"sglang_profile={profile}",
        inventory=with_fleet_model_dirs.inventory,
    )
    assert recap(proc.stdout)["lab-node1"]["changed"] == 0


BAD = [
    (
        "abbreviated flag",
        ["-e", '{"sglang_server_flags": {"tp": 8}}'],
        "--tp is an abbreviation of --tp-size: write the flag in full (set by sglang_server_flags.tp)",
    ),
    (
        "renamed flag (the seed's --cuda-graph-max-bs)",
        ["-e", '{"sglang_server_flags": {"cuda_graph_max_bs": 128}}'],
        "--cuda-graph-max-bs is ambiguous (--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill",
    ),
    (
        "misspelt flag",
        ["-e", instance(speculative_algortihm="EAGLE3")],
        "--speculative-algortihm is not a flag of the installed SGLang (set by sglang_instances[0].flags.speculative_algortihm)",
    ),
    (
        "bad value",
        ["-e", '{"sglang_server_flags": {"mem_fraction_static": "most"}}'],
        "SGLang's parser: argument --mem-fraction-static: invalid float value: 'most' (set by sglang_server_flags.mem_fraction_static)",
    ),
    (
        "unknown algorithm",
        ["-e", instance(speculative_algorithm="EAGLE4")],
        "Unknown speculative algorithm name: EAGLE4 (set by sglang_instances[0].flags.speculative_algorithm)",
    ),
    (
        "EAGLE-3 draft under EAGLE",
        ["-e", instance(speculative_algorithm="EAGLE")],
        "is an EAGLE-3 model (LlamaForCausalLMEagle3) but --speculative-algorithm is EAGLE (set by sglang_instances[0].flags.speculative_algorithm): use EAGLE3",
    ),
    (
        "draft tokens against topk 1",
        ["-e", instance(speculative_num_draft_tokens=5)],
        "with --speculative-eagle-topk 1 the draft tokens are steps + 1 = 3, but --speculative-num-draft-tokens is 5",
    ),
    (
        "tp against the instance's GPUs",
        ["-e", instance(tp_size=4)],
        "tp 4 x dp 1 x pp 1 = 4 GPUs over 1 node(s) needs 4 GPU(s) on this node, but the instance is given 8",
    ),
    (
        "GPUs the host lacks",
        ["-e", json.dumps({"sglang_instances": [{"name": "main", "port": 30000, "gpus": [6, 7, 8, 9]}]})],
        "GPUs [8, 9] are given to the instance but the host has 8 (0-7)",
    ),
    (
        "missing model",
        ["-e", "sglang_model_path=/srv/models/absent"],
        "--model-path /srv/models/absent does not exist (set by sglang_model_path)",
    ),
    ("bad NCCL value", ["-e", '{"sglang_server_env": {"NCCL_ALGO": "Rign"}}'], "NCCL_ALGO=Rign: Rign is not one of"),
    (
        "SGLang variable this release lacks (the seed's)",
        ["-e", '{"sglang_server_env": {"SGLANG_ENABLE_SPEC_V2": "True"}}'],
        "SGLANG_ENABLE_SPEC_V2 is not an environment variable of the installed SGLang",
    ),
    (
        "/dev/shm too small for NCCL",
        ["-e", "sglang_service_min_shm_mib=65536"],
        "/dev/shm is 1024 MiB, less than sglang_service_min_shm_mib (65536)",
    ),
    ("unknown profile", ["-e", "sglang_profile=fastest"], "sglang_profile 'fastest' is not in sglang_profiles"),
    (
        "two instances sharing a GPU",
        [
            "-e",
            json.dumps(
                {
                    "sglang_instances": [
                        {"name": "a", "port": 30000, "gpus": [0, 1, 2, 3]},
                        {"name": "b", "port": 30001, "gpus": [3, 4, 5, 6]},
                    ]
                }
            ),
        ],
        "each instance needs its own name, port and GPUs",
    ),
    (
        "multi-node without a rank",
        [
            "-e",
            json.dumps(
                {
                    "sglang_instances": [
                        {
                            "name": "main",
                            "port": 30000,
                            "gpus": ALL_GPUS,
                            "nnodes": 2,
                            "dist_init_addr": "lab-node1:5000",
                        }
                    ]
                }
            ),
        ],
        "sglang_instances[0].node_rank is not set, but sglang_instances[0].nnodes is 2",
    ),
]


@pytest.mark.parametrize("case,extra,message", BAD, ids=[b[0] for b in BAD])
def test_bad_configuration_is_refused_with_its_setting(with_fleet_model_dirs, case, extra, message):
    proc = refused(with_fleet_model_dirs, "playbooks/validate.yml", "--limit", "lab-node1", *extra)
    assert message in proc.flat, f"{case}: {proc.flat[-2500:]}"


def test_two_tp4_instances_on_one_host_pass(with_fleet_model_dirs):
    two = json.dumps(
        {
            "sglang_instances": [
                {"name": "a", "port": 30000, "gpus": [0, 1, 2, 3]},
                {"name": "b", "port": 30001, "gpus": [4, 5, 6, 7]},
            ]
        }
    )
    proc = ansible(
        "ansible-playbook",
        "playbooks/validate.yml",
        "-v",  # the module's result shown: its message says how many instances it found valid
        "--limit",
        "lab-node1",
        "-e",
        two,
        inventory=with_fleet_model_dirs.inventory,
    )
    flat = " ".join(proc.stdout.split())
    assert "2 instance(s) valid (" in flat, proc.stdout[-3000:]  # sglang_validate's verdict on both, in one call
    assert "problems: []" in flat
    out = recap(proc.stdout)
    assert set(out) == {"lab-node1"} and (out["lab-node1"]["failed"], out["lab-node1"]["changed"]) == (0, 0)


def test_a_port_held_by_another_process_is_refused_and_its_holder_named(with_fleet_model_dirs, lab):
    node = lab[1][0]["container"]
    podman_exec(
        node,
        "systemd-run",
        "--unit",
        "lab-port-squatter",
        "python3",
        "-m",
        "http.server",
        "30000",
        "--bind",
        "127.0.0.1",
    )
    try:
        podman_exec(
            node,
            "python3",
            "-c",
            "import socket, time\n"
            "for _ in range(100):\n"
            "    try:\n        socket.create_connection(('127.0.0.1', 30000), 0.2).close(); break\n"
            "    except OSError: time.sleep(0.05)",
        )
        proc = refused(with_fleet_model_dirs, "playbooks/validate.yml", "--limit", "lab-node1")
    finally:
        podman_exec(node, "systemctl", "stop", "lab-port-squatter")
    assert "port 30000 is already in use by pid " in proc.flat
    assert "(lab-port-squatter.service: " in proc.flat and "-m http.server 30000" in proc.flat
    assert "choose another port (sglang_instances[0].port) or stop that process" in proc.flat
