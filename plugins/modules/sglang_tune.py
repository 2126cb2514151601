"""Check an autotune sweep's combinations on the host with the installed SGLang's parser (issue 15).

A thin adapter: the plan is made by plugins/filter/sglang_config.py (sglang_deploy.tune.plan), the checks are
plugins/module_utils/sglang_deploy/validate.py's, one parser run for every combination."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_tune
short_description: Check each combination of an autotune sweep with the installed SGLang, before any restart
description:
  - Runs every combination's rendered record through the checks of C(sglang_validate) (SGLang's own parser, the
    speculative settings against the draft, parallelism, paths, environment, port), as other configurations of
    one instance (never checked against one another). The verdicts are cached, so the sweep's restarts do not
    run the parser again.
  - Returns the plan with each combination's C(valid) and C(problems). Fails only when the checks cannot run,
    or when the baseline (no speculation) itself is refused.
  - Changes nothing; supports check mode.
options:
  plan:
    description: The sweep's plan (filter C(sglang_tune_plan)), C(combinations) and C(dropped).
    type: dict
    required: true
  records:
    description: Each combination's rendered instance record, in the plan's order (as many as its combinations).
    type: list
    elements: dict
    required: true
  service_user:
    description: User the servers run as.
    type: str
    required: true
  state_dir:
    description: Where parser verdicts are kept (under C(validated/)); unset, none is kept.
    type: path
  patch_manifest:
    description: SGLang's patch manifest (part of the installation's identity).
    type: path
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check every combination with SGLang's own parser
  become: true
  sglang.deploy.sglang_tune:
    plan: "{{ tune_plan }}"
    records: "{{ tune_records }}"
    service_user: sglang
    state_dir: /var/lib/sglang
    patch_manifest: /var/lib/sglang/patches.json
  register: tune_checked
"""

RETURN = r"""
instance:
  description: The instance the sweep is for.
  type: str
  returned: always
plan:
  description: C(combinations) (each with C(valid) and C(problems)) and C(dropped) (each with its C(reason)).
  type: dict
  returned: success, and when the baseline is refused
seconds:
  description: Time the checks took.
  type: float
  returned: success
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import env_secrets
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.validate import ValidateError, validate_host


def checked(plan: dict, records: list, result: dict) -> dict:
    """The plan (all of it: its fingerprint, profiles and software name the sweep) with each combination's verdict
    from validate_host's result (problems name their profile)."""
    by_profile: dict = {}
    for p in result.get("problems") or []:
        by_profile.setdefault(p.get("profile"), []).append(f"{p.get('key')}: {p.get('message')}")
    host = by_profile.pop(None, [])
    combos = []
    for c, r in zip(plan["combinations"], records, strict=True):
        problems = host + by_profile.get(r.get("profile"), [])
        combos.append({**c, "valid": not problems, "problems": problems})
    return {**plan, "combinations": combos, "dropped": plan.get("dropped") or []}


def main():
    module = AnsibleModule(
        argument_spec=dict(
            plan=dict(type="dict", required=True),
            records=dict(type="list", elements="dict", required=True),
            service_user=dict(type="str", required=True),
            state_dir=dict(type="path"),
            patch_manifest=dict(type="path"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    for record in p["records"]:  # before any failure (#30)
        module.no_log_values.update(env_secrets(record))
    name = p["records"][0].get("name") if p["records"] else None
    if len(p["records"]) != len(p["plan"].get("combinations") or []):
        module.fail_json(msg="records and the plan's combinations differ in number", instance=name)
    try:
        result = validate_host(
            p["records"],
            p["service_user"],
            state_dir=p["state_dir"],
            patch_manifest=p["patch_manifest"],
            check_mode=module.check_mode,
            variants=True,
        )
        plan = checked(p["plan"], p["records"], result)
    except ValidateError as exc:
        module.fail_json(msg=f"{name}: the combinations could not be checked: {exc}", instance=name)
    except Exception as exc:  # contained: a result, never a traceback instead of one
        module.fail_json(msg=f"{name}: {exc!r}", instance=name, exception=traceback.format_exc())
    base = plan["combinations"][0]
    if not base["valid"]:
        module.fail_json(
            msg=f"{name}: the baseline (no speculation) is refused: {'; '.join(base['problems'])}",
            instance=name,
            plan=plan,
        )
    valid = sum(c["valid"] for c in plan["combinations"])
    module.exit_json(
        changed=False,
        instance=name,
        plan=plan,
        seconds=result.get("seconds"),
        msg=f"{valid} of {len(plan['combinations'])} combination(s) valid, {len(plan['dropped'])} dropped",
    )


if __name__ == "__main__":
    main()
