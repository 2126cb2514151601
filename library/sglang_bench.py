"""Benchmark a running SGLang instance on its host: autotune's fixed load (issue 15).

A thin adapter: the measurement lives in module_utils/sglang_deploy/bench.py."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_bench
short_description: Measure a running SGLang instance with a fixed streamed load
description:
  - After I(warmup) unmeasured requests, sends I(requests) streamed C(/generate) requests of
    I(max_new_tokens) tokens (C(ignore_eos)) at each concurrency level, to the instance's port on this host,
    with its API key when it has one.
  - Reports per level and for the first level output tok/s, accept length (tokens over SGLang's
    C(spec_verify_ct)), time to first token and inter-token latency (median, p99), and failed requests.
  - Changes nothing. Fails (naming the instance) when no request of a level succeeded.
options:
  instance:
    description: The instance's rendered record (C(name), C(port), C(secrets_path), ...), as the role renders it.
    type: dict
    required: true
  concurrency:
    description: Concurrency levels, in order; the first is what a sweep ranks by.
    type: list
    elements: int
    default: [1]
  requests:
    description: Measured requests per level.
    type: int
    default: 8
  max_new_tokens:
    description: Tokens per request.
    type: int
    default: 64
  warmup:
    description: Unmeasured requests first.
    type: int
    default: 2
  timeout:
    description: Seconds one request may take.
    type: float
    default: 120
author: sglang-deploy
"""

RETURN = r"""
instance:
  description: The instance's name.
  type: str
  returned: always
bench:
  description: output_tokens_per_s, accept_length, ttft_median_s, ttft_p99_s, itl_median_s, itl_p99_s (the first
    level's), levels (each level's, with ok, failed and the first failures), failed, seconds.
  type: dict
  returned: success
gpu_model:
  description: The model of the instance's GPUs, as nvidia-smi names them (null when it cannot say).
  type: str
  returned: success
"""

import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_deploy import bench, gpu
from ansible.module_utils.sglang_deploy.instance import Instance


def gpu_model(gpus: list[int]) -> str | None:
    """The model of the instance's GPUs as nvidia-smi names them ("NVIDIA H200"); None when it cannot say."""
    try:
        names = sorted({g["name"] for g in gpu.snapshot(describe_processes=False)["gpus"] if g["index"] in gpus})
    except (gpu.NvidiaSmiError, OSError):
        return None
    return ", ".join(names) or None


def main():
    module = AnsibleModule(
        argument_spec=dict(
            instance=dict(type="dict", required=True),
            concurrency=dict(type="list", elements="int", default=[1]),
            requests=dict(type="int", default=8),
            max_new_tokens=dict(type="int", default=64),
            warmup=dict(type="int", default=2),
            timeout=dict(type="float", default=120.0),
        ),
        supports_check_mode=True,
    )
    p = module.params
    name = p["instance"].get("name")
    if module.check_mode:
        module.exit_json(changed=False, instance=name, msg="check mode: nothing measured")
    try:
        inst = Instance.from_params(p["instance"])
        module.no_log_values.update(inst.secret_values())
        result = bench.run(
            inst.base,
            p["concurrency"],
            p["requests"],
            p["max_new_tokens"],
            p["warmup"],
            api_key=inst.api_key(),
            timeout=p["timeout"],
        )
    except (ValueError, TypeError, OSError) as exc:
        module.fail_json(msg=f"{name}: cannot benchmark: {exc}", instance=name)
    except Exception as exc:  # contained: a result, never a traceback instead of one
        module.fail_json(msg=f"{name}: the benchmark failed: {exc!r}", instance=name, exception=traceback.format_exc())
    empty = [lv["concurrency"] for lv in result["levels"] if not lv["ok"]]
    if empty:
        first = next((f for lv in result["levels"] for f in lv["failures"]), "no answer")
        module.fail_json(
            msg=f"{name}: no request succeeded at concurrency {empty}: {first}", instance=name, bench=result
        )
    module.exit_json(changed=False, instance=name, bench=result, gpu_model=gpu_model(inst.gpus))


if __name__ == "__main__":
    main()
