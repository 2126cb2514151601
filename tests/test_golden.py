"""The rendered unit and environment file of every shipped profile, against golden copies.

A change to a profile, the renderer or the templates shows here as a diff to review;
UPDATE_GOLDEN=1 rewrites the copies."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
PROFILES = sorted(yaml.safe_load((REPO / "group_vars" / "all.yml").read_text())["sglang_profiles"])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("rendered")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            "localhost,",
            "tests/golden/render.yml",
            "-e",
            f"out_dir={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    if os.environ.get("UPDATE_GOLDEN") == "1":
        for profile in PROFILES:
            shutil.copytree(out / profile, GOLDEN / profile, dirs_exist_ok=True)
    return out


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", ["sglang-main.service", "main.env"])
def test_rendered_matches_golden(rendered, profile, name):
    got = (rendered / profile / name).read_text()
    want = (GOLDEN / profile / name).read_text()
    assert got == want, "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "rendered"))


def test_the_golden_units_differ_where_the_profiles_do():
    units = {p: (GOLDEN / p / "sglang-main.service").read_text() for p in PROFILES}
    assert "--speculative-num-steps 3 " in units["eagle3_5tok_cuda_graph"]
    assert "--speculative-num-steps 2 " in units["eagle3_topk1"]
    assert "--speculative" not in units["baseline_no_spec"]
    assert 'NCCL_PROTO="LL"' in (GOLDEN / "eagle3_5tok_cuda_graph" / "main.env").read_text()
