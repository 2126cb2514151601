"""Action plugin of the sglang_server module: a restart's or rollback's progress streamed to the controller.

Without $SGLANG_DEPLOY_PROGRESS_DIR (the driver sets it: its run's progress/ directory), and for verify and
status, the module runs as any module does. With it, a restart or rollback runs detached on the host
(sglang_server detach=true) and this plugin asks sglang_job for its progress, one call per change (at most one
per progress_every seconds, never per second), writing each answer to <dir>/<host>.<instance>.json for the
driver's live table; the task's result is the module's own, as if it had run in one call.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ansible.plugins.action import ActionBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "module_utils"))
from sglang_deploy.progress import DETACHED_ACTIONS, PROGRESS_DIR_ENV, progress_file

# How long one sglang_job call waits on the host for a change (a stalled load answers once per WAIT_S).
WAIT_S = 30.0


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        where = os.environ.get(PROGRESS_DIR_ENV)
        if not where or args.get("action") not in DETACHED_ACTIONS or self._play_context.check_mode:
            result.update(self._execute_module(module_name="sglang_server", module_args=args, task_vars=task_vars))
            return result
        every = float(args.get("progress_every", 2.0))
        path = progress_file(
            where, task_vars.get("inventory_hostname", "?"), (args.get("instance") or {}).get("name", "?")
        )
        res = self._execute_module(
            module_name="sglang_server", module_args={**args, "detach": True}, task_vars=task_vars
        )
        while res.get("sglang_job") and not res.get("failed"):
            self._write(path, res.get("progress") or {}, done=False)
            res = self._execute_module(
                module_name="sglang_job",
                module_args={"job": res["sglang_job"], "seen": res.get("seq", 0), "wait_s": WAIT_S, "min_s": every},
                task_vars=task_vars,
            )
        self._write(
            path,
            {"outcome": res.get("outcome"), "steps": res.get("steps", []), "trail": res.get("trail", [])},
            done=True,
        )
        result.update(res)
        return result

    @staticmethod
    def _write(path: str, doc: dict, done: bool) -> None:
        """The controller's copy, written atomically; received is the controller's clock (the driver's stall
        check compares it with its own)."""
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**doc, "done": done, "received": time.time()}, f, default=str)
        os.replace(tmp, path)
