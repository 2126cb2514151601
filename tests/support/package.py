"""sglang-deploy as pip installs it (pyproject.toml, setup.py): the wheel built from this working tree, installed
into a fresh virtualenv of its own (no system site-packages, nothing of the checkout on its path).

    from support.package import installed_driver
    sglang_deploy = installed_driver(tmp_path / "venv")   # .../venv/bin/sglang-deploy
    subprocess.run([sglang_deploy, "status", "-i", hosts], cwd=somewhere_else, env=package.clean_env(home))

Everything comes from a wheelhouse (WHEELHOUSE, like the lab's under ~/.cache/sglang-deploy/wheelhouse): the
build requirements and the dependencies pyproject.toml names, `pip download`ed once per set of requirements, then
installed with --no-index: the install proves the declared dependencies suffice, and costs no index after the first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from support import REPO

WHEELHOUSE_ROOT = Path(
    os.environ.get("SGLANG_DEPLOY_WHEELHOUSE") or Path.home() / ".cache" / "sglang-deploy" / "wheelhouse"
)
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


def _pip(*args: str) -> None:
    """pip of the project's .venv, without PYTHONPATH: with the checkout on it, pip would take the checkout (or an
    egg-info a build left there) for sglang-deploy installed already, and install nothing."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    subprocess.run([*PIP, *args], check=True, env=env)


def requirements() -> list[str]:
    """What building and installing the package takes: pyproject.toml's build requirements and dependencies."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    return [*project["build-system"]["requires"], *project["project"]["dependencies"]]


def wheelhouse() -> Path:
    """The wheels of requirements() (and theirs), downloaded on first use into a directory named by their hash;
    made whole in a temporary directory, then renamed: a concurrent or interrupted download leaves none half made."""
    reqs = requirements()
    digest = hashlib.sha256("\n".join(sorted(reqs)).encode()).hexdigest()[:16]
    house = WHEELHOUSE_ROOT / f"sglang-deploy-package-{digest}"
    if house.is_dir():
        return house
    WHEELHOUSE_ROOT.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{house.name}-", dir=WHEELHOUSE_ROOT))
    try:
        _pip("download", "-q", "--only-binary=:all:", "-d", str(partial), *reqs)
        (partial / "requirements.txt").write_text("\n".join(reqs) + "\n", encoding="utf-8")
        try:
            partial.rename(house)
        except OSError:  # another run made it first
            pass
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return house


def source_copy(dest: Path) -> Path:
    """The working tree's files as git knows them (tracked, and untracked but not ignored), links kept as links:
    what a fresh clone with these changes holds, without the checkout's build/, .venv or caches."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet in the index
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            target.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, target)
    return dest


def build_wheel(dest: Path) -> Path:
    """The wheel of this working tree (built from a copy of it: the checkout gets no build/ or egg-info), in dest."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sglang-deploy-src-") as tmp:
        src = source_copy(Path(tmp) / "src")
        _pip("wheel", "-q", "--no-deps", "--no-index", "--find-links", str(wheelhouse()), "-w", str(dest), str(src))
    (wheel,) = dest.glob("sglang_deploy-*.whl")
    return wheel


def installed_driver(venv: Path, wheel: Path | None = None) -> Path:
    """A fresh virtualenv at venv (no system site-packages, no pip of its own) with the package and its declared
    dependencies installed from the wheelhouse only; the path of its sglang-deploy. wheel: one built already."""
    if wheel is None:
        wheel = build_wheel(venv.parent / f"{venv.name}-wheel")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _pip(
        "--python",
        str(venv / "bin" / "python"),
        "install",
        "-q",
        "--no-compile",  # Python compiles what it imports; the ansible package alone is 36,000 files
        "--no-index",
        "--find-links",
        str(wheelhouse()),
        str(wheel),
    )
    script = venv / "bin" / "sglang-deploy"
    assert script.is_file(), f"{wheel.name} installed no {script}"
    return script


def clean_env(home: Path) -> dict[str, str]:
    """An environment for the installed driver that names nothing of the checkout: no PYTHONPATH, no ANSIBLE_*
    (no ANSIBLE_CONFIG, no inventory), no virtualenv, HOME (its ledger, ~/.ansible) at home; PATH without .venv/bin."""
    venv_bin = str(Path(sys.executable).parent)
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "SGLANG_DEPLOY_"))}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "XDG_STATE_HOME", "COV_CORE_SOURCE", "COV_CORE_CONFIG"):
        keep.pop(name, None)
    path = [p for p in keep.get("PATH", "").split(os.pathsep) if p and p != venv_bin]
    return {**keep, "HOME": str(home), "PATH": os.pathsep.join(path or ["/usr/bin", "/bin"])}
