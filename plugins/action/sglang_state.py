"""Action plugin of the sglang_state module: the desired state's digest computed on the controller, then one call.

Unless the task gives `digest`, it is the digest (sglang_deploy.digest.desired) of the collection's files that shape
a node (DEPLOY_ROLES, DEPLOY_PLAY and plugins/, beside this file, and the task's `inputs`) and of the host's deploy
variables as written, before templating: the inventory's (host and group variables) and -e's, as hostvars holds
them. Not the play's or the roles' defaults: those are files of the collection, hashed as such, and so the same
digest comes out of deploy.yml (its roles' defaults in scope) and drift.yml (none).
"""

from __future__ import annotations

from pathlib import Path

from ansible.plugins.action import ActionBase

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import digest

# The roles deploy.yml runs on a GPU node and the play itself (its tasks, what it fingerprints), in the collection
# beside this plugin.
DEPLOY_ROLES = ("gpu_node", "cuda", "ml_env", "sglang", "sglang_service")
DEPLOY_PLAY = ("playbooks/deploy.yml", "playbooks/vars/deploy_state.yml")
COLLECTION = Path(__file__).resolve().parents[2]


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
        if not args.get("digest"):
            try:
                tree = digest.files_digest(roots(args.get("inputs") or []))
            except digest.StateError as exc:
                return {**result, "failed": True, "msg": f"sglang_state: the desired state's files: {exc}"}
            args["digest"] = digest.desired(digest.deploy_vars(host_vars(task_vars or {})), tree)
        args.pop("inputs", None)  # the controller's paths: nothing for the host
        result.update(
            self._execute_module(module_name="sglang.deploy.sglang_state", module_args=args, task_vars=task_vars)
        )
        return result
