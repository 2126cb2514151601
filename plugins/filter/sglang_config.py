"""The roles' filters over sglang_deploy.render (an instance's argv, environment and record from the inventory's
variables) and sglang_deploy.tune (autotune's plan): thin adapters turning a ConfigError into a filter error."""

from __future__ import annotations

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import render
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.render import (
    ConfigError,
    env_file_line,
    instance_record,
    server_config,
    systemd_quote,
    with_tuned,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.rollout import count_of, rollout_routers
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.tune import (
    SPEC,
    GridError,
    fingerprint,
    plan,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.worker_urls import worker_url


def tune_plan(
    instances, name, profiles, profile, common_flags=None, common_env=None, grid=None, identity=None, software=None
):
    """The sweep over `profile` for instance `name` (sglang_deploy.tune.plan): {index, combinations: [{name,
    label, values, notes, profile}], dropped: [{values, reason}], profiles (every name known), fingerprint (of
    what the sweep starts from: its flags, environment and `identity`, the software and model), software (the
    generation the plan rendered with, `sglang_software`: every measure step of the sweep runs it), the baseline
    first."""
    names = [str(i.get("name")) for i in instances or []]
    if name not in names:
        raise ConfigError(
            f"sglang_tune.instance {name!r} is not one of this host's sglang_instances ({', '.join(names)})"
        )
    index = names.index(name)
    instance = instances[index]
    if profile not in profiles:
        raise ConfigError(f"the sweep's starting profile {profile!r} is not in sglang_profiles")
    start = profiles[profile] or {}
    own = instance.get("flags") or {}
    start_flags = {**(common_flags or {}), **(start.get("flags") or {}), **own}
    start_env = {**(common_env or {}), **(start.get("env") or {}), **(instance.get("env") or {})}
    fixed = {k: f"sglang_instances[{index}].flags.{k}" for k in own}
    fixed.update({k: f"sglang_instances[{index}].env.{k}" for k in instance.get("env") or {}})
    spec_own = sorted(k for k in own if k.startswith(SPEC))
    if spec_own:  # the instance's flags override every profile: the baseline could not turn speculation off
        raise ConfigError(
            f"sglang_instances[{index}].flags.{spec_own[0]} overrides every profile, so the sweep's no-speculation "
            "baseline would still speculate: move the speculative flags into the profile"
        )
    try:
        combos, dropped = plan(start_flags, start_env, grid or {}, fixed)
    except GridError as exc:
        raise ConfigError(str(exc)) from exc
    return {
        "index": index,
        "combinations": [
            {**c.as_dict(), "notes": c.notes, "profile": c.profile(start, f"tune of {profile}")} for c in combos
        ],
        "dropped": dropped,
        "profiles": sorted(profiles),
        "fingerprint": fingerprint(start_flags, start_env, identity),
        "software": software,
    }


def _filter_error(fn, errors: tuple[type[Exception], ...] = (ConfigError,)):
    def wrapped(*args, **kwargs):
        from ansible.errors import AnsibleFilterError

        try:
            return fn(*args, **kwargs)
        except errors as exc:
            raise AnsibleFilterError(str(exc)) from exc

    return wrapped


class FilterModule:
    def filters(self):
        return {
            "sglang_server_config": _filter_error(server_config),
            # the instance's record, rendered once: what the unit template, validation and the modules read
            "sglang_instance": _filter_error(instance_record),
            # sglang_instances | sglang_instances(profiles, ...): every instance's record (sglang_deploy.render).
            "sglang_instances": _filter_error(render.instances),
            "systemd_quote": systemd_quote,
            "env_file_line": lambda item: env_file_line(*item),
            # host | sglang_worker_url(port, scheme): a router worker's URL (sglang_deploy.worker_urls.worker_url).
            "sglang_worker_url": worker_url,
            # sglang_profiles | sglang_with_tuned(hostvars[inventory_hostname]): with every tuned profile.
            "sglang_with_tuned": _filter_error(with_tuned),
            "sglang_tune_plan": _filter_error(tune_plan),
            # '25%' | sglang_count_of(hosts, at_least): the rollout's counts (sglang_deploy.rollout.count_of).
            "sglang_count_of": _filter_error(count_of, (ValueError,)),
            # groups['sglang_routers'] | sglang_rollout_routers(hostvars, defaults, key): every gateway as the rollout
            # reaches it (sglang_deploy.rollout.rollout_routers).
            "sglang_rollout_routers": _filter_error(rollout_routers, (ValueError,)),
        }
