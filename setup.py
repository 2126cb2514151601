"""`pip install .`: the driver (the package driver, the console script sglang-deploy) and the collection sglang.deploy.

The metadata is pyproject.toml's; this file only puts the collection into the wheel. The repository root is the
collection (galaxy.yml); the wheel carries it as the Python package ansible_collections/sglang/deploy, the way the
ansible package on PyPI ships its collections: ansible-core finds a collection in any ansible_collections directory
on sys.path, so the installed ansible-playbook runs sglang.deploy.* from site-packages. What goes in is what
`ansible-galaxy collection build` packs (its own ignores, then galaxy.yml's build_ignore), plus galaxy.yml itself
(a collection without MANIFEST.json is named and versioned by it); a symlink inside the collection
(playbooks/group_vars -> ../group_vars) becomes a copy, since wheels hold no links. The checkout's ansible.cfg goes
in as driver/ansible.cfg: the installed driver's Ansible settings (driver/paths.py), the same file.

Building needs setuptools 70.1 or later (bdist_wheel built in) and PyYAML (galaxy.yml): pip's build isolation
fetches both; the project's .venv (setuptools 65, no wheel) cannot build with --no-build-isolation.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("ansible_collections", "sglang", "deploy")
# ansible-galaxy collection build's own ignores (ansible.galaxy.collection._build_files_manifest_walk), less
# galaxy.yml, which the wheel keeps.
GALAXY_IGNORES = ["MANIFEST.json", "FILES.json", "galaxy.yaml", ".git", "*.pyc", "*.retry", "tests/output"]
GALAXY_IGNORE_DIRS = {"CVS", ".bzr", ".hg", ".git", ".svn", "__pycache__", ".tox"}


def collection_files(root: Path = ROOT) -> list[str]:
    """The collection's files, relative to root, as ansible-galaxy collection build walks them (fnmatch of each
    relative path against the ignores, version-control and __pycache__ directories skipped), symlinked directories
    inside the collection followed."""
    import yaml

    galaxy = yaml.safe_load((root / "galaxy.yml").read_text(encoding="utf-8"))
    ignores = [*GALAXY_IGNORES, f"{galaxy['namespace']}-{galaxy['name']}-*.tar.gz", *galaxy.get("build_ignore", [])]
    out: list[str] = []

    def walk(directory: Path) -> None:
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            rel = os.path.relpath(entry.path, root)
            if entry.is_dir():
                if entry.name in GALAXY_IGNORE_DIRS or any(fnmatch.fnmatch(rel, p) for p in ignores):
                    continue
                if entry.is_symlink() and not Path(entry.path).resolve().is_relative_to(root.resolve()):
                    continue  # ansible-galaxy skips a link out of the collection too
                walk(Path(entry.path))
            elif not any(fnmatch.fnmatch(rel, p) for p in ignores):
                out.append(rel)

    walk(root)
    return out


class BuildPy(build_py):
    """build_py, then the collection into build/lib/ansible_collections/sglang/deploy and ansible.cfg beside the
    driver: bdist_wheel packs whatever build/lib holds."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib)
        dest = target / PACKAGE_DIR
        if dest.exists():
            shutil.rmtree(dest)  # a stale build/ of an older tree: nothing it no longer has
        for rel in collection_files():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, dest / rel)  # follows links: their content
        shutil.copyfile(ROOT / "ansible.cfg", target / "driver" / "ansible.cfg")


class Sdist(sdist):
    """The sdist carries what the wheel is built from: the collection's files and ansible.cfg."""

    def make_release_tree(self, base_dir, files) -> None:
        extra = [*collection_files(), "ansible.cfg", "setup.py"]
        super().make_release_tree(base_dir, sorted(set(files) | set(extra)))


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist})
