#!/usr/bin/python
"""Ansible module: stage one SGLang instance's configuration (a thin adapter over sglang_deploy.stage)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: sglang_stage
short_description: Write a changed SGLang unit and environment as pending, under the instance's lock
description:
  - A deploy never changes what systemd starts after a crash or at boot. A changed unit or
    environment file is written under the pending directory; the safe restart
    (sglang_server) promotes it. A first configuration, with nothing verified to protect,
    is written as the unit's while none was ever verified (not enabled: a verified restart enables it).
  - A rendered configuration equal to the unit's removes a stale pending one.
  - The secrets file (always the current values, never staged, never rolled back) is written as given.
  - Holds the instance's lock while writing; refused (outcome C(locked)) while a restart holds it.
options:
  instance: {type: dict, required: true, description: The instance's rendered record (filter sglang_instance).}
  unit_content: {type: str, required: true}
  env_content: {type: str, required: true}
  secrets_content: {type: str, no_log: true, description: The secrets file's content; omitted, it is left alone.}
  state_dir: {type: path, default: /var/lib/sglang, description: Where the known-good generations are.}
  controller: {type: str, default: ""}
  command: {type: str, default: ""}
author: sglang-deploy
"""

RETURN = r"""
outcome: {description: "staged (pending, or a first configuration), unchanged, or locked.", type: str, returned: always}
pending: {description: The configuration waits for the safe restart., type: bool, returned: success}
wrote: {description: Files written., type: list, returned: success}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_deploy import outcomes
from ansible.module_utils.sglang_deploy.instance import Instance, env_secrets
from ansible.module_utils.sglang_deploy.lock import InstanceLock, Locked
from ansible.module_utils.sglang_deploy.stage import stage


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
