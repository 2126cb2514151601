"""Render an SGLang server instance from group_vars: the exact argv and environment,
each flag and variable with the name of the setting that produced it."""

from __future__ import annotations

import json
import re
from typing import Any

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import NAME
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.rollout import count_of
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.router import worker_url
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import (
    REFUSED_FLAGS,
    secret_name,
    secret_value,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.tune import (
    SPEC,
    TUNED_PREFIX,
    GridError,
    fingerprint,
    plan,
)


class ConfigError(ValueError):
    pass


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _render_value(flag: str, value: Any) -> list[str]:
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (list, tuple)):
        return [flag, *(str(v) for v in value)] if value else []
    if isinstance(value, dict):
        return [flag, json.dumps(value, sort_keys=True)]
    return [flag, str(value)]


def server_config(
    instance: dict[str, Any],
    profiles: dict[str, Any],
    profile: str,
    model_path: str,
    common_flags: dict[str, Any] | None = None,
    common_env: dict[str, Any] | None = None,
    listen_host: str = "0.0.0.0",
    instance_index: int = 0,
) -> dict[str, Any]:
    """{argv, origins, env, env_origins, profile} for one instance.

    Precedence, lowest first: sglang_server_flags, the profile's flags, the
    instance's flags; the same for the environment. The instance's GPUs become
    CUDA_VISIBLE_DEVICES and, unless a flag says otherwise, the tensor parallel size.
    """
    if profile not in profiles:
        raise ConfigError(
            f"sglang_profile {profile!r} is not in sglang_profiles (known: {', '.join(sorted(profiles))})"
        )
    prof = profiles[profile] or {}
    unknown = set(prof) - {"description", "flags", "env", "baseline"}
    if unknown:
        raise ConfigError(
            f"sglang_profiles.{profile}: unknown keys {sorted(unknown)} (allowed: description, flags, env, baseline)"
        )
    inst_name = f"sglang_instances[{instance_index}]"
    gpus = instance.get("gpus") or []
    if not gpus:
        raise ConfigError(f"{inst_name} ({instance.get('name', '?')}) has no gpus")
    layers = [
        ("sglang_server_flags", common_flags or {}),
        (f"sglang_profiles.{profile}.flags", prof.get("flags") or {}),
        (f"{inst_name}.flags", instance.get("flags") or {}),
    ]
    flags: dict[str, Any] = {}
    origins: dict[str, str] = {}
    for where, layer in layers:
        for key, value in layer.items():
            if key.startswith("-") or key != key.lower():
                raise ConfigError(f"{where}.{key}: write flags as snake_case keys (tp_size for --tp-size)")
            if flag_name(key) in REFUSED_FLAGS and value not in (None, False, ""):
                raise ConfigError(
                    f"{where}.{key}: a secret on a command line and in the unit file; set "
                    "sglang_service_api_key instead (a root-only secrets file; the launcher passes it)"
                )
            flags[key] = value
            origins[flag_name(key)] = f"{where}.{key}"
    fixed = {
        "model_path": (model_path, "sglang_model_path"),
        "host": (listen_host, "sglang_listen_host"),
        "port": (instance.get("port"), f"{inst_name}.port"),
    }
    # One model over several nodes: every node runs the same instance with its own rank.
    nnodes = int(instance.get("nnodes") or 1)
    if nnodes > 1:
        for key in ("node_rank", "dist_init_addr"):
            if instance.get(key) in (None, ""):
                raise ConfigError(f"{inst_name}.{key} is not set, but {inst_name}.nnodes is {nnodes}")
        if not 0 <= int(instance["node_rank"]) < nnodes:
            raise ConfigError(f"{inst_name}.node_rank is {instance['node_rank']}, not in 0..{nnodes - 1}")
        fixed["nnodes"] = (nnodes, f"{inst_name}.nnodes")
        fixed["node_rank"] = (int(instance["node_rank"]), f"{inst_name}.node_rank")
        fixed["dist_init_addr"] = (instance["dist_init_addr"], f"{inst_name}.dist_init_addr")
    for key, (value, where) in fixed.items():
        if key in flags:
            raise ConfigError(
                f"{origins[flag_name(key)]}: --{key.replace('_', '-')} is set from {where}; remove it from the flags"
            )
        if value is None or value == "":
            raise ConfigError(f"{where} is not set")
    argv: list[str] = []
    for key, (value, where) in fixed.items():
        argv += _render_value(flag_name(key), value)
        origins[flag_name(key)] = where
    if "tp_size" not in flags and "tp" not in flags:
        flags["tp_size"] = len(gpus) * nnodes // int(flags.get("dp_size") or 1) // int(flags.get("pp_size") or 1) or 1
        origins["--tp-size"] = f"{inst_name}.gpus (one tensor-parallel rank per GPU)"
    for key in sorted(flags):
        argv += _render_value(flag_name(key), flags[key])

    env: dict[str, str] = {}
    env_origins: dict[str, str] = {}
    for where, layer in (
        ("sglang_server_env", common_env or {}),
        (f"sglang_profiles.{profile}.env", prof.get("env") or {}),
        (f"{inst_name}.env", instance.get("env") or {}),
    ):
        for name, value in layer.items():
            if value is None:  # null unsets what a lower layer set (autotune's baseline and '' values)
                env.pop(name, None)
                env_origins.pop(name, None)
                continue
            if secret_name(name) and secret_value(value):
                # The env file is configuration: recorded in every known-good generation and rolled back.
                raise ConfigError(
                    f"{where}.{name}: a secret in the instance's env file, which every known-good generation "
                    f"records and a rollback puts back; set sglang_service_secret_env.{name} instead (a root-only "
                    "secrets file, always the current value, never recorded)"
                )
            env[name] = "1" if value is True else "0" if value is False else str(value)
            env_origins[name] = f"{where}.{name}"
    if "CUDA_VISIBLE_DEVICES" in env:
        raise ConfigError(f"{env_origins['CUDA_VISIBLE_DEVICES']}: CUDA_VISIBLE_DEVICES comes from {inst_name}.gpus")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env_origins["CUDA_VISIBLE_DEVICES"] = f"{inst_name}.gpus"
    return {"argv": argv, "origins": origins, "env": env, "env_origins": env_origins, "profile": profile}


