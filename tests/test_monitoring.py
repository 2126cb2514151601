"""roles/sglang_monitoring without a lab (issue #34): the scrape jobs and the alerts' `for:` (module_utils'
monitoring.py), the rules under promtool (check, and tests/promtool's unit tests, which a broken rule fails), the
configuration the role makes for the example inventory under promtool check config, the dashboard's expressions
against the metrics that exist, and docs/monitoring.md against the rules."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import metrics, monitoring
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import worker_urls as wu
from support import REPO

ROLE = REPO / "roles" / "sglang_monitoring"
RULES = ROLE / "files" / "sglang-deploy.rules.yml"
DASHBOARD = ROLE / "files" / "sglang-deploy-dashboard.json"
PROMTOOL_TESTS = REPO / "tests" / "promtool" / "sglang-deploy.rules.test.yml"
PROMTOOL = shutil.which("promtool") or str(REPO / ".venv" / "bin" / "promtool")
VENV_BIN = Path(PROMTOOL).parent


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, text=True, capture_output=True, check=False)


# ------------------------------------------------------------------ scrape jobs


def server(host, instance="main", port=30000, **kw):
    return {"host": host, "instance": instance, "port": port, **kw}


def test_each_instance_is_a_target_labelled_as_the_textfile_metrics_and_the_gateways_name_it():
    jobs = monitoring.scrape_configs(
        [server("n1", gateway_worker=True), server("n1", "b", 30001), server("n2", address="fd00::2")],
        [{"host": "gw", "port": 29000}],
        [{"host": "n1"}, {"host": "n2", "address": "10.0.0.2"}],
    )
    by_job = {j["job_name"]: j for j in jobs}
    assert list(by_job) == ["prometheus", "sglang", "sglang_gateway", "node"]
    servers = by_job["sglang"]["static_configs"]
    assert [g["targets"] for g in servers] == [["n1:30000"], ["n1:30001"], ["[fd00::2]:30000"]]
    assert servers[0]["labels"] == {
        "host": "n1",
        "sglang_instance": "main",
        "worker": wu.worker_url("n1", 30000),  # smg_worker_health{worker=...}: one spelling
        "gateway_worker": "true",
    }
    assert servers[2]["labels"]["worker"] == "http://[fd00::2]:30000"
    assert servers[1]["labels"]["gateway_worker"] == "false"
    assert by_job["sglang_gateway"]["static_configs"] == [{"targets": ["gw:29000"], "labels": {"host": "gw"}}]
    assert [g["targets"] for g in by_job["node"]["static_configs"]] == [["n1:9100"], ["10.0.0.2:9100"]]
    assert by_job["prometheus"]["static_configs"] == [{"targets": ["127.0.0.1:9090"]}]


def test_only_node_rank_0_of_a_multi_node_instance_is_scraped_and_empty_groups_make_no_job():
    jobs = monitoring.scrape_configs([server("a", "big", node_rank=0), server("b", "big", node_rank=1)], [], [])
    assert [j["job_name"] for j in jobs] == ["prometheus", "sglang"]
    assert [g["labels"]["host"] for g in jobs[1]["static_configs"]] == ["a"]


def test_the_scheme_and_node_exporter_port_are_the_callers():
    jobs = monitoring.scrape_configs([server("a")], [], [{"host": "a"}], "https", 9200, "localhost:9091")
    assert jobs[1]["scheme"] == "https" and jobs[1]["static_configs"][0]["labels"]["worker"] == "https://a:30000"
    assert jobs[2]["static_configs"][0]["targets"] == ["a:9200"]
    assert jobs[0]["static_configs"][0]["targets"] == ["localhost:9091"]


@pytest.mark.parametrize(
    ("servers", "gateways", "nodes", "said"),
    [
        ([server("a", port="http")], [], [], "instance main on a: port 'http' is not a whole number"),
        ([server("a", port=0)], [], [], "instance main on a: port 0 is out of range"),
        ([server("a", port=70000)], [], [], "port 70000 is out of range"),
        ([{"host": "a", "port": 1}], [], [], "a server on a: no 'instance'"),
        ([{"instance": "x", "port": 1}], [], [], "a server: no 'host'"),
        ([], [{"host": "gw"}], [], "the gateway on gw: no 'port'"),
        ([server("a", port=9100)], [], [{"host": "a"}], "node_exporter on a: a:9100 is also instance main on a's"),
        ([server("a"), server("a", "b")], [], [], "instance b on a: a:30000 is also instance main on a's"),
        ([server("a", port=True)], [], [], "instance main on a: port True is not a whole number"),
        ([server("a", port=30000.7)], [], [], "port 30000.7 is not a whole number"),
        ([server("N1")], [], [{"host": "n1", "address": "n1"}], None),  # no clash: other ports
        ([server("N1", port=9100)], [], [{"host": "n1"}], "node_exporter on n1: n1:9100 is also instance main on N1's"),
    ],
)
def test_a_bad_item_is_refused_naming_its_host_and_instance(servers, gateways, nodes, said):
    if said is None:
        assert monitoring.scrape_configs(servers, gateways, nodes)
        return
    with pytest.raises(ValueError, match=re.escape(said)):
        monitoring.scrape_configs(servers, gateways, nodes)


@pytest.mark.parametrize(
    ("listen", "local"),
    [
        ("0.0.0.0:9090", "127.0.0.1:9090"),
        (":9090", "127.0.0.1:9090"),
        ("[::]:9091", "[::1]:9091"),
        ("10.0.0.5:9090", "10.0.0.5:9090"),  # bound to a management network: loopback does not answer there
        ("[fd00::5]:9090", "[fd00::5]:9090"),
        ("mon-01:9090", "mon-01:9090"),
    ],
)
def test_prometheus_scrapes_itself_where_it_listens(listen, local):
    assert monitoring.local_address(listen) == local
    assert monitoring.scrape_configs([], [], [], listen_address=listen)[0]["static_configs"] == [{"targets": [local]}]


def test_a_listen_address_without_a_port_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="sglang_monitoring_listen_address: '9090x' is not host:port"):
        monitoring.local_address("9090x")
    with pytest.raises(ValueError, match="sglang_monitoring_listen_address: port 'x' is not a whole number"):
        monitoring.local_address("0.0.0.0:x")


# ------------------------------------------------------------------ the alerts' for:


def rules_doc() -> dict:
    return yaml.safe_load(RULES.read_text())


def alerts(doc: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def test_an_alerts_for_is_replaced_where_asked_and_the_file_is_left_as_it_was():
    doc = rules_doc()
    out = monitoring.alert_rules(doc, {"SGLangAcceptLengthBelowFloor": "10s", "SGLangServerDown": "1h30m"})
    assert alerts(out)["SGLangAcceptLengthBelowFloor"]["for"] == "10s"
    assert alerts(out)["SGLangServerDown"]["for"] == "1h30m"
    assert alerts(out)["SGLangGatewayCircuitOpen"]["for"] == alerts(doc)["SGLangGatewayCircuitOpen"]["for"]
    assert alerts(doc)["SGLangAcceptLengthBelowFloor"]["for"] == "5m"  # the input is not changed
    assert monitoring.alert_rules(doc, None) == doc


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (
            {"SGLangAcceptLenghtBelowFloor": "1m"},
            "sglang_monitoring_alert_for names no alert of the rules: SGLangAccept",
        ),
        ({"SGLangServerDown": "5 minutes"}, "sglang_monitoring_alert_for.SGLangServerDown: '5 minutes' is not a"),
        ({"SGLangServerDown": "-1m"}, "is not a Prometheus duration"),
        ({"SGLangServerDown": ""}, "is not a Prometheus duration"),
    ],
)
def test_a_typo_in_an_alerts_name_or_duration_is_refused_naming_the_variable(overrides, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        monitoring.alert_rules(rules_doc(), overrides)


# ------------------------------------------------------------------ promtool


def test_promtool_is_debian_12s():
    out = subprocess.run([PROMTOOL, "--version"], text=True, capture_output=True, check=True).stdout
    assert re.match(r"promtool, version 2\.42\.0[+ ]", out), out


def test_the_rules_pass_promtool_check_and_their_unit_tests():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(PROMTOOL_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("(sglang:spec_accept_length:max < on", "(sglang:spec_accept_length:max > on"),  # the comparison flipped
        ("and on (host, sglang_instance) (sglang:generation_tokens:rate1m > 0)", ""),  # idle servers alert too
        ('outcome="not_recovered"} == 1', 'outcome="rolled_back"} == 1'),
        ("unless on (worker) (max by (worker) (smg_worker_health) == 1)", ""),
        ('and on () (count(up{job="sglang_gateway"} == 1) > 0)', ""),
        ("(smg_worker_cb_state) == 1", "(smg_worker_cb_state) >= 1"),
        ("(1 - max by", "(1.5 - max by"),
        ('{unit!~"sglang-.+\\\\.service"}', ""),  # the instances' own memory alerts too
        ("sglang_deploy_gpu_read_ok == 0 or", "sglang_deploy_gpu_read_ok == 2 or"),
        ("> 120", "> 600"),
        ("and on (host, sglang_instance) (sglang:spec_accept_length:max > 0)", ""),  # speculation off alerts too
        ("and on (host, sglang_instance, operation)", "or on (host, sglang_instance, operation)"),  # not the latest
        ('up{job=~"node|sglang_gateway"} == 0', "up == 0"),
    ],
)
def test_a_broken_rule_fails_the_promtool_unit_tests(tmp_path, old, new):
    """Each rule's tests catch a change of its meaning: the rules file broken on purpose, the same tests red."""
    text = RULES.read_text()
    assert old in text
    files = tmp_path / "roles" / "sglang_monitoring" / "files"
    files.mkdir(parents=True)
    (files / RULES.name).write_text(text.replace(old, new))
    tests = tmp_path / "tests" / "promtool"
    tests.mkdir(parents=True)
    shutil.copy(PROMTOOL_TESTS, tests)
    proc = promtool("test", "rules", str(tests / PROMTOOL_TESTS.name), cwd=tmp_path)
    assert proc.returncode != 0, proc.stdout


