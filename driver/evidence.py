"""The crash evidence of a run, on the controller: one tar.gz per run, old ones pruned.

The hosts write their bundles (plugins/module_utils/sglang_deploy/evidence.py: journal, py-spy of every
rank, nvidia-smi -q, ...); the playbooks bring them to ``<run dir>/evidence/<host>/`` (the driver
names that directory in SGLANG_DEPLOY_EVIDENCE_DIR). After the run, ``package`` puts them into
``<run dir>/evidence-<run id>.tar.gz`` (0600), and ``prune`` keeps the newest KEEP of those.
"""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import durable

KEEP = 20
ENV = "SGLANG_DEPLOY_EVIDENCE_DIR"
FILE_MODE = 0o600


def directory(run_dir: Path) -> Path:
    return run_dir / "evidence"


def package(run_dir: Path, run_id: int) -> Path | None:
    """The run's bundles as one tar.gz (host/bundle.tar.gz inside); None when no host sent one."""
    src = directory(run_dir)
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else []
    if not files:
        shutil.rmtree(src, ignore_errors=True)
        return None
    out = run_dir / f"evidence-{run_id}.tar.gz"
    tmp = out.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "wb") as fh:
        with tarfile.open(fileobj=fh, mode="w:gz") as tar:
            for f in files:
                tar.add(f, arcname=f"evidence-{run_id}/{f.relative_to(src)}")
        fh.flush()
        os.fsync(fh.fileno())  # streamed, not held whole in memory for durable.write_atomic: the same steps here
    durable.rename(tmp, out)
    shutil.rmtree(src, ignore_errors=True)
    return out


def prune(runs_root: Path, keep: int = KEEP) -> list[Path]:
    """Remove all but the newest `keep` run bundles (by run id); the removed paths."""
    bundles = sorted(
        runs_root.glob("*/evidence-*.tar.gz"), key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else -1
    )
    gone = bundles[:-keep] if keep > 0 else bundles
    for p in gone:
        p.unlink(missing_ok=True)
    return gone
