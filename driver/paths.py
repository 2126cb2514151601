"""Where the driver finds the collection sglang.deploy, Ansible's settings and the default inventory (issue #33).

Two ways to run it, one code path:

- from a checkout (`python -m driver`): the checkout is the collection (its collections/ first on the import path,
  driver/__init__.py), its ansible.cfg the settings, the lab's inventory/lab/hosts.yml the default inventory;
- installed (`pip install .`, then `sglang-deploy`): the collection is the Python package
  ansible_collections.sglang.deploy in site-packages (the wheel carries it, setup.py), the settings the copy of
  the checkout's ansible.cfg the wheel carries beside this file (driver/ansible.cfg), and there is no default
  inventory: -i is required.

Only the standard library, and nothing read until asked: `--help` answers at once.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A checkout: the repository root is the collection, with what a checkout's driver uses: its ansible.cfg and its
# collections/ symlink tree (site-packages, where an installed driver is, has neither).
CHECKOUT: Path | None = (
    ROOT if (ROOT / "ansible.cfg").is_file() and (ROOT / "collections" / "ansible_collections").is_dir() else None
)
PACKAGE = "ansible_collections.sglang.deploy"
# The checkout's ansible.cfg, which the wheel carries as driver/ansible.cfg (setup.py): one file, two places.
SHIPPED_CFG = Path(__file__).resolve().parent / "ansible.cfg"


class NotInstalled(RuntimeError):
    """Neither a checkout nor an installed collection sglang.deploy: the driver has no playbooks to run."""


@functools.cache
def _location() -> Path:
    """ansible_collections/sglang/deploy as Python imports it (unresolved: under a checkout's collections/)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled(f"the collection sglang.deploy ({PACKAGE}) is not installed beside the driver")
    return Path(next(iter(spec.submodule_search_locations)))


def collection() -> Path:
    """The collection's root: playbooks/, roles/, plugins/ (commands.PLAYBOOKS are paths from here)."""
    return CHECKOUT if CHECKOUT else _location().resolve()


def collections_path() -> Path:
    """The directory whose ansible_collections/sglang/deploy is the collection the driver runs: first on
    ANSIBLE_COLLECTIONS_PATH, ahead of any other copy (~/.ansible/collections)."""
    return CHECKOUT / "collections" if CHECKOUT else _location().parents[2]


def ansible_cfg() -> Path:
    """The settings ansible-playbook and the driver's own Ansible read (ANSIBLE_CONFIG)."""
    return CHECKOUT / "ansible.cfg" if CHECKOUT else SHIPPED_CFG


def default_inventory() -> Path | None:
    """The lab's inventory, from a checkout only; installed, None (-i is required)."""
    return CHECKOUT / "inventory" / "lab" / "hosts.yml" if CHECKOUT else None
