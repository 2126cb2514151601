"""The deployed state's digest (sglang_deploy.digest, the sglang_state module and its action plugin; issue #36):
what makes a host current, and every way it stops being so."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import digest
from support import local_play
from support.modules import run_module, shim


def tree(tmp_path):
    """A host's deployed files under tmp_path: a configuration tree, units, a virtualenv behind a link, generations."""
    (tmp_path / "etc" / "sglang" / "pending").mkdir(parents=True)
    (tmp_path / "etc" / "sglang" / "main.env").write_text("A=1\n")
    (tmp_path / "units").mkdir()
    (tmp_path / "units" / "sglang-main.service").write_text("[Service]\n")
    venv = tmp_path / "gens" / "g1"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "mod.py").write_text("x = 1\n")
    (tmp_path / "ml-env").symlink_to(venv)
    (tmp_path / "state" / "known-good").mkdir(parents=True)
    return [
        {"path": str(tmp_path / "etc" / "sglang"), "kind": "tree"},
        {"path": str(tmp_path / "units" / "sglang-*.service"), "kind": "glob"},
        {"path": str(tmp_path / "ml-env"), "kind": "listing"},
        {"path": str(tmp_path / "gens"), "kind": "entries"},
        {"path": str(tmp_path / "missing.conf"), "kind": "file"},
        {"path": str(tmp_path / "state"), "kind": "stat"},
    ]


@pytest.fixture
def recorded(tmp_path):
    paths = tree(tmp_path)
    where = str(tmp_path / "rec" / "deploy-state.json")
    assert digest.record(where, digest.begin(where, "d1"), paths) is True
    return where, paths


def test_a_host_recorded_and_unmoved_is_current_and_its_record_is_roots_alone(recorded):
    where, paths = recorded
    assert digest.check(where, "d1", paths) == (True, [])
    assert digest.check(where, "d1") == (True, [])  # the record's own list
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(where)).st_mode) == 0o700


@pytest.mark.parametrize(
    "move, moved",
    [
        (lambda t: (t / "etc" / "sglang" / "main.env").write_text("A=2\n"), "etc/sglang"),
        (lambda t: (t / "etc" / "sglang" / "pending" / "sglang-main.service").write_text("x"), "etc/sglang"),
        (lambda t: (t / "etc" / "sglang" / "main.env").chmod(0o640), "etc/sglang"),
        (lambda t: (t / "units" / "sglang-other.service").write_text("[Service]\n"), "units/sglang-*.service"),
        (lambda t: (t / "units" / "sglang-main.service").write_text("[Unit]\n"), "units/sglang-*.service"),
        (lambda t: (t / "gens" / "g1" / "lib" / "mod.py").write_text("x = 22\n"), "ml-env"),
        (lambda t: os.utime(t / "gens" / "g1" / "lib" / "mod.py", ns=(1, 1)), "ml-env"),
        (lambda t: (t / "gens" / "g2").mkdir(), "gens"),
        (lambda t: ((t / "ml-env").unlink(), (t / "ml-env").symlink_to(t / "gens")), "ml-env"),
        (lambda t: (t / "missing.conf").write_text("now here\n"), "missing.conf"),
        (lambda t: (t / "etc" / "sglang").chmod(0o777), "etc/sglang"),
        (lambda t: (t / "gens").chmod(0o777), "gens"),
        (lambda t: (t / "state").chmod(0o777), "state"),
    ],
    ids=["content", "a new file", "a mode", "a new glob match", "a match's content", "a listed file's size",
         "a listed file's mtime", "a new entry", "a link's target", "a file that appeared", "a tree's own mode",
         "the entries' directory's own mode", "a stat's mode"],
)  # fmt: skip
def test_anything_moved_since_the_record_makes_the_host_not_current_and_is_named(tmp_path, recorded, move, moved):
    where, paths = recorded
    move(tmp_path)
    current, why = digest.check(where, "d1", paths)
    assert not current
    assert why == [f"{tmp_path}/{moved} changed since the deploy"]


