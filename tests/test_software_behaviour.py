"""What pruning and migrating software generations decide, say and leave on disk (issue #31: the behaviours behind
the mutants tests/test_software.py let survive in sglang_deploy/software.py).

plan's decisions are the module's result (sglang_generations prints each kept and removed entry with its reason,
version and date); the references are what keeps a rollback's software from being pruned, whatever the files hold
and however the directory is spelled; a removal is hidden first and finished later; the current generation and the
link are on disk before anything goes; a migrated generation is an ordinary one, its record laid out as the ml_env
role writes one, with the role's modes.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable, software
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.software import migrate, plan, prune

RULE2 = "keep=2: the current one and the newest other"
NOT_VENV = "not a virtualenv (no pyvenv.cfg, no generation.json): left alone"
INCOMPLETE = "incomplete: no sglang-deploy/generation.json (an install that failed or was interrupted)"


def make_generation(gen_dir: Path, name: str, created=None, record: object = "default", venv: bool = True) -> Path:
    """A virtualenv; with a generation.json (a record of `created` and SGLang 0.5.23 by default, else `record`
    as given, text or not), or without one (record=None)."""
    path = gen_dir / name
    (path / "bin").mkdir(parents=True)
    if venv:
        (path / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.11.2\n")
    if record is not None:
        if record == "default":
            record = {"generation": name, "created": created, "sglang_version": "0.5.23"}
        (path / "sglang-deploy").mkdir()
        text = record if isinstance(record, str) else json.dumps(record)
        (path / "sglang-deploy" / "generation.json").write_text(text)
    return path


def dated(path: Path, when: float) -> str:
    """The directory's time set: the date a generation without a recorded one is sorted by."""
    os.utime(path, (when, when))
    return software.stamp(when)


@pytest.fixture
def gens(tmp_path: Path) -> Path:
    d = tmp_path / "ml-env.d"
    d.mkdir()
    return d


def by_name(entries: list[dict]) -> dict[str, str]:
    return {e["name"]: e["reason"] for e in entries}


# ---------------------------------------------------------------- plan: every entry's whole decision


def test_every_entry_of_the_directory_gets_its_whole_decision(gens, tmp_path):
    make_generation(gens, "cur", created="2026-01-05T00:00:00Z")
    make_generation(gens, "linked", created="2025-01-01T00:00:00Z")
    make_generation(gens, "ref", created="2025-01-02T00:00:00Z")
    make_generation(gens, "new", created="2026-01-03T00:00:00Z", record={"created": "2026-01-03T00:00:00Z"})
    make_generation(gens, "old", created="2026-01-02T00:00:00Z")
    undated = make_generation(gens, "undated", record={"created": 20260104, "sglang_version": "0.4.6"})
    listed = make_generation(gens, "listed", record="[]")  # a generation.json that is no record
    failed = make_generation(gens, "failed", record=None)
    hidden = make_generation(gens, ".cache", record=None, venv=False)  # a dot, but no removal of ours
    make_generation(gens, ".x.removing", created="2020-01-01T00:00:00Z")
    stranger = make_generation(gens, "stranger", record=None, venv=False)
    times = {p.name: dated(p, 1.7e9 + i) for i, p in enumerate([undated, listed, failed, hidden, stranger])}
    link = tmp_path / "ml-env"
    link.symlink_to(gens / "linked")
    refs = {"ref": ["/etc/systemd/system/sglang-a.service", "/etc/sglang/pending/sglang-b.service"]}

    decisions = plan(str(gens), "cur", 2, refs, link=str(link))

    def d(name, keep, reason, created, version="0.5.23"):
        return {
            "name": name,
            "path": str(gens / name),
            "keep": keep,
            "reason": reason,
            "created": created,
            "sglang_version": version,
        }

    assert decisions == [
        d(".cache", True, NOT_VENV, times[".cache"], None),
        d(".x.removing", False, "the rest of an interrupted removal", "2020-01-01T00:00:00Z"),
        d("cur", True, "current: the generation just installed", "2026-01-05T00:00:00Z"),
        d("failed", False, INCOMPLETE, times["failed"], None),
        d("linked", True, f"current: {link} points at it", "2025-01-01T00:00:00Z"),
        d("listed", False, INCOMPLETE, times["listed"], None),
        d("new", True, f"newest but the current one ({RULE2})", "2026-01-03T00:00:00Z", None),
        d("old", False, f"older ({RULE2}), referenced by no unit or record", "2026-01-02T00:00:00Z"),
        d("ref", True, f"referenced by {refs['ref'][0]}, {refs['ref'][1]}", "2025-01-02T00:00:00Z"),
        d("stranger", True, NOT_VENV, times["stranger"], None),
        # created as a number is no date: the directory's time (2023-11-14), older than "old"
        d("undated", False, f"older ({RULE2}), referenced by no unit or record", times["undated"], "0.4.6"),
    ]


