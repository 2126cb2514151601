"""Render an SGLang server instance from group_vars: the exact argv and environment,
each flag and variable with the name of the setting that produced it."""

from __future__ import annotations

import json
from typing import Any


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
        raise ConfigError(f"sglang_profile {profile!r} is not in sglang_profiles (known: {', '.join(sorted(profiles))})")
    prof = profiles[profile] or {}
    unknown = set(prof) - {"description", "flags", "env", "baseline"}
    if unknown:
        raise ConfigError(f"sglang_profiles.{profile}: unknown keys {sorted(unknown)} (allowed: description, flags, env, baseline)")
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
            raise ConfigError(f"{origins[flag_name(key)]}: --{key.replace('_', '-')} is set from {where}; remove it from the flags")
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
            env[name] = "1" if value is True else "0" if value is False else str(value)
            env_origins[name] = f"{where}.{name}"
    if "CUDA_VISIBLE_DEVICES" in env:
        raise ConfigError(f"{env_origins['CUDA_VISIBLE_DEVICES']}: CUDA_VISIBLE_DEVICES comes from {inst_name}.gpus")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env_origins["CUDA_VISIBLE_DEVICES"] = f"{inst_name}.gpus"
    return {"argv": argv, "origins": origins, "env": env, "env_origins": env_origins, "profile": profile}


def sglang_server_config(instance, profiles, profile, model_path, common_flags=None, common_env=None,
                         listen_host="0.0.0.0", instance_index=0):  # fmt: skip
    from ansible.errors import AnsibleFilterError

    try:
        return server_config(instance, profiles, profile, model_path, common_flags, common_env, listen_host, instance_index)
    except ConfigError as exc:
        raise AnsibleFilterError(str(exc)) from exc


def sglang_profile_argvs(instance, profiles, model_path, common_flags=None, common_env=None, listen_host="0.0.0.0",
                        instance_index=0, prefix=None):  # fmt: skip
    """{profile: the argv this instance would run with it}, to name the profile a running server runs."""
    out = {}
    for name in profiles:
        try:
            conf = server_config(instance, profiles, name, model_path, common_flags, common_env, listen_host, instance_index)
        except ConfigError:
            continue
        out[name] = list(prefix or []) + conf["argv"]
    return out


def systemd_quote(args: list[str]) -> str:
    """An argv as one systemd command line: each word double-quoted when it needs it,
    with backslash, quote, % (specifier) and $ (variable) escaped."""
    out = []
    for arg in args:
        word = str(arg).replace("%", "%%").replace("$", "$$")
        if word and all(c.isalnum() or c in "-_./:=,+@" for c in word):
            out.append(word)
        else:
            out.append('"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"')
    return " ".join(out)


def env_file_line(name: str, value: str) -> str:
    """NAME=value for an EnvironmentFile, double-quoted with escapes."""
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return f'{name}="{escaped}"'


class FilterModule:
    def filters(self):
        return {
            "sglang_server_config": sglang_server_config,
            "sglang_profile_argvs": sglang_profile_argvs,
            "systemd_quote": systemd_quote,
            "env_file_line": lambda item: env_file_line(*item),
        }