def test_another_desired_state_or_no_record_or_a_broken_one_is_not_current(tmp_path, recorded):
    where, paths = recorded
    assert digest.check(where, "d2", paths) == (
        False,
        ["the desired state changed (the collection's files or the host's variables)"],
    )
    assert digest.forget(where) is True and digest.forget(where) is False
    assert digest.check(where, "d1", paths) == (False, ["no record of a complete deploy"])
    for text in ("{not json", '{"format": 0, "digest": "d1"}', "[]"):
        with open(where, "w") as f:
            f.write(text)
        assert digest.check(where, "d1", paths)[0] is False, text


def test_the_system_state_is_always_part_of_it(tmp_path):
    keys = digest.fingerprint([])
    assert set(keys) == {
        f"{s['kind']}:{os.path.realpath(s['path']) if s['kind'] == 'file' else s['path']}" for s in digest.SYSTEM
    }


def test_a_gpu_lost_or_a_driver_that_stopped_answering_makes_the_host_not_current(tmp_path, recorded, monkeypatch):
    """nvidia-smi's GPUs are part of the state: the deploy's own probe and its refusals run again."""
    where, paths = recorded
    smi = shim(tmp_path / "bin", "nvidia-smi", "printf '0, GPU-a\\n1, GPU-b\\n'\n")
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    digest.write(where, "d1", paths)
    assert digest.check(where, "d1") == (True, [])
    shim(tmp_path / "bin", "nvidia-smi", "printf '0, GPU-a\\n'\n")
    assert digest.check(where, "d1") == (False, ["nvidia-smi changed since the deploy"])
    shim(tmp_path / "bin", "nvidia-smi", "echo 'Failed to initialize NVML: Driver/library version mismatch'; exit 18\n")
    assert digest.check(where, "d1") == (False, ["nvidia-smi changed since the deploy"])


@pytest.mark.parametrize("spec, says", [
    ({"path": "relative/path", "kind": "file"}, "is not absolute"),
    ({"path": "/etc", "kind": "contents"}, "is none of file, tree, listing, entries, stat, glob"),
])  # fmt: skip
def test_a_path_it_cannot_fingerprint_is_refused_by_name(spec, says):
    with pytest.raises(digest.StateError, match=says):
        digest.fingerprint([spec])


def test_the_desired_digest_is_the_deploy_variables_as_written_and_the_files(tmp_path):
    vars1 = {"sglang_profile": "a", "cuda_version": "13.0", "ml_env_path": "/opt/ml-env", "gpu_node_x": [1, {"b": 2}]}
    base = digest.desired(digest.deploy_vars(vars1), "t")
    # Order, other variables, internal facts and one run's own do not count.
    noise = {
        "inventory_hostname": "n1",
        "ansible_host": "10.0.0.1",
        "_sglang_service_instances": [1],
        "sglang_service_cancel_file": "/tmp/x",
        "sglang_deploy_state": True,
    }
    assert digest.desired(digest.deploy_vars({**noise, **dict(reversed(vars1.items()))}), "t") == base
    # Every deploy variable's value does, as do the files.
    for changed in ({"sglang_profile": "b"}, {"gpu_node_x": [1, {"b": 3}]}, {"sglang_new": None}):
        assert digest.desired(digest.deploy_vars({**vars1, **changed}), "t") != base, changed
    assert digest.desired(digest.deploy_vars(vars1), "t2") != base


