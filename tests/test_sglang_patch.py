"""sglang_deploy.patch (plugins/modules/sglang_patch.py is its adapter): atomic, idempotent, recorded
application of a patch series.

Runs the series against a small installed distribution made here, with a RECORD like pip
writes; the adapter itself runs as Ansible runs it (a JSON args file). The real series against
the real SGLang 0.5.23 is exercised by molecule/stack.
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.patch import PatchError, patch_series

REPO = Path(__file__).resolve().parents[1]
MODULE = REPO / "plugins" / "modules" / "sglang_patch.py"

ORIGINAL = """class Worker:
    def __init__(self, cfg):
        self.cfg = cfg
        self.runner = self.build(cfg)
        self.threshold = 0

    def build(self, cfg):
        return cfg
"""

STEP_1 = ORIGINAL.replace(
    "        self.cfg = cfg\n        self.runner = self.build(cfg)\n        self.threshold = 0\n",
    "        self.threshold = 0\n        self.cfg = cfg\n        self.runner = self.build(cfg)\n",
)
STEP_2 = STEP_1.replace("    def build(self, cfg):\n", '    def build(self, cfg):\n        """Build the runner."""\n')


def make_patch(title: str, old: str, new: str, path: str = "pkg/worker.py") -> str:
    diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    return f"{title}\n\n" + "".join(diff)


PATCH_1 = make_patch("Initialise threshold first.", ORIGINAL, STEP_1)
PATCH_2 = make_patch("Document build.", STEP_1, STEP_2)
# Written against a tree that has moved on: its context is not in 1.2.3.
_ELSEWHERE = ORIGINAL.replace("def build(self, cfg):", "def build(self, cfg, extra):")
CONFLICT = make_patch("Context that is not there.", _ELSEWHERE, _ELSEWHERE.replace("return cfg", "return cfg, extra"))
BREAKS_SYNTAX = make_patch(
    "Leaves a syntax error.",
    ORIGINAL,
    ORIGINAL.replace("        return cfg\n", "        return (\n        return cfg\n"),
)


def record_line(root: Path, rel: str) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256((root / rel).read_bytes()).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{(root / rel).stat().st_size}"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    root = tmp_path / "site-packages"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "worker.py").write_text(ORIGINAL)
    (root / "pkg" / "__init__.py").write_text("")
    info = root / "pkg-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 1.2.3\n")
    (info / "RECORD").write_text(
        "\n".join(
            [record_line(root, "pkg/worker.py"), record_line(root, "pkg/__init__.py"), "pkg-1.2.3.dist-info/RECORD,,"]
        )
        + "\n"
    )
    return root


def run(tmp_path: Path, check_mode: bool = False, **args) -> dict:
    """patch_series as the module calls it; a refusal as the module reports it (failed, msg)."""
    args.setdefault("package", "pkg")
    args.setdefault("version", "1.2.3")
    try:
        return patch_series(check_mode=check_mode, **args)
    except PatchError as exc:
        return {"failed": True, "msg": str(exc), "report": []}


def run_module(tmp_path: Path, check_mode: bool = False, **args) -> dict:
    """plugins/modules/sglang_patch.py as Ansible runs it, the package from collections/ (as Ansible ships it)."""
    args.setdefault("package", "pkg")
    args.setdefault("version", "1.2.3")
    if check_mode:
        args["_ansible_check_mode"] = True
    path = tmp_path / f"args-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    code = "import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(MODULE), str(path)],
        env={**os.environ, "PYTHONPATH": str(REPO / "collections")},
        capture_output=True,
        text=True,
        check=False,
    )
    return json.loads(proc.stdout)


def series(*patches: tuple[str, str]) -> list[dict[str, str]]:
    return [{"name": n, "content": c} for n, c in patches]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_applies_in_order_and_records_a_manifest(tmp_path, site):
    manifest = tmp_path / "state" / "patches.json"
    res = run(
        tmp_path,
        site_packages=str(site),
        patches=series(("0001.patch", PATCH_1), ("0002.patch", PATCH_2)),
        manifest=str(manifest),
    )
    assert res.get("failed") is not True, res
    assert res["changed"] is True
    text = (site / "pkg" / "worker.py").read_text()
    assert text.index("self.threshold = 0") < text.index("self.runner")
    assert '"""Build the runner."""' in text
    saved = json.loads(manifest.read_text())
    assert saved["version"] == "1.2.3"
    assert [p["name"] for p in saved["patches"]] == ["0001.patch", "0002.patch"]
    assert saved["patches"][0]["sha256"] == hashlib.sha256(PATCH_1.encode()).hexdigest()
    assert saved["files"]["pkg/worker.py"]["after"] == hashlib.sha256(text.encode()).hexdigest()
    assert saved["files"]["pkg/worker.py"]["before"] == hashlib.sha256(ORIGINAL.encode()).hexdigest()


def test_second_run_changes_nothing(tmp_path, site):
    manifest = tmp_path / "patches.json"
    s = series(("0001.patch", PATCH_1), ("0002.patch", PATCH_2))
    run(tmp_path, site_packages=str(site), patches=s, manifest=str(manifest))
    before = tree(site), manifest.read_bytes()
    res = run(tmp_path, site_packages=str(site), patches=s, manifest=str(manifest))
    assert res["changed"] is False
    assert (tree(site), manifest.read_bytes()) == before


def test_a_failing_patch_changes_nothing_and_names_patch_file_and_hunk(tmp_path, site):
    before = tree(site)
    manifest = tmp_path / "patches.json"
    res = run(
        tmp_path,
        site_packages=str(site),
        patches=series(("0001.patch", PATCH_1), ("0002-conflict.patch", CONFLICT)),
        manifest=str(manifest),
    )
    assert res["failed"] is True
    assert res["msg"] == (
        "patch 0002-conflict.patch does not apply to pkg 1.2.3: pkg/worker.py: hunk #1 FAILED at line 5. "
        "Nothing was changed."
    )
    assert tree(site) == before
    assert not manifest.exists()


def test_a_series_that_breaks_syntax_changes_nothing(tmp_path, site):
    before = tree(site)
    res = run(tmp_path, site_packages=str(site), patches=series(("0001.patch", BREAKS_SYNTAX)))
    assert res["failed"] is True
    assert res["msg"].startswith("pkg/worker.py does not compile after patching")
    assert tree(site) == before


@pytest.mark.parametrize("entry", ["logic", "module"])
def test_check_mode_reports_a_change_but_writes_nothing(tmp_path, site, entry):
    """Through the logic and through the Ansible module that adapts it."""
    before = tree(site)
    manifest = tmp_path / "patches.json"
    res = (run if entry == "logic" else run_module)(
        tmp_path,
        check_mode=True,
        site_packages=str(site),
        patches=series(("0001.patch", PATCH_1)),
        manifest=str(manifest),
    )
    assert res["changed"] is True
    assert tree(site) == before
    assert not manifest.exists()


def test_check_mode_before_the_package_is_installed(tmp_path):
    empty = tmp_path / "empty-site"
    empty.mkdir()
    res = run(tmp_path, check_mode=True, site_packages=str(empty), patches=series(("0001.patch", PATCH_1)))
    assert res["changed"] is True
    assert "not installed yet" in res["msg"]


def test_a_hand_edited_file_is_refused(tmp_path, site):
    (site / "pkg" / "worker.py").write_text(ORIGINAL.replace("cfg", "config"))
    before = tree(site)
    res = run(tmp_path, site_packages=str(site), patches=series(("0001.patch", PATCH_1)))
    assert res["failed"] is True
    assert "pkg/worker.py: neither as pkg 1.2.3 installed it (RECORD) nor as this series patches it" in res["msg"]
    assert "pip install --force-reinstall --no-deps pkg==1.2.3" in res["msg"]
    assert tree(site) == before


def test_an_applied_series_without_its_manifest_is_recognised(tmp_path, site):
    s = series(("0001.patch", PATCH_1), ("0002.patch", PATCH_2))
    run(tmp_path, site_packages=str(site), patches=s, manifest=str(tmp_path / "first.json"))
    patched = tree(site)
    manifest = tmp_path / "lost.json"
    res = run(tmp_path, site_packages=str(site), patches=s, manifest=str(manifest))
    assert res.get("failed") is not True, res
    assert tree(site) == patched
    assert (
        json.loads(manifest.read_text())["files"]["pkg/worker.py"]["before"]
        == hashlib.sha256(ORIGINAL.encode()).hexdigest()
    )


def test_wrong_installed_version_is_refused(tmp_path, site):
    res = run(tmp_path, site_packages=str(site), version="9.9.9", patches=series(("0001.patch", PATCH_1)))
    assert res["failed"] is True
    assert res["msg"].startswith("pkg 1.2.3 is installed in")
    assert "but the series is for 9.9.9" in res["msg"]


def test_report_mode_says_per_patch_whether_it_applies(tmp_path, site):
    before = tree(site)
    res = run(
        tmp_path,
        site_packages=str(site),
        mode="report",
        patches=series(("0001.patch", PATCH_1), ("0002-conflict.patch", CONFLICT), ("0003.patch", PATCH_2)),
    )
    assert res["changed"] is False
    assert [(r["name"], r["applies"]) for r in res["report"]] == [
        ("0001.patch", True),
        ("0002-conflict.patch", False),
        ("0003.patch", True),
    ]
    assert res["report"][1]["detail"] == "pkg/worker.py: hunk #1 FAILED at line 5"
    assert tree(site) == before


def test_a_patch_without_paths_is_refused(tmp_path, site):
    res = run(tmp_path, site_packages=str(site), patches=series(("bad.patch", "not a diff\n")))
    assert res["failed"] is True
    assert "patch bad.patch: no '+++ b/<path>' line" in res["msg"]


def test_the_shipped_series_targets_only_files_of_the_pinned_wheel():
    shipped = sorted((REPO / "roles" / "sglang" / "files" / "patches" / "0.5.23").glob("*.patch"))
    assert [p.name for p in shipped] == [
        "0001-eagle-worker-v2-init-attributes-first.patch",
        "0002-eagle-draft-worker-init-attributes-first.patch",
    ]
    for p in shipped:
        text = p.read_text()
        assert "+++ b/sglang/srt/speculative/eagle_worker_v2.py" in text


def test_the_module_applies_the_series_once_and_reports_the_manifest(tmp_path, site):
    manifest = tmp_path / "patches.json"
    args = dict(site_packages=str(site), patches=series(("0001.patch", PATCH_1)), manifest=str(manifest))
    res = run_module(tmp_path, **args)
    assert res.get("failed") is not True, res
    assert res["changed"] is True
    assert res["manifest"] == json.loads(manifest.read_text())
    again = run_module(tmp_path, **args)
    assert again["changed"] is False


def test_the_module_fails_with_the_reason_and_changes_nothing(tmp_path, site):
    before = tree(site)
    res = run_module(tmp_path, site_packages=str(site), patches=series(("0002-conflict.patch", CONFLICT)))
    assert res["failed"] is True
    assert res["msg"].startswith("patch 0002-conflict.patch does not apply to pkg 1.2.3: pkg/worker.py: hunk #1 FAILED")
    assert tree(site) == before


def test_the_module_refuses_an_item_without_name_or_content(tmp_path, site):
    res = run_module(tmp_path, site_packages=str(site), patches=[{"name": "0001.patch"}])
    assert res["failed"] is True
    assert res["msg"] == "every item of patches needs a 'name' and a 'content'"