def test_a_record_that_is_text_not_a_mapping_is_an_incomplete_generation(gens):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    make_generation(gens, "odd", record='"2026-01-01T00:00:00Z"')
    res = prune(str(gens), "cur", keep=2, patterns=[])
    assert by_name(res["removed"]) == {"odd": INCOMPLETE}


def test_a_link_into_another_directory_names_no_generation_of_this_one(gens, tmp_path):
    make_generation(gens, "cur", created="2026-01-02T00:00:00Z")
    make_generation(gens, "old", created="2026-01-01T00:00:00Z")
    elsewhere = tmp_path / "elsewhere"
    make_generation(elsewhere, "old", created="2026-01-01T00:00:00Z")
    link = tmp_path / "ml-env"
    link.symlink_to(elsewhere / "old")  # a generation of the same name, in another directory
    res = prune(str(gens), "cur", keep=1, patterns=[], link=str(link))
    assert by_name(res["removed"]) == {"old": "older (keep=1: the current one only), referenced by no unit or record"}
    assert (elsewhere / "old").exists()


@pytest.mark.parametrize(
    "keep, kept, removed",
    [
        (1, {}, {"g3", "g2", "g1"}),
        (3, {"g3", "g2"}, {"g1"}),
        (4, {"g3", "g2", "g1"}, set()),
    ],
)
def test_the_rule_is_said_as_keep_reads_it(gens, keep, kept, removed):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    for d in range(1, 4):
        make_generation(gens, f"g{d}", created=f"2025-01-0{d}T00:00:00Z")
    rule = {
        1: "keep=1: the current one only",
        3: "keep=3: the current one and the 2 newest others",
        4: "keep=4: the current one and the 3 newest others",
    }[keep]
    res = prune(str(gens), "cur", keep=keep, patterns=[], check_mode=True)
    assert by_name(res["kept"]) == {
        "cur": "current: the generation just installed",
        **{n: f"newest but the current one ({rule})" for n in kept},
    }
    assert by_name(res["removed"]) == {n: f"older ({rule}), referenced by no unit or record" for n in removed}


def test_by_default_the_current_one_and_the_newest_other_are_kept(gens):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    for d in range(1, 4):
        make_generation(gens, f"g{d}", created=f"2025-01-0{d}T00:00:00Z")
    res = prune(str(gens), "cur", patterns=[])
    assert set(by_name(res["kept"])) == {"cur", "g3"}
    assert sorted(os.listdir(gens)) == ["cur", "g3"]


def test_each_entry_prune_returns_says_its_version_and_date(gens):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    make_generation(gens, "old", created="2025-01-01T00:00:00Z", record={"created": "2025-01-01T00:00:00Z"})
    res = prune(str(gens), "cur", keep=1, patterns=[])
    assert res == {
        "changed": True,
        "kept": [
            {
                "name": "cur",
                "path": str(gens / "cur"),
                "reason": "current: the generation just installed",
                "created": "2026-01-01T00:00:00Z",
                "sglang_version": "0.5.23",
            }
        ],
        "removed": [
            {
                "name": "old",
                "path": str(gens / "old"),
                "reason": "older (keep=1: the current one only), referenced by no unit or record",
                "created": "2025-01-01T00:00:00Z",
                "sglang_version": None,
            }
        ],
        "warnings": [],
    }


# ---------------------------------------------------------------- references


