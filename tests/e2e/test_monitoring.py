"""playbooks/monitoring.yml on the lab (issue #34; docs/monitoring.md): Prometheus from Debian's package on lab-node1
(the lab inventory's sglang_monitoring group), node_exporter from Debian's package on both nodes, scraping what the
inventory names; the operations' metrics within one scrape; the accept-length alert on a replica started by hand
with the stand-in's wrong-accept fault; every panel of the dashboard against this Prometheus.

Lab-sized intervals (scrape, evaluation and the GPU reader every 2 s, the accept-length alert's `for:` 10 s) through -e: the rules
and the dashboard are the role's own. At the end both packages are purged and `main` is as deploy.yml left it.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from support import wait_for
from support.e2e import REPO, ansible, back_to_deployed, driver_runner, main_with, podman_exec, recap

pytestmark = pytest.mark.lab

MONITOR = "lab-node1"
NODES = ("lab-node1", "lab-node2")
SCRAPE_S = 2
ALERT_FOR_S = 10
ALERT = "SGLangAcceptLengthBelowFloor"
SETTINGS = json.dumps(
    {
        "sglang_monitoring_scrape_interval": f"{SCRAPE_S}s",
        "sglang_monitoring_evaluation_interval": f"{SCRAPE_S}s",
        "sglang_monitoring_gpu_metrics_interval": SCRAPE_S,
        "sglang_monitoring_alert_for": {ALERT: f"{ALERT_FOR_S}s"},
    }
)
# `main` runs a profile with a baseline (group_vars: 82.3 tok/s), so that the textfile metrics carry one.
MAIN = main_with(profile="eagle3_5tok_cuda_graph")
DASHBOARD = REPO / "roles" / "sglang_monitoring" / "files" / "sglang-deploy-dashboard.json"
RULES = REPO / "roles" / "sglang_monitoring" / "files" / "sglang-deploy.rules.yml"
# The lab's wrong-accept replica: started by hand (systemctl), as an operator's restart that skips verification.
FAULT_DROPIN = "/etc/systemd/system/sglang-main.service.d/lab-wrong-accept.conf"


def prom(container: str, path: str, **params) -> dict:
    """Prometheus' HTTP API on the monitoring node (its port is not published to the controller)."""
    url = f"http://127.0.0.1:9090{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    code = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=10).read().decode())"
    doc = json.loads(podman_exec(container, "python3", "-c", code))
    assert doc["status"] == "success", doc
    return doc["data"]


def query(container: str, expr: str, at: float | None = None) -> list[dict]:
    return prom(container, "/api/v1/query", query=expr, **({"time": f"{at:.3f}"} if at else {}))["result"]


@pytest.fixture(scope="module")
def monitored(deployed, tmp_path_factory):
    """Prometheus and node_exporter deployed (twice: the second run changes nothing), `main` serving on both nodes
    through the safe restart (its textfile metrics written), every target scraped once."""
    the_lab, hosts = deployed
    containers = {h["name"]: h["container"] for h in hosts}
    run = driver_runner(the_lab, tmp_path_factory.mktemp("ledger") / "ledger.sqlite3", None)
    try:
        # --check on the fresh nodes first: it says what it would do and touches nothing (no package, no unit).
        checked = ansible(
            "ansible-playbook", "playbooks/monitoring.yml", "--check", "-e", SETTINGS, inventory=the_lab.inventory
        )
        installed = "dpkg -l 'prometheus*' 2>/dev/null | grep '^ii' || true"
        assert all(podman_exec(c, "sh", "-c", installed) == "" for c in containers.values()), "--check installed"
        first = ansible("ansible-playbook", "playbooks/monitoring.yml", "-e", SETTINGS, inventory=the_lab.inventory)
        again = ansible("ansible-playbook", "playbooks/monitoring.yml", "-e", SETTINGS, inventory=the_lab.inventory)
        code, _, proc = run("restart", "-e", MAIN)
        assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield the_lab, containers, run, first, again, checked
    finally:
        for name, container in containers.items():
            podman_exec(container, "sh", "-c", f"rm -rf {Path(FAULT_DROPIN).parent} && systemctl daemon-reload")
            back_to_deployed(the_lab, container, name)
            podman_exec(
                container, "sh", "-c",
                "{ systemctl disable --now sglang-gpu-metrics.timer || true; } && rm -f /etc/systemd/system/sglang-gpu-metrics.*"
                " && systemctl daemon-reload && rm -rf /usr/local/libexec/sglang-deploy-metrics"
                " && DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq prometheus prometheus-node-exporter >/dev/null"
                " && rm -rf /var/lib/prometheus /etc/prometheus /var/lib/sglang-deploy/grafana",
            )  # fmt: skip


