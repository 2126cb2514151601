"""The multi-node restart's plan for roles/sglang_service/tasks/restart_multinode.yml: a thin adapter over
module_utils/sglang_deploy/phases.py (MULTINODE_PLAN), where the order and its tests live."""

from __future__ import annotations

from dataclasses import asdict


def sglang_multinode_plan(selected):
    # Imported here: Ansible loads every filter file of the collection in each process that templates one of its
    # filters, and the state machine's modules cost about 0.09 s that only a multi-node restart needs.
    from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.phases import MULTINODE_PLAN

    return [asdict(step) for step in MULTINODE_PLAN] if selected else []


class FilterModule:
    def filters(self):
        return {"sglang_multinode_plan": sglang_multinode_plan}