@pytest.mark.parametrize("spelled", ["{d}", "{d}/"], ids=["as is", "trailing slash"])
@pytest.mark.parametrize("dirname", ["ml-env.d", "venvs-X"])
def test_every_file_naming_a_generation_keeps_it(tmp_path, spelled, dirname):
    """Whatever the directory is called or however it is spelled; a unit file with bytes that are not UTF-8, a
    directory among the matches and two files naming one generation."""
    gens = tmp_path / dirname
    gens.mkdir()
    for d, name in enumerate(["cur", "unit", "pending", "free"], start=1):
        make_generation(gens, name, created=f"2026-01-0{d}T00:00:00Z")
    units = tmp_path / "system"
    units.mkdir()
    (units / "sglang-a.service").write_bytes(
        b"[Unit]\nDescription=caf\xe9 (Latin-1)\n[Service]\nExecStart=" + str(gens / "unit").encode() + b"/bin/python\n"
    )
    (units / "sglang-b.service").write_text(f"[Service]\nEnvironment=VIRTUAL_ENV={gens}/unit\n")
    pending = tmp_path / "pending"
    (pending / "a.d").mkdir(parents=True)  # sorted before the staged unit
    (pending / "sglang-b.service").write_text(f"ExecStart={gens}/pending/bin/python\n")
    patterns = [str(units / "sglang-*.service"), str(pending / "*")]
    res = prune(spelled.format(d=gens), "cur", keep=1, patterns=patterns)
    kept = by_name(res["kept"])
    assert kept["unit"] == f"referenced by {units}/sglang-a.service, {units}/sglang-b.service"
    assert kept["pending"] == f"referenced by {pending}/sglang-b.service"
    assert set(by_name(res["removed"])) == {"free"}
    assert res["warnings"] == []


def test_unreadable_references_are_all_named_and_the_kept_keep_their_reasons(gens, tmp_path, monkeypatch):
    make_generation(gens, "cur", created="2026-01-02T00:00:00Z")
    make_generation(gens, "prev", created="2026-01-01T00:00:00Z")
    make_generation(gens, "old", created="2020-01-01T00:00:00Z")
    refs = tmp_path / "units"
    refs.mkdir()
    for name in ("sglang-a.service", "sglang-b.service", "sglang-c.service"):
        (refs / name).write_text("x")
    denied = {str(refs / "sglang-a.service"), str(refs / "sglang-b.service")}
    real_open = open

    def deny(path, *args, **kwargs):
        if str(path) in denied:
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(software, "open", deny, raising=False)
    res = prune(str(gens), "cur", keep=2, patterns=[str(refs / "sglang-*.service")])
    assert res["warnings"] == [
        f"nothing pruned: could not read {refs}/sglang-a.service: Permission denied; "
        f"{refs}/sglang-b.service: Permission denied"
    ]
    assert by_name(res["kept"]) == {
        "cur": "current: the generation just installed",
        "prev": f"newest but the current one ({RULE2})",
        "old": "not pruned: references unreadable",
    }
    assert res["removed"] == [] and res["changed"] is False


# ---------------------------------------------------------------- removal


@pytest.fixture
def failing_rmtree(monkeypatch):
    """shutil.rmtree failing (EIO) on the paths named in the returned set, the real one elsewhere."""
    failing: set[str] = set()
    real = shutil.rmtree

    def rmtree(path, *a, **kw):
        if os.path.basename(path) in failing:
            raise OSError(errno.EIO, "Input/output error")
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return failing


def test_a_failed_removal_is_said_and_the_others_still_go(gens, failing_rmtree):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    make_generation(gens, "a", created="2025-01-02T00:00:00Z")
    make_generation(gens, "b", created="2025-01-01T00:00:00Z")
    failing_rmtree.add(".a.removing")
    res = prune(str(gens), "cur", keep=1, patterns=[])
    assert res["warnings"] == [f"could not remove {gens}/a: [Errno 5] Input/output error"]
    assert by_name(res["kept"])["a"] == "removal failed: [Errno 5] Input/output error"
    assert [e["name"] for e in res["removed"]] == ["b"] and res["changed"] is True
    assert sorted(os.listdir(gens)) == [".a.removing", "cur"]


@pytest.mark.parametrize("name", ["0123456789abcdef", ".by-hand", "v1.removing"])
def test_whatever_its_name_a_generation_being_removed_is_hidden_and_never_renamed_again(gens, failing_rmtree, name):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    make_generation(gens, name, created="2025-01-01T00:00:00Z")
    hidden = f".{name}.removing"
    failing_rmtree.add(hidden)
    assert prune(str(gens), "cur", keep=1, patterns=[])["removed"] == []
    assert sorted(os.listdir(gens)) == sorted([hidden, "cur"])
    # Finishing it fails too: the same hidden name is left, said to be what it is.
    res = prune(str(gens), "cur", keep=1, patterns=[])
    assert sorted(os.listdir(gens)) == sorted([hidden, "cur"])
    assert by_name(res["kept"])[hidden] == "removal failed: [Errno 5] Input/output error"
    failing_rmtree.clear()
    res = prune(str(gens), "cur", keep=1, patterns=[])
    assert by_name(res["removed"]) == {hidden: "the rest of an interrupted removal"}
    assert os.listdir(gens) == ["cur"]


