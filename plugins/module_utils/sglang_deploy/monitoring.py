"""Prometheus' scrape jobs for the fleet, from the inventory (issue #34; roles/sglang_monitoring).

The role's template reads the inventory (hostvars, groups) into three plain lists and this module turns them into
``scrape_configs``: the SGLang servers (each instance's /metrics on its own port), the gateways (their Prometheus
port) and node_exporter on every GPU node (its textfile collector carries the operations' metrics, metrics.py).

Every series gets the labels the rules join on: ``host`` (the inventory name) everywhere and, on a server's series,
``sglang_instance`` (as the textfile metrics name it) and ``worker`` (the URL a gateway lists it under, as
``smg_worker_health{worker=...}`` names it: worker_urls.worker_url, the one spelling).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .worker_urls import worker_url

# The jobs' names: the rules and the dashboard select by them (docs/monitoring.md).
JOBS = {"server": "sglang", "gateway": "sglang_gateway", "node": "node", "self": "prometheus"}


def _address(host: str, port: Any, what: str) -> str:
    """host:port as Prometheus wants a target (an IPv6 address in brackets); ValueError naming `what`."""
    # A port is a whole number, or its digits as a string: not a bool (int(True) is 1), not 30000.7.
    text = str(port).strip()
    if isinstance(port, bool) or not (isinstance(port, int) or text.isdigit()):
        raise ValueError(f"{what}: port {port!r} is not a whole number")
    number = int(text)
    if not 0 < number < 65536:
        raise ValueError(f"{what}: port {number} is out of range (1-65535)")
    if not str(host).strip():
        raise ValueError(f"{what}: no address")
    return worker_url(host, number, "x").split("://", 1)[1]


def local_address(listen: str) -> str:
    """Where Prometheus answers on its own host, from its --web.listen-address: every address (0.0.0.0, ::, none)
    on the loopback, else the address it was bound to (a management network's: loopback does not answer there)."""
    host, sep, port = str(listen).strip().rpartition(":")
    if not sep:
        raise ValueError(f"sglang_monitoring_listen_address: {listen!r} is not host:port")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return _address(host, port, "sglang_monitoring_listen_address")


def _field(item: Mapping, key: str, what: str) -> Any:
    if not isinstance(item, Mapping) or key not in item:
        raise ValueError(f"{what}: no {key!r} in {item!r}")
    return item[key]


def scrape_configs(
    servers: Iterable[Mapping],
    gateways: Iterable[Mapping],
    nodes: Iterable[Mapping],
    scheme: str = "http",
    node_exporter_port: int = 9100,
    listen_address: str = "0.0.0.0:9090",
) -> list[dict]:
    """Prometheus' scrape_configs for the fleet.

    servers: {host, address, instance, port[, node_rank, gateway_worker]} per SGLang instance; only node rank 0 serves
    HTTP in a multi-node instance (the other ranks run schedulers only), so only it is scraped.
    gateways: {host, address, port} per gateway, port its Prometheus port (sglang_router_prometheus_port).
    nodes: {host, address} per GPU node, scraped on node_exporter_port.
    listen_address: Prometheus' own --web.listen-address; it scrapes itself there (local_address).
    ValueError naming the host and instance for a bad port, a missing field or two targets at one address.
    """
    seen: dict[str, str] = {}  # every target so far (lower case) and whose it is: one port, one job
    server_groups = _server_groups(servers, scheme, seen)
    gateway_groups = _gateway_groups(gateways, seen)
    node_groups = _node_groups(nodes, node_exporter_port, seen)
    jobs = [{"job_name": JOBS["self"], "static_configs": [{"targets": [local_address(listen_address)]}]}]
    if server_groups:
        jobs.append({"job_name": JOBS["server"], "scheme": scheme, "static_configs": server_groups})
    if gateway_groups:
        jobs.append({"job_name": JOBS["gateway"], "static_configs": gateway_groups})
    if node_groups:
        jobs.append({"job_name": JOBS["node"], "static_configs": node_groups})
    return jobs


def _target(seen: dict[str, str], address: str, who: str) -> str:
    """address, recorded in `seen` as who's; ValueError when another job already scrapes it."""
    key = address.lower()  # host names are not case-sensitive: N1:9100 is n1:9100
    if key in seen:
        raise ValueError(f"{who}: {address} is also {seen[key]}'s target: two jobs would scrape one port")
    seen[key] = who
    return address


def _server_groups(servers: Iterable[Mapping], scheme: str, seen: dict[str, str]) -> list[dict]:
    """The SGLang servers' static_configs, one per instance on node rank 0, labelled as the rules join them."""
    groups = []
    for item in servers:
        host = str(_field(item, "host", "a server"))
        name = str(_field(item, "instance", f"a server on {host}"))
        who = f"instance {name} on {host}"
        if int(item.get("node_rank", 0) or 0) > 0:
            continue
        address = str(item.get("address") or host)
        port = _field(item, "port", who)
        groups.append(
            {
                "targets": [_target(seen, _address(address, port, who), who)],
                "labels": {
                    "host": host,
                    "sglang_instance": name,
                    "worker": worker_url(address, int(port), scheme),
                    "gateway_worker": "true" if item.get("gateway_worker") else "false",
                },
            }
        )
    return groups


def _gateway_groups(gateways: Iterable[Mapping], seen: dict[str, str]) -> list[dict]:
    """The gateways' static_configs, each on its Prometheus port."""
    groups = []
    for item in gateways:
        host = str(_field(item, "host", "a gateway"))
        who = f"the gateway on {host}"
        address = _address(item.get("address") or host, _field(item, "port", who), who)
        groups.append({"targets": [_target(seen, address, who)], "labels": {"host": host}})
    return groups


def _node_groups(nodes: Iterable[Mapping], node_exporter_port: int, seen: dict[str, str]) -> list[dict]:
    """node_exporter's static_configs, one per GPU node."""
    groups = []
    for item in nodes:
        host = str(_field(item, "host", "a node"))
        who = f"node_exporter on {host}"
        address = _address(item.get("address") or host, node_exporter_port, who)
        groups.append({"targets": [_target(seen, address, who)], "labels": {"host": host}})
    return groups


DURATION = re.compile(r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$")  # Prometheus' duration syntax


def alert_rules(doc: Mapping, alert_for: Mapping | None = None) -> dict:
    """The rules file (roles/sglang_monitoring/files/sglang-deploy.rules.yml, loaded) with each alert named in
    `alert_for` given that `for:`. ValueError for an alert the file does not have or a duration Prometheus would
    refuse, naming the variable: a typo must not leave an alert at its default in silence."""
    overrides = dict(alert_for or {})
    out = copy.deepcopy(dict(doc))
    names = set()
    for group in out.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert")
            if name is None:
                continue
            names.add(name)
            if name in overrides:
                value = str(overrides[name]).strip()
                if not DURATION.match(value):
                    raise ValueError(
                        f"sglang_monitoring_alert_for.{name}: {overrides[name]!r} is not a Prometheus duration (5m, 30s, 1h30m)"
                    )
                rule["for"] = value
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(
            f"sglang_monitoring_alert_for names no alert of the rules: {', '.join(unknown)} (they are: {', '.join(sorted(names))})"
        )
    return out
