#!/usr/bin/python
"""Software generations on a host: prune old virtualenvs, or migrate a real one into a generation."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_generations
short_description: Prune software generations (one virtualenv each), never one a unit or record names
description:
  - With I(state=pruned), keeps the I(current) generation, the one I(link) points at, the newest
    I(keep)-1 other complete ones, and every one that a file matched by I(references) names; removes
    the rest, incomplete ones (no C(sglang-deploy/generation.json)) included. Changed only when
    something is removed. See docs/software-generations.md.
  - With I(state=migrated), a real virtualenv directory at I(link) (the layout before generations)
    becomes the generation C(legacy-<UTC time>) and I(link) a link to it.
  - Supports check mode (says what it would remove or migrate).
options:
  dir:
    description: The generations directory (one virtualenv per generation).
    type: path
    required: true
  link:
    description: The link to the current generation.
    type: path
    required: true
  state:
    description: C(pruned) or C(migrated).
    type: str
    choices: [pruned, migrated]
    default: pruned
  current:
    description: The generation just installed (required with I(state=pruned)).
    type: str
  keep:
    description: How many complete generations to keep, the current one included (at least 1).
    type: int
    default: 2
  references:
    description: Glob patterns (C(**) recursive) of files whose text names generations that must stay.
    type: list
    elements: str
    default:
      - /etc/systemd/system/sglang-*.service
      - /etc/systemd/system/sglang-*.service.d/*.conf
      - /etc/sglang/pending/*
      - /var/lib/sglang/known-good/**/*.json
  manifest:
    description: With I(state=migrated), the old layout's patch manifest, copied into the legacy generation.
    type: path
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Prune old generations (never one a unit or a record names)
  become: true
  sglang.deploy.sglang_generations:
    dir: /opt/ml-env-generations
    link: /opt/ml-env
    current: "{{ ml_env_generation_id }}"
    keep: 2
  register: pruned

- name: Move a virtualenv of the layout before generations into one
  become: true
  sglang.deploy.sglang_generations:
    state: migrated
    dir: /opt/ml-env-generations
    link: /opt/ml-env
    manifest: /var/lib/sglang/patches.json
"""

RETURN = r"""
kept:
  description: Generations kept, each with name, path, reason, created and sglang_version.
  type: list
  elements: dict
  returned: state=pruned
removed:
  description: Generations removed (in check mode, that would be), each with the same fields.
  type: list
  elements: dict
  returned: state=pruned
generation:
  description: With state=migrated, the name of the legacy generation (null when nothing was migrated).
  type: str
  returned: state=migrated
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.software import (
    REFERENCES,
    SoftwareError,
    migrate,
    prune,
)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            dir=dict(type="path", required=True),
            link=dict(type="path", required=True),
            state=dict(type="str", choices=["pruned", "migrated"], default="pruned"),
            current=dict(type="str"),
            keep=dict(type="int", default=2),
            references=dict(type="list", elements="str", default=list(REFERENCES)),
            manifest=dict(type="path"),
        ),
        required_if=[("state", "pruned", ["current"])],
        supports_check_mode=True,
    )
    p = module.params
    try:
        if p["state"] == "migrated":
            result = migrate(p["link"], p["dir"], manifest=p["manifest"], check_mode=module.check_mode)
        else:
            result = prune(p["dir"], p["current"], p["keep"], p["references"], p["link"], check_mode=module.check_mode)
    except (SoftwareError, OSError) as exc:
        module.fail_json(msg=str(exc))
    for warning in result.pop("warnings", []):
        module.warn(warning)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
