"""Prometheus' scrape jobs from the inventory (roles/sglang_monitoring): a thin adapter over
module_utils/sglang_deploy/monitoring.py, where the rules and their tests live."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.monitoring import alert_rules, scrape_configs


def sglang_scrape_configs(
    servers, gateways, nodes, scheme="http", node_exporter_port=9100, listen_address="0.0.0.0:9090"
):
    try:
        return scrape_configs(servers, gateways, nodes, scheme, node_exporter_port, listen_address)
    except ValueError as exc:
        raise AnsibleFilterError(f"sglang_scrape_configs: {exc}") from exc


def sglang_alert_rules(doc, alert_for=None):
    try:
        return alert_rules(doc, alert_for)
    except ValueError as exc:
        raise AnsibleFilterError(f"sglang_alert_rules: {exc}") from exc


class FilterModule:
    def filters(self):
        return {"sglang_scrape_configs": sglang_scrape_configs, "sglang_alert_rules": sglang_alert_rules}
