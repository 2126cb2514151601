"""The execution environment (issue #33, execution-environment.yml): its pins are the controller's, and ansible-builder
3 renders its build context from the collection as `ansible-galaxy collection build` packs it (what CI can prove
without building the image: no registry is reachable from here)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
EE = yaml.safe_load((REPO / "execution-environment.yml").read_text())


def locked() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[name.lower().replace("_", "-")] = version.strip()
    return pins


def pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            assert "==" in line, f"{line!r}: every package of the execution environment is pinned"
            name, version = line.split("==", 1)
            out[name.lower().replace("_", "-")] = version
    return out


def test_the_execution_environments_pins_are_the_controllers():
    lock = locked()
    deps = EE["dependencies"]
    core = pins([deps["ansible_core"]["package_pip"], deps["ansible_runner"]["package_pip"]])
    extra = pins((REPO / deps["python"]).read_text().splitlines())
    assert set(extra) >= {"ansible", "rich", "pyyaml"}, extra
    for name, version in {**core, **extra}.items():
        assert lock.get(name) == version, f"{name}=={version} in the execution environment, {lock.get(name)} locked"


def test_ansible_builder_renders_the_context_with_the_collection_installed_in_the_final_image(tmp_path):
    for rel in ("execution-environment.yml", "ee"):
        src = REPO / rel
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / rel)
    dist = tmp_path / ".ee" / "dist"
    subprocess.run(
        [BIN / "ansible-galaxy", "collection", "build", "--output-path", dist, REPO],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    version = yaml.safe_load((REPO / "galaxy.yml").read_text())["version"]
    tarball = f"sglang-deploy-{version}.tar.gz"
    assert [p.name for p in dist.iterdir()] == [tarball]
    proc = subprocess.run(
        [BIN / "ansible-builder", "create", "-f", "execution-environment.yml", "-c", "context"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    build = tmp_path / "context" / "_build"
    assert (build / "collections" / tarball).read_bytes() == (dist / tarball).read_bytes()
    assert (build / "requirements.txt").read_text() == (REPO / "ee" / "requirements.txt").read_text()
    assert "openssh-clients" in (build / "bindep.txt").read_text()
    containerfile = (tmp_path / "context" / "Containerfile").read_text()
    lock = locked()
    refs = f"ansible-core=={lock['ansible-core']} ansible-runner=={lock['ansible-runner']}"
    assert f'ANSIBLE_INSTALL_REFS="{refs}"' in containerfile, containerfile
    final = containerfile.split("FROM base AS final", 1)[1]
    install = "ansible-galaxy collection install --no-deps -p /usr/share/ansible/collections /tmp/sglang-deploy/"
    assert "COPY _build/collections/ /tmp/sglang-deploy/" in final and install in final, final
    # installed before the image drops to its unprivileged user
    assert final.index(install) < final.index("USER 1000")