def test_the_files_digest_reads_every_file_but_caches(tmp_path):
    role = tmp_path / "role"
    (role / "tasks").mkdir(parents=True)
    (role / "tasks" / "main.yml").write_text("---\n")
    base = digest.files_digest([str(role)])
    (role / "__pycache__").mkdir()
    (role / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert digest.files_digest([str(role)]) == base
    (role / "tasks" / "main.yml").write_text("--- \n")
    assert digest.files_digest([str(role)]) != base
    (role / "tasks" / "main.yml").write_text("---\n")
    (role / "tasks" / "more.yml").write_text("---\n")
    assert digest.files_digest([str(role)]) != base


def test_what_a_stat_or_the_walk_cannot_wait_on_or_finds_gone_is_not_a_hang_nor_a_failure(tmp_path, recorded):
    where, paths = recorded
    os.mkfifo(tmp_path / "etc" / "sglang" / "fifo")  # never opened
    os.symlink(tmp_path / "nowhere", tmp_path / "etc" / "sglang" / "dangling")
    assert digest.check(where, "d1")[0] is False
    digest.write(where, "d1", paths)
    assert digest.check(where, "d1") == (True, [])
    assert digest.stat.S_ISDIR(os.lstat(tmp_path / "state").st_mode)  # a stat's contents are not its
    (tmp_path / "state" / "known-good" / "main").mkdir()
    assert digest.check(where, "d1") == (True, [])


def test_state_things_that_change_nothing_a_deploy_leaves_are_not_in_the_digest():
    base = {"sglang_profile": "a"}
    for other in ({"sglang_service_instances_selected": ["x"]}, {"sglang_rollout_max_unavailable": "2"},
                  {"sglang_monitoring_scrape_interval": "5s"}):  # fmt: skip
        assert digest.deploy_vars({**base, **other}) == digest.deploy_vars(base), other


def test_a_run_records_only_the_digest_its_own_check_kept_and_only_the_last_to_begin(tmp_path, recorded):
    where, paths = recorded
    token = digest.begin(where, "d2")
    assert digest.read(where) is None  # the record set aside
    assert digest.record(where, "another", paths) is False and digest.read(where) is None
    assert digest.record(where, token, paths) is True and digest.check(where, "d2") == (True, [])
    assert digest.record(where, token, paths) is False  # kept once
    # A tagged run meanwhile makes the run in flight contended.
    token = digest.begin(where, "d2")
    assert digest.forget(where) is False and digest.record(where, token, paths) is False
    # A run that failed or was stopped left its digest pending: the next run's replaces it and records.
    digest.begin(where, "d3")
    latest = digest.begin(where, "d4")
    assert digest.record(where, latest, paths) is True and digest.check(where, "d4") == (True, [])
    # Two at once: only the last to begin records.
    first, second = digest.begin(where, "d5"), digest.begin(where, "d6")
    assert digest.record(where, first, paths) is False and digest.read(where) is None
    assert digest.record(where, second, paths) is True and digest.check(where, "d6") == (True, [])


def test_the_module_checks_sets_aside_only_outside_check_mode_records_and_never_returns_the_digest(tmp_path, recorded):
    """And a current host the deploy runs every role on all the same (keep_current false) begins a run too."""
    rc, out = run_module("sglang_state", {"action": "check", "digest": "d1", "record": recorded[0], "forget": True,
                                          "keep_current": False}, tmp_path)  # fmt: skip
    assert out["current"] is True and out["check_id"] and not os.path.exists(recorded[0]), out
    rc, out = run_module("sglang_state", {"action": "record", "record": recorded[0], "paths": recorded[1],
                                          "check_id": out["check_id"]}, tmp_path)  # fmt: skip
    assert out["recorded"] is True, out
    where, paths = recorded
    args = {"action": "check", "digest": "d1", "record": where, "forget": True}
    rc, out = run_module("sglang_state", args, tmp_path)
    assert rc == 0 and out["current"] is True and out["changed"] is False and out["forgotten"] is False, out
    assert out["outcome"] == "current" and "check_id" not in out
    rc, out = run_module("sglang_state", {**args, "digest": "d2"}, tmp_path, check_mode=True)
    assert out["current"] is False and out["forgotten"] is False and os.path.exists(where), out
    rc, out = run_module("sglang_state", {**args, "digest": "d2-secret"}, tmp_path)
    assert out["current"] is False and out["forgotten"] is True and not os.path.exists(where), out
    assert out["outcome"] == "drifted" and out["msg"].startswith("drifted: the desired state changed"), out
    assert "d2-secret" not in json.dumps(out)  # not in the result, not in its invocation
    token = out["check_id"]
    record = {"action": "record", "record": where, "paths": paths, "check_id": token}
    rc, out = run_module("sglang_state", record, tmp_path, check_mode=True)
    assert rc == 0 and not os.path.exists(where) and out["recorded"] is False, out
    rc, out = run_module("sglang_state", {**record, "check_id": "another"}, tmp_path)
    assert rc == 0 and out["recorded"] is False and not os.path.exists(where), out
    rc, out = run_module("sglang_state", {**args, "digest": "d2-secret"}, tmp_path)  # that attempt cost the pending
    rc, out = run_module("sglang_state", {**record, "check_id": out["check_id"]}, tmp_path)
    assert rc == 0 and out["changed"] is False and out["recorded"] is True, out
    assert digest.check(where, "d2-secret") == (True, [])
    rc, out = run_module("sglang_state", {**args, "paths": [{"path": "x", "kind": "file"}]}, tmp_path)
    assert rc == 1 and out["failed"] and "'x' is not absolute" in out["msg"] and "outcome" not in out, out
    rc, out = run_module(
        "sglang_state", {**args, "paths": [{"path": "x", "kind": "file"}], "on_error": "warn"}, tmp_path
    )
    assert rc == 0 and out["current"] is False and "'x' is not absolute" in json.dumps(out["warnings"]), out
    assert "check_id" not in out and not os.path.exists(where)  # set aside all the same, nothing to record
    rc, out = run_module("sglang_state", {"action": "record", "record": where}, tmp_path)
    assert rc == 1 and "record needs paths" in out["msg"], out
    digest.write(where, "d1", paths)
    rc, out = run_module("sglang_state", {"action": "forget", "record": where}, tmp_path, check_mode=True)
    assert rc == 0 and out["forgotten"] is False and os.path.exists(where), out
    rc, out = run_module("sglang_state", {"action": "forget", "record": where}, tmp_path)
    assert rc == 0 and out["forgotten"] is True and not os.path.exists(where) and out["changed"] is False, out


PLAY = """
- hosts: n1
  gather_facts: false
  vars: {sglang_play_var: "%(play_var)s"}
  roles: ["%(role)s"]
  tasks:
    - sglang.deploy.sglang_state: {action: check, forget: true, record: "%(out)s.d/deploy-state.json"}
      register: state
    - ansible.builtin.copy: {content: "{{ state | to_json }}", dest: "%(out)s", mode: "0600"}
"""


def test_the_action_plugin_hashes_the_hosts_deploy_variables_as_written_not_the_plays_or_the_roles(tmp_path):
    """The inventory's and -e's values count; the play's and a role's defaults do not (they are the collection's
    files: deploy.yml, with its roles' defaults in scope, and drift.yml, with none, must agree). The digest is read
    where the check keeps it, on the host."""
    inventory = {"hosts": {"n1": {"sglang_profile": "a", "sglang_model_path": "{{ undefined_here }}/m"}}}
    role = tmp_path / "roles" / "own"
    (role / "defaults").mkdir(parents=True)
    (role / "defaults" / "main.yml").write_text("sglang_own_default: 1\n")
    (role / "tasks").mkdir()
    (role / "tasks" / "main.yml").write_text("[]\n")
    pending = tmp_path / "out.json.d" / "deploy-state.json.pending"

    def digest_of(*extra, play_var="x", with_role=True):
        play = PLAY.replace('"%(play_var)s"', f'"{play_var}"').replace(
            '["%(role)s"]', f'["{role}"]' if with_role else "[]"
        )
        result = local_play(tmp_path, inventory, play, *extra)
        assert result["current"] is False and result["why"] == ["no record of a complete deploy"], result
        kept = json.loads(pending.read_text())
        pending.unlink()  # the next run is not a second deploy at once
        return kept["digest"]

    first = digest_of()
    assert first == digest_of()
    assert first == digest_of(play_var="y", with_role=False)
    assert first == digest_of("-e", "sglang_service_cancel_file=/x")
    assert first != digest_of("-e", "sglang_profile=b")
    assert first != digest_of("-e", "cuda_version=12.9")
    # A value is hashed as it resolves with the host's own variables: the same text, another value, another digest.
    inventory["hosts"]["n1"].update(sglang_service_api_key="{{ lab_key }}", lab_key="k1")
    keyed = digest_of()
    inventory["hosts"]["n1"]["lab_key"] = "k2"
    assert keyed != digest_of() and keyed != first
    # Leaf by leaf: a neighbour that names a role's default does not keep the rotated value from counting.
    env = {"TOKEN": "{{ lab_key }}", "HOME": "{{ sglang_own_default }}/hf"}
    inventory["hosts"]["n1"].update(sglang_server_env=env)
    before = digest_of()
    inventory["hosts"]["n1"]["lab_key"] = "k3"
    assert digest_of() != before
