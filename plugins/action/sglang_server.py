"""Action plugin of the sglang_server module: a restart's or rollback's progress streamed to the controller.

Without $SGLANG_DEPLOY_PROGRESS_DIR (the driver sets it: its run's progress/ directory), and for verify and
status, the module runs as any module does. With it, a restart or rollback runs detached on the host
(sglang_server detach=true) and this plugin asks sglang_job for its progress, one call per change (at most one
per progress_every seconds, never per second), writing each answer to <dir>/<host>.<instance>.json for the
driver's live table; the task's result is the module's own, as if it had run in one call.

A poll that fails on the connection (an SSH blip: AnsibleConnectionFailure, or a result marked unreachable) is
asked again, for the same job from the same seq, every few seconds (RECONNECT_FIRST_S doubling up to
RECONNECT_MAX_S) until the option reconnect_s (this plugin's own, default RECONNECT_S; 0: no retry) is out since
the first failed poll; meanwhile the progress file says connection_lost_s. The worker on the host runs on either
way: once the budget is out the task is unreachable, naming the job and its last phase. sglang_job answers an
ended job's result on every call until the plugin acknowledges it (ack), so an answer lost on the way is asked
for again.
"""

from __future__ import annotations

import json
import os
import time

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.progress import (
    DETACHED_ACTIONS,
    PROGRESS_DIR_ENV,
    progress_file,
)

# How long one sglang_job call waits on the host for a change (a stalled load answers once per WAIT_S).
WAIT_S = 30.0
# A poll failing on the connection is asked again for up to reconnect_s (the default) after the first failure,
# RECONNECT_FIRST_S after it, then twice as long each time up to RECONNECT_MAX_S between two.
RECONNECT_S = 120.0
RECONNECT_FIRST_S = 2.0
RECONNECT_MAX_S = 10.0

display = Display()


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = False
    # The controller's clock and sleep while reconnecting (the tests' fakes replace them).
    clock = staticmethod(time.monotonic)
    sleep = staticmethod(time.sleep)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        reconnect_s = max(0.0, float(args.pop("reconnect_s", RECONNECT_S)))  # this plugin's, not the module's
        where = os.environ.get(PROGRESS_DIR_ENV)
        if not where or args.get("action") not in DETACHED_ACTIONS or self._play_context.check_mode:
            result.update(
                self._execute_module(module_name="sglang.deploy.sglang_server", module_args=args, task_vars=task_vars)
            )
            return result
        every = float(args.get("progress_every", 2.0))
        path = progress_file(
            where, task_vars.get("inventory_hostname", "?"), (args.get("instance") or {}).get("name", "?")
        )
        res = self._execute_module(
            module_name="sglang.deploy.sglang_server", module_args={**args, "detach": True}, task_vars=task_vars
        )
        job = None
        while res.get("sglang_job") and not res.get("failed"):
            job, seen, prog = res["sglang_job"], res.get("seq", 0), res.get("progress") or {}
            self._write(path, prog, done=False)
            res = self._poll(path, job, seen, prog, every, reconnect_s, task_vars, boot=res.get("boot_id"))
        if res.get("unreachable") and job:  # the budget is out; the worker on the host goes on
            prog = res["progress"]
            doc = {"outcome": "unreachable", "job": job, "steps": prog.get("steps", []), "trail": prog.get("trail", [])}
            self._write(path, {**doc, **{k: res[k] for k in ("phase", "step", "connection_lost_s")}}, done=True)
        else:
            self._write(
                path,
                {"outcome": res.get("outcome"), "steps": res.get("steps", []), "trail": res.get("trail", [])},
                done=True,
            )
            if job and "lost_job" not in res:  # a killed worker's files stay (sglang_job's answer names them)
                self._ack(job, task_vars)
        result.update(res)
        return result

    def _poll(
        self, path: str, job: str, seen: int, prog: dict, every: float, budget: float, task_vars, boot=None
    ) -> dict:
        """sglang_job's next answer on `job` past `seen`. A poll that fails on the connection is asked again, the
        same, until `budget` seconds are out since the first that failed (each failure written to the progress
        file: connection_lost_s); then an unreachable result naming the job and its last phase."""
        lost_at = None
        delay = RECONNECT_FIRST_S
        while True:
            try:
                res = self._execute_module(
                    module_name="sglang.deploy.sglang_job",
                    module_args={"job": job, "seen": seen, "wait_s": WAIT_S, "min_s": every, "boot_id": boot},
                    task_vars=task_vars,
                )
                if not res.get("unreachable"):
                    return res
                error = res.get("msg") or "unreachable"
            except AnsibleConnectionFailure as exc:
                error = str(exc)
            now = self.clock()
            lost_at = now if lost_at is None else lost_at
            down = now - lost_at
            error = " ".join(error.split())[-500:]
            self._write(path, {**prog, "connection_lost_s": round(down, 1), "connection_error": error}, done=False)
            if down >= budget:
                return self._unreachable(job, prog, down, budget, error)
            self.sleep(min(delay, budget - down))
            delay = min(delay * 2, RECONNECT_MAX_S)

    @staticmethod
    def _unreachable(job: str, prog: dict, down: float, budget: float, error: str) -> dict:
        phase = prog.get("phase") or "its start"
        step = prog.get("step") or ""
        where = phase + (f", {step}" + (f" {prog['detail']}" if prog.get("detail") else "") if step else "")
        return {
            "unreachable": True,
            "changed": True,
            "msg": (
                f"connection to the host lost during the restart, in {where}, for {down:.0f} s (reconnect_s "
                f"{budget:g}): the restart goes on on the host, in its detached job {job}, to its end (restarted, "
                "rolled back or contained) and keeps its result there until it is collected (sglang_job "
                f"job={job}) or the host reboots; `python -m driver status` says what runs. Last error: {error}"
            ),
            "job": job,
            "phase": phase,
            "step": step,
            "progress": prog,
            "connection_lost_s": round(down, 1),
        }

    def _ack(self, job: str, task_vars) -> None:
        """The result is here: the job's files removed on the host. Best effort: a failure leaves them on its
        tmpfs until the next boot, and the task's result is the restart's all the same."""
        try:
            self._execute_module(
                module_name="sglang.deploy.sglang_job", module_args={"job": job, "ack": True}, task_vars=task_vars
            )
        except AnsibleError as exc:
            display.warning(f"{job}: the restart's result is in, its files stay on the host until a reboot: {exc}")

    @staticmethod
    def _write(path: str, doc: dict, done: bool) -> None:
        """The controller's copy, written atomically; received is the controller's clock (the driver's stall
        check compares it with its own)."""
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**doc, "done": done, "received": time.time()}, f, default=str)
        os.replace(tmp, path)
