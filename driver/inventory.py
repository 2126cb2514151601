"""The inventory and --limit, checked with Ansible's own inventory loader before anything runs.

A missing, nonexistent or unparsable inventory, one without hosts, and a --limit (or any part of it)
that matches no host are usage errors (exit 2) with Ansible's own message: ansible-playbook would only
warn, then run on no host and end "successfully".
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / "inventory" / "lab" / "hosts.yml"


class InventoryError(Exception):
    """The inventory or the limit is unusable: the message says why, in Ansible's words where it has some."""


@dataclass
class Checked:
    source: str  # what ansible-playbook is given (-i, or the default)
    hosts: list[str] = field(default_factory=list)  # the hosts the run may act on (after --limit)


def source_of(inventory: str | None) -> str:
    """The inventory a run uses: -i, else $ANSIBLE_INVENTORY (as Ansible reads it), else the local lab's."""
    if inventory is not None:
        if not inventory.strip():
            raise InventoryError("no inventory: -i was given an empty value")
        return inventory
    if os.environ.get("ANSIBLE_INVENTORY"):
        return os.environ["ANSIBLE_INVENTORY"]
    if not DEFAULT.exists():
        raise InventoryError(f"no inventory: the lab is not up (make lab-up) or pass -i ({DEFAULT} does not exist)")
    return str(DEFAULT)


class _Recorder:
    """Stands in for ansible.inventory.manager's Display while the check runs: keeps the warnings and the
    plugins' parse errors for the message, instead of printing them."""

    def __init__(self, real):
        self.real = real
        self.warnings: list[str] = []
        self.failures: list[tuple[str, str]] = []  # (plugin, message with where)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def warning(self, msg, *args, **kwargs) -> None:
        self.warnings.append(str(msg))

    def error_as_warning(self, msg, exception=None, *args, **kwargs) -> None:
        plugin = str(msg).split("'")[1] if str(msg).count("'") >= 2 else str(msg)
        text = " ".join(str(exception).split()) if exception is not None else str(msg)
        origin = getattr(exception, "obj", None)
        path, line = getattr(origin, "path", None), getattr(origin, "line_num", None)
        if path:
            text += f" ({path}{f':{line}' if line else ''})"
        self.failures.append((plugin, text))


@contextlib.contextmanager
def _recording():
    from ansible.inventory import manager

    recorder = _Recorder(manager.display)
    manager.display = recorder
    try:
        yield recorder
    finally:
        manager.display = recorder.real


def _parse_failure(source: str, rec: _Recorder) -> str:
    """Ansible's words for a source it could not parse: each plugin's error once (plugins that agree, together)."""
    by_message: dict[str, list[str]] = {}
    for plugin, text in rec.failures:
        by_message.setdefault(text, []).append(plugin)
    lines = [f"inventory {source} could not be parsed:"]
    lines += [f"  {', '.join(plugins)}: {text}" for text, plugins in by_message.items()]
    lines += [f"  {w}" for w in rec.warnings if w.startswith("Unable to parse")]
    return "\n".join(lines)


def check(inventory: str | None, limit: str | None) -> Checked:
    """Parse the inventory as ansible-playbook will, and match --limit part by part; InventoryError if unusable."""
    source = source_of(inventory)
    if "," not in source and not Path(source).exists():
        raise InventoryError(f"inventory {source}: no such file or directory")
    os.environ.setdefault("ANSIBLE_CONFIG", str(REPO / "ansible.cfg"))  # as runner.py gives ansible-playbook
    # Heavy (about a second): imported only when a command runs, never for --help.
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager, split_host_pattern
    from ansible.parsing.dataloader import DataLoader

    with _recording() as rec:
        try:
            inv = InventoryManager(loader=DataLoader(), sources=[source])
        except AnsibleError as e:
            raise InventoryError(f"inventory {source}: {' '.join(str(e).split())}") from None
        if rec.failures or any(w.startswith("Unable to parse") for w in rec.warnings):
            raise InventoryError(_parse_failure(source, rec))
        every = [h.name for h in inv.get_hosts("all")]
        if not every:
            raise InventoryError(f"inventory {source} has no hosts")
        if not limit:
            return Checked(source, every)
        unmatched = []
        for part in split_host_pattern(limit):
            if not part or part.startswith("@"):
                continue  # a limit file: Ansible reads it below
            try:
                if not inv.get_hosts(part.lstrip("!&")):
                    unmatched.append(part)
            except AnsibleError as e:
                raise InventoryError(f"--limit {limit}: {' '.join(str(e).split())}") from None
        try:
            inv.subset(limit)
            hosts = [h.name for h in inv.get_hosts("all")]
        except AnsibleError as e:
            raise InventoryError(f"--limit {limit}: {' '.join(str(e).split())}") from None
    if unmatched and unmatched != [limit]:
        raise InventoryError(
            f"--limit {limit}: {', '.join(repr(p) for p in unmatched)} matched no host in inventory {source}"
        )
    if not hosts:
        raise InventoryError(f"--limit {limit} matches no host in inventory {source}")
    return Checked(source, hosts)
