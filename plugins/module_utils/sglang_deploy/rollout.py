"""The rollout's arithmetic (playbooks/vars/rollout.yml through the sglang_count_of filter): counts an operator gives
as a count or as a percentage of the hosts (--max-unavailable, --max-fail)."""

from __future__ import annotations

import re

COUNT = re.compile(r"[0-9]+%?")


def count_of(value, total: int, at_least: int = 0) -> int:
    """`value` ("2", 2, or "25%" of `total` hosts, rounded down) as a count; a percentage's count is at least
    `at_least` (25 % of 2 hosts is no batch at all: the batch size asks 1). A count is as given, 0 included, so that
    the playbook's check refuses a batch of 0. ValueError for anything else."""
    v = str(value).strip()
    if not COUNT.fullmatch(v):
        raise ValueError(f"{value!r} is neither a count (2) nor a percentage (25%)")
    if v.endswith("%"):
        return max(at_least, int(v[:-1]) * int(total) // 100)
    return int(v)