@pytest.fixture
def synced(monkeypatch) -> list[tuple[str, str]]:
    """Each fsync of a directory, rename and tree removal software makes, in order (each done for real)."""
    log: list[tuple[str, str]] = []
    real_fsync, real_rename, real_rmtree = durable.fsync_dir, durable.rename, durable.rmtree

    def fsync_dir(path):
        real_fsync(path)
        log.append(("fsync", path))

    def rename(src, dst):
        log.append(("rename", src))
        real_rename(src, dst)

    def rmtree(path):
        log.append(("rmtree", path))
        real_rmtree(path)

    monkeypatch.setattr(durable, "fsync_dir", fsync_dir)
    monkeypatch.setattr(durable, "rename", rename)
    monkeypatch.setattr(durable, "rmtree", rmtree)
    return log


def test_the_current_generation_and_the_link_are_on_disk_before_anything_is_removed(gens, tmp_path, synced):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    make_generation(gens, "old", created="2025-01-01T00:00:00Z")
    links = tmp_path / "opt"
    links.mkdir()
    (links / "ml-env").symlink_to(gens / "cur")
    prune(str(gens), "cur", keep=1, patterns=[], link=str(links / "ml-env"))
    first = next(i for i, (op, _) in enumerate(synced) if op != "fsync")
    assert synced[first] == ("rename", str(gens / "old"))
    assert {p for _, p in synced[:first]} == {
        str(gens / "cur" / "sglang-deploy"),
        str(gens / "cur"),
        str(gens),
        str(links),
    }


def test_a_prune_that_removes_nothing_or_only_reports_touches_nothing(gens, tmp_path, synced):
    make_generation(gens, "cur", created="2026-01-01T00:00:00Z")
    make_generation(gens, "prev", created="2025-01-01T00:00:00Z")
    link = str(tmp_path / "ml-env")
    assert prune(str(gens), "cur", keep=2, patterns=[], link=link)["changed"] is False
    assert synced == []
    res = prune(str(gens), "cur", keep=1, patterns=[], link=link, check_mode=True)
    assert [e["name"] for e in res["removed"]] == ["prev"]
    assert synced == []
    assert sorted(os.listdir(gens)) == ["cur", "prev"]


# ---------------------------------------------------------------- migration


@pytest.fixture
def group_umask():
    """A umask that lets a group write: a directory made without its own mode would be 0775, a file 0664."""
    old = os.umask(0o002)
    yield
    os.umask(old)


def old_venv(path: Path, cfg: str = "home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n"):
    (path / "lib" / "python3.11" / "site-packages" / "sglang-0.5.23.dist-info").mkdir(parents=True)
    (path / "pyvenv.cfg").write_text(cfg)
    (path / "bin").mkdir()
    (path / "bin" / "python").write_text("")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


NOW = 1767225600  # 2026-01-01T00:00:00Z
LEGACY = "legacy-20260101T000000Z"


def test_nothing_to_migrate_is_said_whole(tmp_path, gens):
    absent = tmp_path / "absent"
    assert migrate(str(absent), str(gens)) == {
        "changed": False,
        "generation": None,
        "msg": f"{absent} is a link or absent: nothing to migrate",
    }
    link = tmp_path / "ml-env"
    link.symlink_to(gens)
    assert migrate(str(link), str(gens)) == {
        "changed": False,
        "generation": None,
        "msg": f"{link} is a link or absent: nothing to migrate",
    }


def test_a_migration_says_what_it_moves_in_check_mode_and_for_real(tmp_path, gens):
    link = tmp_path / "ml-env"
    old_venv(link)
    said = {
        "changed": True,
        "generation": LEGACY,
        "msg": f"moved the virtualenv {link} to {gens}/{LEGACY} and linked {link} to it",
    }
    assert migrate(str(link), str(gens), check_mode=True, now=NOW) == said
    assert link.is_dir() and not link.is_symlink() and os.listdir(gens) == []
    assert migrate(str(link), str(gens), now=NOW) == said
    assert os.readlink(link) == str(gens / LEGACY)


