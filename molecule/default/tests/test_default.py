"""The lab works: systemd as PID 1, the base role applied, simulated GPUs answering like the real nvidia-smi."""

from pathlib import Path

import pytest

VECTORS = Path(__file__).resolve().parents[3] / "tests" / "vectors" / "nvidia-smi-h200.md"


def test_systemd_is_pid_1_and_running(host):
    assert host.process.get(pid=1).comm == "systemd"
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state == "running", host.run("systemctl --failed --no-legend").stdout


def test_a_unit_is_started(host):
    ssh = host.service("ssh")
    assert ssh.is_running
    assert ssh.is_enabled


def test_service_user_is_unprivileged(host):
    user = host.user("sglang")
    assert user.exists
    assert user.uid != 0
    assert user.shell == "/usr/sbin/nologin"
    assert user.group == "sglang"


@pytest.mark.parametrize("path", ["/etc/sglang", "/var/lib/sglang"])
def test_directories(host, path):
    d = host.file(path)
    assert d.is_directory
    assert d.user == "root"
    assert d.group == "sglang"
    assert d.mode == 0o750


def _reference_header(prefix: str) -> str:
    for line in VECTORS.read_text().splitlines():
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting {prefix!r} in {VECTORS}")


def test_simulated_nvidia_smi_query_matches_the_real_format(host):
    out = host.check_output(
        "nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.used,memory.total,"
        "driver_version,persistence_mode,compute_mode --format=csv"
    )
    lines = out.splitlines()
    assert lines[0] == _reference_header("index, uuid, name, pci.bus_id, memory.used [MiB]")
    assert len(lines) == 9
    fields = lines[1].split(", ")
    assert fields[0] == "0"
    assert fields[1].startswith("GPU-") and len(fields[1]) == 40
    assert fields[2:] == ["NVIDIA H200", "00000000:00:06.0", "0 MiB", "143771 MiB", "580.159.04", "Enabled", "Default"]


def test_simulated_nvidia_smi_shows_a_process_holding_memory(host):
    holder = host.run("sudo sh -c 'sleep 60 >/dev/null 2>&1 & echo $!'")
    pid = int(holder.stdout.strip())
    try:
        host.run_expect([0], f"sudo lab-gpu hold --pid {pid} --gpu 3 --mib 8148 --name python3")
        apps = host.check_output(
            "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader,nounits"
        )
        uuid3 = host.check_output("nvidia-smi -i 3 --query-gpu=uuid --format=csv,noheader")
        assert apps == f"{pid}, {uuid3}, 8148, python3"
        used = host.check_output("nvidia-smi -i 3 --query-gpu=memory.used --format=csv,noheader,nounits")
        assert used == "8163"
    finally:
        host.run(f"sudo kill {pid}")
    assert host.check_output("nvidia-smi --query-compute-apps=pid --format=csv,noheader") == ""


def test_plain_nvidia_smi_has_the_real_layout(host):
    out = host.check_output("nvidia-smi").splitlines()
    ref = VECTORS.read_text().splitlines()
    banner = next(line for line in ref if line.startswith("| NVIDIA-SMI"))
    assert out[2] == banner
    assert out[4:8] == ref[ref.index(banner) + 2 : ref.index(banner) + 6]
    assert sum(1 for line in out if "NVIDIA H200" in line) == 8
    assert all(len(line) == 91 for line in out[1:] if line)
