"""End to end on the lab: the wheelhouse, the CUDA driver gate and SGLang's preflight."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.e2e import ansible, lab_gpu_state, podman_exec, recap, refused

pytestmark = pytest.mark.lab


def test_wheels_are_fetched_once_for_two_nodes(lab, tmp_path):
    the_lab, hosts = lab
    cache = tmp_path / "wheelhouse"
    extra = ["-e", f"ml_env_wheelhouse_cache={cache}"]
    first = ansible("ansible-playbook", "tests/e2e/playbooks/wheelhouse.yml", *extra, inventory=the_lab.inventory)
    assert {h: r["failed"] for h, r in recap(first.stdout).items()} == {"lab-node1": 0, "lab-node2": 0}
    (log,) = cache.glob("ml-env-*.download.log")
    saved = re.findall(r"Saved (\S+\.whl)", log.read_text())
    assert sorted(Path(s).name for s in saved) == ["idna-3.10-py3-none-any.whl", "six-1.16.0-py2.py3-none-any.whl"]
    for h in hosts:
        freeze = podman_exec(h["container"], "/opt/wheelhouse-test-env/bin/pip", "freeze")
        assert freeze.split() == ["idna==3.10", "six==1.16.0"]
    log_before = log.read_text()
    second = ansible("ansible-playbook", "tests/e2e/playbooks/wheelhouse.yml", *extra, inventory=the_lab.inventory)
    assert {h: r["changed"] for h, r in recap(second.stdout).items()} == {"lab-node1": 0, "lab-node2": 0}
    assert log.read_text() == log_before, "a second run must not download again"


def test_an_unpinned_requirement_is_refused(lab):
    proc = refused(lab[0], "tests/e2e/playbooks/wheelhouse.yml", "-e", '{"ml_env_requirements": ["six>=1.0"]}')
    assert 'ml_env_requirements must be a complete lock of "name==version" items; not pinned: six>=1.0' in proc.flat


def test_cuda_refuses_a_driver_older_than_580(lab):
    the_lab, hosts = lab
    # The CUDA preflight alone: the GPU node's and the instances' checks (always run) read what other tests
    # leave on the nodes (servers, GPU states), which is not this test's subject.
    with lab_gpu_state(hosts[0]["container"], ["driver", "570.86.15"], ["driver", "580.159.04"]):
        proc = refused(
            the_lab,
            "playbooks/deploy.yml",
            "--tags",
            "cuda_preflight",
            "--skip-tags",
            "gpu_node_preflight,sglang_service_validate",
        )
    assert "lab-node1: the NVIDIA driver is 570.86.15, but CUDA 13.0 needs driver branch 580 or newer" in proc.flat
    assert recap(proc.stdout)["lab-node2"]["failed"] == 0, f"lab-node2 is not refused:\n{proc.stdout[-4000:]}"


def test_cuda_skips_only_the_driver_check_on_a_host_without_gpus(lab):
    the_lab, hosts = lab
    container = hosts[1]["container"]
    podman_exec(container, "mv", "/usr/local/bin/nvidia-smi", "/usr/local/bin/nvidia-smi.away")
    try:
        proc = ansible(
            "ansible-playbook",
            "playbooks/deploy.yml",
            "--tags",
            "cuda_preflight",
            "--limit",
            "lab-node2",
            "--skip-tags",
            "gpu_node_preflight,sglang_service_validate",
            inventory=the_lab.inventory,
            check=False,
        )
    finally:
        podman_exec(container, "mv", "/usr/local/bin/nvidia-smi.away", "/usr/local/bin/nvidia-smi")
    flat = " ".join(proc.stdout.split())
    assert (
        "lab-node2: no NVIDIA driver (nvidia-smi not found): a host with no GPU; skipping only the driver check."
        in flat
    )
    assert recap(proc.stdout)["lab-node2"]["failed"] == 0


@pytest.mark.parametrize(
    "extra,message",
    [
        (["-e", "sglang_version=0.5.99"], "No complete lock for sglang 0.5.99 (profile parser)"),
        # 0.5.23's full lock ships (roles/sglang/files/locks); 0.5.22's full set does not resolve (docs/locks.md)
        (
            ["-e", "sglang_install_profile=full", "-e", "sglang_version=0.5.22"],
            "No complete lock for sglang 0.5.22 (profile full)",
        ),
        (["-e", "sglang_install_profile=gpu"], "sglang_install_profile"),
        (["-e", "sglang_patch_series_version=0.4.0", "-e", "sglang_patches_enabled=true"], "holds no *.patch"),
    ],
)
def test_sglang_preflight_errors_name_the_variable(lab, extra, message):
    proc = refused(lab[0], "playbooks/deploy.yml", "--tags", "sglang_preflight", *extra)
    assert message in proc.flat