def test_every_alert_has_a_promtool_test_that_expects_it_to_fire():
    tests = yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    assert fired == set(alerts(rules_doc()))


def test_the_configuration_made_for_the_example_inventory_passes_promtool_check_config(tmp_path):
    """The role's own tasks (tasks/config.yml) on the example inventory, written on the controller and checked by
    the promtool of the Prometheus that will load it."""
    env = {"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "PATH": f"{VENV_BIN}:/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), "-i", "inventory/example/hosts.yml", "tests/playbooks/monitoring_config.yml",
         "-e", f"out={tmp_path}", "-e", json.dumps({"sglang_monitoring_alert_for": {"SGLangServerDown": "30s"}})],
        cwd=REPO, env=env, text=True, capture_output=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    config = yaml.safe_load((tmp_path / "router-01.example.internal-prometheus.yml").read_text())
    rules = tmp_path / "router-01.example.internal-rules.yml"
    assert alerts(yaml.safe_load(rules.read_text()))["SGLangServerDown"]["for"] == "30s"
    assert config["rule_files"] == ["/etc/prometheus/sglang-deploy.rules.yml"]
    config["rule_files"] = [str(rules)]  # where this test wrote them
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    jobs = {j["job_name"]: [t for g in j["static_configs"] for t in g["targets"]] for j in config["scrape_configs"]}
    assert jobs["sglang"] == [f"gpu-node-0{i}.example.internal:{p}" for i, p in ((1, 30000), (2, 30000), (3, 30000))]
    assert jobs["sglang_gateway"] == ["router-01.example.internal:29000"]
    assert len(jobs["node"]) == 4


