#!/usr/bin/python
"""Ansible module: a host's deployed state against the desired one, in one call (a thin adapter over digest)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_state
short_description: Compare a host's deployed state with the desired one, or record it after a complete deploy
description:
  - C(check) compares the host's record of its last complete deploy (I(record)) with I(digest), the desired state's
    digest, and fingerprints what that deploy left (the record's I(paths) unless given, and always the package
    database, users, groups, the OS release and the GPUs nvidia-smi lists) to compare it with the record's. The host is C(current) when both
    match.
  - With I(forget), a C(check) that finds the host not current (or any, without I(keep_current)) sets its record
    aside (not in check mode), so that a deploy that stops half way leaves no record vouching for it, and keeps
    I(digest) on the host under a C(check_id) it returns.
  - C(record) writes the record (root's alone, atomically) at the end of a complete deploy, with the digest its check
    kept under I(check_id); none where another run began on the host since or at once (two controllers).
  - C(forget) sets the record aside, for a run that changes the host without the check (C(--tags), a part of a
    deploy, vouches for no whole state).
  - I(digest) is never returned (it hashes the host's secret variables among the rest).
  - The action plugin of the same name computes I(digest) on the controller when it is not given (the collection's
    roles and plugins, I(inputs), and the host's deploy variables as written; sglang_deploy.digest).
  - Neither action reports a change; the record is the deploy's own bookkeeping (check mode reports as a run does).
options:
  action:
    description: C(check) the host against I(digest), C(record) it as deployed to the digest its check kept, or
      C(forget) its record.
    type: str
    choices: [check, record, forget]
    required: true
  digest:
    description: The desired state's digest (C(check)). Computed by the action plugin when unset.
    type: str
  check_id:
    description: What the C(check) that set the record aside returned, naming this run's check (C(record)).
    type: str
  inputs:
    description: Files or directories on the controller that shape the deploy besides the collection's roles and
      plugins (a patch series kept elsewhere); read by the action plugin only.
    type: list
    elements: path
    default: []
  paths:
    description: What the deploy leaves on the host (C(record); with C(check), instead of the record's own list),
      each fingerprinted by its I(kind) - C(file) (content, mode,
      owner), C(tree) (every file's content under it), C(listing) (every entry's type, size, mode and mtime; a
      virtualenv), C(entries) (its own entries' names, types and links), C(stat) (its own type, mode and owner alone),
      C(glob) (each match's content). A directory's own mode and owner count in every kind.
    type: list
    elements: dict
    suboptions:
      path:
        description: An absolute path (a glob pattern for C(glob)).
        type: str
        required: true
      kind:
        description: How it is fingerprinted.
        type: str
        choices: [file, tree, listing, entries, stat, glob]
        required: true
  record:
    description: The record's path on the host.
    type: path
    default: /var/lib/sglang-deploy/deploy-state.json
  forget:
    description: With C(check), set the record aside when the host is not current (never in check mode).
    type: bool
    default: false
  keep_current:
    description: With C(check) and I(forget), whether a current host is left as it is (the deploy ends it); false, it
      begins a run all the same (every role runs, then C(record)).
    type: bool
    default: true
  on_error:
    description: What a path that cannot be read does - C(fail) the task, or C(warn) and call the host not current
      (the deploy then runs every role, as without the check).
    type: str
    choices: [fail, warn]
    default: fail
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Compare the host with its desired state
  become: true
  sglang.deploy.sglang_state:
    action: check
    forget: true
  register: state

- name: Record the host as deployed
  become: true
  sglang.deploy.sglang_state:
    action: record
    check_id: "{{ state.check_id }}"
    paths:
      - {path: /etc/systemd/system/sglang-*.service, kind: glob}
      - {path: /opt/ml-env, kind: listing}
"""

RETURN = r"""
current:
  description: Whether the host's record names I(digest) and nothing it fingerprinted moved (C(check)).
  type: bool
  returned: always
why:
  description: Why the host is not current, one line each (none when it is).
  type: list
  elements: str
  returned: always
forgotten:
  description: Whether the record was set aside (C(check) with I(forget) on a host not current, C(forget)).
  type: bool
  returned: always
check_id:
  description: What C(record) must be given to record this run's check (C(check) with I(forget) on a host not current).
  type: str
  returned: when the record was set aside
recorded:
  description: Whether the record was written (C(record)).
  type: bool
  returned: always
outcome:
  description: C(current) or C(drifted) (sglang_deploy.outcomes), as C(current) says.
  type: str
  returned: always
msg:
  description: The host's state in a line (what moved, when it drifted).
  type: str
  returned: always
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import digest as state
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes


def _forget_quietly(module: AnsibleModule, record: str) -> None:
    """A check that could not read the state sets the record aside all the same (every role runs; no record
    vouches for what they leave), a failure to do so a warning too."""
    try:
        state.forget(record)
    except OSError as exc:
        module.warn(f"sglang_state: the record could not be set aside: {exc}")


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            action=dict(type="str", required=True, choices=["check", "record", "forget"]),
            digest=dict(type="str", no_log=True),
            check_id=dict(type="str"),
            inputs=dict(type="list", elements="path", default=[]),
            paths=dict(
                type="list",
                elements="dict",
                options=dict(
                    path=dict(type="str", required=True),
                    kind=dict(type="str", required=True, choices=list(state.KINDS)),
                ),
            ),
            record=dict(type="path", default=state.RECORD),
            forget=dict(type="bool", default=False),
            keep_current=dict(type="bool", default=True),
            on_error=dict(type="str", choices=["fail", "warn"], default="fail"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    out = {"changed": False, "current": False, "why": [], "forgotten": False, "recorded": False}
    try:
        if p["action"] == "forget":
            out["forgotten"] = False if module.check_mode else state.forget(p["record"])
        elif p["action"] == "record":
            if p["paths"] is None or not p["check_id"]:
                module.fail_json(msg="record needs paths (what the deploy leaves) and its check's check_id", **out)
            if not module.check_mode:
                out["recorded"] = state.record(p["record"], p["check_id"], p["paths"])
            out["current"] = out["recorded"]
            if not out["recorded"]:
                out["why"] = ["another run checked the host since this one: nothing recorded"]
        else:
            if not p["digest"]:  # the action plugin fills it in; the module run by itself must be given one
                module.fail_json(msg="digest: the desired state's digest is required (the action plugin computes it)")
            out["current"], out["why"] = state.check(p["record"], p["digest"], p["paths"])
            # Every role runs unless the host is current and kept so: the run begins (its record at the end).
            if p["forget"] and not (out["current"] and p["keep_current"]) and not module.check_mode:
                out["forgotten"], out["check_id"] = True, state.begin(p["record"], p["digest"])
    except Exception as exc:  # anything the host's state raises: a failure (drift), or every role (deploy)
        if p["on_error"] == "fail" or not isinstance(exc, (state.StateError, OSError, ValueError, KeyError)):
            module.fail_json(msg=f"sglang_state {p['action']}: {exc}", **out)  # a failure, not a drift
        module.warn(f"sglang_state {p['action']}: {exc}: the host is taken as not current")
        out["current"], out["why"] = False, [f"the state could not be read: {exc}"]
        if p["forget"] and not module.check_mode:
            _forget_quietly(module, p["record"])
    out["outcome"] = outcomes.CURRENT if out["current"] else outcomes.DRIFTED
    out["msg"] = out["outcome"] if out["current"] else f"{out['outcome']}: " + "; ".join(out["why"])
    module.exit_json(**out)


if __name__ == "__main__":
    main()
