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

status with this plugin's option render=true (roles/sglang_service/tasks/status.yml): no `instance`; the plugin
renders every instance of sglang_service_instances_selected from the host's variables on the controller, as the role's
render.yml does (sglang_deploy.render: the software generation's id, then each instance's record), and runs the
module once per instance; the result lists each instance's under `instances`, failed when one failed. A status is
then one task a host, not the render's include, facts and loop (docs/fleet-scale.md).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import time
from pathlib import Path

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import outcomes, render
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
# The sglang role (its defaults and lock files) beside this plugin: status names the generation as its preflight does.
SGLANG_ROLE = Path(__file__).resolve().parents[2] / "roles" / "sglang"
MISSING = object()  # a variable not defined at all
REQUIRED = object()  # _var's default: a variable not defined is an error
# The sglang_service role's expression for every instance's record (its vars/main.yml; render.yml keeps it as a fact),
# and the entry point whose arguments a status checks.
SERVICE_ROLE = SGLANG_ROLE.parent / "sglang_service"
RECORDS = "__sglang_service_records"
ENTRY_POINT = "status"
# The module's arguments a status takes from the role's variables (the task may name them itself).
ROLE_ARGS = {"service_user": "sglang_service_user", "state_dir": "sglang_service_state_dir"}
# The filters the records' expression calls.
RECORD_FILTERS = ("sglang.deploy.sglang_instances", "sglang.deploy.sglang_with_tuned", "ansible.builtin.default")
# What Ansible keeps on a module's result for itself (each instance's own result is returned whole otherwise).
NOT_REPORTED = ("invocation", "warnings", "deprecations")  # the last two lifted to the task's result


def _role_file(path: Path, trusted: bool = False):
    from ansible.parsing.dataloader import DataLoader

    try:
        return DataLoader().load_from_file(str(path), trusted_as_template=trusted)
    except TypeError as exc:  # ansible-core before 2.19: no template trust, every template is templated
        if "trusted_as_template" not in str(exc):
            raise
        return DataLoader().load_from_file(str(path))


@functools.cache
def preloaded() -> tuple[dict, dict]:
    """(the sglang role's defaults, the status entry point's argument spec), the records' filters loaded: once a
    process. Loaded when the strategy loads this class, in ansible-playbook's own process, each host's worker (a
    fork) inherits them: parsed and loaded in each worker they were about 0.13 CPU-s a host (docs/fleet-scale.md)."""
    from ansible.plugins.loader import filter_loader

    defaults = _role_file(SGLANG_ROLE / "defaults" / "main.yml", trusted=True) or {}
    spec = _role_file(SERVICE_ROLE / "meta" / "argument_specs.yml")["argument_specs"][ENTRY_POINT]["options"]
    for name in RECORD_FILTERS:
        filter_loader.get(name)
    return defaults, spec


# Without a collection loader set up (ansible-doc, a test importing this file) it is loaded on first use instead.
try:
    preloaded()