def test_the_roles_defaults_equal_the_roles_they_watch():
    mine = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    gateway = yaml.safe_load((REPO / "roles" / "sglang_router" / "defaults" / "main.yml").read_text())
    service = yaml.safe_load((REPO / "roles" / "sglang_service" / "defaults" / "main.yml").read_text())
    assert mine["sglang_monitoring_gateway_port"] == gateway["sglang_router_prometheus_port"]
    assert mine["sglang_monitoring_gateway_worker_groups"] == gateway["sglang_router_worker_groups"]
    assert mine["sglang_monitoring_textfile_dir"] == service["sglang_service_metrics_dir"]


# ------------------------------------------------------------------ the dashboard

PROMQL_WORDS = {
    "sum", "max", "min", "count", "by", "on", "and", "or", "unless", "group_left", "rate", "increase", "changes",
    "histogram_quantile", "vector", "le", "without", "ignoring",
}  # fmt: skip


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])] + [
        a["expr"] for a in doc["annotations"]["list"]
    ]


def metric_names(expr: str) -> set[str]:
    """The series names an expression reads (labels, strings and functions taken out)."""
    bare = re.sub(r"\{[^}]*\}|\"[^\"]*\"|\[[^\]]*\]", " ", expr)
    bare = re.sub(r"\b(by|on|without|ignoring|group_left)\s*\([^)]*\)", " ", bare)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare))
    return {n for n in names - PROMQL_WORDS if not re.fullmatch(r"[0-9.e]+", n)}


