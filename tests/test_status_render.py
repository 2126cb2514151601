"""status in one task a host (issue #36): plugins/action/sglang_server.py with render=true renders every selected
instance on the controller as the roles do, then asks the module once per instance.

The rendering is held equal to the roles' own: the sglang role's preflight (its lock and patch series read by
Ansible's lookups, the generation named by its Jinja) and sglang_service's record expression (vars/main.yml, which
render.yml keeps as a fact), each rendered by Ansible's templar, against the plugin's. Both run in a process of
their own (tests/support/render_probe.py: Ansible's collection loader before the collection is imported); the
plugin's module calls are answered there (the module itself: tests/test_server_module.py; the lab: tests/e2e).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, render
from driver import exitcodes
from driver.events import Tracker
from support import REPO

HOST = "gpu-node-01.example.internal"
STATUS = {"action": "status", "render": True}


def inventory(tmp_path: Path, **more) -> dict:
    """A host as group_vars/all.yml describes one, with two instances, a tuned profile, an instance's own profile
    and a patch series kept outside the collection."""
    series = tmp_path / "series"
    series.mkdir(exist_ok=True)
    (series / "0002-b.patch").write_text("é\n", encoding="utf-8")
    (series / "0001-a.patch").write_text("--- a/x\n+++ b/x\n\n", encoding="utf-8")
    (series / "notes.txt").write_text("not a patch")
    own = yaml.safe_load((REPO / "group_vars" / "all.yml").read_text())
    profile = next(iter(own["sglang_profiles"]))
    own.update(
        sglang_model_path="/srv/models/target",
        sglang_draft_model_path="/srv/models/draft",
        sglang_install_profile="parser",
        sglang_patch_series_dir=str(series),
        ml_env_requirements=["six==1.16.0"],
        sglang_server_env={"PYTHONPATH": "/opt/x"},
        sglang_instances=[
            {"name": "a", "port": 30000, "gpus": [0, 1, 2, 3]},
            {"name": "b", "port": 30001, "gpus": [4, 5, 6, 7], "profile": "fast"},
        ],
        sglang_tuned_profile_fast={"description": "tuned", "flags": dict(own["sglang_profiles"][profile]["flags"])},
        sglang_service_instance_profiles={"a": profile},
    )
    return {**own, **more}


def probe(own: dict, args: dict = STATUS, answers: dict | None = None, **env_more) -> dict:
    """{roles: render.yml's records (or its error), result: the plugin's, calls: the module's args, one a call}."""
    # support on the path, the collection not: Ansible's collection loader must import it first (render_probe).
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests"), **env_more}
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "render_probe.py")],
        input=json.dumps({"own": own, "args": args, "answers": answers or {}}),
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_status_renders_every_instance_as_the_roles_do(tmp_path):
    out = probe(inventory(tmp_path))
    expected = out["roles"]
    assert [r["name"] for r in expected] == ["a", "b"] and expected[1]["profile"] == "fast"
    assert expected[0]["python"].startswith("/opt/ml-env.d/") and expected[0]["python"].endswith("/bin/python")
    assert not out["result"].get("failed"), out["result"]
    assert [c["instance"] for c in out["calls"]] == expected, "the records the module gets are render.yml's"
    assert all(c["module"] == "sglang.deploy.sglang_server" and "render" not in c for c in out["calls"])
    assert [(c["service_user"], c["state_dir"]) for c in out["calls"]] == [("sglang", "/var/lib/sglang")] * 2
    out = probe(inventory(tmp_path, sglang_service_user="svc"), {**STATUS, "state_dir": "/srv/state"})
    assert {(c["service_user"], c["state_dir"]) for c in out["calls"]} == {("svc", "/srv/state")}, "the task's own win"
    assert [r["instance"] for r in out["result"]["instances"]] == ["a", "b"]
    assert out["result"]["msg"] == "a: active; b: active"


def test_the_generation_follows_the_patch_series_and_the_lock_as_the_roles_do(tmp_path):
    def python(**more) -> str:
        out = probe(inventory(tmp_path, **more))
        assert [c["instance"] for c in out["calls"]] == out["roles"]
        return out["calls"][0]["instance"]["python"]

    first = python()
    (tmp_path / "series" / "0003-c.patch").write_text("c\n")
    second = python()
    assert second != first
    assert python(sglang_requirements=["sglang==0.5.23"]) not in (first, second)
    assert python(sglang_patches_enabled=False) not in (first, second)
    assert python(ml_env_generations_dir="/srv/gens").startswith("/srv/gens/")


def test_a_generation_the_run_named_already_is_kept(tmp_path):
    named = {"generation": "g", "venv": "/opt/ml-env.d/g", "python": "/opt/ml-env.d/g/bin/python"}
    out = probe(inventory(tmp_path, sglang_software=named))
    assert {c["instance"]["python"] for c in out["calls"]} == {"/opt/ml-env.d/g/bin/python"}


