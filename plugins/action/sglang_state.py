"""Action plugin of the sglang_state module: the desired state's digest computed on the controller, then one call.

For a check, unless the task gives `digest`, it is the digest (sglang_deploy.digest.desired) of:
- the collection's files that shape a node: DEPLOY_ROLES, DEPLOY_PLAY and plugins/ beside this file, the task's
  `inputs`, and a patch series the inventory keeps elsewhere (sglang_patch_series_dir); ansible-core's version;
- the host's deploy variables as the inventory (host and group variables) and -e give them, each templated with
  those alone (a vault value, an environment lookup, another inventory variable resolved; one that names a role's
  default or a fact is kept as written). Not the play's variables nor the roles' defaults: those are files of the
  collection, hashed as such, so deploy.yml (its roles' defaults in scope) and drift.yml (none) agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ansible.plugins.action import ActionBase
from ansible.release import __version__ as ANSIBLE_CORE

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import digest

# The roles deploy.yml runs on a GPU node and the play itself (its tasks, what it fingerprints), in the collection
# beside this plugin.
DEPLOY_ROLES = ("gpu_node", "cuda", "ml_env", "sglang", "sglang_service")
DEPLOY_PLAY = ("playbooks/deploy.yml", "playbooks/vars/deploy_state.yml")
COLLECTION = Path(__file__).resolve().parents[2]
# Variables naming controller files the roles read, where the inventory sets them (their defaults are in the roles).
INPUT_VARS = ("sglang_patch_series_dir",)


def roots(inputs: list[str]) -> list[str]:
    """What the desired state's files are read from: the deploy's roles and play, the plugins, the task's inputs."""
    own = [str(COLLECTION / "roles" / r) for r in DEPLOY_ROLES] + [str(COLLECTION / p) for p in DEPLOY_PLAY]
    return own + [str(COLLECTION / "plugins")] + [str(Path(p).resolve()) for p in inputs]


def host_vars(task_vars: dict) -> dict:
    """The host's variables as the inventory and -e give them, untemplated (no play, no role defaults)."""
    raw = task_vars["hostvars"].raw_get(task_vars["inventory_hostname"])
    return raw if isinstance(raw, dict) else {}


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        inputs = list(args.pop("inputs", None) or [])  # the controller's paths: nothing for the host
        if args.get("action") == "check" and not args.get("digest"):
            own = self.resolved(host_vars(task_vars or {}))
            inputs += [str(own[v]) for v in INPUT_VARS if isinstance(own.get(v), str) and own[v].startswith("/")]
            try:
                tree = digest.files_digest(roots(inputs))
            except digest.StateError as exc:
                return {**result, "failed": True, "msg": f"sglang_state: the desired state's files: {exc}"}
            args["digest"] = digest.desired({**digest.deploy_vars(own), "ansible_core": ANSIBLE_CORE}, tree)
        result.update(
            self._execute_module(module_name="sglang.deploy.sglang_state", module_args=args, task_vars=task_vars)
        )
        return result

    def resolved(self, own: dict) -> dict:
        """Each deploy variable templated with the host's own variables alone, leaf by leaf; a leaf that does not
        resolve so (a role's default, a fact) stays as written, its neighbours resolved all the same."""
        templar = self._templar.copy_with_new_env(available_variables=own)

        def leaf(value):
            if isinstance(value, Mapping):
                return {k: leaf(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [leaf(v) for v in value]
            if isinstance(value, (bool, int, float)) or value is None:
                return value
            if isinstance(value, str) and "{" not in value and type(value) is str:
                return value
            try:  # a template, or a vaulted value
                return templar.template(value)
            except Exception:  # any templating failure (undefined, a lookup's error): as written
                return value

        return {n: leaf(v) for n, v in own.items() if digest.DEPLOY_VARS.match(n) and n not in digest.RUN_SCOPED}
