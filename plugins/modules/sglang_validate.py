#!/usr/bin/python
"""Validate the SGLang instances of a host and the host, before anything running is touched.

A thin adapter: the checks live in plugins/module_utils/sglang_deploy/validate.py."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_validate
short_description: Check a host's SGLang instances with the installed SGLang, and the host
description:
  - Parses each instance's exact argument vector with the installed SGLang's own parser
    (C(ServerArgs.add_cli_args)), refusing misspelt, renamed and abbreviated flags and bad values with
    SGLang's message and the variable that produced the flag. One parser run for all instances.
  - Checks speculative decoding (draft path, EAGLE versus EAGLE3 against the draft's C(config.json),
    steps/topk/draft tokens), parallelism against the instance's GPUs, the model paths as the service
    user sees them, the C(NCCL_*) and C(SGLANG_*) environment, and the port (free, or held by the
    instance's own unit).
  - Checks the host; distinct names, ports and GPUs across its instances, the GPUs it has
    (C(nvidia-smi)), the size of C(/dev/shm), and that SGLang is installed (in check mode on a fresh
    node it says that SGLang is not installed yet, and does not fail).
  - Keeps each successful parser verdict under I(state_dir)C(/validated/), keyed by the SGLang
    installation (version, dist-info RECORD, patch manifest), the python, the argv, the environment,
    the GPUs, the port and the service user; while none of these changed the parser does not run
    again. The other checks run every time.
  - Changes nothing running. Every problem is reported, not only the first; a refusal carries
    C(outcome=invalid_config).
options:
  instances:
    description:
      - The host's rendered instance records, each with at least C(name), C(unit), C(port), C(gpus),
        C(server_argv) (SGLang's flags only), C(origins) (flag to the variable that produced it),
        C(env), C(env_origins) and C(python) (the virtualenv's python).
    type: list
    elements: dict
    required: true
  service_user:
    description: User the servers run as (paths must be readable by it).
    type: str
    required: true
  min_shm_mib:
    description: Least size of C(/dev/shm) in MiB (C(sglang_service_min_shm_mib)); 0 skips the check.
    type: int
    default: 0
  state_dir:
    description: Where the parser verdicts are kept (under C(validated/)); unset, none is kept.
    type: path
  patch_manifest:
    description: SGLang's patch manifest; its hash is part of the installation's identity.
    type: path
  cache:
    description: Reuse kept parser verdicts (false runs SGLang's parser for every instance).
    type: bool
    default: true
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check the host's instances with SGLang's own parser, and the host
  become: true
  sglang.deploy.sglang_validate:
    instances: "{{ sglang_rendered_instances }}"
    service_user: sglang
    min_shm_mib: 1024
    state_dir: /var/lib/sglang
    patch_manifest: /var/lib/sglang/patches.json
  register: validated
"""

RETURN = r"""
outcome:
  description: C(invalid_config) when a setting was refused.
  type: str
  returned: on refusal
problems:
  description: Each problem as C(check), C(key) (the variable), C(message) and C(instance) (null for the host's).
  type: list
  elements: dict
  returned: always
instances:
  description: Per instance C(name), C(unit), C(profile), C(parsed) (SGLang's parser verdict known) and C(cached).
  type: list
  elements: dict
  returned: when the checks ran
installed:
  description: Whether SGLang's python exists for every instance.
  type: bool
  returned: when the checks ran
host_gpus:
  description: The GPUs nvidia-smi lists (null in check mode on a node without the driver).
  type: int
  returned: when the checks ran
shm_mib:
  description: The size of C(/dev/shm) in MiB (null when not checked).
  type: int
  returned: when the checks ran
seconds:
  description: Time the checks took.
  type: float
  returned: when the checks ran
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import env_secrets
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.validate import ValidateError, validate_host


def main():
    module = AnsibleModule(
        argument_spec=dict(
            instances=dict(type="list", elements="dict", required=True),
            service_user=dict(type="str", required=True),
            min_shm_mib=dict(type="int", default=0),
            state_dir=dict(type="path"),
            patch_manifest=dict(type="path"),
            cache=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    for record in p["instances"]:  # before any failure (#30)
        module.no_log_values.update(env_secrets(record))
    try:
        result = validate_host(
            p["instances"],
            p["service_user"],
            min_shm_mib=p["min_shm_mib"],
            state_dir=p["state_dir"],
            patch_manifest=p["patch_manifest"],
            cache=p["cache"],
            check_mode=module.check_mode,
        )
    except ValidateError as exc:
        module.fail_json(msg=str(exc), problems=[])
    except Exception as exc:  # contained: a result, never a traceback instead of one
        module.fail_json(
            msg=f"sglang_validate: unexpected {type(exc).__name__}: {exc}",
            problems=[],
            exception=traceback.format_exc(),
        )
    if result.pop("failed", False):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
