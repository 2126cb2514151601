"""The inventory and --limit, checked with Ansible's own inventory loader before anything runs.

A missing, nonexistent or unparsable inventory, one without hosts, and a --limit (or any part of it)
that matches no host are usage errors (exit 2) with Ansible's own message: ansible-playbook would only
warn, then run on no host and end "successfully".

Given the command's playbook, so is a selection that matches nothing there (issue #29): hosts (after --limit)
none of which the playbook's plays run on (their `hosts:` as the playbook files write them, rendered with
their defaults and -e, as ansible-playbook renders them), and an --instance that no such host defines in
its sglang_instances (its value as Ansible's variable precedence gives it: the group_vars/ beside the
playbooks, the inventory's group_vars and host_vars, -e). What Ansible itself cannot render here (a -e it
cannot read, an undefined variable) is left for ansible-playbook to report: never refused on a guess.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from driver import paths

# The lab's inventory: a checkout's default; installed, there is none (driver/paths.py) and -i is required.
DEFAULT = paths.default_inventory()


class InventoryError(Exception):
    """The inventory or the limit is unusable: the message says why, in Ansible's words where it has some."""


@dataclass
class Checked:
    source: str  # what ansible-playbook is given (-i, or the default)
    # the hosts the run may act on: after --limit, and, given the playbook, those its plays run on
    hosts: list[str] = field(default_factory=list)


def source_of(inventory: str | None) -> str:
    """The inventory a run uses: -i, else $ANSIBLE_INVENTORY (as Ansible reads it), else the local lab's (from a
    checkout only: the installed driver has no default)."""
    if inventory is not None:
        if not inventory.strip():
            raise InventoryError("no inventory: -i was given an empty value")
        return inventory
    if os.environ.get("ANSIBLE_INVENTORY"):
        return os.environ["ANSIBLE_INVENTORY"]
    if DEFAULT is None:
        raise InventoryError(
            "no inventory: pass -i/--inventory (or set $ANSIBLE_INVENTORY): the installed driver has no default one"
        )
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


def check(
    inventory: str | None,
    limit: str | None,
    playbook: str | None = None,
    instances: Sequence[str] = (),
    extravars: Sequence[str] = (),
) -> Checked:
    """Parse the inventory as ansible-playbook will, and match --limit part by part; given the playbook (a path
    from the collection's root, as commands.PLAYBOOKS names it), also the selection against its plays' hosts and
    each --instance against the selected hosts' sglang_instances, with -e (extravars, as ansible-playbook takes
    them). InventoryError if unusable."""
    source = source_of(inventory)
    if "," not in source and not Path(source).exists():
        raise InventoryError(f"inventory {source}: no such file or directory")
    os.environ.setdefault("ANSIBLE_CONFIG", str(paths.ansible_cfg()))  # as runner.py gives ansible-playbook
    # Heavy (about a second): imported only when a command runs, never for --help.
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager, split_host_pattern
    from ansible.parsing.dataloader import DataLoader

    loader = DataLoader()
    with _recording() as rec:
        try:
            inv = InventoryManager(loader=loader, sources=[source])
        except AnsibleError as e:
            raise InventoryError(f"inventory {source}: {' '.join(str(e).split())}") from None
        if rec.failures or any(w.startswith("Unable to parse") for w in rec.warnings):
            raise InventoryError(_parse_failure(source, rec))
        every = [h.name for h in inv.get_hosts("all")]
        if not every:
            raise InventoryError(f"inventory {source} has no hosts")
        hosts = every
        if limit:
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
        if playbook is not None:
            hosts = _selection(inv, loader, source, limit, playbook, instances, extravars, hosts)
    return Checked(source, hosts)


def _extra_vars(loader, extravars: Sequence[str]) -> dict:
    """-e as ansible-playbook reads them (ansible.utils.vars.load_extra_vars, which reads them from Ansible's
    global command line and keeps the first answer: not callable here): @file, YAML/JSON, or key=value; each
    trusted as a template, as Ansible's command line trusts them. AnsibleError if one is unreadable."""
    from collections.abc import MutableMapping

    from ansible.errors import AnsibleError
    from ansible.parsing.splitter import parse_kv
    from ansible.template import trust_as_template
    from ansible.utils.vars import combine_vars

    out: dict = {}
    for opt in extravars:
        if not opt:
            continue
        opt = trust_as_template(opt)
        if opt.startswith("@"):
            data = loader.load_from_file(opt[1:], trusted_as_template=True)
        elif opt[0] in "/.":
            raise AnsibleError(f"extra vars {opt!r}: a file is given with '@'")
        elif opt[0] in "[{":
            data = loader.load(opt)
        else:
            data = parse_kv(opt)
        if not isinstance(data, MutableMapping):
            raise AnsibleError(f"extra vars {opt!r}: not a mapping")
        out = combine_vars(out, data)
    return out


