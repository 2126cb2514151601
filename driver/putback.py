"""After an abandoned rollout (a second Ctrl-C or SIGTERM stopped ansible-playbook mid-turn): what serves and is out
of the router goes back in, what does not serve stays out, said (PLAYBOOK below; docs/rollout.md).

Run by the driver itself, once, with the abandoned run's settings; only a third Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from driver import runner

PLAYBOOK = "playbooks/rollout_putback.yml"
# The fact the role sets with what a host's put-back did, line by line (roles/sglang_service/tasks/rollout_putback.yml).
FACT = "sglang_service_rollout_putback"
STOPPED = "the put-back was stopped as well (a third interrupt): check the router's workers yourself"


def lines_of(event: dict) -> list[str]:
    """What one event of the put-back says to the operator."""
    kind = event.get("event")
    data = event.get("event_data") or {}
    res = data.get("res") or {}
    said = (res.get("ansible_facts") or {}).get(FACT)
    if kind == "runner_on_ok" and isinstance(said, list):
        return [str(line) for line in said]
    if kind in ("runner_on_failed", "runner_item_on_failed", "runner_on_unreachable"):
        return [f"put-back failed on {data.get('host')}: {str(res.get('msg', ''))[:300]}"]
    return []


def run(job: runner.Job, stopped: Callable[[], bool], record: Path) -> list[str]:
    """The put-back with the abandoned job's inventory, limit and variables; what it did, line by line."""
    lines: list[str] = []
    outcome = runner.run(
        dataclasses.replace(job, playbook=PLAYBOOK, progress_dir=None, check=False),
        lambda event: lines.extend(lines_of(event)),
        stopped,
        record=record,
    )
    if outcome.status == "canceled":
        lines.append(STOPPED)
    elif not lines:
        lines.append("put-back: nothing serving was out of the router")
    return lines