def sglang_server_config(
    instance, profiles, profile, model_path, common_flags=None, common_env=None, listen_host="0.0.0.0", instance_index=0
):
    from ansible.errors import AnsibleFilterError

    try:
        return server_config(
            instance, profiles, profile, model_path, common_flags, common_env, listen_host, instance_index
        )
    except ConfigError as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_instance(
    instance,
    index,
    profiles,
    profile,
    model_path,
    common_flags=None,
    common_env=None,
    listen_host="0.0.0.0",
    venv="/opt/ml-env",
    launch_module="sglang.launch_server",
    config_dir="/etc/sglang",
    launcher="/usr/local/libexec/sglang-deploy/sglang-launch",
):
    """The instance's record, rendered once: what the unit template, validation and the modules read."""
    from ansible.errors import AnsibleFilterError

    try:
        return instance_record(
            instance,
            index,
            profiles,
            profile,
            model_path,
            common_flags,
            common_env,
            listen_host,
            venv,
            launch_module,
            config_dir,
            launcher,
        )
    except ConfigError as exc:
        raise AnsibleFilterError(str(exc)) from exc


# Directories under the state dir that are sglang-deploy's: StateDirectory=sglang/<name> must not be one.
RESERVED_NAMES = ("known-good", "validated", "locks", "pending", "secrets", "instances", "evidence")


def instance_record(
    instance,
    index,
    profiles,
    profile,
    model_path,
    common_flags,
    common_env,
    listen_host,
    venv,
    launch_module,
    config_dir,
    launcher,
) -> dict[str, Any]:
    name = str(instance.get("name") or "")
    if not NAME.match(name) or name in RESERVED_NAMES:
        raise ConfigError(
            f"sglang_instances[{index}].name {name!r}: use lowercase letters, digits, '-' and '_' "
            f"(it names the unit, its files and its lock), not one of {', '.join(RESERVED_NAMES)}"
        )
    check_profile_names(profiles, profile, f"sglang_instances[{index}] ({name})")
    conf = server_config(instance, profiles, profile, model_path, common_flags, common_env, listen_host, index)
    # The launcher adds the API key from the secrets file in-process: never on the command line.
    prefix = [f"{venv}/bin/python", launcher, launch_module]
    others = {}
    for other in profiles:
        try:
            others[other] = (
                prefix
                + server_config(instance, profiles, other, model_path, common_flags, common_env, listen_host, index)[
                    "argv"
                ]
            )
        except ConfigError:
            continue
    baseline = ((profiles[profile] or {}).get("baseline") or {}).get("output_tokens_per_s")
    return {
        "name": name,
        "unit": f"sglang-{name}.service",
        "unit_path": f"/etc/systemd/system/sglang-{name}.service",
        "env_path": f"{config_dir}/{name}.env",
        "secrets_path": f"{config_dir}/secrets/{name}.env",
        "pending_dir": f"{config_dir}/pending",
        "port": instance["port"],
        "gpus": list(instance["gpus"]),
        "nnodes": int(instance.get("nnodes") or 1),
        "node_rank": int(instance.get("node_rank") or 0),
        "dist_init_addr": instance.get("dist_init_addr") or None,
        "profile": profile,
        "python": prefix[0],
        "server_argv": conf["argv"],
        "argv": prefix + conf["argv"],
        "origins": conf["origins"],
        "env": conf["env"],
        "env_origins": conf["env_origins"],
        "profiles_argv": others,
        "baseline": baseline,
    }


