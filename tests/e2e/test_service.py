"""The sglang_service role on lab nodes: units rendered, verified, hardened, not enabled before a restart
verified them; a changed flag changes exactly its files and never restarts."""

from __future__ import annotations

import re
import subprocess

import pytest

from support.e2e import ansible, back_to_deployed, changed_tasks, podman_exec

pytestmark = pytest.mark.lab
# lab-node1's service configuration alone (the unit, its environment): what these cases change and put back. That
# the whole deploy changes nothing a second time is test_lab.py's (test_deploy_converges_then_changes_nothing).
CONFIGURE = ["--limit", "lab-node1", "--tags", "sglang_service_configure"]


@pytest.fixture(scope="module")
def node1(deployed):
    """lab-node1 deployed and never restarted, whatever ran on it before: this module reads that state."""
    the_lab, hosts = deployed
    node = hosts[0]["container"]
    back_to_deployed(the_lab, node, "lab-node1")
    return the_lab, node


def test_unit_is_written_verified_not_enabled_and_not_started(node1):
    _, node = node1
    enabled = subprocess.run(
        ["podman", "exec", node, "systemctl", "is-enabled", "sglang-main.service"], capture_output=True, text=True
    )
    assert enabled.stdout.strip() == "disabled", (
        "never verified: a boot must not start it (a verified restart enables it)"
    )
    state = subprocess.run(
        ["podman", "exec", node, "systemctl", "is-active", "sglang-main.service"], capture_output=True, text=True
    )
    assert state.stdout.strip() == "inactive", "deploy must not start servers: the safe restart does"
    podman_exec(node, "systemd-analyze", "verify", "/etc/systemd/system/sglang-main.service")


def test_environment_file_is_root_only(node1):
    _, node = node1
    assert podman_exec(node, "stat", "-c", "%U %G %a", "/etc/sglang/main.env").split() == ["root", "root", "600"]


def test_security_exposure_is_at_most_4(node1):
    _, node = node1
    out = podman_exec(node, "systemd-analyze", "security", "--no-pager", "sglang-main.service")
    exposure = float(re.search(r"Overall exposure level for sglang-main.service: ([\d.]+)", out).group(1))
    assert exposure <= 4.0, out


def test_a_changed_flag_changes_exactly_its_files_and_never_restarts(node1):
    """Never verified, so nothing to protect: written as the unit's (a verified one is staged: test_restart.py)."""
    the_lab, node = node1
    before = podman_exec(node, "systemctl", "show", "-p", "InactiveEnterTimestamp", "sglang-main.service")
    extra = [
        "--limit",
        "lab-node1",
        "-e",
        '{"sglang_server_flags": {"trust_remote_code": true, "mem_fraction_static": 0.85, "enable_metrics": true}}',
    ]
    proc = ansible("ansible-playbook", "playbooks/deploy.yml", *extra, inventory=the_lab.inventory)
    assert changed_tasks(proc.stdout) == ["sglang.deploy.sglang_service : Stage each instance's configuration"], (
        proc.stdout[-4000:]
    )
    assert "--mem-fraction-static 0.85" in podman_exec(node, "cat", "/etc/systemd/system/sglang-main.service")
    assert podman_exec(node, "sh", "-c", "ls /etc/sglang/pending 2>/dev/null | wc -l").strip() == "0"
    after = podman_exec(node, "systemctl", "show", "-p", "InactiveEnterTimestamp", "sglang-main.service")
    assert before == after, "the unit must not have been restarted"
    # And back: the group_vars' value again (the service's configuration alone: nothing else changed).
    ansible("ansible-playbook", "playbooks/deploy.yml", *CONFIGURE, inventory=the_lab.inventory)


def test_the_units_gpu_gate_refuses_busy_gpus_and_says_who(node1):
    the_lab, node = node1
    ansible(
        "ansible-playbook",
        "playbooks/deploy.yml",
        *CONFIGURE,
        "-e",
        "sglang_service_gpu_gate_timeout=2",
        inventory=the_lab.inventory,
    )
    podman_exec(node, "lab-gpu", "hold", "--pid", "4242", "--gpu", "3", "--mib", "8148", "--pinned", "--name", "stray")
    try:
        start = subprocess.run(
            ["podman", "exec", node, "systemctl", "start", "sglang-main.service"], capture_output=True, text=True
        )
        assert start.returncode != 0
        journal = podman_exec(node, "journalctl", "-u", "sglang-main.service", "--no-pager", "-o", "cat")
        assert (
            "/opt/ml-env/bin/python -m lab_sglang_standin"
            not in subprocess.run(["podman", "exec", node, "ps", "-eo", "args"], capture_output=True, text=True).stdout
        ), "the server must not have started"
    finally:
        # Stop it first: Restart=on-failure would start it again once the GPU is free.
        subprocess.run(["podman", "exec", node, "systemctl", "stop", "sglang-main.service"], check=False)
        podman_exec(node, "lab-gpu", "release", "--pid", "4242")
        subprocess.run(["podman", "exec", node, "systemctl", "reset-failed", "sglang-main.service"], check=False)
        ansible("ansible-playbook", "playbooks/deploy.yml", *CONFIGURE, inventory=the_lab.inventory)
    assert "sglang-gpu-gate: GPUs [0, 1, 2, 3, 4, 5, 6, 7] not clean after 2s; refusing to start." in journal
    assert "GPU 3: pid 4242 holds 8148 MiB" in journal
