"""lab/bin/doctor (`make doctor`, the end of `make setup`): a missing part is named with how to get it.

The tools are found through SGLANG_DOCTOR_SEARCH_PATH, a directory of links to this machine's real
tools with one left out (or a fake podman), so each failure is simulated without touching the system.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCTOR = REPO / "lab" / "bin" / "doctor"
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/lib/podman"])
# Each tool the doctor looks for, the Debian package its hint names and why the lab needs it.
TOOLS = {
    "podman": ("podman", ""),
    "runc": ("runc", " (the lab's container runtime: crun fails here)"),
    "netavark": ("netavark", " (podman's network stack)"),
    "aardvark-dns": ("aardvark-dns", " (lab nodes resolve each other by name)"),
    "debootstrap": ("debootstrap", " (builds the lab image)"),
    "ssh": ("openssh-client", " (Ansible connects over SSH)"),
    "ssh-keygen": ("openssh-client", " (the lab's SSH key)"),
}
FIREWALL = ("iptables", "nft")


def tool_dir(tmp_path: Path, leave_out: tuple[str, ...] = (), podman: str | None = None) -> Path:
    """Links to the real tools of this machine, but for leave_out; podman replaced by a script when given."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in [*TOOLS, *FIREWALL]:
        real = shutil.which(name, path=SEARCH)
        if name not in leave_out and real:
            (bindir / name).symlink_to(real)
    if podman is not None:
        (bindir / "podman").unlink(missing_ok=True)
        (bindir / "podman").write_text(podman)
        (bindir / "podman").chmod(0o755)
    return bindir


def doctor(bindir: Path | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if bindir is not None:
        env["SGLANG_DOCTOR_SEARCH_PATH"] = str(bindir)
    return subprocess.run(
        [sys.executable, str(DOCTOR), *args], text=True, capture_output=True, check=False, env=env, timeout=120
    )


def fake_podman(log: Path, image_exists: bool, run_error: str = "") -> str:
    """A podman that records its argv and answers the doctor's calls; `run` fails with run_error when given."""
    run = f'echo "{run_error}" >&2; exit 126' if run_error else "exit 0"
    return f"""#!/bin/sh
echo "$@" >> {log}
case "$1" in
  --version) echo "podman version 4.3.1" ;;
  image) exit {0 if image_exists else 1} ;;
  run) {run} ;;
esac
exit 0
"""


def test_no_iptables_nor_nft_fails_naming_them_and_the_package(tmp_path):
    proc = doctor(tool_dir(tmp_path, leave_out=FIREWALL), "--no-container")
    lines = proc.stdout.splitlines()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        "FAIL    iptables/nft: neither iptables nor nft found (netavark, podman's network stack, needs one)"
        " - apt-get install iptables"
    ) in lines
    assert [ln for ln in lines if ln.startswith("FAIL")] == [ln for ln in lines if "iptables/nft" in ln]
    assert lines[-1].endswith(", 1 failed, 1 skipped")


def test_iptables_installed_but_off_path_fails_as_netavark_would_not_find_it():
    """The issue's `netavark: No such file or directory`: iptables must be on the PATH podman runs with."""
    iptables = shutil.which("iptables", path="/usr/local/sbin:/usr/sbin:/sbin")
    assert iptables and not shutil.which("iptables", path="/usr/bin:/bin"), "expects Debian's /usr/sbin/iptables"
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(DOCTOR), "--no-container"], text=True, capture_output=True, check=False, env=env
    )
    assert proc.returncode == 1
    assert (
        f"FAIL    iptables/nft: {iptables} not on PATH, where netavark looks for it (/usr/bin:/bin)"
        f" - export PATH=$PATH:{os.path.dirname(iptables)}"
    ) in proc.stdout.splitlines()


