"""Every rename or removal that matters is followed by an fsync of its directory (issue #30).

A rename changes the directory, not the file: until the directory is fsync'd, a power loss may bring the old
name back. An os-level fake records, in order, each rename, unlink, new file and fsync (by the path the fsync'd
descriptor was opened on); each operation below must be followed by an fsync of the directory it changed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import (
    durable,
    job,
    known_good,
    software,
    stage,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from driver import evidence as run_evidence
from driver.ledger import Ledger


class Recorder:
    def __init__(self, monkeypatch):
        self.log: list[tuple[str, str]] = []
        self.fds: dict[int, str] = {}
        real_open, real_fsync, real_replace, real_rename = os.open, os.fsync, os.replace, os.rename
        real_unlink, real_rmdir = os.unlink, os.rmdir

        def open_(path, flags, *a, **kw):
            fd = real_open(path, flags, *a, **kw)
            self.fds[fd] = os.path.abspath(os.fspath(path))
            if flags & os.O_CREAT:
                self.log.append(("create", os.path.abspath(os.fspath(path))))
            return fd

        def fsync(fd):
            real_fsync(fd)
            self.log.append(("fsync", self.fds.get(fd, f"fd {fd}")))

        def replace(src, dst, *a, **kw):
            real_replace(src, dst, *a, **kw)
            self.log.append(("rename", os.path.abspath(os.fspath(src)) + "\0" + os.path.abspath(os.fspath(dst))))

        def rename(src, dst, *a, **kw):
            real_rename(src, dst, *a, **kw)
            self.log.append(("rename", os.path.abspath(os.fspath(src)) + "\0" + os.path.abspath(os.fspath(dst))))

        def unlink(path, *a, **kw):
            real_unlink(path, *a, **kw)
            if kw.get("dir_fd") is None:  # shutil.rmtree's, inside the tree it removes: no directory kept
                self.log.append(("unlink", os.path.abspath(os.fspath(path))))

        def rmdir(path, *a, **kw):
            real_rmdir(path, *a, **kw)
            if kw.get("dir_fd") is None:
                self.log.append(("rmdir", os.path.abspath(os.fspath(path))))

        fakes = {"open": open_, "fsync": fsync, "replace": replace, "rename": rename, "unlink": unlink, "rmdir": rmdir}
        for name, fake in fakes.items():
            monkeypatch.setattr(os, name, fake)

    def unsynced(self, ops=("rename", "unlink", "rmdir"), under: Path | None = None) -> list[str]:
        """Each directory an operation changed with no fsync of it after that operation."""
        missing = []
        for i, (op, path) in enumerate(self.log):
            if op not in ops:
                continue
            dirs = {os.path.dirname(p) for p in path.split("\0")}
            synced = {p for o, p in self.log[i + 1 :] if o == "fsync"}
            for d in sorted(dirs - synced):
                if under is None or d.startswith(str(under)):
                    missing.append(f"{op} {path.replace(chr(0), ' -> ')}: {d} never fsync'd after it")
        return missing

    def renamed_into(self, directory: Path) -> list[str]:
        return [p for op, p in self.log if op == "rename" and os.path.dirname(p.split("\0")[1]) == str(directory)]


@pytest.fixture
def rec(monkeypatch) -> Recorder:
    return Recorder(monkeypatch)


def make_inst(tmp_path: Path) -> Instance:
    inst = Instance(
        name="m",
        unit="sglang-m.service",
        unit_path=str(tmp_path / "systemd" / "sglang-m.service"),
        env_path=str(tmp_path / "etc" / "m.env"),
        secrets_path=str(tmp_path / "etc" / "secrets" / "m.env"),
        pending_dir=str(tmp_path / "etc" / "pending"),
        port=30000,
        gpus=[0],
        argv=["/venv/bin/python", "-m", "sglang.launch_server"],
        profile="good",
        state_dir=str(tmp_path / "state"),
    )
    for path, text in ((inst.unit_path, "[Service]\n"), (inst.env_path, 'A="1"\n')):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return inst


def test_the_helper_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, rec):
    durable.write_atomic(str(tmp_path / "f"), "x", 0o640)
    tmp = durable.tmp_path(str(tmp_path / "f"))
    assert [e for e in rec.log if e[0] != "create"] == [
        ("fsync", tmp),
        ("rename", f"{tmp}\0{tmp_path / 'f'}"),
        ("fsync", str(tmp_path)),
    ]
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o640
    (tmp_path / "a").mkdir()
    durable.rename(str(tmp_path / "f"), str(tmp_path / "a" / "f"))  # across directories: both fsync'd
    durable.unlink(str(tmp_path / "a" / "f"))
    assert rec.unsynced() == []


def test_a_known_good_record_and_its_pruning_survive_a_crash(tmp_path, rec):
    inst = make_inst(tmp_path)
    store = known_good.Store(inst, keep=1)
    store.record(store.snapshot(), inst.argv, {})
    store.record(store.snapshot(), inst.argv, {})  # prunes the first
    assert rec.renamed_into(Path(store.dir)), rec.log
    assert any(op == "unlink" and p.startswith(store.dir) for op, p in rec.log)
    assert rec.unsynced() == []


def test_a_promoted_configuration_survives_a_crash(tmp_path, rec):
    inst = make_inst(tmp_path)
    Path(inst.pending_dir).mkdir(parents=True)
    rendered = {inst.unit_path: "[Service]\nExecStart=/new\n", inst.env_path: 'A="2"\n'}
    for live, text in rendered.items():
        Path(inst.pending_path(live)).write_text(text)
    manifest = {inst.pending_path(p): stage.digest(c) for p, c in rendered.items()}
    Path(stage.manifest_path(inst)).write_text(json.dumps(manifest))
    assert stage.promote(inst, reload=lambda: None)["promoted"]
    assert Path(inst.unit_path).read_text() == rendered[inst.unit_path]
    assert rec.renamed_into(Path(inst.unit_path).parent) and rec.renamed_into(Path(inst.env_path).parent)
    assert rec.unsynced() == []


def test_a_staged_configuration_and_the_secrets_survive_a_crash(tmp_path, rec, monkeypatch):
    inst = make_inst(tmp_path)
    monkeypatch.setattr(stage, "verify_unit", lambda path, unit: None)
    monkeypatch.setattr(stage, "checked", lambda *a: None)
    stage.stage(inst, {inst.unit_path: "[Service]\nExecStart=/x\n", inst.env_path: 'A="3"\n'}, 'K="s"\n')
    assert rec.renamed_into(Path(inst.secrets_path).parent)
    assert rec.unsynced() == []


def test_a_job_result_survives_a_crash(tmp_path, rec):
    j = job.new("m", str(tmp_path / "jobs"))
    job.write_json(j.result, {"ok": True})
    assert rec.renamed_into(Path(j.dir))
    assert rec.unsynced() == []


def test_software_generations_migrate_and_remove_survive_a_crash(tmp_path, rec):
    link, gen_dir = tmp_path / "ml-env", tmp_path / "ml-env.d"
    (link / "bin").mkdir(parents=True)
    (link / "pyvenv.cfg").write_text("version = 3.11.9\n")
    name = software.migrate(str(link), str(gen_dir))["generation"]
    assert rec.renamed_into(gen_dir) and rec.renamed_into(tmp_path)  # the venv moved in, the link replaced
    assert Path(software.record_path(str(gen_dir / name))).exists()
    old = gen_dir / "0123456789abcdef"
    old.mkdir()
    software.remove(str(old))
    assert not old.exists()
    assert ("rmdir", str(gen_dir / ".0123456789abcdef.removing")) in rec.log
    assert rec.unsynced() == []


def test_pruning_settles_the_link_and_the_current_record_before_removing(tmp_path, rec):
    gen_dir, link = tmp_path / "d", tmp_path / "ml-env"
    for name in ("cur", "old"):
        (gen_dir / name / software.META_DIR).mkdir(parents=True)
        (gen_dir / name / "pyvenv.cfg").write_text("")
    Path(software.record_path(str(gen_dir / "cur"))).write_text(json.dumps({"created": "2030-01-01T00:00:00Z"}))
    os.symlink(gen_dir / "cur", link)
    rec.log.clear()
    res = software.prune(str(gen_dir), "cur", keep=1, patterns=(), link=str(link))
    assert [d["name"] for d in res["removed"]] == ["old"]
    first_removal = next(i for i, (op, _) in enumerate(rec.log) if op == "rename")
    synced_before = {p for op, p in rec.log[:first_removal] if op == "fsync"}
    assert {str(tmp_path), str(gen_dir / "cur" / software.META_DIR)} <= synced_before
    assert rec.unsynced() == []


def test_the_ledger_its_run_directories_and_evidence_survive_a_crash(tmp_path, rec):
    home = tmp_path / "state"
    home.mkdir()
    ledger = Ledger(home / "ledger.sqlite3")
    creations = [p for op, p in rec.log if op == "create" and p == str(home / "ledger.sqlite3")]
    assert creations, rec.log
    i = rec.log.index(("create", creations[0]))
    assert ("fsync", str(home)) in rec.log[i + 1 :], "the new ledger's name is never fsync'd"
    run_id = ledger.start("deploy", [], None, None)
    run_dir = ledger.events_dir(run_id)
    assert ("fsync", str(run_dir.parent)) in rec.log
    (run_evidence.directory(run_dir) / "h").mkdir(parents=True)
    (run_evidence.directory(run_dir) / "h" / "bundle.tar.gz").write_bytes(b"x")
    out = run_evidence.package(run_dir, run_id)
    assert out is not None and rec.renamed_into(run_dir)
    assert rec.unsynced(ops=("rename",), under=tmp_path) == []  # the staging directory removed after: no matter
    ledger.close()
