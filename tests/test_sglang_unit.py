"""module_utils/sglang_unit: the cause of a failed start, found in a journal; metrics; and the
profile argvs that let verify name the profile a server runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "module_utils"))
sys.path.insert(0, str(REPO / "filter_plugins"))
import sglang_config  # noqa: E402
import sglang_unit  # noqa: E402

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
    assert sglang_unit.cause_of(DECODE_CRASH) == "AttributeError: 'EAGLEWorkerV2' object has no attribute 'adaptive_controller'"
    tb = sglang_unit.traceback_of(DECODE_CRASH)
    assert tb[0].endswith("Traceback (most recent call last):") and tb[-1].startswith("AttributeError:")


@pytest.mark.parametrize(
    "lines,cause",
    [
        (["usage: launch_server.py [-h] --model-path MODEL_PATH", "launch_server.py: error: unrecognized arguments: --speculative-num-step 3"],
         "error: unrecognized arguments: --speculative-num-step 3"),
        (["sglang-gpu-gate: GPUs [0, 1] not clean after 120s; refusing to start.", "  GPU 1: pid 4242 holds 8148 MiB (user bob, ...)"],
         "sglang-gpu-gate: GPUs [0, 1] not clean after 120s; refusing to start."),
        (["just a line"], None),
    ],
)  # fmt: skip
def test_other_causes(lines, cause):
    assert sglang_unit.cause_of(lines) == cause


def test_metric_reads_a_series_with_labels():
    text = '# HELP x\nsglang:spec_accept_length{model_name="m"} 2.75\nsglang:gen_throughput 91.5\n'
    assert sglang_unit.metric(text, "sglang:spec_accept_length") == 2.75
    assert sglang_unit.metric(text, "sglang:gen_throughput") == 91.5
    assert sglang_unit.metric(text, "sglang:nope") is None


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
    argvs = sglang_config.sglang_profile_argvs({"name": "main", "port": 30000, "gpus": [0, 1]}, profiles, "/m",
                                               prefix=["/opt/ml-env/bin/python", "-m", "sglang.launch_server"])  # fmt: skip
    assert set(argvs) == {"a", "b"} and argvs["a"] != argvs["b"]
    assert argvs["a"][:3] == ["/opt/ml-env/bin/python", "-m", "sglang.launch_server"]
    assert argvs["a"][argvs["a"].index("--speculative-num-steps") + 1] == "3"
