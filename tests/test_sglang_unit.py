"""sglang_deploy.unit and .http: the cause of a failed start, found in a journal; metrics; and the
instance record's profile argvs that let verify name the profile a server runs."""

from __future__ import annotations

import pytest

from ansible_collections.sglang.deploy.plugins.filter import sglang_config
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import http as sglang_http
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import unit as sglang_unit

# What a crash on the first decode leaves in the journal (SGLang's scheduler log shape).
DECODE_CRASH = """\
[2026-11-30 10:02:11] The server is fired up and ready to roll!
[2026-11-30 10:12:40] Scheduler hit an exception: Traceback (most recent call last):
  File "/opt/ml-env/lib/python3.11/site-packages/sglang/srt/managers/scheduler.py", line 3110, in run_scheduler_process
    scheduler.event_loop_overlap()
  File "/opt/ml-env/lib/python3.11/site-packages/sglang/srt/speculative/eagle_worker_v2.py", line 512, in forward_batch_generation
    self.adaptive_controller.on_verify(batch)
AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'
[2026-11-30 10:12:40] Received sigquit from a child process. It usually means the child failed.
sglang-main.service: Main process exited, code=killed, status=9/KILL""".splitlines()


def test_the_traceback_and_its_last_line_are_found():
    assert (
        sglang_unit.cause_of(DECODE_CRASH)
        == "AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'"
    )
    tb = sglang_unit.traceback_of(DECODE_CRASH)
    assert tb[0].endswith("Traceback (most recent call last):") and tb[-1].startswith("AttributeError:")


@pytest.mark.parametrize(
    "lines,cause",
    [
        (
            [
                "usage: launch_server.py [-h] --model-path MODEL_PATH",
                "launch_server.py: error: unrecognized arguments: --speculative-num-step 3",
            ],
            "error: unrecognized arguments: --speculative-num-step 3",
        ),
        (
            [
                "sglang-gpu-gate: GPUs [0, 1] not clean after 120s; refusing to start.",
                "  GPU 1: pid 4242 holds 8148 MiB (user bob, ...)",
            ],
            "sglang-gpu-gate: GPUs [0, 1] not clean after 120s; refusing to start.",
        ),
        (["just a line"], None),
    ],
)
def test_other_causes(lines, cause):
    assert sglang_unit.cause_of(lines) == cause


def test_metric_reads_a_series_with_labels():
    text = '# HELP x\nsglang:spec_accept_length{model_name="m"} 2.75\nsglang:gen_throughput 91.5\n'
    assert sglang_http.metric(text, "sglang:spec_accept_length") == 2.75
    assert sglang_http.metric(text, "sglang:gen_throughput") == 91.5
    assert sglang_http.metric(text, "sglang:nope") is None


def test_has_failed_counts_auto_restart():
    assert sglang_unit.has_failed({"ActiveState": "activating", "SubState": "auto-restart"})
    assert sglang_unit.has_failed({"ActiveState": "failed", "SubState": "failed"})
    assert not sglang_unit.has_failed({"ActiveState": "activating", "SubState": "start-pre"})
    assert not sglang_unit.has_failed({"ActiveState": "active", "SubState": "running"})


def test_profile_argvs_tell_profiles_apart():
    profiles = {
        "a": {"flags": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3}},
        "b": {"flags": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2}},
        "bad": {"flags": {"--oops": 1}},  # cannot render: left out
    }
    record = sglang_config.instance_record(
        {"name": "main", "port": 30000, "gpus": [0, 1]},
        0,
        profiles,
        "a",
        "/m",
        None,
        None,
        "0.0.0.0",
        "/opt/ml-env",
        "sglang.launch_server",
        "/etc/sglang",
        "/l/sglang-launch",
    )
    argvs = record["profiles_argv"]
    assert set(argvs) == {"a", "b"} and argvs["a"] != argvs["b"]
    assert argvs["a"][:3] == ["/opt/ml-env/bin/python", "/l/sglang-launch", "sglang.launch_server"]
    assert argvs["a"][argvs["a"].index("--speculative-num-steps") + 1] == "3"
    assert record["argv"] == argvs["a"] and record["unit"] == "sglang-main.service"
    assert record["server_argv"] == record["argv"][3:], "validation sees SGLang's flags alone"


def test_no_command_line_carries_an_api_key_and_one_that_does_is_masked():
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import masked

    record = sglang_config.instance_record(
        {"name": "main", "port": 30000, "gpus": [0]},
        0,
        {"a": {"flags": {}}},
        "a",
        "/m",
        None,
        None,
        "0.0.0.0",
        "/v",
        "sglang.launch_server",
        "/etc/sglang",
        "/l/sglang-launch",
    )
    assert "--api-key" not in record["argv"], "the launcher adds it in-process, from the secrets file"
    assert sglang_config.systemd_quote(["a$b"]) == '"a$$b"', "a $ is escaped: systemd expands nothing"
    by_hand = [*record["argv"], "--api-key", "s3cr3t"]
    assert "s3cr3t" not in masked(by_hand) and masked(by_hand)[-1] == "<secret>"
    assert masked(["x", "--api-key=s3cr3t"]) == ["x", "--api-key=<secret>"]


def test_a_secret_flag_in_a_profile_is_refused():
    with pytest.raises(
        sglang_config.ConfigError, match=r"sglang_profiles\.a\.flags\.api_key: a secret on a command line"
    ):
        sglang_config.server_config(
            {"name": "m", "port": 1, "gpus": [0]}, {"a": {"flags": {"api_key": "k"}}}, "a", "/m"
        )


@pytest.mark.parametrize(
    "flags",
    [
        {"bucket_time_to_first_token": [0.1, 0.5]},  # SGLang 0.5.23 flags whose names the secret rule matches
        {"kt_max_deferred_experts_per_token": 2},
        {"ssl_keyfile_password": "p"},  # no other way in yet; its value is masked wherever it is shown
    ],
)
def test_an_sglang_flag_named_like_a_secret_is_not_refused(flags):
    """Only the flags the launcher passes from the secrets file are refused (secret_rule.REFUSED_FLAGS)."""
    config = sglang_config.server_config({"name": "m", "port": 1, "gpus": [0]}, {"a": {"flags": flags}}, "a", "/m")
    (key,) = flags
    assert config["origins"]["--" + key.replace("_", "-")] == f"sglang_profiles.a.flags.{key}", config


@pytest.mark.parametrize("name", ["../etc", "a/b", "Main", "known-good", "validated", "evidence", "", "-x"])
def test_an_instance_name_that_would_be_a_path_or_a_reserved_directory_is_refused(name):
    """The name names the unit, its files, its lock and StateDirectory=sglang/<name>: never a path, never one of ours."""
    with pytest.raises(sglang_config.ConfigError, match=r"sglang_instances\[0\]\.name"):
        sglang_config.instance_record(
            {"name": name, "port": 1, "gpus": [0]},
            0,
            {"a": {}},
            "a",
            "/m",
            None,
            None,
            "0.0.0.0",
            "/v",
            "m",
            "/etc/sglang",
            "/l",
        )
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import NAME, Instance

    if NAME.match(name):
        return  # a reserved name is a valid word: the renderer refuses it, the modules need not
    with pytest.raises((ValueError, TypeError)):
        Instance.from_params(
            {
                "name": name,
                "unit": "u",
                "unit_path": "/u",
                "env_path": "/e",
                "secrets_path": "/s",
                "pending_dir": "/p",
                "port": 1,
                "gpus": [0],
                "argv": [],
                "profile": "a",
            }
        )
