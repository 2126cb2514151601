"""plugins/module_utils/sglang_deploy/metrics.py: an instance's operations as node_exporter textfile metrics (#34).

The results fed here have the shape sglang_server returns (tests/driver/streams hold real ones); the file is
checked against the exposition format's rules (one HELP and TYPE per metric, escaped label values, counters
named _total)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import metrics, outcomes
from support.modules import run_module

REPO = Path(__file__).resolve().parents[1]
THRESHOLDS = {"accept_length_min": 1.5, "baseline_tokens_per_s": 380.0, "regression_threshold": 0.1}


def restart_result(outcome=outcomes.RESTARTED, tok=394.2, acc=2.56, profile="eagle3_topk1", generation="000016-x"):
    return {
        "outcome": outcome,
        "profile": profile,
        "downtime_s": 4.225,
        "phases": [
            {"phase": "lock", "seconds": 0.0},
            {"phase": "start", "seconds": 2.915},
            {"phase": "verify", "seconds": 0.882},
        ],
        "verify": {"running_profile": profile, "tokens_per_s": tok, "accept_length": acc, "ok": True},
        "known_good": {"generation": generation, "config_hash": "e955a1b9f29d027f", "profile": profile},
    }


def samples(directory: Path, instance: str = "main") -> dict:
    return metrics.parse((directory / f"sglang_deploy_{instance}.prom").read_text())


def value(found: dict, name: str, **labels) -> float:
    want = tuple(sorted({"sglang_instance": "main", **labels}.items()))
    return found[(name, want)]


def test_a_restart_is_written_with_its_outcome_duration_downtime_measurements_and_known_good(tmp_path):
    written = metrics.write(str(tmp_path), "main", "restart", restart_result(), THRESHOLDS)
    assert written == str(tmp_path / "sglang_deploy_main.prom")
    found = samples(tmp_path)
    assert value(found, "sglang_deploy_operation_outcome", operation="restart", outcome="restarted") == 1
    assert value(found, "sglang_deploy_operation_duration_seconds", operation="restart") == pytest.approx(3.797)
    assert value(found, "sglang_deploy_restart_downtime_seconds") == 4.225
    assert value(found, "sglang_deploy_verified_tokens_per_second", profile="eagle3_topk1") == 394.2
    assert value(found, "sglang_deploy_verified_accept_length", profile="eagle3_topk1") == 2.56
    assert value(found, "sglang_deploy_accept_length_floor") == 1.5
    assert value(found, "sglang_deploy_baseline_tokens_per_second", profile="eagle3_topk1") == 380.0
    assert value(found, "sglang_deploy_regression_threshold_ratio") == 0.1
    info = dict(generation="000016-x", config_hash="e955a1b9f29d027f", profile="eagle3_topk1")
    assert value(found, "sglang_deploy_known_good_info", **info) == 1
    assert value(found, "sglang_deploy_rollbacks_total") == 0 and value(found, "sglang_deploy_not_recovered_total") == 0
    # node_exporter runs as its own user: readable by all, written by root only
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o644


def test_each_operation_keeps_one_outcome_and_the_counters_count_across_writes(tmp_path):
    metrics.write(str(tmp_path), "main", "restart", restart_result(), THRESHOLDS)
    metrics.write(
        str(tmp_path), "main", "restart", restart_result(outcomes.ROLLED_BACK, generation="000015-y"), THRESHOLDS
    )
    metrics.write(str(tmp_path), "main", "verify", {"outcome": outcomes.VERIFY_FAILED, "verify": {}}, THRESHOLDS)
    metrics.write(
        str(tmp_path), "main", "restart", restart_result(outcomes.ROLLED_BACK, generation="000015-y"), THRESHOLDS
    )
    found = samples(tmp_path)
    outcomes_now = {
        dict(k[1])["operation"]: dict(k[1])["outcome"] for k in found if k[0] == "sglang_deploy_operation_outcome"
    }
    assert outcomes_now == {"restart": "rolled_back", "verify": "verify_failed"}
    assert value(found, "sglang_deploy_rollbacks_total") == 2
    assert value(found, "sglang_deploy_not_recovered_total") == 0
    gens = [dict(k[1])["generation"] for k in found if k[0] == "sglang_deploy_known_good_info"]
    assert gens == ["000015-y"], "one known-good generation: the newest"
    # a verification that measured nothing leaves the last measurement (and its time says when that was)
    assert value(found, "sglang_deploy_verified_accept_length", profile="eagle3_topk1") == 2.56


def test_a_not_recovered_restart_counts_and_a_new_profile_replaces_the_old_measurement(tmp_path):
    metrics.write(str(tmp_path), "main", "restart", restart_result(), THRESHOLDS)
    metrics.write(
        str(tmp_path), "main", "restart", restart_result(outcomes.NOT_RECOVERED, tok=None, acc=None), THRESHOLDS
    )
    metrics.write(str(tmp_path), "main", "rollback", restart_result(profile="baseline_no_spec", acc=1.0), THRESHOLDS)
    found = samples(tmp_path)
    assert value(found, "sglang_deploy_not_recovered_total") == 1
    profiles = {dict(k[1])["profile"] for k in found if k[0] == "sglang_deploy_verified_accept_length"}
    assert profiles == {"baseline_no_spec"}
    assert value(found, "sglang_deploy_operation_outcome", operation="restart", outcome="not_recovered") == 1
    assert value(found, "sglang_deploy_operation_outcome", operation="rollback", outcome="restarted") == 1


def test_no_textfile_directory_writes_nothing(tmp_path):
    assert metrics.write(None, "main", "restart", restart_result(), THRESHOLDS) is None
    assert metrics.write(str(tmp_path / "absent"), "main", "restart", restart_result(), THRESHOLDS) is None
    assert not (tmp_path / "absent").exists()


def test_label_values_are_escaped_and_read_back(tmp_path):
    odd = 'a "quoted" back\\slash\nnewline'
    metrics.write(str(tmp_path), "main", "restart", restart_result(profile=odd), THRESHOLDS)
    text = (tmp_path / "sglang_deploy_main.prom").read_text()
    assert '\\"quoted\\"' in text and "back\\\\slash" in text and "\\nnewline" in text and "\nnewline" not in text
    found = samples(tmp_path)
    assert value(found, "sglang_deploy_verified_tokens_per_second", profile=odd) == 394.2


def test_the_file_is_valid_exposition_format(tmp_path):
    metrics.write(str(tmp_path), "main", "restart", restart_result(), THRESHOLDS)
    metrics.write(str(tmp_path), "main", "verify", restart_result(outcomes.VERIFIED), THRESHOLDS)
    text = (tmp_path / "sglang_deploy_main.prom").read_text()
    helps = re.findall(r"^# HELP (\S+) ", text, re.M)
    types = re.findall(r"^# TYPE (\S+) (counter|gauge)$", text, re.M)
    assert len(helps) == len(set(helps)) and [n for n, _ in types] == helps
    for line in text.splitlines():
        assert line.startswith("# ") or metrics.SAMPLE.match(line), line
    assert all(n.endswith("_total") for n, kind in types if kind == "counter")


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    metrics.write(str(tmp_path), "main", "restart", restart_result(), THRESHOLDS)
    metrics.write(str(tmp_path), "other", "restart", restart_result(), THRESHOLDS)
    names = sorted(p.name for p in tmp_path.iterdir())
    # the .prom files node_exporter reads, and each instance's writers' lock (a name it never reads)
    assert [n for n in names if not n.startswith(".")] == ["sglang_deploy_main.prom", "sglang_deploy_other.prom"]
    assert [n for n in names if n.startswith(".")] == [".sglang_deploy_main.lock", ".sglang_deploy_other.lock"]


def test_nan_and_missing_measurements_are_left_out(tmp_path):
    res = restart_result(tok=float("nan"), acc="n/a")
    metrics.write(str(tmp_path), "main", "restart", res, {"accept_length_min": 1.5, "baseline_tokens_per_s": None})
    names = {k[0] for k in samples(tmp_path)}
    assert "sglang_deploy_verified_tokens_per_second" not in names
    assert "sglang_deploy_verified_accept_length" not in names
    assert "sglang_deploy_baseline_tokens_per_second" not in names


@pytest.mark.parametrize(("table", "common"), [(metrics.METRICS, ("sglang_instance",)), (metrics.GPU_METRICS, ())])
def test_docs_monitoring_lists_every_metric_with_its_type_and_labels(table, common):
    doc = (REPO / "docs" / "monitoring.md").read_text()
    for name, (kind, labels, _) in table.items():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"docs/monitoring.md has no row for {name}"
        assert f"| {kind} |" in row, row
        for label in (*common, *labels):
            assert f"`{label}`" in row, (name, label)


class FakeMachine:
    inst = type("Inst", (), {"name": "main"})()


def test_the_module_writes_a_restarts_end_and_says_where(tmp_path):
    run = metrics.recorded("restart", lambda m: restart_result(), str(tmp_path), THRESHOLDS)
    res = run(FakeMachine())
    assert res["outcome"] == "restarted" and res["metrics"] == str(tmp_path / "sglang_deploy_main.prom")
    assert value(samples(tmp_path), "sglang_deploy_restart_downtime_seconds") == 4.225


@pytest.mark.parametrize(("name", "directory"), [("status", True), ("restart", False)])
def test_status_and_no_directory_write_nothing(tmp_path, name, directory):
    """Status reads; no directory: check mode, one phase of a multi-node group, or metrics_dir unset."""
    run = metrics.recorded(name, lambda m: {"outcome": "x"}, str(tmp_path) if directory else None, THRESHOLDS)
    assert "metrics" not in run(FakeMachine()) and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "plant",
    [
        lambda p: p.mkdir(),  # a directory: not a regular file
        lambda p: os.mkfifo(p),  # a FIFO: opened non-blocking, refused, never hangs the worker
        lambda p: p.symlink_to("/dev/zero"),  # a link: never followed
    ],
)
def test_a_failed_write_is_a_warning_and_the_operations_outcome_stands(tmp_path, plant):
    target = tmp_path / "d" / "sglang_deploy_main.prom"
    target.parent.mkdir()
    plant(target)
    try:
        res = metrics.recorded("restart", lambda m: restart_result(), str(target.parent), THRESHOLDS)(FakeMachine())
    finally:
        os.chmod(target.parent, 0o700)
    if os.geteuid() == 0 and plant.__code__.co_consts and "chmod" in str(plant.__code__.co_names):
        return  # root writes into a 0500 directory: nothing to refuse here
    assert res["outcome"] == "restarted" and res["metrics"] is None
    assert res["metrics_error"].startswith("the metrics were not written: ")
    assert res["warnings"] == [res["metrics_error"]]


def test_a_multi_node_groups_end_writes_its_outcome_and_known_good_and_keeps_the_measurements(tmp_path):
    """The group's end on a node (record, or the rollback's confirmation) is one phase of several: its outcome and
    known-good generation are written, no duration or downtime (that call saw one phase), and the verification
    measured before stays."""
    metrics.write(str(tmp_path), "main", "restart", restart_result(), THRESHOLDS)
    end = {"outcome": outcomes.NOT_RECOVERED, "phases": [{"phase": "verify", "seconds": 0.5}], "downtime_s": 0.1}
    res = metrics.recorded("restart", lambda m: end, str(tmp_path), THRESHOLDS, whole=False)(FakeMachine())
    assert res["metrics"]
    found = samples(tmp_path)
    assert value(found, "sglang_deploy_operation_outcome", operation="restart", outcome="not_recovered") == 1
    assert ("sglang_deploy_operation_outcome", (("operation", "restart"), ("outcome", "restarted"),
            ("sglang_instance", "main"))) not in found  # fmt: skip
    assert value(found, "sglang_deploy_not_recovered_total") == 1
    # no duration or downtime: this phase's would pass for the group's, the earlier restart's for this one
    assert not {n for n, _ in found} & {
        "sglang_deploy_operation_duration_seconds",
        "sglang_deploy_restart_downtime_seconds",
    }
    assert value(found, "sglang_deploy_verified_tokens_per_second", profile="eagle3_topk1") == 394.2


def test_a_file_with_bytes_not_utf8_is_read_past_not_raised(tmp_path):
    (tmp_path / "sglang_deploy_main.prom").write_bytes(b"# \xe9dited by hand\n" + b"\xff\xfe\n")
    res = metrics.recorded("restart", lambda m: restart_result(), str(tmp_path), THRESHOLDS)(FakeMachine())
    assert res["metrics"] and "metrics_error" not in res


def test_an_operators_rollback_is_not_counted_as_a_failed_restart(tmp_path):
    metrics.write(str(tmp_path), "main", "rollback", restart_result(outcomes.ROLLED_BACK), THRESHOLDS)
    assert value(samples(tmp_path), "sglang_deploy_rollbacks_total") == 0


def test_a_label_value_with_a_unicode_line_separator_survives_the_next_write(tmp_path):
    odd = "prof\u2028ile\x85x"
    metrics.write(str(tmp_path), "main", "restart", restart_result(profile=odd), THRESHOLDS)
    metrics.write(str(tmp_path), "main", "verify", {"outcome": outcomes.VERIFIED}, THRESHOLDS)
    assert value(samples(tmp_path), "sglang_deploy_verified_tokens_per_second", profile=odd) == 394.2


def test_a_rollouts_end_is_written_beside_the_restarts_and_counts_nothing_again(tmp_path):
    metrics.write(str(tmp_path), "main", "restart", restart_result(outcomes.NOT_RECOVERED), THRESHOLDS)
    said = metrics.record_outcome(str(tmp_path), "main", "rollout", outcomes.NOT_RECOVERED, 0)
    assert said == {"metrics": str(tmp_path / "sglang_deploy_main.prom")}
    found = samples(tmp_path)
    assert value(found, "sglang_deploy_operation_outcome", operation="rollout", outcome="not_recovered") == 1
    assert value(found, "sglang_deploy_operation_outcome", operation="restart", outcome="not_recovered") == 1
    assert value(found, "sglang_deploy_rollout_gateways_healthy") == 0
    assert value(found, "sglang_deploy_not_recovered_total") == 1  # the restart's, not counted again
    assert (
        "sglang_deploy_operation_duration_seconds",
        (("operation", "rollout"), ("sglang_instance", "main")),
    ) not in found
    # the next rollout replaces its outcome; unknown gateways leave the gauge out
    metrics.record_outcome(str(tmp_path), "main", "rollout", "restarted", None)
    found = samples(tmp_path)
    assert [dict(k[1])["outcome"] for k in found if k[0] == "sglang_deploy_operation_outcome"
            and dict(k[1])["operation"] == "rollout"] == ["restarted"]  # fmt: skip
    assert "sglang_deploy_rollout_gateways_healthy" not in {n for n, _ in found}  # unknown now: not the last one


def test_a_rollouts_write_that_fails_is_said_never_raised_and_other_operations_are_refused(tmp_path):
    (tmp_path / "sglang_deploy_main.prom").mkdir()
    said = metrics.record_outcome(str(tmp_path), "main", "rollout", "restarted", 1)
    assert said["metrics"] is None and said["metrics_error"].startswith("the metrics were not written: ")
    assert metrics.record_outcome(str(tmp_path / "absent"), "main", "rollout", "restarted", 1) == {"metrics": None}
    with pytest.raises(ValueError, match="'restart' is not one the playbooks record"):
        metrics.record_outcome(str(tmp_path), "main", "restart", "restarted", 1)


def test_the_sglang_metrics_module_writes_a_rollouts_end_and_nothing_in_check_mode(tmp_path):
    (tmp_path / "work").mkdir()
    args = {"instance": "main", "operation": "rollout", "outcome": "rolled_back", "gateways_healthy": 2,
            "directory": str(tmp_path)}  # fmt: skip
    code, res = run_module("sglang_metrics", args, tmp_path / "work", check_mode=True)
    assert (
        code == 0 and res["metrics"] is None and not res["changed"] and list(tmp_path.iterdir()) == [tmp_path / "work"]
    )
    code, res = run_module("sglang_metrics", args, tmp_path / "work")
    assert code == 0 and res["changed"] and res["metrics"] == str(tmp_path / "sglang_deploy_main.prom")
    assert value(samples(tmp_path), "sglang_deploy_rollout_gateways_healthy") == 2
    (tmp_path / "sglang_deploy_main.prom").unlink()
    (tmp_path / "sglang_deploy_main.prom").mkdir()  # a write that fails: a warning, the task not failed
    code, res = run_module("sglang_metrics", args, tmp_path / "work")
    assert code == 0 and not res["changed"] and res["metrics_error"].startswith("the metrics were not written")
    assert res["metrics_error"] in str(res["warnings"])
