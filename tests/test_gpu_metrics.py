"""roles/sglang_monitoring's GPU reader (files/sglang-gpu-metrics): installed as the role's node_exporter entry
point lays it out, run by the system Python against the lab's simulated nvidia-smi with a real process holding a
GPU, it writes who holds each GPU's memory for node_exporter's textfile collector (issue #34)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import metrics
from support import REPO
from support.gpus import PACKAGE, holding, imports_beyond, simulated

ROLE = REPO / "roles" / "sglang_monitoring"
READER = ROLE / "files" / "sglang-gpu-metrics"


def reader_package() -> tuple[str, ...]:
    """What the role's node_exporter entry point installs beside the reader, read from its task (one list)."""
    tasks = yaml.safe_load((ROLE / "tasks" / "node_exporter.yml").read_text())
    (block,) = [t for t in tasks if t.get("name") == "Read who holds the GPUs into the textfile collector"]
    (task,) = [t for t in block["block"] if t.get("name") == "Install the code the GPU reader runs"]
    return tuple(task["loop"])


def install(root: Path) -> Path:
    (root / "sglang_deploy").mkdir(parents=True)
    for name in reader_package():
        shutil.copy2(PACKAGE / name, root / "sglang_deploy" / name)
    shutil.copy2(READER, root / "sglang-gpu-metrics")
    return root / "sglang-gpu-metrics"


# The hosts' own Python (the reader's shebang), with nothing of this checkout or its virtualenv on its path.
HOST_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def run(reader: Path, directory: Path, env: dict) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "COVERAGE_PROCESS_START")}
    return subprocess.run(
        [HOST_PYTHON, str(reader), str(directory)], env=clean, cwd="/", text=True, capture_output=True, check=False
    )


def test_what_the_reader_imports_is_only_the_standard_library_and_the_files_installed_beside_it():
    assert imports_beyond(reader_package()) == []


def test_the_reader_writes_each_gpus_memory_by_its_holder(tmp_path):
    state, env = simulated(tmp_path / "gpus", count=4)
    reader = install(tmp_path / "libexec")
    out = tmp_path / "textfiles"
    out.mkdir()
    with holding(state, ["sleep", "60"], gpu=2, mib=1536):
        proc = run(reader, out, env)
    assert proc.returncode == 0, proc.stderr
    text = (out / "sglang-deploy-gpus.prom").read_text()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}
    assert samples["sglang_deploy_gpu_read_ok"] == 1
    [(series, used)] = [(k, v) for k, v in samples.items() if k.startswith("sglang_deploy_gpu_memory_used_bytes")]
    assert series.startswith('sglang_deploy_gpu_memory_used_bytes{gpu="2",unit="') and used == 1536 * 2**20
    assert oct((out / "sglang-deploy-gpus.prom").stat().st_mode & 0o777) == "0o644"  # node_exporter's user reads it
    assert sorted(p.name for p in out.iterdir()) == ["sglang-deploy-gpus.prom"]  # no temporary file left


def test_a_failed_nvidia_smi_is_a_reading_that_says_so_and_an_unwritable_directory_fails(tmp_path):
    reader = install(tmp_path / "libexec")
    out = tmp_path / "textfiles"
    out.mkdir()
    no_smi = {**os.environ, "PATH": str(tmp_path / "empty")}
    proc = run(reader, out, no_smi)
    assert proc.returncode == 0 and "nvidia-smi" in proc.stderr
    text = (out / "sglang-deploy-gpus.prom").read_text()
    assert "\nsglang_deploy_gpu_read_ok 0\n" in text and "memory_used_bytes" not in text
    gone = run(reader, tmp_path / "absent", no_smi)
    assert gone.returncode == 1 and "sglang-gpu-metrics:" in gone.stderr


@pytest.mark.parametrize(
    ("unit", "labelled"),
    [
        ("sglang-main.service", "sglang-main.service"),
        (None, "none"),
        ("session-4.scope", "none"),
        ("cron.service", "cron.service"),
    ],
)
def test_a_process_is_counted_under_its_unit_or_none(unit, labelled):
    snap = {"processes": [{"gpu": 0, "used_mib": 2, "unit": unit}, {"gpu": 0, "used_mib": 3, "unit": unit},
                          {"gpu": 1, "used_mib": None, "unit": unit}]}  # fmt: skip
    samples = metrics.gpu_samples(snap, 1.0)
    assert samples[("sglang_deploy_gpu_memory_used_bytes", (("gpu", "0"), ("unit", labelled)))] == 5 * 2**20
    assert len([k for k in samples if k[0] == "sglang_deploy_gpu_memory_used_bytes"]) == 1  # unknown memory left out
