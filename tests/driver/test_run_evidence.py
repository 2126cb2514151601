"""driver/evidence.py: the hosts' crash evidence bundles of a run packed into one tar.gz, and old ones pruned."""

from __future__ import annotations

import os
import stat
import tarfile

from driver import evidence


def fetched(run_dir, host: str, name: str, content: bytes = b"bundle") -> None:
    """A host's bundle as the playbook fetches it to <run dir>/evidence/<host>/."""
    path = evidence.directory(run_dir) / host / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


def test_the_runs_bundles_become_one_private_tar_gz(tmp_path):
    run_dir = tmp_path / "runs" / "7"
    fetched(run_dir, "node-a", "main-1.tar.gz", b"a")
    fetched(run_dir, "node-b", "main-2.tar.gz", b"bb")
    out = evidence.package(run_dir, 7)
    assert out == run_dir / "evidence-7.tar.gz"
    assert stat.S_IMODE(os.stat(out).st_mode) == evidence.FILE_MODE
    with tarfile.open(out) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    assert members == {"evidence-7/node-a/main-1.tar.gz": b"a", "evidence-7/node-b/main-2.tar.gz": b"bb"}
    assert not evidence.directory(run_dir).exists() and not out.with_suffix(".tmp").exists()


def test_no_bundle_from_any_host_is_no_file(tmp_path):
    run_dir = tmp_path / "runs" / "8"
    assert evidence.package(run_dir, 8) is None
    evidence.directory(run_dir).joinpath("node-a").mkdir(parents=True)  # a host sent nothing
    assert evidence.package(run_dir, 8) is None
    assert not evidence.directory(run_dir).exists() and list(run_dir.iterdir()) == []


def test_prune_keeps_the_newest_by_run_id_not_by_name(tmp_path):
    runs = tmp_path / "runs"
    for run_id in (2, 9, 10, 11):
        fetched(runs / str(run_id), "node-a", "b.tar.gz")
        evidence.package(runs / str(run_id), run_id)
    (runs / "odd").mkdir()
    (runs / "odd" / "evidence-x.tar.gz").write_bytes(b"not a run's")
    gone = evidence.prune(runs, keep=2)
    assert [p.parent.name for p in gone] == ["odd", "2", "9"]  # "10" < "9" as text; by number 9 < 10
    assert sorted(p.parent.name for p in runs.glob("*/evidence-*.tar.gz")) == ["10", "11"]
    assert [p.parent.name for p in evidence.prune(runs, keep=0)] == ["10", "11"]
    assert list(runs.glob("*/evidence-*.tar.gz")) == []
