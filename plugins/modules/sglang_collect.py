#!/usr/bin/python
"""Ansible module: the crash evidence bundle of one SGLang instance, written on its host (a thin adapter).

The logic lives in plugins/module_utils/sglang_deploy/evidence.py; the controller fetches the bundle (ansible.builtin.fetch)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_collect
short_description: Collect an SGLang instance's crash evidence into one tar.gz on the host
description:
  - Takes, each within its own timeout and all within I(budget_s) - the unit's journal of I(invocation) (else of
    its last start), a py-spy dump of every Python process of the unit's cgroup (the launcher and its ranks), the
    failure and request given, the unit and environment files (never the secrets file), the patch manifest, the
    GPU state, C(nvidia-smi -q), the kernel log's Xid/NVRM lines and the virtualenv's pip freeze.
  - Writes them as one tar.gz, mode 0600, at I(out_dir)/<instance>/<UTC time>-<invocation or on-demand>.tar.gz
    (directories 0700) and keeps the newest I(keep) of the instance. Every secret is replaced by C(<secret>)
    (the one secret rule, sglang_deploy.secret_rule).
  - An item that could not be taken (no nvidia-smi, no py-spy, the budget spent) is listed with ok false and the
    reason; the module fails only when no bundle could be written. Check mode writes nothing.
options:
  action:
    description: What to do; C(collect) is the only action.
    type: str
    choices: [collect]
    default: collect
  instance:
    description: The instance's rendered record (filter sglang_instance), as sglang_server takes it.
    type: dict
    required: true
  state_dir:
    description: The instance's state directory, as sglang_server's; bundles go under its C(evidence/) unless I(out_dir).
    type: path
    default: /var/lib/sglang
  out_dir:
    description: Where bundles go (default I(state_dir)/evidence).
    type: path
  invocation:
    description: The failing invocation's systemd InvocationID (default the unit's current one).
    type: str
  failure:
    description: The failure of sglang_server (phase, cause, journal_tail, traceback, ...).
    type: dict
  request:
    description: The failing request (its response is the failure's C(response), if any).
    type: dict
  budget_s:
    description: Seconds for the whole collection (above 0).
    type: float
    default: 10.0
  keep:
    description: Bundles kept per instance (at least 1).
    type: int
    default: 5
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Take an instance's evidence bundle on demand
  become: true
  sglang.deploy.sglang_collect:
    instance: "{{ item }}"
    state_dir: /var/lib/sglang
    budget_s: 10
  loop: "{{ sglang_rendered_instances }}"
  register: collected

- name: Bring the bundle to the controller
  ansible.builtin.fetch:
    src: "{{ collected.results[0].path }}"
    dest: evidence/
  when: collected.results[0].path is string
"""

RETURN = r"""
path:
  description: The bundle on the host (null in check mode).
  type: str
  returned: success
bytes:
  description: Its size.
  type: int
  returned: success
items:
  description: Each item taken or not - name, ok, seconds, detail.
  type: list
  elements: dict
  returned: success
seconds:
  description: How long the collection took.
  type: float
  returned: success
truncated:
  description: An item was skipped for the budget or an output was cut.
  type: bool
  returned: success
pruned:
  description: Older bundles deleted.
  type: list
  elements: str
  returned: success
host:
  description: The host's name as it knows itself.
  type: str
  returned: success, not in check mode
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.evidence import collect, redactor_for
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance, env_secrets


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            action=dict(type="str", choices=["collect"], default="collect"),
            instance=dict(type="dict", required=True),
            state_dir=dict(type="path", default="/var/lib/sglang"),
            out_dir=dict(type="path"),
            invocation=dict(type="str"),
            failure=dict(type="dict"),
            request=dict(type="dict"),
            budget_s=dict(type="float", default=10.0),
            keep=dict(type="int", default=5),
        ),
        supports_check_mode=True,
    )
    p = module.params
    module.no_log_values.update(env_secrets(p["instance"]))  # before any failure (#30)
    if p["budget_s"] <= 0 or p["keep"] < 1:
        module.fail_json(msg=f"budget_s ({p['budget_s']}) must be above 0 and keep ({p['keep']}) at least 1")
    try:
        inst = Instance.from_params({**p["instance"], "state_dir": p["state_dir"]})
    except (TypeError, ValueError) as exc:
        module.fail_json(msg=f"instance: not a rendered instance record ({exc})")
    # What the bundle holds is redacted; what this module returns is stripped of every secret as well.
    module.no_log_values.update(redactor_for(inst).raw)
    if module.check_mode:
        module.exit_json(changed=False, path=None, bytes=0, items=[], seconds=0.0, truncated=False, pruned=[])
    try:
        out = collect(
            inst,
            invocation=p["invocation"],
            failure=p["failure"],
            request=p["request"],
            budget_s=p["budget_s"],
            out_dir=p["out_dir"],
            keep=p["keep"],
        )
    except OSError as exc:
        module.fail_json(msg=f"no evidence bundle written: {exc}")
    failed = [i["name"] for i in out["items"] if not i["ok"]]
    msg = f"{out['path']} ({out['bytes']} bytes, {out['seconds']} s)" + (
        f"; not taken: {', '.join(failed)}" if failed else ""
    )
    module.exit_json(changed=True, msg=msg, **out)


if __name__ == "__main__":
    main()
