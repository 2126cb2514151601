#!/usr/bin/python
"""Ansible module: an operation run from the playbooks (a rollout) as node_exporter textfile metrics of an instance."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_metrics
short_description: Write where a rollout left an instance as node_exporter textfile metrics on its host
description:
  - Writes the instance's outcome in the operation (I(operation)), when it ended and, for a rollout, how many gateways
    listed it healthy at its end into C(sglang_deploy_<instance>.prom) in I(directory), the file
    M(sglang.deploy.sglang_server) writes each restart's, rollback's and verify's end into (docs/monitoring.md). The
    file's other series stay; it is replaced atomically, under the instance's metrics lock.
  - Where I(directory) does not exist (no node_exporter on the host) nothing is written, and that is no failure.
  - A failure to write is a warning and C(metrics_error), never a failed task (the operation ended as it did).
  - In check mode nothing is written.
options:
  instance:
    description: The instance's name (its C(sglang_instance) label).
    type: str
    required: true
  operation:
    description: The operation, the C(operation) label. Restarts, rollbacks and verifications are written by
      M(sglang.deploy.sglang_server) itself.
    type: str
    choices: [rollout]
    required: true
  outcome:
    description: How the operation left the instance (C(restarted), C(rolled_back), C(not_recovered), C(not_begun), ...).
    type: str
    required: true
  gateways_healthy:
    description: How many gateways listed the instance healthy at the end (0 - out of every gateway); unset, not written.
    type: int
  directory:
    description: node_exporter's textfile collector directory (the role's C(sglang_service_metrics_dir)).
    type: path
    required: true
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Write where the rollout left main
  become: true
  sglang.deploy.sglang_metrics:
    instance: main
    operation: rollout
    outcome: restarted
    gateways_healthy: 2
    directory: /var/lib/prometheus/node-exporter
"""

RETURN = r"""
metrics:
  description: The textfile written; null where none was (no I(directory) on the host, check mode, or a failure).
  type: str
  returned: always
metrics_error:
  description: Why the metrics could not be written.
  type: str
  returned: when writing failed
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import metrics


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            instance=dict(type="str", required=True),
            operation=dict(type="str", required=True, choices=["rollout"]),
            outcome=dict(type="str", required=True),
            gateways_healthy=dict(type="int"),
            directory=dict(type="path", required=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if module.check_mode:
        module.exit_json(changed=False, metrics=None)
    result = metrics.record_outcome(p["directory"], p["instance"], p["operation"], p["outcome"], p["gateways_healthy"])
    if "metrics_error" in result:
        module.warn(result["metrics_error"])
    module.exit_json(changed=result["metrics"] is not None, **result)


if __name__ == "__main__":
    main()
