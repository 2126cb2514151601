#!/usr/bin/python
"""Ansible module: the NCCL preflight of one instance's GPUs (all-reduce bus bandwidth against a floor).

A thin adapter: the logic lives in plugins/module_utils/sglang_deploy/nccl.py, the worker in nccl_worker.py."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nccl_preflight
short_description: All-reduce on an instance's GPUs with its own NCCL/GLOO environment, judged against a floor
description:
  - Runs the all-reduce worker (one process per GPU, torch.distributed) with I(python) under I(env),
    sizes from I(min_bytes) doubling to I(max_bytes), within I(budget_s) seconds in all.
  - Compares the bus bandwidth at the largest size (nccl-tests' busbw) with I(floor_gbps), or with
    a floor derived from C(nvidia-smi topo -m) and C(nvidia-smi nvlink --status), and says why.
  - Fails with NCCL's own message when NCCL refuses the environment (C(NCCL_PROTO=bogus)).
  - Changes nothing; one GPU is C(skipped) (no all-reduce). Supports check mode (it runs, and only reads).
options:
  python:
    description: The ml-env virtualenv's python (with torch).
    type: str
    default: /opt/ml-env/bin/python
  env:
    description: The instance's environment (its C(NCCL_*) and C(GLOO_*) variables).
    type: dict
    default: {}
  gpus:
    description: The instance's GPU indices (default all of the host's).
    type: list
    elements: int
  backend:
    description: C(nccl) on GPUs or C(gloo) on CPU ranks.
    type: str
    choices: [nccl, gloo]
    default: nccl
  nprocs:
    description: Ranks for C(gloo); 0 is 2.
    type: int
    default: 0
  min_bytes:
    description: Smallest size, in bytes.
    type: int
    default: 1048576
  max_bytes:
    description: Largest size, in bytes (at least 64 MiB to be judged).
    type: int
    default: 1073741824
  floor_gbps:
    description: The operator's floor in GB/s; replaces the derived one; 0 reports only.
    type: float
  budget_s:
    description: Seconds for the whole run on the host (torch import and NCCL init included).
    type: float
    default: 30.0
  topology:
    description: C(nvidia-smi topo -m) output to use instead of running it.
    type: str
  nvlink_status:
    description: C(nvidia-smi nvlink --status) output to use instead of running it.
    type: str
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: NCCL preflight of one instance's GPUs with its own environment
  become: true
  sglang.deploy.nccl_preflight:
    python: /opt/ml-env/bin/python
    env:
      NCCL_SOCKET_IFNAME: eth0
      NCCL_DEBUG: WARN
    gpus: [0, 1, 2, 3]

- name: Report the bandwidth without judging it
  sglang.deploy.nccl_preflight:
    gpus: [0, 1]
    floor_gbps: 0
  register: nccl
"""

RETURN = r"""
ok:
  description: The measurement ran and met the floor (or there was nothing to check).
  type: bool
  returned: always
status:
  description: C(ok), C(failed) or C(skipped) (one GPU).
  type: str
  returned: always
message:
  description: One line; NCCL's message when NCCL failed.
  type: str
  returned: success, and when the measurement failed
busbw_gbps:
  description: Bus bandwidth at the largest size measured (null when none was).
  type: float
  returned: success, and when the measurement failed
at_bytes:
  description: That size.
  type: int
  returned: success, and when the measurement failed
floor:
  description:
    - The floor and why - floor_gbps, basis (operator, nvlink, pcie, single-gpu or unknown), gpus, link,
      peak_gbps and reasoning (lines).
  type: dict
  returned: success, and when the measurement failed
result:
  description:
    - The worker's JSON report (null when it did not run) - sizes (each bytes, iters, time_us, algbw_gbps, busbw_gbps,
      algorithm, protocol), ok, error, nccl_message, nccl_warnings, nccl_env, nccl_version, transports, channels,
      sum_ok, truncated, timed_out, elapsed_s, ranks.
  type: dict
  returned: success, and when the measurement failed
topology:
  description: The parsed topology (gpus, pairs, nics, cpu_affinity, numa_affinity); null for gloo.
  type: dict
  returned: success, and when the measurement failed
nvlink:
  description: Per GPU its links, active, inactive and gbps; null when unavailable.
  type: dict
  returned: success, and when the measurement failed
command:
  description: The worker's command line (null when it did not run).
  type: list
  elements: str
  returned: success, and when the measurement failed
outcome:
  description: C(invalid_config) when the module fails.
  type: str
  returned: failure
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.nccl import preflight


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            python=dict(type="str", default="/opt/ml-env/bin/python"),
            env=dict(type="dict", default={}),
            gpus=dict(type="list", elements="int"),
            backend=dict(type="str", choices=["nccl", "gloo"], default="nccl"),
            nprocs=dict(type="int", default=0),
            min_bytes=dict(type="int", default=1 << 20),
            max_bytes=dict(type="int", default=1 << 30),
            floor_gbps=dict(type="float"),
            budget_s=dict(type="float", default=30.0),
            topology=dict(type="str"),
            nvlink_status=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        out = preflight(
            p["python"],
            p["env"],
            gpus=p["gpus"],
            backend=p["backend"],
            nprocs=p["nprocs"],
            min_bytes=p["min_bytes"],
            max_bytes=p["max_bytes"],
            floor_gbps=p["floor_gbps"],
            budget_s=p["budget_s"],
            topology=p["topology"],
            nvlink_status=p["nvlink_status"],
        )
    except ValueError as exc:
        module.fail_json(outcome=outcomes.INVALID_CONFIG, msg=str(exc), ok=False, status="failed")
    # JSON object keys are strings: the topology's per-GPU maps and nvlink's GPU keys.
    out = module.from_json(module.jsonify(out))
    if not out["ok"]:
        module.fail_json(outcome=outcomes.INVALID_CONFIG, msg=out["message"], changed=False, **out)
    module.exit_json(changed=False, msg=out["message"], **out)


if __name__ == "__main__":
    main()
