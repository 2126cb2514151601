#!/usr/bin/python
"""Ansible module: the multi-node rendezvous check of one SGLang instance, on one of its nodes (a thin adapter).

The logic lives in plugins/module_utils/sglang_deploy/rendezvous.py; playbooks/preflight.yml runs both steps."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_rendezvous
short_description: Check that the ranks of an SGLang instance over several nodes can meet, stopping nothing
description:
  - Two steps, each a task run on every node of the instance at once (Ansible runs a task on all hosts of the
    batch in parallel).
  - C(step=check), each rank alone - C(GLOO_SOCKET_IFNAME) names interfaces of this host with an address;
    C(NCCL_SOCKET_IFNAME) selects at least one by NCCL's rules (comma-separated prefixes, C(^) excludes,
    C(=) exact names); C(dist_init_addr) parses and resolves; on rank 0 it is an address of this host and its
    port is free or held by the instance's own unit; on the other ranks it is not an address of theirs.
  - C(step=meet), every rank at once, given every rank's check result in I(ranks) - rank 0 listens on
    C(dist_init_addr)'s port for I(timeout_s) and each other rank connects to it (one line each way), then
    all ranks run a gloo all-reduce on CPU over the nodes with the instance's environment and
    MASTER_ADDR/MASTER_PORT from C(dist_init_addr) (rank 0's choice of port when its own server holds it).
  - A failure names the variable (C(GLOO_SOCKET_IFNAME), C(NCCL_SOCKET_IFNAME), C(dist_init_addr)), the host
    and what to do. Changes nothing; supports check mode (it runs, and changes nothing either way).
options:
  step:
    description: Which step, C(check) or C(meet).
    type: str
    choices: [check, meet]
    required: true
  instance:
    description:
      - The instance's rendered record (filter sglang_instance) - name, unit, nnodes, node_rank, dist_init_addr,
        env, python.
    type: dict
    required: true
  host:
    description: This node's inventory name (for messages and the other ranks).
    type: str
    required: true
  ranks:
    description:
      - For C(meet), every node's C(check) result (the registered loop results of all hosts; others are ignored).
    type: list
    elements: dict
    default: []
  timeout_s:
    description: Seconds for the handshake, and again for the all-reduce (above 0, at most 60).
    type: float
    default: 30.0
  python:
    description: The python with torch for the all-reduce (default the instance's, its argv[0]).
    type: str
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Check the instance's interfaces and dist_init_addr on every node
  become: true
  sglang.deploy.sglang_rendezvous:
    step: check
    instance: "{{ item }}"
    host: "{{ inventory_hostname }}"
  loop: "{{ multinode_instances }}"
  register: rendezvous_check

- name: Meet on dist_init_addr and all-reduce across the nodes
  become: true
  sglang.deploy.sglang_rendezvous:
    step: meet
    instance: "{{ item }}"
    host: "{{ inventory_hostname }}"
    ranks: >-
      {{ ansible_play_hosts_all | map('extract', hostvars, 'rendezvous_check') | map(attribute='results')
         | flatten(levels=1) | selectattr('instance', 'eq', item.name) | list }}
    timeout_s: 30
  loop: "{{ multinode_instances }}"
"""

RETURN = r"""
ok:
  description: Every check passed (and, for meet, the ranks met and all-reduced).
  type: bool
  returned: always
problems:
  description: One line each, naming the variable, the host and what to do.
  type: list
  elements: str
  returned: always
instance:
  description: The instance's name.
  type: str
  returned: success, and when a check failed
node_rank:
  description: This node's rank.
  type: int
  returned: success, and when a check failed
host:
  description: This node's inventory name.
  type: str
  returned: success, and when a check failed
nnodes:
  description: The instance's number of nodes.
  type: int
  returned: success, and when a check failed
dist_init_addr:
  description: The instance's dist_init_addr as this rank has it.
  type: str
  returned: check
interfaces:
  description: This host's interfaces and their addresses.
  type: dict
  returned: check
gloo_ifname:
  description: The instance's GLOO_SOCKET_IFNAME (null when unset).
  type: str
  returned: check
port:
  description: dist_init_addr's port.
  type: int
  returned: check
nccl_selected:
  description: The interfaces NCCL_SOCKET_IFNAME selects here (null when unset).
  type: list
  elements: str
  returned: check
resolved:
  description: The addresses dist_init_addr's host resolves to here.
  type: list
  elements: str
  returned: check
port_state:
  description: On rank 0, the state (free, own, taken), holders and error of dist_init_addr's port.
  type: dict
  returned: check
store_port:
  description: The port the all-reduce meets on (rank 0's choice).
  type: int
  returned: success, and when a check failed
listener:
  description: On rank 0, whether it listens on dist_init_addr's port in meet.
  type: bool
  returned: check
handshake:
  description: In meet, rank 0's joined, missing and error; the other ranks' ok, address, error and attempts.
  type: dict
  returned: meet
allreduce:
  description: In meet, the all-reduce's ok, error, timed_out, sizes, sum_ok, seconds and command.
  type: dict
  returned: meet
outcome:
  description: C(invalid_config) when the module fails.
  type: str
  returned: failure
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import env_secrets
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.rendezvous import check, meet


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            step=dict(type="str", choices=["check", "meet"], required=True),
            instance=dict(type="dict", required=True),
            host=dict(type="str", required=True),
            ranks=dict(type="list", elements="dict", default=[]),
            timeout_s=dict(type="float", default=30.0),
            python=dict(type="str"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    module.no_log_values.update(env_secrets(p["instance"]))  # before any failure (#30)
    if not 0 < p["timeout_s"] <= 60:
        module.fail_json(
            outcome=outcomes.INVALID_CONFIG,
            msg=f"timeout_s is {p['timeout_s']}: give 1 to 60 seconds",
            ok=False,
            problems=[],
        )
    inst = p["instance"]
    try:
        if p["step"] == "check":
            out = check(inst, p["host"])
        else:
            out = meet(inst, p["host"], p["ranks"], timeout_s=p["timeout_s"], python=p["python"])
    except ValueError as exc:
        module.fail_json(
            outcome=outcomes.INVALID_CONFIG, msg=f"dist_init_addr {exc} (on {p['host']})", ok=False, problems=[str(exc)]
        )
    if not out["ok"]:
        module.fail_json(outcome=outcomes.INVALID_CONFIG, msg="; ".join(out["problems"]), changed=False, **out)
    module.exit_json(changed=False, msg=f"{inst.get('name')} rank {out['node_rank']}: ok", **out)


if __name__ == "__main__":
    main()
