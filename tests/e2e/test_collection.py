"""The collection as a user gets it (issue #33): `ansible-galaxy collection build`, then `ansible-galaxy collection
install` of the tarball into an empty path, then the deploy playbook by its name from a directory outside the
checkout, with none of the checkout's settings (no ansible.cfg, no collections/ symlink) — through ansible-playbook
and through ansible-navigator (--ee false: the image is AWX's to build, execution-environment.yml); and the driver
as `pip install .` gives it (sglang-deploy), its playbooks from the collection installed with it.

Each run must put back what this test removed from lab-node1 (the GPU gate, its package copied from the collection's
plugins/module_utils, the launcher), so the deploy's tasks ran from the installed copy, not only parsed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from support import REPO
from support.e2e import VENV_BIN, controller_env, podman_exec
from support.package import clean_env, installed_driver

pytestmark = pytest.mark.lab

NODE = "lab-node1"
GATE_DIR = "/usr/local/libexec/sglang-deploy"
PUT_BACK = [f"{GATE_DIR}/sglang-gpu-gate", f"{GATE_DIR}/sglang_deploy/gpu.py", f"{GATE_DIR}/sglang-boot-guard"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The collection built from the checkout and installed into an empty collections path, as a user does it: none
    of the checkout's ANSIBLE_* (under make, ANSIBLE_CONFIG names the checkout's collections/, where ansible-galaxy
    finds sglang.deploy 0.1.0 "already installed" and installs nothing)."""
    top = tmp_path_factory.mktemp("galaxy")
    env = {k: v for k, v in controller_env().items() if not k.startswith("ANSIBLE_")}
    run(VENV_BIN / "ansible-galaxy", "collection", "build", "--output-path", top / "dist", REPO, cwd=top, env=env)
    (tarball,) = (top / "dist").iterdir()
    # --no-deps: community.general comes with the `ansible` package, as on the controller (never Galaxy, offline)
    argv = [VENV_BIN / "ansible-galaxy", "collection", "install", "--no-deps", "-p", top / "collections", tarball]
    run(*argv, cwd=top, env=env | {"ANSIBLE_COLLECTIONS_PATH": str(top / "collections")})
    assert (top / "collections" / "ansible_collections" / "sglang" / "deploy" / "MANIFEST.json").is_file()
    return top / "collections"


def run(*argv, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, text=True, capture_output=True)
    assert proc.returncode == 0, f"{argv[0]} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return proc


def outside(installed: Path, tmp_path: Path) -> dict[str, str]:
    """A user's environment: the installed path the only place sglang.deploy is, no checkout settings."""
    env = {k: v for k, v in controller_env().items() if not k.startswith("ANSIBLE_")}
    env |= {"ANSIBLE_COLLECTIONS_PATH": str(installed), "ANSIBLE_FORCE_COLOR": "0", "HOME": str(Path.home())}
    # the controller's virtualenv active, as a user's is (ansible-navigator --ee false runs the ansible on PATH)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    listed = run(VENV_BIN / "ansible-galaxy", "collection", "list", "sglang.deploy", cwd=tmp_path, env=env).stdout
    assert str(installed) in listed and str(REPO) not in listed, listed
    return env


def remove_the_gate(container: str) -> None:
    podman_exec(container, "rm", "-rf", GATE_DIR)
    for path in PUT_BACK:
        assert podman_exec(container, "sh", "-c", f"test -e {path} || echo gone").strip() == "gone"


def assert_put_back(container: str) -> None:
    for path in PUT_BACK:
        podman_exec(container, "test", "-s", path)


# How a user runs the installed collection's deploy: the playbook by its name, through each tool. navigator:
# --ee false runs the ansible on PATH; --pae false, no playbook artefact (AWX keeps its own job events).
THROUGH = {
    "ansible-playbook": ["ansible-playbook", "sglang.deploy.deploy"],
    "ansible-navigator": ["ansible-navigator", "run", "sglang.deploy.deploy", "--ee", "false", "-m", "stdout",
                          "--pae", "false"],
}  # fmt: skip


@pytest.mark.parametrize("tool", sorted(THROUGH))
def test_the_installed_collection_deploys_the_lab(deployed, installed, tmp_path, tool):
    the_lab, hosts = deployed
    container = next(h["container"] for h in hosts if h["name"] == NODE)
    env = outside(installed, tmp_path)
    remove_the_gate(container)
    program, *args = THROUGH[tool]
    if tool == "ansible-navigator":
        args += ["--lf", str(tmp_path / "navigator.log")]  # its log under this test's directory
    proc = run(VENV_BIN / program, *args, "-i", the_lab.inventory, "--limit", NODE, cwd=tmp_path, env=env)
    assert "failed=0" in proc.stdout and NODE in proc.stdout, proc.stdout[-3000:]
    assert_put_back(container)


def test_the_pip_installed_driver_reports_the_lab_status_from_outside_the_checkout(deployed, tmp_path):
    """`pip install .` into a fresh virtualenv: its sglang-deploy runs status.yml from the installed collection
    against the lab, with nothing of the checkout in its environment (no ANSIBLE_*, no PYTHONPATH, no .venv)."""
    the_lab, hosts = deployed
    script = installed_driver(tmp_path / "venv")
    # a HOME as short as a user's: ssh's ControlPath (~/.ansible/cp/...) must fit a Unix socket's 108 bytes
    home = Path(tempfile.mkdtemp(prefix="sgd-home-", dir="/tmp"))
    try:
        status(the_lab, hosts, script, clean_env(home), tmp_path)
        ledger = home / ".local" / "state" / "sglang-deploy"
        assert ledger.is_dir(), "the installed driver keeps its ledger under the user's HOME, not the checkout"
    finally:
        shutil.rmtree(home, ignore_errors=True)


def status(the_lab, hosts, script: Path, env: dict, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(script), "status", "-i", str(the_lab.inventory), "--json"],
        cwd=tmp_path, env=env, text=True, capture_output=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["command"] == "status" and doc["exit_code"] == 0
    assert set(doc["hosts"]) == {h["name"] for h in hosts}, doc["hosts"]
