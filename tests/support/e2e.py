"""Helpers of the end-to-end tests (tests/e2e): Ansible against the lab, its output read back,
podman on its nodes. The fixtures (the lab, deployed once) are in tests/e2e/conftest.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import lab as labmod
from support import REPO

VENV_BIN = Path(sys.executable).parent
# The e2e lab's name: another name runs a second e2e suite beside this one (its own nodes and network).
LAB_NAME = os.environ.get("SGD_E2E_LAB", "sgd-e2e")
ALL_GPUS = [0, 1, 2, 3, 4, 5, 6, 7]

__all__ = [
    "ALL_GPUS",
    "LAB_NAME",
    "REPO",
    "VENV_BIN",
    "ansible",
    "changed_tasks",
    "controller_env",
    "driver_runner",
    "lab_gpu_state",
    "labmod",
    "main_with",
    "members",
    "podman_exec",
    "recap",
    "refused",
    "remove_instances",
]


def controller_env() -> dict[str, str]:
    """This process's environment for the controller commands the lab tests start (ansible-playbook, the driver),
    without coverage's subprocess hook: coverage measures the controller's Python through the unit tests' own
    subprocesses; under it, each lab test's several minutes of ansible-playbook would run markedly slower."""
    return {k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_CONFIG"}


def ansible(
    *args: str, inventory: Path, check: bool = True, env: dict | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {
        **controller_env(),
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_FORCE_COLOR": "0",
        **(env or {}),
    }
    cmd = [str(VENV_BIN / args[0]), "-i", str(inventory), *args[1:]]
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, text=True, capture_output=True, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
        )
    return proc


def refused(the_lab, playbook: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run a playbook that must fail; .flat is its output with the YAML callback's folding undone."""
    proc = ansible("ansible-playbook", playbook, *extra, inventory=the_lab.inventory, check=False)
    assert proc.returncode != 0, f"{playbook} {' '.join(extra)} did not fail:\n{proc.stdout[-3000:]}"
    proc.flat = " ".join(proc.stdout.split())
    return proc


def changed_tasks(output: str) -> list[str]:
    """Names of the tasks and handlers that reported a change, in order."""
    names = []
    for block in re.split(r"^(?=TASK \[|RUNNING HANDLER \[)", output, flags=re.M):
        m = re.match(r"(?:TASK|RUNNING HANDLER) \[([^\]]+)\]", block)
        if m and re.search(r"^changed: ", block, re.M):
            names.append(m.group(1))
    return names


def recap(output: str) -> dict[str, dict[str, int]]:
    hosts = {}
    for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", output, re.M):
        hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return hosts


def podman_exec(container: str, *cmd: str) -> str:
    return subprocess.run(["podman", "exec", container, *cmd], check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def lab_gpu_state(container: str, change: list[str], restore: list[str]):
    """Change a node's simulated GPUs (`lab-gpu ...`) for the block, then put them back."""
    podman_exec(container, "lab-gpu", *change)
    try:
        yield
    finally:
        podman_exec(container, "lab-gpu", *restore)


def main_with(**kw) -> str:
    """-e for lab-node1's one instance `main` on all 8 GPUs, with kw (env, profile, ...)."""
    return json.dumps({"sglang_instances": [{"name": "main", "port": 30000, "gpus": ALL_GPUS, **kw}]})


def driver_runner(the_lab, ledger: Path, default_limit: str | None):
    """run(*args) -> (exit code, the --json document, the process): python -m driver against the lab."""

    def run(*args: str, limit: str | None = default_limit, inventory=None, json_out: bool = True, popen: bool = False):
        cmd = [sys.executable, "-m", "driver", *args, "-i", str(inventory or the_lab.inventory)]
        if limit:
            cmd += ["--limit", limit]
        if json_out:
            cmd.append("--json")
        env = {**controller_env(), "SGLANG_DEPLOY_LEDGER": str(ledger), "COLUMNS": "200"}
        if popen:
            return subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc = subprocess.run(cmd, cwd=REPO, env=env, text=True, capture_output=True)
        doc = json.loads(proc.stdout) if json_out and proc.stdout.strip().startswith("{") else None
        return proc.returncode, doc, proc

    return run


def back_to_deployed(the_lab, container: str, host: str) -> None:
    """lab-node's `main` as deploy.yml leaves it: stopped, never verified (no known-good generation, nothing
    staged, no secrets file), its configuration rewritten from group_vars. The e2e modules that restart main
    end with it."""
    podman_exec(container, "systemctl", "disable", "--now", "sglang-main.service")
    # A stop leaves a failed unit failed: deploy leaves none (and the node's systemd "degraded" until reset).
    podman_exec(container, "sh", "-c", "systemctl reset-failed sglang-main.service 2>/dev/null || true")
    podman_exec(
        container, "rm", "-rf", "/var/lib/sglang/known-good/main", "/etc/sglang/pending", "/etc/sglang/secrets/main.env"
    )
    ansible(
        "ansible-playbook",
        "playbooks/deploy.yml",
        "--limit",
        host,
        "--tags",
        "sglang_service_configure",
        inventory=the_lab.inventory,
    )


def members(path: str) -> dict[str, bytes]:
    """Every file of the run's tar.gz and of each host bundle inside it, by name (host bundles' as host/member)."""
    out: dict[str, bytes] = {}
    with tarfile.open(path) as outer:
        for m in outer.getmembers():
            if not m.isfile():
                continue
            data = outer.extractfile(m).read()
            out[m.name] = data
            if m.name.endswith(".tar.gz"):
                host = m.name.split("/")[1]
                with tarfile.open(fileobj=io.BytesIO(data)) as inner:
                    for n in inner.getmembers():
                        if n.isfile():
                            out[f"{host}/{n.name}"] = inner.extractfile(n).read()
    return out


def wait_ssh(inventory, host: str, timeout: float = 240) -> float:
    """Until Ansible reaches `host` again after its sshd was stopped or its node restarted; the seconds it took.
    With logind on the node (KillUserProcesses=yes), a connection right after sshd came back was seen to fail
    for about a minute ("mux_client_request_session: read from master failed"): what follows starts from a host
    Ansible reaches, as an operator's next command would after the outage."""
    t0 = time.monotonic()
    while True:
        proc = ansible("ansible", host, "-m", "ansible.builtin.ping", inventory=inventory, check=False)
        if proc.returncode == 0:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{host} not reachable over SSH after {timeout:.0f} s:\n{proc.stdout[-2000:]}")
        time.sleep(1)


def remove_instances(container: str, *names: str) -> None:
    """Each instance of `names` gone from the node (unit, configuration, staged files, secrets, known-good
    generations): the node as deploy.yml left it. The e2e modules that start instances of their own end with it."""
    for name in names:
        podman_exec(container, "sh", "-c", f"systemctl disable --now sglang-{name}.service || true")
        podman_exec(
            container,
            "rm",
            "-rf",
            f"/etc/systemd/system/sglang-{name}.service",
            f"/etc/sglang/{name}.env",
            f"/etc/sglang/pending/sglang-{name}.service",
            f"/etc/sglang/pending/{name}.env",
            f"/etc/sglang/secrets/{name}.env",
            f"/var/lib/sglang/known-good/{name}",
        )
    podman_exec(container, "systemctl", "daemon-reload")
