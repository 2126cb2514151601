#!/usr/bin/python
"""Ansible module: the GPUs of a host and who holds them; optionally wait until some are clean."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_state
short_description: Read nvidia-smi; optionally wait, polling on the host, until GPUs are clean
description:
  - Returns every GPU (index, uuid, memory used/total) and every compute process on
    them with its pid, memory, user, command line and systemd unit.
  - With I(wait=true), polls every I(interval) seconds (on the host, in this one call)
    until the GPUs in I(gpus) hold no compute process and each one's used memory is at
    most I(max_used_mib); fails on timeout naming each offender.
  - Fails with nvidia-smi's own message when nvidia-smi fails (no driver, driver/library mismatch).
  - Read-only unless I(stop_policy) allows stopping offenders; supports check mode (never stops then).
options:
  gpus:
    description: GPU indices to check (default all).
    type: list
    elements: int
  wait:
    description: Wait until I(gpus) are clean, or fail.
    type: bool
    default: false
  timeout:
    description: Seconds to wait.
    type: float
    default: 60.0
  interval:
    description: Seconds between polls, above 0 and at most 0.25 (else the module fails).
    type: float
    default: 0.1
  max_used_mib:
    description: Used memory a GPU may show with no process on it and still count as clean.
    type: int
    default: 1024
  stop_policy:
    description:
      - C(none) never stops anything.
      - C(own) stops offenders of I(service_unit), and those of I(service_user) that no systemd unit owns
        (outside any unit, or in a login session's scope), never another unit's (SIGTERM, then SIGKILL after
        I(kill_grace)).
      - C(force) stops any offender, only when the operator asks for it explicitly.
    type: str
    choices: [none, own, force]
    default: none
  service_unit:
    description: The service's own unit (for C(stop_policy=own)).
    type: str
  service_user:
    description: The service's own user (for C(stop_policy=own)).
    type: str
  kill_grace:
    description: Seconds between SIGTERM and SIGKILL for stopped offenders.
    type: float
    default: 10.0
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Read the GPUs and who holds them
  sglang.deploy.gpu_state:
  register: gpus

- name: Wait until GPUs 0-3 are clean, stopping the service's own leftovers
  become: true
  sglang.deploy.gpu_state:
    gpus: [0, 1, 2, 3]
    wait: true
    timeout: 120
    stop_policy: own
    service_unit: sglang-main.service
    service_user: sglang
"""

RETURN = r"""
gpus:
  description:
    - Every GPU of the host (index, uuid, name, memory_used_mib, memory_total_mib); empty when nvidia-smi failed.
    - A number nvidia-smi reports as C([N/A]) or C([Not Supported]) is null.
  type: list
  elements: dict
  returned: always
processes:
  description: Every compute process (pid, gpu, gpu_uuid, used_mib, process_name, user, unit, cmdline).
  type: list
  elements: dict
  returned: always
wait:
  description:
    - The wait and its last verdict (the one the unit's GPU gate gives on the same state) - clean, missing,
      offenders, busy, unknown_memory, lines, note, refused, stopped, stopped_processes, waited_s, polls, message.
    - stopped_processes is each stopped process (pid, user, unit, gpus, command, how); I(gpus) and I(processes)
      are then the state as the wait last saw it.
  type: dict
  returned: with I(wait=true), also when the wait failed
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.gpu import (
    NvidiaSmiError,
    snapshot,
    wait_clean,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="list", elements="int"),
            wait=dict(type="bool", default=False),
            timeout=dict(type="float", default=60.0),
            interval=dict(type="float", default=0.1),
            max_used_mib=dict(type="int", default=1024),
            stop_policy=dict(type="str", choices=["none", "own", "force"], default="none"),
            service_unit=dict(type="str"),
            service_user=dict(type="str"),
            kill_grace=dict(type="float", default=10.0),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if not 0 < p["interval"] <= 0.25:
        module.fail_json(msg=f"interval is {p['interval']}: poll at least every 0.25 s (0 < interval <= 0.25)")
    try:
        snap = snapshot()
        result = {"changed": False, **snap}
        if p["wait"]:
            gpus = p["gpus"] if p["gpus"] is not None else [g["index"] for g in snap["gpus"]]
            policy = "none" if module.check_mode else p["stop_policy"]
            waited = wait_clean(
                gpus,
                p["timeout"],
                p["interval"],
                p["max_used_mib"],
                policy,
                p["service_unit"],
                p["service_user"],
                p["kill_grace"],
            )
            # The state as the wait last saw it, not as it was before.
            result["wait"] = {k: v for k, v in waited.items() if k not in ("gpus", "processes")}
            result.update(gpus=waited["gpus"], processes=waited["processes"])
            result["changed"] = bool(waited["stopped"])
            if not waited["clean"]:
                module.fail_json(msg=waited["message"], **result)
    except NvidiaSmiError as exc:
        module.fail_json(msg=str(exc), gpus=[], processes=[])
    module.exit_json(**result)


if __name__ == "__main__":
    main()