def test_only_the_selected_instances_in_the_inventorys_order(tmp_path):
    out = probe(inventory(tmp_path, sglang_service_instances_selected=["b"]))
    assert [c["instance"]["name"] for c in out["calls"]] == ["b"]
    assert [r["instance"] for r in out["result"]["instances"]] == ["b"]


def test_a_setting_refused_fails_the_task_naming_it_and_asks_no_host(tmp_path):
    out = probe(inventory(tmp_path, sglang_service_instance_profiles={"a": "nope"}))
    assert out["result"]["failed"] and out["calls"] == []
    assert "sglang_profile 'nope' is not in sglang_profiles" in out["result"]["msg"], out["result"]
    assert "sglang_profile 'nope' is not in sglang_profiles" in out["roles"], "the roles refuse it the same"
    own = inventory(tmp_path)
    del own["sglang_model_path"]
    out = probe(own)
    assert out["result"]["failed"] and "sglang_model_path" in out["result"]["msg"] and out["calls"] == []


def test_render_is_for_status_only(tmp_path):
    out = probe(inventory(tmp_path), {**STATUS, "action": "restart"})
    assert out["result"]["failed"] and "render is for action status" in out["result"]["msg"] and out["calls"] == []


def test_one_instance_failing_fails_the_task_and_keeps_every_answer(tmp_path):
    failed = {"failed": True, "msg": "a: not a rendered instance record", "outcome": outcomes.INVALID_CONFIG}
    out = probe(inventory(tmp_path), answers={"a": failed})
    assert out["result"]["failed"] and out["result"]["msg"] == "a: not a rendered instance record"
    assert [r["instance"] for r in out["result"]["instances"]] == ["a", "b"]


def test_an_unreachable_host_is_unreachable_and_asked_once(tmp_path):
    out = probe(inventory(tmp_path), answers={"a": {"unreachable": True, "msg": "ssh: gone"}})
    assert out["result"]["unreachable"] and out["result"]["msg"] == "a: ssh: gone"
    assert len(out["calls"]) == 1, "an unreachable host is not asked again for its other instances"


def test_the_driver_reads_each_instance_of_the_one_task():
    data = {
        "host": HOST,
        "resolved_action": "sglang.deploy.sglang_server",
        "res": {"instances": [{"instance": "a", "outcome": "status", "state": "active"}, {"instance": "b"}]},
    }
    t = Tracker("status")
    t.handle({"event": "runner_on_ok", "event_data": data})
    assert t.hosts[HOST].instances == {"a": {"instance": "a", "outcome": "status", "state": "active"}}
    t = Tracker("status")
    t.handle({"event": "runner_on_ok", "event_data": {**data, "resolved_action": "sglang.deploy.sglang_validate"}})
    assert t.hosts[HOST].instances == {}, "another module's `instances` are not instances' results"


def test_an_instance_with_no_profile_says_where_to_set_one():
    with pytest.raises(render.ConfigError, match=r"sglang_instances\[0\] \(a\) has no profile: set sglang_profile"):
        render.instances([{"name": "a", "port": 1, "gpus": [0]}], {"p": {}}, {}, None, "/m")


def test_the_status_entry_points_arguments_are_checked_in_the_one_call(tmp_path):
    """playbooks/status.yml imports the role without Ansible's validation task: the plugin checks the same spec."""
    book = yaml.safe_load((REPO / "playbooks" / "status.yml").read_text())
    imported = book[0]["tasks"][0]["ansible.builtin.import_role"]
    assert imported["tasks_from"] == "status" and imported["rolespec_validate"] is False
    out = probe(inventory(tmp_path, sglang_profiles="not a dict"))
    assert out["result"]["failed"] and out["calls"] == [], out["result"]
    assert "Validating arguments against arg spec 'status'" in out["result"]["msg"]
    assert "sglang_profiles" in out["result"]["msg"]
    own = inventory(tmp_path)
    del own["sglang_instances"]
    out = probe(own)
    assert out["result"]["failed"] and "sglang_instances" in out["result"]["msg"] and out["calls"] == []


def same_as_the_roles(out: dict) -> str:
    assert not out["result"].get("failed"), out["result"]
    assert [c["instance"] for c in out["calls"]] == out["roles"]
    return out["calls"][0]["instance"]["python"]


def test_patches_are_read_as_the_file_lookup_reads_them(tmp_path):
    """Their bytes as they are: a carriage return kept, bytes not UTF-8 hashed as bytes; hidden files and
    directories not patches."""
    first = same_as_the_roles(probe(inventory(tmp_path)))
    (tmp_path / "series" / "0003-crlf.patch").write_bytes(b"+x\r\n+y\r")
    crlf = same_as_the_roles(probe(inventory(tmp_path)))
    (tmp_path / "series" / "0004-latin1.patch").write_bytes(b"+caf\xe9\n")
    latin = same_as_the_roles(probe(inventory(tmp_path)))
    assert len({first, crlf, latin}) == 3
    (tmp_path / "series" / "0004-Upper.patch").write_bytes(b"+U\n")  # Jinja's sort: case-insensitive
    mixed = same_as_the_roles(probe(inventory(tmp_path)))
    assert mixed != latin
    (tmp_path / "series" / "._0001-a.patch").write_bytes(b"resource fork")
    (tmp_path / "series" / "0005-dir.patch").mkdir()
    assert same_as_the_roles(probe(inventory(tmp_path))) == mixed