def _plays(loader, path: Path, outer: dict):
    """(hosts as written, the play's vars) of each play of the playbook, its imports followed (their vars over
    the play's own, as Ansible's import_playbook applies them; an import's `when` is not evaluated: its plays count)."""
    from ansible import constants as C
    from ansible.utils.vars import combine_vars

    for entry in loader.load_from_file(str(path), cache="none", unsafe=True, trusted_as_template=True) or []:
        if not isinstance(entry, dict):
            continue
        key = next((k for k in C._ACTION_IMPORT_PLAYBOOK if k in entry), None)
        if key is not None:
            yield from _plays(loader, path.parent / str(entry[key]), combine_vars(entry.get("vars") or {}, outer))
        else:
            yield entry.get("hosts"), combine_vars(_play_vars(loader, path.parent, entry), outer)


def _play_vars(loader, base: Path, play: dict) -> dict:
    """The play's vars, its vars_files over them (a list in an entry: the first that exists, as Ansible takes it;
    a templated name is not followed here)."""
    from ansible.utils.vars import combine_vars

    out = play.get("vars") or {}
    files = play.get("vars_files") or []
    for item in [files] if isinstance(files, str) else files:
        for name in [item] if isinstance(item, str) else item:
            if "{{" not in name and (base / name).is_file():
                out = combine_vars(out, loader.load_from_file(str(base / name), trusted_as_template=True) or {})
                break
    return out


def _selection(inv, loader, source: str, limit, playbook: str, instances, extravars, hosts: list[str]) -> list[str]:
    """The hosts (after --limit) the playbook's plays run on; InventoryError when there are none, or when an
    --instance is defined by none of them."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import split_host_pattern
    from ansible.template import Templar
    from ansible.utils.vars import combine_vars

    try:
        extra = _extra_vars(loader, extravars)
    except AnsibleError:
        return hosts  # ansible-playbook says what is wrong with the -e
    path = Path(playbook) if Path(playbook).is_absolute() else paths.collection() / playbook

    # The hosts each play runs on, its `hosts:` rendered as ansible-playbook renders it (the play's vars, -e,
    # the magic variables a play's hosts can use before it runs: groups, playbook_dir; another is undefined
    # here, and the check left to ansible-playbook). The groups a play builds as it runs (group_by, add_host)
    # are made of hosts an earlier play ran on, so match nothing here and take nothing away.
    magic = {"groups": inv.get_groups_dict(), "playbook_dir": str(path.parent)}
    try:
        rendered = [
            Templar(loader=loader, variables=combine_vars(combine_vars(magic, play_vars), extra)).template(written)
            for written, play_vars in _plays(loader, path, {})
        ]
        patterns = [[p] if isinstance(p, str) else list(p or []) for p in rendered]
        selected = {h.name for p in patterns if p for h in inv.get_hosts(p)}
    except (AnsibleError, TypeError):
        patterns = None  # not known here: ansible-playbook renders it or says why not
    if patterns is not None:
        chosen = [h for h in hosts if h in selected]
        if not chosen:
            parts = list(dict.fromkeys(part for p in patterns for item in p for part in split_host_pattern(item)))
            known = [part for part in parts if inv.get_hosts(part.lstrip("!&"), ignore_limits=True)]
            where = ", ".join(known or parts) or "no host"
            what = f"--limit {limit} matches" if limit else f"inventory {source} has"
            raise InventoryError(f"{what} none of the hosts {playbook} plays on ({where})")
        hosts = chosen

    if instances:
        _instances_defined(inv, loader, path.parent, extra, hosts, instances)
    return hosts


def _instances_defined(inv, loader, basedir: Path, extra: dict, hosts: list[str], instances) -> None:
    """InventoryError naming each --instance that none of the hosts defines in its sglang_instances, and the
    instances they do define. A host whose sglang_instances cannot be rendered here refuses nothing."""
    from collections.abc import Mapping

    from ansible.errors import AnsibleError
    from ansible.template import Templar
    from ansible.utils.vars import combine_vars
    from ansible.vars.manager import VariableManager  # a quarter of a second to import: only for --instance

    # Each host's variables by Ansible's own precedence; its vars plugins read the group_vars/ and host_vars/
    # beside the playbook (playbooks/group_vars -> ../group_vars) as ansible-playbook does, and the inventory's.
    loader.set_basedir(str(basedir))
    variables = VariableManager(loader=loader, inventory=inv)
    missing = list(dict.fromkeys(instances))
    defined: dict[str, None] = {}
    unknown = False
    for name in hosts:
        host_vars = combine_vars(variables.get_vars(host=inv.get_host(name), include_hostvars=False), extra)
        try:
            value = Templar(loader=loader, variables=host_vars).template(host_vars.get("sglang_instances", []))
        except AnsibleError:
            unknown = True
            continue
        if not isinstance(value, list):
            unknown = True
            continue
        defined.update((str(i["name"]), None) for i in value if isinstance(i, Mapping) and "name" in i)
        missing = [m for m in missing if m not in defined]
        if not missing:
            return
    if unknown:
        return
    them = "it" if len(missing) == 1 else "them"
    raise InventoryError(
        f"--instance {', '.join(missing)}: no selected host defines {them} (defined: {', '.join(defined) or 'none'})"
    )