except Exception:
    pass


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
        if boolean(args.pop("render", False), strict=False):
            return {**result, **self._status_all(args, task_vars or {})}
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

    def _status_all(self, args: dict, task_vars: dict) -> dict:
        """status of every selected instance, each rendered here (render.yml's records), one module call each. A
        setting refused is invalid_config (the driver's exit 3), before any host is asked."""
        if args.get("action") != "status":
            return {"failed": True, "msg": f"sglang_server: render is for action status, not {args.get('action')}"}
        try:
            records, given = self._rendered(task_vars)
        except (render.ConfigError, AnsibleError, OSError, TypeError, ValueError, KeyError) as exc:
            msg = f"sglang_server: rendering the instances: {exc}"
            return {"failed": True, "outcome": outcomes.INVALID_CONFIG, "msg": msg}
        # The role's service user and state directory, unless the task names others.
        own = {arg: given[var] for arg, var in ROLE_ARGS.items() if var in given}
        out, said, told = [], [], []
        for record in records:
            try:
                res = self._execute_module(
                    module_name="sglang.deploy.sglang_server",
                    module_args={**own, **args, "instance": record},
                    task_vars=task_vars,
                )
            except AnsibleConnectionFailure as exc:  # as Ansible reports it, with the instances asked before
                res = {"unreachable": True, "msg": str(exc)}
            said += [w for w in res.get("warnings") or [] if w not in said]
            told += [d for d in res.get("deprecations") or [] if d not in told]
            one = {"instance": record["name"], **{k: v for k, v in res.items() if not self._hidden(k)}}
            msg = str(one.get("msg") or "")
            one["msg"] = msg if msg.startswith(f"{record['name']}:") else f"{record['name']}: {msg or 'no answer'}"
            out.append(one)
            if res.get("unreachable"):  # the host: its other instances are not asked
                return {
                    "unreachable": True,
                    "instances": out,
                    "msg": one["msg"],
                    "warnings": said,
                    "deprecations": told,
                }
        failed = [r for r in out if r.get("failed")]
        result = {"changed": False, "failed": bool(failed), "instances": out, "warnings": said, "deprecations": told}
        result["msg"] = "; ".join(r["msg"] for r in (failed or out))
        if failed and failed[0].get("outcome"):  # the driver's exit code: the first failed instance's outcome
            result["outcome"] = failed[0]["outcome"]
        return result

    @staticmethod
    def _hidden(key: str) -> bool:
        return key in NOT_REPORTED or key.startswith("_ansible")

    def _rendered(self, task_vars: dict) -> tuple[list[dict], dict]:
        """The selected instances' records, as render.yml renders them: the software generation named as the sglang
        role's preflight names it (its defaults under the host's variables, role_path its own), then the role's own
        expression for the records (RECORDS) with it; those of sglang_service_instances_selected, in order. With
        them, the entry point's variables as checked (_check_arguments)."""
        defaults, _ = preloaded()
        ours = self._templar.copy_with_new_env(
            available_variables={**defaults, **task_vars, "role_path": str(SGLANG_ROLE)}
        )
        software = self._var(ours, "sglang_software", MISSING)
        if software is MISSING:  # a run's own preflight (deploy's sglang role) named it already otherwise
            software = self._software(ours)
        host = self._templar.copy_with_new_env(available_variables={**task_vars, "sglang_software": software})
        given = self._check_arguments(host)
        # The expression over the values just checked (templated once: no template compiled twice in this worker).
        host = self._templar.copy_with_new_env(available_variables={**host.available_variables, **given})
        records = self._var(host, RECORDS)
        selected = self._var(host, "sglang_service_instances_selected")
        return [r for r in records if r["name"] in selected], given

    def _software(self, ours) -> dict:
        """sglang_software as roles/sglang/tasks/preflight.yml names it: the lock (sglang_requirements, else the
        role's lock file for the version and profile, unreadable as none), the patch series as the fileglob and
        file lookups read it (the directory found as Ansible finds a role's file, the files' bytes as they are),
        the generations' directory with default()'s meaning (unset only)."""
        var = self._var
        version, profile = var(ours, "sglang_version"), var(ours, "sglang_install_profile")
        try:
            lock = (SGLANG_ROLE / "files" / "locks" / f"{version}-{profile}.txt").read_bytes()
        except OSError:  # the lookup's errors='ignore': no lock (deploy's assert says so)
            lock = b""
        lock_text = lock.decode("utf-8", "surrogateescape")
        patches = self._patches(var(ours, "sglang_patch_series_dir")) if var(ours, "sglang_patches_enabled") else []
        gens = var(ours, "ml_env_generations_dir", MISSING)
        software = render.software(
            var(ours, "sglang_python_version"),
            version,
            profile,
            render.lock_requirements(var(ours, "sglang_requirements", []), lock_text),
            var(ours, "ml_env_requirements", []),
            patches,
            f"{var(ours, 'ml_env_path', '/opt/ml-env')}.d" if gens is MISSING else gens,
        )
        manifest = self._templar.copy_with_new_env(
            available_variables={**ours.available_variables, "sglang_software": software}
        )
        return {**software, "manifest": var(manifest, "sglang_patch_manifest")}

    def _patches(self, series) -> list[dict]:
        """[{name, content}] of <series>/*.patch in name order, as the fileglob lookup finds them (a relative
        directory in the sglang role's files/ or the playbook's, ~ expanded, no hidden file, files only)."""
        where = os.path.expanduser(str(series))
        if not os.path.isabs(where):
            try:
                where = self._loader.path_dwim_relative_stack([str(SGLANG_ROLE)], "files", where, is_role=True)
            except AnsibleFileNotFound:
                return []
        # As fileglob globs (the directory a pattern too) and as Jinja's sort orders (case-insensitively).
        found = sorted((f for f in glob.glob(os.path.join(where, "*.patch")) if os.path.isfile(f)), key=str.lower)
        out = []
        for path in found:
            with open(path, "rb") as f:  # the file lookup's text: the bytes as they are (\r kept), undecodable kept
                out.append({"name": os.path.basename(path), "content": f.read().decode("utf-8", "surrogateescape")})
        return out

    @staticmethod
    def _var(templar, name: str, default=REQUIRED):
        """A variable templated, `default` when it is not defined at all (Jinja's default(): null is a value); an
        error names the variable."""
        value = templar.available_variables.get(name, MISSING)
        if value is MISSING:
            if default is REQUIRED:
                raise AnsibleError(f"{name} is not defined")
            return default
        try:
            return templar.template(value)
        except AnsibleError as exc:
            raise AnsibleError(f"{name}: {exc}") from exc

    def _check_arguments(self, host) -> dict:
        """The role's status entry point's argument spec, checked here as Ansible checks it before a role's tasks
        (playbooks/status.yml imports the role with rolespec_validate false: no task a host for it); the values
        checked, as templated (not as the spec would convert them: the role reads them as they are)."""
        from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

        _, spec = preloaded()
        given = {name: self._var(host, name) for name in spec if name in host.available_variables}
        errors = ArgumentSpecValidator(spec).validate(given).error_messages
        if errors:
            raise AnsibleError(f"Validating arguments against arg spec '{ENTRY_POINT}': {'; '.join(errors)}")
        return given

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