def test_a_series_directory_is_found_as_ansible_finds_a_roles_file(tmp_path):
    """Relative: in the sglang role's files/ (the default's own series, named relatively); ~: the home's."""
    default = same_as_the_roles(
        probe(inventory(tmp_path, sglang_patch_series_dir=str(REPO / "roles/sglang/files/patches/0.5.23")))
    )
    assert same_as_the_roles(probe(inventory(tmp_path, sglang_patch_series_dir="files/patches/0.5.23"))) == default
    assert same_as_the_roles(probe(inventory(tmp_path, sglang_patch_series_dir="patches/0.5.23"))) == default
    home = same_as_the_roles(probe(inventory(tmp_path, sglang_patch_series_dir="~/series"), HOME=str(tmp_path)))
    assert home == same_as_the_roles(probe(inventory(tmp_path)))
    assert same_as_the_roles(probe(inventory(tmp_path, sglang_patch_series_dir="nowhere/at/all"))) not in (
        home,
        default,
    )


def test_null_and_wrong_values_mean_what_they_mean_to_the_roles(tmp_path):
    assert same_as_the_roles(probe(inventory(tmp_path, sglang_software=None))) == "/opt/ml-env/bin/python"
    assert same_as_the_roles(probe(inventory(tmp_path, ml_env_generations_dir="/g"))).startswith("/g/")
    for bad in ({"ml_env_requirements": None}, {"sglang_requirements": "sglang==0.5.23"}):
        out = probe(inventory(tmp_path, **bad))
        assert isinstance(out["roles"], str), "the roles refuse it too"
        name = next(iter(bad))
        assert out["result"]["failed"] and name in out["result"]["msg"] and out["calls"] == [], out["result"]
        assert out["result"]["outcome"] == outcomes.INVALID_CONFIG
    out = probe(inventory(tmp_path, sglang_version="{{ nope_undefined }}"))
    assert out["result"]["failed"] and "sglang_version:" in out["result"]["msg"], out["result"]


def test_a_refused_setting_is_the_drivers_exit_3_and_an_instances_outcome_its_own(tmp_path):
    out = probe(inventory(tmp_path, sglang_service_instance_profiles={"a": "nope"}))
    t = Tracker("status")
    t.handle({"event": "runner_on_failed", "event_data": {"host": HOST, "task": "status", "res": out["result"]}})
    assert [f.code for f in t.hosts[HOST].failures] == [exitcodes.INVALID_CONFIG]
    failed = {"failed": True, "msg": "not a rendered instance record", "outcome": outcomes.INVALID_CONFIG}
    out = probe(inventory(tmp_path), answers={"b": failed})
    assert (
        out["result"]["outcome"] == outcomes.INVALID_CONFIG
        and out["result"]["msg"] == "b: not a rendered instance record"
    )


def test_each_instances_answer_without_what_ansible_keeps_for_itself(tmp_path):
    noisy = {
        "outcome": "status",
        "instance": "a",
        "msg": "a: active",
        "invocation": {"module_args": {"instance": {"argv": ["x"]}}},
        "_ansible_no_log": False,
        "warnings": ["w1"],
    }
    out = probe(
        inventory(tmp_path), answers={"a": noisy, "b": {**noisy, "instance": "b", "msg": "", "warnings": ["w1", "w2"]}}
    )
    assert [sorted(r) for r in out["result"]["instances"]] == [["instance", "msg", "outcome"]] * 2
    assert out["result"]["warnings"] == ["w1", "w2"] and out["result"]["instances"][1]["msg"] == "b: no answer"


@pytest.mark.parametrize("lost", [{"unreachable": True, "msg": "ssh: gone"}, {"raise": "ssh: gone"}])
def test_the_instances_asked_before_the_host_went_unreachable_are_kept(tmp_path, lost):
    """The connection lost as a result marked unreachable, or as the ssh plugin's AnsibleConnectionFailure."""
    out = probe(inventory(tmp_path), answers={"b": lost})
    assert out["result"]["unreachable"] and out["result"]["msg"] == "b: ssh: gone"
    t = Tracker("status")
    data = {"host": HOST, "task": "status", "resolved_action": "sglang.deploy.sglang_server", "res": out["result"]}
    t.handle({"event": "runner_on_unreachable", "event_data": data})
    assert list(t.hosts[HOST].instances) == ["a"] and t.hosts[HOST].status == "unreachable"


def test_render_false_as_a_string_is_false(tmp_path):
    out = probe(inventory(tmp_path), {**STATUS, "render": "false", "instance": {"name": "x"}})
    assert [c["instance"] for c in out["calls"]] == [{"name": "x"}] and "instances" not in out["result"]
