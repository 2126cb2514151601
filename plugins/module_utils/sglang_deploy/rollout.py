"""The rollout's arithmetic (playbooks/vars/rollout.yml through the sglang_count_of and sglang_rollout_routers
filters): counts an operator gives as a count or as a percentage of the hosts (--max-unavailable, --max-fail), and
every gateway of sglang_routers as the rollout's worker-API calls reach it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from .worker_urls import worker_url

COUNT = re.compile(r"[0-9]+%?")
# A gateway listening on every address of a family answers its own host on that family's loopback.
LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


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


def rollout_routers(
    names: Iterable[str], host_vars: Mapping, defaults: Mapping, service_api_key: Any = ""
) -> list[dict[str, Any]]:
    """Every gateway of `names` (the hosts of sglang_routers, in order) as the first of them reaches it, where the
    rollout's worker-API calls run: [{name, impl, url, metrics_url, api_key, discovery_file}]. Each setting is the
    host's own (`host_vars[name]`), else roles/sglang_router's `defaults`; an empty key is `service_api_key`'s
    (sglang_service_api_key); the discovery file only in file mode (else None). ValueError naming a gateway whose
    port is not a whole number."""
    names = list(names or [])
    out = []
    for name in names:
        try:
            out.append(_gateway(name, host_vars[name], name == names[0], defaults, service_api_key))
        except ValueError as exc:
            raise ValueError(f"sglang_routers host {name}: {exc}") from exc
    return out


def _gateway(name: str, own: Mapping, first: bool, defaults: Mapping, service_api_key: Any) -> dict[str, Any]:
    """One gateway of rollout_routers: `own` its host's variables, `first` whether it is the first router."""

    def setting(key: str) -> Any:
        return own[key] if key in own else defaults[key]

    def reach(listen: Any) -> str:
        listen = str(listen)
        if listen not in LOOPBACK:  # one address: that one, from anywhere
            return listen
        if first:
            return LOOPBACK[listen]
        # the address other hosts reach it by, as the router reaches workers (ansible_host may be a tunnel's)
        return own.get("sglang_router_address", name)

    return {
        "name": name,
        "impl": setting("sglang_router_impl"),
        "url": worker_url(reach(setting("sglang_router_host")), setting("sglang_router_port")),
        "metrics_url": worker_url(
            reach(setting("sglang_router_prometheus_host")), setting("sglang_router_prometheus_port")
        ),
        "api_key": own.get("sglang_router_api_key") or service_api_key,
        "discovery_file": (
            setting("sglang_router_discovery_file") if setting("sglang_router_discovery") == "file" else None
        ),
    }