@pytest.mark.parametrize("tool", TOOLS)
def test_each_missing_tool_is_named_with_its_package(tmp_path, tool):
    package, why = TOOLS[tool]
    proc = doctor(tool_dir(tmp_path, leave_out=(tool,)), "--no-container")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"FAIL    {tool}: not found{why} - apt-get install {package}" in proc.stdout.splitlines()


@pytest.mark.parametrize(
    "error,hint",
    [
        (  # the failure, on a machine without iptables
            "Error: netavark: No such file or directory (os error 2)",
            "netavark found no iptables or nft on PATH: apt-get install iptables, with /usr/sbin on PATH",
        ),
        (
            "Error: OCI runtime error: runc: runc create failed: unable to start container process: error setting rlimit type 7: operation not permitted",
            "apt-get install podman runc netavark aardvark-dns iptables",
        ),
    ],
    ids=["netavark", "runc"],
)
def test_a_podman_that_cannot_start_the_container_fails_with_its_error_and_cleans_up(tmp_path, error, hint):
    log = tmp_path / "podman.log"
    proc = doctor(tool_dir(tmp_path, podman=fake_podman(log, image_exists=True, run_error=error)))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (
        f"FAIL    podman run: podman could not start a container under runc on a network: {error} - {hint}"
    ) in proc.stdout.splitlines()
    calls = log.read_text().splitlines()
    run = next(c for c in calls if c.startswith("run "))
    assert "--runtime runc" in run and "--network sglang-doctor-" in run and "--publish 127.0.0.1:" in run
    # What it made is removed: the container (if any) and its network.
    assert any(c.startswith("rm --force --time 0 sglang-doctor-") for c in calls)
    assert any(c.startswith("network rm --force sglang-doctor-") for c in calls)


def test_no_lab_image_is_a_skip_for_make_setup_and_a_failure_for_make_doctor(tmp_path):
    log = tmp_path / "podman.log"
    bindir = tool_dir(tmp_path, podman=fake_podman(log, image_exists=False))

    setup = doctor(bindir, "--setup")
    assert setup.returncode == 0, setup.stdout + setup.stderr
    skipped = [ln for ln in setup.stdout.splitlines() if ln.startswith("skipped")]
    assert skipped == [
        "skipped podman run: lab image not built yet (make image);"
        " localhost/sglang-deploy-node:bookworm is checked by `make doctor` after it"
    ]
    assert setup.stdout.splitlines()[-1].endswith(", 0 failed, 1 skipped")  # a skip is never an ok

    alone = doctor(bindir)
    assert alone.returncode == 1
    assert (
        "FAIL    podman run: lab image localhost/sglang-deploy-node:bookworm not built - make image, then make doctor"
        in alone.stdout.splitlines()
    )
    assert not any(c.startswith("run ") for c in log.read_text().splitlines())


def test_this_machine_passes_every_check_but_the_container_one():
    proc = doctor(None, "--no-container")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    checks = [ln.split(None, 1)[1].split(":", 1)[0] for ln in lines[:-1]]
    assert checks == [
        "podman",
        "runc",
        "netavark",
        "aardvark-dns",
        "iptables/nft",
        *(["newuidmap", "slirp4netns"] if os.geteuid() != 0 else []),
        "debootstrap",
        "ssh",
        "ssh-keygen",
        ".venv",
        "ansible-playbook",
        "molecule",
        "ruff",
        "py-spy",
        "promtool",
        "podman run",
    ]
    assert all(ln.startswith("ok ") for ln in lines[:-2]), proc.stdout
    assert lines[-2] == "skipped podman run: --no-container"
    assert lines[-1] == f"doctor: {len(lines) - 2} ok, 0 failed, 1 skipped"


@pytest.mark.lab
def test_this_machine_runs_the_lab_image_on_a_network_with_a_published_port():
    proc = doctor(None)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "podman run:" in ln)
    assert line.startswith(
        "ok      podman run: localhost/sglang-deploy-node:bookworm under runc on network sglang-doctor-"
    )
    assert ", answering on http://127.0.0.1:" in line