def known_metrics() -> set[str]:
    """What exists: the textfile metrics (metrics.METRICS, GPU_METRICS), the rules' records, the stand-in's /metrics (SGLang's
    names), smg's per-worker series (docs/router.md), Prometheus' own."""
    records = {r["record"] for g in rules_doc()["groups"] for r in g["rules"] if "record" in r}
    sglang = set(re.findall(r"(sglang:[a-z_]+)", (REPO / "lab" / "standin" / "lab_sglang_standin.py").read_text()))
    sglang |= {f"{n}_bucket" for n in sglang}
    smg = {"smg_worker_health", "smg_worker_cb_state", "smg_worker_requests_active"}
    return set(metrics.METRICS) | set(metrics.GPU_METRICS) | records | sglang | smg | {"up", "ALERTS"}


def test_every_dashboard_expression_reads_metrics_that_exist():
    unknown = {e: sorted(metric_names(e) - known_metrics()) for e in dashboard_exprs()}
    assert {e: u for e, u in unknown.items() if u} == {}


def test_the_dashboards_panels_have_unique_ids_and_read_the_datasource_variable():
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert {p["datasource"]["uid"] for p in doc["panels"] if p["type"] != "row"} == {"${datasource}"}
    assert [r["title"] for r in doc["panels"] if r["type"] == "row"] == [
        "Fleet",
        "Per replica",
        "Operations",
        "Gateways",
    ]


def test_the_metric_name_reader_sees_through_functions_and_labels():
    assert metric_names('histogram_quantile(0.5, sum by (le, host) (rate(x:y_bucket{a="b"}[5m])))') == {"x:y_bucket"}
    assert metric_names("a < on (host, i) group_left () (1 - max by (host) (b))") == {"a", "b"}


# ------------------------------------------------------------------ docs/monitoring.md


def test_the_docs_name_every_alert_and_recording_rule_and_the_dashboards_rows():
    text = (REPO / "docs" / "monitoring.md").read_text()
    doc = rules_doc()
    for name in [r.get("alert") or r["record"] for g in doc["groups"] for r in g["rules"]]:
        assert f"`{name}`" in text, name
    for row in ("Fleet", "Per replica", "Operations", "Gateways"):
        assert f"**{row}**" in text, row


def test_the_filters_pass_their_arguments_through_and_say_a_refusal_as_ansibles_filter_error():
    from ansible.errors import AnsibleFilterError

    from ansible_collections.sglang.deploy.plugins.filter.sglang_monitoring import FilterModule

    filters = FilterModule().filters()
    jobs = filters["sglang_scrape_configs"]([server("a")], [], [{"host": "a"}], "https", 9200, "localhost:9091")
    assert jobs == monitoring.scrape_configs([server("a")], [], [{"host": "a"}], "https", 9200, "localhost:9091")
    assert filters["sglang_alert_rules"](rules_doc()) == rules_doc()
    with pytest.raises(AnsibleFilterError, match="sglang_scrape_configs: instance main on a: port 0 is out of range"):
        filters["sglang_scrape_configs"]([server("a", port=0)], [], [])
    with pytest.raises(AnsibleFilterError, match="sglang_alert_rules: sglang_monitoring_alert_for names no alert"):
        filters["sglang_alert_rules"](rules_doc(), {"Nope": "1m"})