def all_up(container: str) -> dict[str, str] | None:
    """Every active target's health by its URL, once all of them are up."""
    health = {t["scrapeUrl"]: t["health"] for t in prom(container, "/api/v1/targets")["activeTargets"]}
    return health if set(health.values()) == {"up"} else None


def test_prometheus_scrapes_every_target_of_the_inventory_with_the_rules_loaded_and_a_second_run_changes_nothing(
    monitored,
):
    _, containers, _, first, again, checked = monitored
    assert {h: r["failed"] for h, r in recap(checked.stdout).items()} == dict.fromkeys(NODES, 0), checked.stdout[-3000:]
    assert recap(first.stdout)[MONITOR]["changed"] > 0
    assert {h: r["changed"] for h, r in recap(again.stdout).items()} == dict.fromkeys(NODES, 0), again.stdout[-3000:]
    want = {
        "http://127.0.0.1:9090/metrics",
        *(f"http://{n}:30000/metrics" for n in NODES),  # each node's instance `main`
        *(f"http://{n}:9100/metrics" for n in NODES),  # node_exporter
    }
    monitor = containers[MONITOR]
    seen = wait_for("every target up", lambda: all_up(monitor), 30, 0.5)
    assert set(seen) == want
    loaded = {r.get("name") for g in prom(monitor, "/api/v1/rules")["groups"] for r in g["rules"]}
    written = {
        r.get("alert") or r.get("record") for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
    }
    assert loaded == written
    [rule] = [r for g in prom(monitor, "/api/v1/rules")["groups"] for r in g["rules"] if r.get("name") == ALERT]
    assert rule["duration"] == ALERT_FOR_S  # the inventory's `for:`, not the file's 5m
    # Each node's GPU reader: nvidia-smi read, and `main`'s memory under its own unit (none outside it).
    read = {r["metric"]["host"]: r["value"][1] for r in query(monitor, "sglang_deploy_gpu_read_ok")}
    assert read == dict.fromkeys(NODES, "1")
    # Polled: a reading between a test's stop and start of `main` shows no holder until the next one.
    want = {(n, "sglang-main.service") for n in NODES}
    wait_for("main's memory under its unit on both nodes", lambda: holders(monitor) == want, 30, 0.5)


def holders(container: str) -> set[tuple[str, str]]:
    held = query(container, "sum by (host, unit) (sglang_deploy_gpu_memory_used_bytes)")
    return {(r["metric"]["host"], r["metric"]["unit"]) for r in held}


def test_a_restarts_outcome_and_duration_are_a_metric_within_one_scrape(monitored):
    _, containers, run, _, _, _ = monitored
    monitor = containers[MONITOR]
    code, _, proc = run("restart", "-e", MAIN, limit="lab-node2")
    ended = time.time()
    assert code == 0, proc.stdout[-3000:]
    # Evaluated at the restart's end plus one scrape interval (and a second for the scrape itself): the first
    # scrape after the module wrote the file falls before it, so its samples must be there.
    at = ended + SCRAPE_S + 1
    wait_for("the instant one scrape after the restart", lambda: time.time() > at + 0.5, 10, 0.2)
    selector = '{host="lab-node2", sglang_instance="main", operation="restart"}'
    [stamp] = query(monitor, f"sglang_deploy_operation_timestamp_seconds{selector}", at)
    assert ended - 60 < float(stamp["value"][1]) <= ended  # this restart's end, not the fixture's
    [outcome] = query(monitor, f"sglang_deploy_operation_outcome{selector} == 1", at)
    assert outcome["metric"]["outcome"] == "restarted"
    [took] = query(monitor, f"sglang_deploy_operation_duration_seconds{selector}", at)
    assert float(took["value"][1]) > 0
    [down] = query(monitor, 'sglang_deploy_restart_downtime_seconds{host="lab-node2", sglang_instance="main"}', at)
    assert float(down["value"][1]) > 0


def load(container: str, port: int, stop: str) -> subprocess.Popen:
    """Requests one after the other to the instance on its node until `stop` exists."""
    code = (
        "import json, os, urllib.request as u\n"
        f"while not os.path.exists({stop!r}):\n"
        f"    u.urlopen(u.Request('http://127.0.0.1:{port}/generate', data=json.dumps({{'text': 'hi', "
        "'sampling_params': {'max_new_tokens': 32}}).encode(), headers={'Content-Type': 'application/json'}), "
        "timeout=30).read()\n"
    )
    podman_exec(container, "rm", "-f", stop)
    return subprocess.Popen(["podman", "exec", container, "python3", "-c", code], stderr=subprocess.PIPE, text=True)


