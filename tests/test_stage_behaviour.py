"""What staging a configuration leaves on disk and says (issue #31: the behaviours behind the mutants the unit suite
let survive in sglang_deploy/stage.py).

The module's result is read by the deploy playbook (changed, outcome, pending, wrote) and by the operator (detail);
the files' and directories' modes are the host's contract (a unit systemd reads, an environment and a pending set
that are root's alone); the pending set is complete only with its manifest, which a restart refuses without.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, stage
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import Instance
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.known_good import Store, content_hash
from support.modules import instance_record

UNIT = "sglang-m.service"
GOOD_UNIT = "[Unit]\nDescription=m\n[Service]\nExecStart=/opt/venv/bin/python -m sglang.launch_server --port 30000\n"
NEW_UNIT = GOOD_UNIT.replace("30000", "30001")


@pytest.fixture
def inst(tmp_path) -> Instance:
    return Instance.from_params(instance_record(tmp_path, state_dir=str(tmp_path / "state")))


pytestmark = pytest.mark.usefixtures("usual_umask")


@pytest.fixture
def verified(monkeypatch):
    """systemd-analyze replaced by a recorder (its own test is below); daemon-reload recorded."""
    seen: dict = {"verified": [], "reloads": []}

    def verify(path, unit):
        seen["verified"].append((path, unit, Path(path).read_text(), stat.S_IMODE(os.stat(path).st_mode)))

    monkeypatch.setattr(stage, "verify_unit", verify)
    monkeypatch.setattr(stage, "checked", lambda *a: seen["reloads"].append(a))
    return seen


def rendered(inst: Instance, unit: str = GOOD_UNIT, env: str = "A=1\n") -> dict[str, str]:
    return {inst.unit_path: unit, inst.env_path: env}


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def record_good(inst: Instance) -> None:
    """A restart verified what is live: from now on a deploy stages."""
    store = Store(inst)
    store.record(store.snapshot(), ["/opt/venv/bin/python"], {})


def test_the_first_configuration_is_written_live_with_its_modes_and_the_whole_result(inst, verified):
    res = stage.stage(inst, rendered(inst), None)
    assert res == {
        "instance": "m",
        "changed": True,
        "pending": False,
        "wrote": sorted([inst.env_path, inst.unit_path]),
        "config_hash": content_hash(rendered(inst)),
        "outcome": outcomes.STAGED,
        "first": True,
        "detail": "written as the unit's: no configuration of it was ever verified, so none to protect",
    }
    assert mode(inst.unit_path) == 0o644 and mode(inst.env_path) == 0o600  # systemd reads the unit; env is root's
    assert mode(os.path.dirname(inst.unit_path)) == 0o755
    assert verified["reloads"] == [("daemon-reload",)]  # systemd loads what it will start
    # The unit alone is verified, as the file it becomes: its text, beside it, then gone.
    ((probe, unit, text, _),) = verified["verified"]
    assert (os.path.dirname(probe), os.path.basename(probe), unit, text) == (
        os.path.dirname(inst.unit_path),
        f".{UNIT}.verify",
        UNIT,
        GOOD_UNIT,
    )
    assert not os.path.exists(probe) and not os.path.exists(inst.pending_dir)


def test_once_verified_a_new_configuration_is_staged_complete_and_root_only(inst, verified):
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    res = stage.stage(inst, rendered(inst, NEW_UNIT), None)
    pending = sorted(inst.pending_path(p) for p in rendered(inst))
    assert res == {
        "instance": "m",
        "changed": True,
        "pending": True,
        "wrote": pending,
        "config_hash": content_hash(rendered(inst, NEW_UNIT)),
        "outcome": outcomes.STAGED,
        "detail": "pending: the safe restart promotes it; until then a crash or a boot starts the verified one",
    }
    assert Path(inst.unit_path).read_text() == GOOD_UNIT  # the live unit is still the verified one
    assert Path(inst.pending_path(inst.unit_path)).read_text() == NEW_UNIT
    assert mode(inst.pending_dir) == 0o700 and mode(inst.pending_path(inst.unit_path)) == 0o644
    assert mode(inst.pending_path(inst.env_path)) == 0o600
    manifest = stage.manifest_path(inst)
    assert manifest == os.path.join(inst.pending_dir, "m.staged")  # beside the set it completes
    assert mode(manifest) == 0o600 and stage.stage_complete(inst)
    assert json.loads(Path(manifest).read_text()) == {
        inst.pending_path(p): stage.digest(c) for p, c in rendered(inst, NEW_UNIT).items()
    }
    assert verified["reloads"] == [("daemon-reload",)]  # only the first, live write reloads
    assert verified["verified"][-1][2] == NEW_UNIT


def test_staging_the_same_again_writes_nothing_and_is_not_a_change(inst, verified):
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    stage.stage(inst, rendered(inst, NEW_UNIT), None)
    before = {p: os.stat(inst.pending_path(p)).st_ino for p in rendered(inst)}
    again = stage.stage(inst, rendered(inst, NEW_UNIT), None)
    assert again["changed"] is False and again["wrote"] == [] and again["outcome"] == outcomes.STAGED
    assert {p: os.stat(inst.pending_path(p)).st_ino for p in rendered(inst)} == before  # not rewritten


def test_only_the_pending_file_that_differs_is_rewritten(inst, verified):
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    stage.stage(inst, rendered(inst, NEW_UNIT), None)
    env_inode = os.stat(inst.pending_path(inst.env_path)).st_ino
    res = stage.stage(inst, rendered(inst, NEW_UNIT, "A=2\n"), None)
    assert res["changed"] is True and res["wrote"] == [inst.pending_path(inst.env_path)]
    assert os.stat(inst.pending_path(inst.env_path)).st_ino != env_inode  # written anew, atomically
    assert len(verified["verified"]) == 2  # the unit, unchanged, not verified again
    assert stage.stage_complete(inst)


def test_a_pending_set_without_its_manifest_is_written_whole_again(inst, verified):
    """A deploy interrupted after its files but before the manifest: the files equal the rendered ones, the set
    is incomplete, and a restart would refuse it. Staging again completes it."""
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    stage.stage(inst, rendered(inst, NEW_UNIT), None)
    os.unlink(stage.manifest_path(inst))
    assert not stage.stage_complete(inst)
    res = stage.stage(inst, rendered(inst, NEW_UNIT), None)
    assert res["changed"] is True and res["wrote"] == sorted(inst.pending_path(p) for p in rendered(inst))
    assert stage.stage_complete(inst)


def test_a_configuration_equal_to_the_live_one_removes_a_stale_pending_set(inst, verified):
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    stage.stage(inst, rendered(inst, NEW_UNIT), None)
    stale = [*(inst.pending_path(p) for p in rendered(inst)), stage.manifest_path(inst)]
    check = stage.stage(inst, rendered(inst), None, check_mode=True)
    assert check["changed"] is True and all(os.path.exists(p) for p in stale)  # check mode: said, not done
    res = stage.stage(inst, rendered(inst), None)
    assert res == {
        "instance": "m",
        "changed": True,
        "pending": False,
        "wrote": [],
        "config_hash": content_hash(rendered(inst)),
        "outcome": outcomes.UNCHANGED,
        "removed_pending": stale,
    }
    assert not any(os.path.exists(p) for p in stale)
    quiet = stage.stage(inst, rendered(inst), None)
    assert quiet["changed"] is False and quiet["removed_pending"] == []


def test_check_mode_writes_nothing_and_says_what_it_would(inst, verified):
    res = stage.stage(inst, rendered(inst), "K=v\n", check_mode=True)
    assert res["changed"] is True and res["secrets_changed"] is True
    assert res["wrote"] == sorted(rendered(inst)) and not os.path.exists(os.path.dirname(inst.unit_path))
    assert not os.path.exists(inst.secrets_path) and verified == {"verified": [], "reloads": []}


def test_secrets_are_written_root_only_and_a_change_to_them_alone_is_a_change(inst, verified):
    stage.stage(inst, rendered(inst), "K=v1\n")
    assert Path(inst.secrets_path).read_text() == "K=v1\n"
    assert mode(inst.secrets_path) == 0o600 and mode(os.path.dirname(inst.secrets_path)) == 0o700
    record_good(inst)
    res = stage.stage(inst, rendered(inst), "K=v2\n")  # the configuration unchanged, the secret rotated
    assert res["changed"] is True and res["secrets_changed"] is True and res["outcome"] == outcomes.UNCHANGED
    assert Path(inst.secrets_path).read_text() == "K=v2\n"
    same = stage.stage(inst, rendered(inst), "K=v2\n")
    assert same["changed"] is False and "secrets_changed" not in same


def test_a_unit_the_verifier_refuses_leaves_no_file_behind(inst, monkeypatch):
    def refuse(path, unit):
        raise ValueError(f"systemd-analyze verify refuses the rendered {unit}: bad")

    monkeypatch.setattr(stage, "verify_unit", refuse)
    with pytest.raises(ValueError, match="refuses the rendered"):
        stage.stage(inst, rendered(inst), None)
    assert os.listdir(os.path.dirname(inst.unit_path)) == []  # neither the unit, nor its probe
    assert not os.path.exists(inst.env_path)


def test_promote_moves_the_complete_pending_set_live_and_reloads(inst, verified):
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    stage.stage(inst, rendered(inst, NEW_UNIT), None)
    reloads = []
    out = stage.promote(inst, reload=lambda: reloads.append(1))
    assert out == {"promoted": sorted(rendered(inst))} and reloads == [1]
    assert Path(inst.unit_path).read_text() == NEW_UNIT and mode(inst.unit_path) == 0o644
    assert not os.path.exists(stage.manifest_path(inst)) and inst.pending_files == {}
    assert stage.promote(inst, reload=lambda: reloads.append(2)) == {"promoted": []} and reloads == [1]


def test_promote_refuses_an_incomplete_set_and_touches_nothing(inst, verified):
    stage.stage(inst, rendered(inst), None)
    record_good(inst)
    stage.stage(inst, rendered(inst, NEW_UNIT), None)
    Path(inst.pending_path(inst.env_path)).write_text("A=tampered\n")  # not what the manifest says
    with pytest.raises(ValueError, match="incomplete"):
        stage.promote(inst, reload=lambda: pytest.fail("nothing to reload"))
    assert Path(inst.unit_path).read_text() == GOOD_UNIT


def test_read_is_none_only_for_a_missing_file(tmp_path):
    assert stage.read(str(tmp_path / "none")) is None
    (tmp_path / "u").write_bytes("Description=caf\u00e9\n".encode())
    assert stage.read(str(tmp_path / "u")) == "Description=caf\u00e9\n"  # UTF-8, whatever the locale
    (tmp_path / "d").mkdir()
    with pytest.raises(IsADirectoryError):
        stage.read(str(tmp_path / "d"))


NO_SYSTEMD_ANALYZE = pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="no systemd-analyze here (staging runs it on the lab nodes)"
)


@NO_SYSTEMD_ANALYZE
def test_verify_unit_runs_systemd_analyze_accepting_a_good_unit_and_quoting_its_refusal(tmp_path):
    true = shutil.which("true")
    good = tmp_path / "probe"
    good.write_text(f"[Unit]\nDescription=m\n[Service]\nExecStart={true}\n")
    stage.verify_unit(str(good), "sglang-m.service")
    bad = tmp_path / "probe-bad"
    bad.write_text("[Unit]\nDescription=m\n[Service]\nExecStart=relative/path\n")
    with pytest.raises(ValueError) as err:
        stage.verify_unit(str(bad), "sglang-m.service")
    said = str(err.value)
    assert said.startswith("systemd-analyze verify refuses the rendered sglang-m.service: ")
    assert "sglang-m.service" in said.split(": ", 1)[1] and "b'" not in said  # systemd's own words, as text


def test_verify_unit_gives_up_on_a_hung_systemd_analyze(monkeypatch, tmp_path):
    def hung(argv, **kw):
        assert kw.get("timeout"), "would wait on systemd-analyze forever"
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    monkeypatch.setattr(stage.subprocess, "run", hung)
    with pytest.raises(ValueError, match=r"systemd-analyze verify sglang-m\.service could not run"):
        stage.verify_unit(str(tmp_path / "u"), "sglang-m.service")
