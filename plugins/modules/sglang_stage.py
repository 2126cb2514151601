#!/usr/bin/python
"""Ansible module: stage one SGLang instance's configuration (a thin adapter over sglang_deploy.stage)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_stage
short_description: Write a changed SGLang unit and environment as pending, under the instance's lock
description:
  - A deploy never changes what systemd starts after a crash or at boot. A changed unit or
    environment file is written under the pending directory; the safe restart
    (sglang_server) promotes it. A first configuration, with nothing verified to protect,
    is written as the unit's while none was ever verified (not enabled - a verified restart enables it).
  - A rendered configuration equal to the unit's removes a stale pending one.
  - The secrets file (always the current values, never staged, never rolled back) is written as given.
  - Holds the instance's lock while writing; refused (outcome C(locked)) while a restart holds it.
  - Supports check mode (says what it would write, and takes no lock).
options:
  instance:
    description: The instance's rendered record (filter sglang_instance).
    type: dict
    required: true
  unit_content:
    description: The rendered systemd unit.
    type: str
    required: true
  env_content:
    description: The rendered EnvironmentFile (no secrets in it).
    type: str
    required: true
  secrets_content:
    description: The secrets file's content (never logged); omitted, it is left alone.
    type: str
  state_dir:
    description: Where the known-good generations are.
    type: path
    default: /var/lib/sglang
  controller:
    description: Who runs the deploy (shown to an operation the lock refuses).
    type: str
    default: ""
  command:
    description: What the controller runs (shown to an operation the lock refuses).
    type: str
    default: ""
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Stage an instance's configuration (pending until the safe restart)
  become: true
  sglang.deploy.sglang_stage:
    instance: "{{ item }}"
    unit_content: "{{ lookup('ansible.builtin.template', 'sglang.service.j2') }}"
    env_content: "{{ lookup('ansible.builtin.template', 'sglang.env.j2') }}"
    secrets_content: "{{ lookup('ansible.builtin.template', 'sglang.secrets.env.j2') }}"
    controller: "{{ lookup('ansible.builtin.env', 'USER') }}@{{ lookup('ansible.builtin.pipe', 'hostname') }}"
    command: ansible-playbook playbooks/deploy.yml
  loop: "{{ sglang_rendered_instances }}"
  register: staged
"""

RETURN = r"""
outcome:
  description: C(staged) (pending, or a first configuration), C(unchanged), C(locked), C(invalid_config) or C(refused).
  type: str
  returned: always
instance:
  description: The instance's name.
  type: str
  returned: success, and when the lock or systemd-analyze refused
pending:
  description: The configuration waits for the safe restart.
  type: bool
  returned: success
wrote:
  description: Files written (in check mode, that would be).
  type: list
  elements: str
  returned: success
config_hash:
  description: The rendered configuration's hash; a restart of this run must find it staged (expected_config_hash).
  type: str
  returned: success
first:
  description: A first configuration, written as the unit's (no verified one to protect).
  type: bool
  returned: when staged as the first
detail:
  description: Why it was staged where it was.
  type: str
  returned: when staged
removed_pending:
  description: The stale pending files removed, the configuration being the unit's already.
  type: list
  elements: str
  returned: when unchanged
secrets_changed:
  description: The secrets file was written.
  type: bool
  returned: when it changed
lock:
  description: The lock's holder (operation, pid, command, controller, since).
  type: dict
  returned: when locked
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance, env_secrets
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.lock import InstanceLock, Locked
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.stage import stage


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            instance=dict(type="dict", required=True),
            unit_content=dict(type="str", required=True),
            env_content=dict(type="str", required=True),
            secrets_content=dict(type="str", no_log=True),
            state_dir=dict(type="path", default="/var/lib/sglang"),
            controller=dict(type="str", default=""),
            command=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    module.no_log_values.update(env_secrets(p["instance"], p["env_content"]))  # before any failure (#30)
    try:
        inst = Instance.from_params({**p["instance"], "state_dir": p["state_dir"]})
    except (TypeError, ValueError) as exc:
        module.fail_json(msg=f"instance: not a rendered instance record ({exc})", outcome=outcomes.INVALID_CONFIG)
    rendered = {inst.unit_path: p["unit_content"], inst.env_path: p["env_content"]}
    lock = InstanceLock(inst.name, f"deploy {inst.name} (stage profile {inst.profile})", p["controller"], p["command"])
    try:
        if not module.check_mode:
            lock.acquire()
        res = stage(inst, rendered, p["secrets_content"], module.check_mode)
    except Locked as exc:
        module.fail_json(msg=str(exc), outcome=outcomes.LOCKED, instance=inst.name, lock={"holder": exc.holder})
    except ValueError as exc:  # systemd-analyze refused the unit: before anything was written
        module.fail_json(msg=f"{inst.name}: {exc}", outcome=outcomes.INVALID_CONFIG, instance=inst.name)
    except Exception as exc:
        module.fail_json(
            msg=f"{inst.name}: staging failed ({type(exc).__name__}: {exc}); the running server was not "
            "touched, and an incomplete pending set is refused by the safe restart: deploy again",
            outcome=outcomes.REFUSED,
            instance=inst.name,
        )
    finally:
        lock.release()
    res["msg"] = f"{inst.name}: {res['outcome']}" + (
        " (pending: the safe restart applies it)" if res["pending"] else ""
    )
    module.exit_json(**res)


if __name__ == "__main__":
    main()