def answers(container: str, url: str) -> bool:
    code = f"import urllib.request as u\ntry: print(u.urlopen({url!r}, timeout=5).status)\nexcept Exception: print(0)"
    return podman_exec(container, "python3", "-c", code).strip() == "200"


def firing(container: str, host: str) -> dict | None:
    alerts = prom(container, "/api/v1/alerts")["alerts"]
    mine = [a for a in alerts if a["labels"]["alertname"] == ALERT and a["state"] == "firing"]
    assert {a["labels"]["host"] for a in mine} <= {host}, mine  # the healthy node never
    return mine[0] if mine else None


def test_a_replica_started_by_hand_with_the_wrong_draft_fires_the_accept_length_alert(monitored):
    _, containers, _, _, _, _ = monitored
    monitor, node = containers[MONITOR], containers["lab-node2"]
    podman_exec(node, "mkdir", "-p", str(Path(FAULT_DROPIN).parent))
    podman_exec(
        node, "sh", "-c", f"printf '[Service]\\nEnvironment=LAB_STANDIN_FAULT=wrong-accept\\n' > {FAULT_DROPIN}"
    )
    podman_exec(node, "systemctl", "daemon-reload")
    podman_exec(node, "systemctl", "restart", "sglang-main.service")
    wait_for("the hand-restarted server", lambda: answers(node, "http://127.0.0.1:30000/health"), 60, 0.5)
    traffic = [load(c, 30000, "/tmp/monitoring-load.stop") for c in containers.values()]
    started = time.monotonic()
    try:
        # The condition holds once a scrape shows accept length 1.0 and the 1m token rate has two samples (two
        # scrapes); it fires `for:` later, evaluated every SCRAPE_S: allowed its `for:` plus two scrape intervals,
        # plus the two scrapes and an evaluation (and a margin for the loaded CI machine).
        bound = ALERT_FOR_S + 2 * SCRAPE_S + 3 * SCRAPE_S + 10
        alert = wait_for(f"{ALERT} firing for lab-node2", lambda: firing(monitor, "lab-node2"), bound, 0.5)
        took = time.monotonic() - started
    finally:
        for c in containers.values():
            podman_exec(c, "touch", "/tmp/monitoring-load.stop")
        for t in traffic:
            t.wait(60)
        podman_exec(node, "sh", "-c", f"rm -rf {Path(FAULT_DROPIN).parent} && systemctl daemon-reload")
        podman_exec(node, "systemctl", "restart", "sglang-main.service")
    assert alert["labels"]["sglang_instance"] == "main"
    # In Prometheus' own time: the alert became pending (activeAt) within two scrape intervals of the first scrape
    # that saw accept length 1.0, and it fires `for:` after that; so it fires within `for:` plus two intervals.
    [series] = query(monitor, 'sglang:spec_accept_length{host="lab-node2"}[5m]')
    first_one = min(float(t) for t, v in series["values"] if float(v) == 1.0)
    active_at = datetime.fromisoformat(alert["activeAt"][:26].rstrip("Z") + "+00:00").timestamp()
    assert active_at - first_one <= 2 * SCRAPE_S, (first_one, alert["activeAt"])
    assert re.match(
        r"main on lab-node2: speculative accept length 1\.00 below its floor", alert["annotations"]["summary"]
    )
    print(f"{ALERT} fired {took:.1f} s after the load began (for: {ALERT_FOR_S} s, scrape every {SCRAPE_S} s)")


def panel_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]
    return out + [(f"annotation {a['name']}", a["expr"]) for a in doc["annotations"]["list"]]


def test_every_panel_of_the_dashboard_is_a_valid_query_with_series_on_the_lab(monitored):
    _, containers, _, _, _, _ = monitored
    monitor = containers[MONITOR]
    exprs = panel_exprs()
    # No gateway runs beside this module's Prometheus: the gateway's panels are valid queries with no series here
    # (their series are smg's own, named in docs/router.md), and the restart annotation needs a restart in its window.
    no_series_here = {title for title, expr in exprs if "smg_" in expr}
    empty = []
    for title, expr in exprs:
        result = query(monitor, expr)  # prom() asserts status success: a query Prometheus refuses fails here
        if not result and title not in no_series_here and not title.startswith("annotation"):
            empty.append(f"{title}: {expr}")
    assert empty == []
    assert no_series_here == {"Workers healthy per gateway", "Circuit breaker state", "Requests in flight per worker"}