PROFILE_RULE = "is not a name the unit can hold: lowercase letters, digits, '-' and '_' (as an instance's name)"


def check_profile_names(profiles: dict, profile: str, instance: str) -> None:
    """A profile's name goes raw into the unit (Description=, a comment): the instance name's pattern, so a '%'
    (a specifier) or a newline (a directive of its own) never reaches systemd. Checked before anything renders."""
    bad = next((str(k) for k in profiles if not NAME.match(str(k))), None)
    if bad is not None:
        raise ConfigError(f"sglang_profiles: the profile name {bad!r} {PROFILE_RULE}")
    if not NAME.match(str(profile)):
        raise ConfigError(
            f"{instance}: its profile {profile!r} (sglang_service_instance_profiles, the instance's profile or "
            f"sglang_profile) {PROFILE_RULE}"
        )


# Characters a unit file cannot hold raw inside a quoted word: a newline or carriage return ends the line (the
# word's quote then never closes), other control characters are written as C escapes too (systemd.syntax(7)).
CONTROL = re.compile(r"[\x01-\x08\x0a-\x1f\x7f]")


def systemd_quote(args: list[str]) -> str:
    """An argv as one systemd command line (systemd.service(5), "Command lines"): each word double-quoted when
    it needs it, with backslash and quote escaped, % (specifier) and $ (variable) doubled, and control characters
    (a newline) as C escapes, which systemd resolves in a quoted word."""
    out = []
    for arg in args:
        word = str(arg).replace("%", "%%").replace("$", "$$")
        if word and all(c.isalnum() or c in "-_./:=,+@" for c in word):
            out.append(word)
        else:
            word = word.replace("\\", "\\\\").replace('"', '\\"')
            out.append('"' + CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", word) + '"')
    return " ".join(out)


def env_file_line(name: str, value: str) -> str:
    """NAME=value for an EnvironmentFile, double-quoted with escapes."""
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'{name}="{escaped}"'


def with_tuned(profiles: dict, host_vars) -> dict:
    """sglang_profiles and every tuned profile: a variable sglang_tuned_profile_<name> (a group_vars file that
    `python -m driver tune` wrote, or the sweep's combination) is profile <name>. A tuned name that is also one
    of sglang_profiles is refused: a tuned profile never replaces the operator's."""
    out = dict(profiles or {})
    for var in sorted(k for k in host_vars if str(k).startswith(TUNED_PREFIX)):
        name = var[len(TUNED_PREFIX) :]
        if not NAME.match(name):
            raise ConfigError(f"{var}: the profile name {name!r} {PROFILE_RULE}")
        if name in out:
            raise ConfigError(f"{var}: sglang_profiles has a profile {name!r} already; rename the tuned one")
        if not isinstance(host_vars[var], dict):
            raise ConfigError(
                f"{var}: a profile (description, flags, env, baseline), not {type(host_vars[var]).__name__}"
            )
        out[name] = host_vars[var]
    return out


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
            "sglang_server_config": sglang_server_config,
            "sglang_instance": sglang_instance,
            "systemd_quote": systemd_quote,
            "env_file_line": lambda item: env_file_line(*item),
            # host | sglang_worker_url(port, scheme): a router worker's URL (sglang_deploy.router.worker_url).
            "sglang_worker_url": worker_url,
            # sglang_profiles | sglang_with_tuned(hostvars[inventory_hostname]): with every tuned profile.
            "sglang_with_tuned": _filter_error(with_tuned),
            "sglang_tune_plan": _filter_error(tune_plan),
            # '25%' | sglang_count_of(hosts, at_least): the rollout's counts (sglang_deploy.rollout.count_of).
            "sglang_count_of": _filter_error(count_of, (ValueError,)),
        }
