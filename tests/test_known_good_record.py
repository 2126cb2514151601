"""What a known-good generation holds on disk, and what the store reads back (issue #31: the behaviours behind
the mutants the unit suite let survive in sglang_deploy/known_good.py).

A generation is read back by a rollback, by the boot guard and by `driver history`/`status`: its fields, its file
and directory modes (it names the configuration, and is root's alone), its name (sequence, UTC time, hash) and the
summary the module returns are each a contract, so each is checked here as written.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import known_good
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good import Store
from support.modules import instance_record

UNIT = "sglang-m.service"
ARGV = ["/opt/venv-a/bin/python", "-m", "sglang.launch_server", "--api-key", "k-SECRET", "--port", "30000"]


@pytest.fixture
def inst(tmp_path) -> Instance:
    venv_meta = tmp_path / "opt" / "venv-a" / "sglang-deploy"
    venv_meta.mkdir(parents=True)
    (venv_meta / "generation.json").write_text(json.dumps({"generation": "sw-7", "sglang_version": "0.5.23"}))
    (venv_meta / "patches.json").write_text("[]")
    argv = [str(tmp_path / "opt" / "venv-a" / "bin" / "python"), *ARGV[1:]]
    inst = Instance.from_params(
        instance_record(tmp_path, argv=argv, profile="eagle3", state_dir=str(tmp_path / "state"))
    )
    for path, text in ((inst.unit_path, "[Service]\nExecStart=/opt/venv-a/bin/python\n"), (inst.env_path, "A=1\n")):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return inst


VERIFY = {
    "tokens_per_s": 812.5,
    "accept_length": 2.75,
    "checks": [{"name": "generate", "ok": True, "severity": "fail", "detail": "16 tokens"}],
}


@pytest.fixture
def not_utc(monkeypatch):
    """A host whose local time is not UTC (the record's times are UTC all the same); put back after."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_a_generation_holds_what_started_its_software_and_its_checks_root_only(inst, not_utc):
    store = Store(inst)
    before = time.time()
    said = store.record(store.snapshot(), inst.argv, VERIFY)
    [path] = store.records()
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    assert record == {
        "instance": "m",
        "unit": UNIT,
        "profile": "eagle3",
        "argv": [*inst.argv[:4], "<secret>", *inst.argv[5:]],  # the API key masked
        "files": {inst.unit_path: "[Service]\nExecStart=/opt/venv-a/bin/python\n", inst.env_path: "A=1\n"},
        "config_hash": store.snapshot()["config_hash"],
        "argv_hash": known_good.argv_hash(inst.argv),
        "software": {
            "venv": str(Path(inst.argv[0]).parent.parent),
            "generation": "sw-7",
            "sglang_version": "0.5.23",
            "patch_manifest_sha256": hashlib.sha256(b"[]").hexdigest(),  # patches.json's bytes
        },
        "recorded_at": record["recorded_at"],
        "tokens_per_s": 812.5,
        "accept_length": 2.75,
        "checks": [{"name": "generate", "ok": True, "severity": "fail"}],  # the detail is not kept
        "generation": record["generation"],
    }
    # recorded_at is the UTC time of the record; the generation's name is sequence-time-hash, the same time.
    at = time.strptime(record["recorded_at"], "%Y-%m-%dT%H:%M:%SZ")
    assert before - 1 <= calendar.timegm(at) <= time.time() + 1
    assert re.fullmatch(r"000001-\d{8}T\d{6}Z-[0-9a-f]{16}", record["generation"])
    assert record["generation"].split("-")[1] == time.strftime("%Y%m%dT%H%M%SZ", at)
    assert record["generation"].endswith(record["config_hash"]) and Path(path).name == record["generation"] + ".json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(inst.kg_dir).st_mode) == 0o700
    assert Path(path).read_text().startswith('{\n "accept_length"')  # indented, keys sorted: diffable by hand
    assert said == known_good.summary(record)


def test_the_summary_names_the_generation_its_configuration_and_its_software(inst):
    store = Store(inst)
    said = store.record(store.snapshot(), inst.argv, {})
    record = store.latest()
    assert said == {
        "generation": record["generation"],
        "config_hash": record["config_hash"],
        "profile": "eagle3",
        "recorded_at": record["recorded_at"],
        "software": {
            "generation": "sw-7",
            "sglang_version": "0.5.23",
            "lock_sha256": None,
            "patch_series_sha256": None,
            "patch_manifest_sha256": record["software"]["patch_manifest_sha256"],
            "venv": record["software"]["venv"],
        },
    }


def test_five_generations_are_kept_unless_told_otherwise(inst):
    store = Store(inst)
    for _ in range(6):
        store.record(store.snapshot(), inst.argv, {})
    assert [Path(p).name[:6] for p in store.records()] == [f"{n:06d}" for n in range(2, 7)]


def test_the_numbers_continue_after_pruning_and_a_prune_says_what_it_removed(inst):
    store = Store(inst, keep=2)
    for _ in range(3):
        store.record(store.snapshot(), inst.argv, {})
    assert [Path(p).name[:6] for p in store.records()] == ["000002", "000003"]  # 000001 pruned, never reused
    assert store.next_sequence() == 4
    first = store.records()[0]
    assert Store(inst, keep=1).prune() == [first] and not Path(first).exists()
    assert Store(inst, keep=1).prune() == []


def test_a_generation_that_is_not_a_whole_record_is_skipped_for_the_one_before(inst):
    store = Store(inst)
    store.record(store.snapshot(), inst.argv, {})
    good = store.latest()["generation"]
    ok = json.loads(Path(store.records()[0]).read_text())
    damaged = [
        '["argv", "files", "profile", "config_hash"]',  # not a record
        '{"argv": [], "files": {}}',  # fields missing
        '{"argv": []}',
        "{",  # cut short
        json.dumps({**ok, "files": ["x"]}),  # files not path -> text
        json.dumps({**ok, "files": {"/a": 7}}),
        json.dumps({**ok, "files": {}}),
        json.dumps({**ok, "config_hash": "0" * 16}),  # files edited by hand: the hash is not theirs
        json.dumps({**ok, "argv": "python"}),
    ]
    for n, body in enumerate(damaged, 2):
        Path(store.dir, f"{n:06d}-x.json").write_text(body)
        assert store.latest()["generation"] == good, body  # a list, a record lacking a field, cut short: skipped
    assert [r["generation"] for r in known_good.newest_first(store.dir)] == [good]


def test_a_restore_makes_the_directories_a_file_lives_in_0755(inst, tmp_path):
    store = Store(inst)
    store.record(store.snapshot(), inst.argv, {})
    record = store.latest()
    moved = str(tmp_path / "new" / "systemd" / UNIT)  # a unit directory that is not there yet
    record["files"] = {moved: record["files"][inst.unit_path]}
    old = os.umask(0o002)  # a umask that lets a group write: the directory is not made group-writable
    try:
        out = store.restore(record)
    finally:
        os.umask(old)
    assert Path(moved).read_text() == record["files"][moved]
    assert stat.S_IMODE(os.stat(Path(moved).parent).st_mode) == 0o755  # read by all, written by root alone
    assert out == {"generation": record["generation"], "failed_kept_in": str(Path(inst.kg_dir, known_good.FAILED_DIR))}


def test_the_hashes_a_generation_stores_are_the_same_in_every_release():
    """Generations written by one release are compared by the next (a rollback's drift check, the boot guard, an
    operator diffing two records): the hashes are a stored format, pinned here by value."""
    files = {"/etc/systemd/system/sglang-m.service": "[Service]\n", "/etc/sglang/m.env": "A=1\n"}
    joined = b"/etc/sglang/m.env\0A=1\n\0/etc/systemd/system/sglang-m.service\0[Service]\n\0"  # sorted by path
    assert known_good.content_hash(files) == hashlib.sha256(joined).hexdigest()[:16]
    argv = ["/v/bin/python", "-m", "sglang.launch_server", "--api-key", "k"]
    masked = "/v/bin/python\0-m\0sglang.launch_server\0--api-key\0<secret>"
    assert known_good.argv_hash(argv) == hashlib.sha256(masked.encode()).hexdigest()[:16]


def test_a_record_with_exactly_the_fields_a_rollback_needs_is_read(inst):
    store = Store(inst)
    Path(store.dir).mkdir(parents=True)
    files = {"/etc/m.env": "A=1\n"}
    minimal = {"argv": ["python"], "files": files, "profile": "p", "config_hash": known_good.content_hash(files)}
    Path(store.dir, "000001-x.json").write_text(json.dumps(minimal))
    assert store.latest() == {**minimal, "path": str(Path(store.dir, "000001-x.json"))}
