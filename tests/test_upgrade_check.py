"""playbooks/upgrade-check.yml against the real SGLang 0.5.23 wheel from PyPI (controller only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAYBOOK = [str(Path(sys.executable).parent / "ansible-playbook"), "playbooks/upgrade-check.yml", "-i", "localhost,"]
ENV = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}


def run(*extra: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([*PLAYBOOK, *extra], cwd=REPO, env=ENV, text=True, capture_output=True, check=False)
    proc.stdout = " ".join(proc.stdout.split())  # the YAML callback folds long lines
    return proc


def test_shipped_series_applies_to_the_pinned_release():
    proc = run("-e", "sglang_candidate_version=0.5.23")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "'0001-eagle-worker-v2-init-attributes-first.patch: applies'" in proc.stdout
    assert "'0002-eagle-draft-worker-init-attributes-first.patch: applies'" in proc.stdout
    assert "sglang 0.5.23: every patch of the series applies." in proc.stdout


def test_a_patch_that_does_not_apply_is_reported_and_fails_the_check():
    proc = run(
        "-e",
        "sglang_candidate_version=0.5.23",
        "-e",
        f"upgrade_check_series_dir={REPO}/molecule/stack/fixtures/conflict",
    )
    assert proc.returncode != 0
    assert (
        "'0002-does-not-apply.patch: DOES NOT APPLY: sglang/srt/speculative/eagle_worker_v2.py: hunk #1 FAILED at line 1300'"
        in proc.stdout
    )
    assert "sglang 0.5.23: 0002-does-not-apply.patch do not apply; rebase them" in proc.stdout


def test_the_candidate_must_be_given():
    proc = run()
    assert proc.returncode != 0
    assert "Give the candidate: -e sglang_candidate_version=X.Y.Z" in proc.stdout
