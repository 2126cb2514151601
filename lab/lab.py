"""The local lab: Debian 12 nodes in podman, systemd as PID 1, reached over SSH.

    python lab/lab.py up [--nodes 2] [--gpus 8]
    python lab/lab.py down
    python lab/lab.py status

Each node is a container of the locally built image (lab/image/build.sh) on the
lab's own podman network, with its sshd published on a loopback port, a lab SSH
key made at `up`, and simulated GPUs (the lab-only nvidia-smi test double).
`up` writes inventory/lab/hosts.yml so that Ansible reaches lab nodes exactly as
it reaches production hosts: over SSH, as a sudo-capable user, with pipelining.
`down` removes every container and network `up` made, the inventory and the key.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IMAGE = os.environ.get("LAB_IMAGE", "localhost/sglang-deploy-node:bookworm")
LABEL = "sglang-deploy.lab"
# The lab's nodes hold no secrets and are re-made at every `up`: accept their
# fresh host keys, but keep them in the lab's own known_hosts, never the user's.
SSH_ARGS = "-o StrictHostKeyChecking=accept-new -o UserKnownHostsFile={kh}"


class LabError(RuntimeError):
    pass


class Lab:
    """One named lab: its containers, network, key and inventory.

    The default lab is "sglang-lab" (make lab-up/lab-down); tests make their own
    (LAB_NAME=...) so that they never touch a lab the user has running.
    """

    def __init__(self, name: str | None = None, inventory: Path | None = None, state: Path | None = None):
        self.name = name or os.environ.get("LAB_NAME", "sglang-lab")
        default_inv = REPO / "inventory" / "lab" / "hosts.yml"
        default_state = REPO / ".lab"
        if self.name != "sglang-lab":
            default_inv = REPO / ".lab-tests" / self.name / "hosts.yml"
            default_state = REPO / ".lab-tests" / self.name
        self.inventory = inventory or Path(os.environ.get("LAB_INVENTORY", default_inv))
        self.state = state or Path(os.environ.get("LAB_STATE_DIR", default_state))
        self.network = self.name
        self.label = f"{LABEL}={self.name}"

    def node_names(self, count: int) -> list[str]:
        return [f"{self.name}-node{i}" for i in range(1, count + 1)]


def podman(
    *args: str, check: bool = True, capture: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["podman", *args], text=True, capture_output=capture, check=False, input=stdin)
    if check and proc.returncode != 0:
        raise LabError(f"podman {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


# A lab node's open-file and process limits (ulimit_args): what a unit on it may ask for at most.
NODE_LIMIT = 16384


def router_vars(port: int, prometheus_port: int, api_key: str) -> dict:
    """roles/sglang_router's variables for a router on a lab node (the rollout's e2e and benches): the gateway they
    were built against (sglang-router 0.3.2; the role's default is smg), its ports, its key, and a nofile limit the
    container allows (the role's default is above the container's hard limit)."""
    return {
        "sglang_router_impl": "sglang-router",
        "sglang_router_port": port,
        "sglang_router_prometheus_port": prometheus_port,
        "sglang_router_api_key": api_key,
        "sglang_router_limit_nofile": NODE_LIMIT,
    }


def ulimit_args() -> list[str]:
    """Containers cannot raise rlimits: ask for no more than this host's hard limits.

    Seen here: podman's default (nofile 1048576) fails with "error setting rlimit",
    and so does nproc 65535 although the shell's hard limit is 96365 (podman's
    conmon runs with 32768). 16384 of each is ample for a lab node.
    """
    out = []
    for name, rlim, want in (
        ("nofile", resource.RLIMIT_NOFILE, NODE_LIMIT),
        ("nproc", resource.RLIMIT_NPROC, NODE_LIMIT),
    ):
        hard = resource.getrlimit(rlim)[1]
        value = want if hard == resource.RLIM_INFINITY else min(want, hard)
        out.append(f"--ulimit={name}={value}:{value}")
    return out


def ensure_image() -> None:
    if podman("image", "exists", IMAGE, check=False).returncode != 0:
        subprocess.run(["bash", str(REPO / "lab" / "image" / "build.sh")], check=True)


def ensure_key(lab: Lab) -> Path:
    key = lab.state / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "sglang-deploy-lab", "-f", str(key)], check=True
        )
    return key


def published_port(name: str) -> int:
    out = podman("port", name, "22/tcp").stdout.strip().splitlines()[0]
    return int(out.rsplit(":", 1)[1])


def wait_ready(name: str, port: int, timeout: float) -> None:
    """Poll until systemd finished booting and sshd answers with its banner."""
    deadline = time.monotonic() + timeout
    booted = ssh_ok = False
    last = ""
    while time.monotonic() < deadline:
        if not booted:
            proc = podman("exec", name, "systemctl", "is-system-running", check=False)
            last = proc.stdout.strip()
            booted = last in ("running", "degraded")
        if booted and not ssh_ok:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    ssh_ok = sock.recv(64).startswith(b"SSH-")
            except OSError:
                ssh_ok = False
        if booted and ssh_ok:
            return
        time.sleep(0.2)
    raise LabError(f"{name}: not ready after {timeout:.0f}s (systemd: {last or 'no answer'}, sshd: {ssh_ok})")


def up(lab: Lab, nodes: int, gpus: int, timeout: float) -> list[dict[str, object]]:
    if shutil.which("podman") is None:
        raise LabError("podman is not installed: run `make setup` first")
    ensure_image()
    key = ensure_key(lab)
    if podman("network", "exists", lab.network, check=False).returncode != 0:
        podman("network", "create", "--label", lab.label, lab.network)
    hosts = []
    for index, name in enumerate(lab.node_names(nodes), start=1):
        hostname = f"lab-node{index}"
        if podman("container", "exists", name, check=False).returncode != 0:
            podman(
                "run",
                "--detach",
                "--name",
                name,
                "--hostname",
                hostname,
                "--label",
                lab.label,
                "--runtime",
                "runc",
                "--systemd",
                "always",
                # Nodes find each other by hostname, as a fleet's hosts do (dist_init_addr, NCCL's rendezvous).
                "--network",
                lab.network,
                "--network-alias",
                hostname,
                "--publish",
                "127.0.0.1::22",
                "--volume",
                f"{key}.pub:/home/ansible/.ssh/authorized_keys:ro",
                "--volume",
                f"{REPO / 'lab' / 'standin'}:{STANDIN_DIR}:ro",
                "--shm-size",
                "1g",
                # Root on a real host may look into every process (/proc/PID/fd: who holds a port).
                "--cap-add",
                "SYS_PTRACE",
                *ulimit_args(),
                IMAGE,
                "/sbin/init",
            )
        port = published_port(name)
        wait_ready(name, port, timeout)
        podman("exec", name, "lab-gpu", "init", "--gpus", str(gpus), "--seed", hostname)
        podman(
            "exec", "-i", name, "sh", "-c", f"mkdir -p {DROPIN.rsplit('/', 1)[0]} && cat > {DROPIN}", stdin=DROPIN_TEXT
        )
        hosts.append({"name": hostname, "container": name, "port": port, "gpus": gpus})
    write_inventory(lab, hosts, key)
    return hosts


# The SGLang stand-in server (a test double, lab/standin), mounted read-only into
# every node and started by the very same unit as SGLang through the launch module.
STANDIN_DIR = "/opt/lab-standin"
# Lab-only drop-in for every sglang-*.service: the stand-in and the simulated
# nvidia-smi keep the simulated GPU state in /var/lib/lab-gpu-sim, which the unit's
# ProtectSystem=strict would make read-only. Production units have no such path.
DROPIN = "/etc/systemd/system/sglang-.service.d/lab-gpu-sim.conf"
DROPIN_TEXT = """# LAB ONLY (lab/lab.py): the simulated GPUs' state must stay writable.
[Service]
ReadWritePaths=/var/lib/lab-gpu-sim
"""

# Settings every lab node gets. Host variables, so that they rank above the
# project's group_vars/all.yml (which speaks for real fleets).
LAB_HOST_VARS = {
    # Lab nodes have no GPU: NVIDIA's CUDA wheels, and SGLang with just what its parser needs.
    "cuda_install_method": "pip",
    "sglang_install_profile": "parser",
    # Lab model directories (config.json only, baked into the lab image).
    "sglang_model_path": "/srv/models/lab-target",
    "sglang_draft_model_path": "/srv/models/lab-eagle3-draft",
    # The stand-in server instead of SGLang (no GPU to serve on), and lab-sized waits.
    "sglang_service_launch_module": "lab_sglang_standin",
    "sglang_server_env": {"PYTHONPATH": STANDIN_DIR},
    "sglang_service_stop_timeout": 5,
    "sglang_service_ready_timeout": 60,
    "sglang_service_gpu_wait_timeout": 20,
}


def write_inventory(lab: Lab, hosts: list[dict[str, object]], key: Path) -> None:
    kh = lab.state / "ssh" / "known_hosts"
    lines = [
        "---",
        "# Written by `make lab-up` (lab/lab.py); removed by `make lab-down`. Do not edit.",
        "all:",
        "  vars:",
        "    ansible_user: ansible",
        f"    ansible_ssh_private_key_file: {key}",
        f"    ansible_ssh_common_args: {SSH_ARGS.format(kh=kh)}",
        "    sglang_lab: true",
        "  children:",
        "    sglang_nodes:",
        "      hosts:",
    ]
    for h in hosts:
        lines += [
            f"        {h['name']}:",
            "          ansible_host: 127.0.0.1",
            f"          ansible_port: {h['port']}",
            f"          lab_container: {h['container']}",
            f"          lab_gpus: {h['gpus']}",
        ]
        lines += [f"          {k}: {json.dumps(v)}" for k, v in LAB_HOST_VARS.items()]
    # Prometheus on the first node (playbooks/monitoring.yml), where the lab's router runs too.
    lines += ["    sglang_monitoring:", "      hosts:", f"        {hosts[0]['name']}:"]
    lab.inventory.parent.mkdir(parents=True, exist_ok=True)
    lab.inventory.write_text("\n".join(lines) + "\n", encoding="utf-8")


def lab_containers(lab: Lab) -> list[str]:
    out = podman("ps", "--all", "--filter", f"label={lab.label}", "--format", "{{.Names}}").stdout
    return [n for n in out.split() if n]


def down(lab: Lab) -> None:
    names = lab_containers(lab)
    if names:
        podman("rm", "--force", "--time", "5", *names)
    if podman("network", "exists", lab.network, check=False).returncode == 0:
        podman("network", "rm", "--force", lab.network)
    lab.inventory.unlink(missing_ok=True)
    shutil.rmtree(lab.state, ignore_errors=True)


def status(lab: Lab) -> list[dict[str, str]]:
    out = podman("ps", "--all", "--filter", f"label={lab.label}", "--format", "json").stdout
    return [
        {"name": c["Names"][0], "state": c["State"], "status": c.get("Status", "")} for c in json.loads(out or "[]")
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="start lab nodes and write inventory/lab/hosts.yml")
    p.add_argument("--nodes", type=int, default=int(os.environ.get("LAB_NODES", "2")))
    p.add_argument("--gpus", type=int, default=int(os.environ.get("LAB_GPUS", "8")), help="simulated GPUs per node")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each node to boot")
    sub.add_parser("down", help="remove every lab container, the network, the inventory and the key")
    sub.add_parser("status", help="list lab containers")
    args = parser.parse_args(argv)
    lab = Lab()
    try:
        if args.cmd == "up":
            if args.nodes < 1 or args.gpus < 1:
                parser.error("--nodes and --gpus must be at least 1")
            t0 = time.monotonic()
            hosts = up(lab, args.nodes, args.gpus, args.timeout)
            for h in hosts:
                print(f"{h['name']}: container {h['container']}, ssh 127.0.0.1:{h['port']}, {h['gpus']} simulated GPUs")
            print(f"lab up in {time.monotonic() - t0:.1f}s; inventory: {lab.inventory}")
        elif args.cmd == "down":
            down(lab)
            print("lab down")
        else:
            for c in status(lab):
                print(f"{c['name']}\t{c['state']}\t{c['status']}")
    except LabError as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