def test_the_migrated_record_is_the_one_the_role_writes_with_the_roles_modes(tmp_path, group_umask):
    """roles/ml_env/tasks/activate.yml: the directory 0755, generation.json 0644 as to_nice_json(indent=2,
    sort_keys=true): one layout whichever wrote it (a diff shows what differs). The generations directory is made
    0755 too."""
    from ansible.plugins.filter.core import to_nice_json

    gens = tmp_path / "ml-env.d"
    link = tmp_path / "ml-env"
    old_venv(link)
    migrate(str(link), str(gens), now=NOW)
    record = gens / LEGACY / "sglang-deploy" / "generation.json"
    text = record.read_text()
    assert text == to_nice_json(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert list(json.loads(text)) == sorted(json.loads(text))
    assert (mode(gens), mode(gens / LEGACY / "sglang-deploy"), mode(record)) == (0o755, 0o755, 0o644)


def test_an_old_manifest_of_any_name_becomes_the_generations_patches_json(tmp_path, gens):
    link = tmp_path / "ml-env"
    old_venv(link)
    manifest = tmp_path / "srv" / "sglang-patches.json"  # sglang_patch_manifest set by the inventory
    manifest.parent.mkdir()
    manifest.write_text('{"series": []}')
    migrate(str(link), str(gens), str(manifest), now=NOW)
    assert sorted(os.listdir(gens / LEGACY / "sglang-deploy")) == ["generation.json", "patches.json"]
    assert (gens / LEGACY / "sglang-deploy" / "patches.json").read_text() == '{"series": []}'
    assert software.manifest_path(str(gens / LEGACY)) == str(gens / LEGACY / "sglang-deploy" / "patches.json")


def test_a_virtualenv_that_already_has_a_sglang_deploy_directory_migrates(tmp_path, gens):
    link = tmp_path / "ml-env"
    old_venv(link)
    (link / "sglang-deploy").mkdir()
    (link / "sglang-deploy" / "patches.json").write_text("{}")  # the manifest the old layout kept in it
    assert migrate(str(link), str(gens), now=NOW)["changed"] is True
    assert json.loads((gens / LEGACY / "sglang-deploy" / "generation.json").read_text())["generation"] == LEGACY
    assert (gens / LEGACY / "sglang-deploy" / "patches.json").read_text() == "{}"


def test_uvs_virtualenv_says_its_python_as_version_info(tmp_path, gens):
    link = tmp_path / "ml-env"
    old_venv(link, cfg="home = /usr/bin\nimplementation = CPython\nuv = 0.4.30\nversion_info = 3.12.7\n")
    migrate(str(link), str(gens), now=NOW)
    record = json.loads((gens / LEGACY / "sglang-deploy" / "generation.json").read_text())
    assert record["python_version"] == "3.12"


def test_the_name_and_the_created_time_are_one_reading_of_the_clock(tmp_path, gens, monkeypatch):
    ticks = iter(range(NOW, NOW + 100))
    monkeypatch.setattr(software.time, "time", lambda: float(next(ticks)))  # a second on at every reading
    link = tmp_path / "ml-env"
    old_venv(link)
    assert migrate(str(link), str(gens))["generation"] == LEGACY
    record = json.loads((gens / LEGACY / "sglang-deploy" / "generation.json").read_text())
    assert record["created"] == "2026-01-01T00:00:00Z"


def test_a_migration_that_cannot_happen_says_why_and_changes_nothing(tmp_path, gens, monkeypatch):
    link = tmp_path / "ml-env"
    old_venv(link)
    (gens / LEGACY).mkdir()
    with pytest.raises(software.SoftwareError) as exc:
        migrate(str(link), str(gens), now=NOW)
    assert str(exc.value) == f"{gens}/{LEGACY} exists already: nothing was changed"
    (gens / LEGACY).rmdir()

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(durable, "rename", cross_device)
    with pytest.raises(software.SoftwareError) as exc:
        migrate(str(link), str(gens), now=NOW)
    assert str(exc.value) == (
        f"cannot move {link} to {gens}/{LEGACY} ([Errno 18] Invalid cross-device link): nothing was changed; "
        "both must be on one file system"
    )
    assert isinstance(exc.value.__cause__, OSError)
    assert link.is_dir() and not link.is_symlink() and os.listdir(gens) == []
