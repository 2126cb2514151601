"""An SGLang server instance rendered from the inventory's variables: the exact argv and environment, each flag
and variable with the name of the setting that produced it, and the instance's record (instance_record: what the
unit template, validation and the modules read); the software generation the units run (software).

No Ansible here: plugins/filter/sglang_config.py is the adapter the roles call, plugins/action/sglang_server.py
renders status's instances with the same functions.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .instance import NAME
from .secret_rule import REFUSED_FLAGS, secret_name, secret_value
from .tune import TUNED_PREFIX


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
    prof = _profile(profiles, profile)
    inst_name = f"sglang_instances[{instance_index}]"
    gpus = instance.get("gpus") or []
    if not gpus:
        raise ConfigError(f"{inst_name} ({instance.get('name', '?')}) has no gpus")
    flags, origins = _layered_flags(
        [
            ("sglang_server_flags", common_flags or {}),
            (f"sglang_profiles.{profile}.flags", prof.get("flags") or {}),
            (f"{inst_name}.flags", instance.get("flags") or {}),
        ]
    )
    nnodes = int(instance.get("nnodes") or 1)
    argv = _fixed_argv(_fixed_flags(instance, inst_name, model_path, listen_host, nnodes), flags, origins)
    if "tp_size" not in flags and "tp" not in flags:
        flags["tp_size"] = len(gpus) * nnodes // int(flags.get("dp_size") or 1) // int(flags.get("pp_size") or 1) or 1
        origins["--tp-size"] = f"{inst_name}.gpus (one tensor-parallel rank per GPU)"
    for key in sorted(flags):
        argv += _render_value(flag_name(key), flags[key])
    env, env_origins = _layered_env(
        [
            ("sglang_server_env", common_env or {}),
            (f"sglang_profiles.{profile}.env", prof.get("env") or {}),
            (f"{inst_name}.env", instance.get("env") or {}),
        ]
    )
    if "CUDA_VISIBLE_DEVICES" in env:
        raise ConfigError(f"{env_origins['CUDA_VISIBLE_DEVICES']}: CUDA_VISIBLE_DEVICES comes from {inst_name}.gpus")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    env_origins["CUDA_VISIBLE_DEVICES"] = f"{inst_name}.gpus"
    return {"argv": argv, "origins": origins, "env": env, "env_origins": env_origins, "profile": profile}


def _profile(profiles: dict[str, Any], profile: str) -> dict[str, Any]:
    """The profile's settings ({} for an empty one); ConfigError for an unknown profile or an unknown key in it."""
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
    return prof


def _layered_flags(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """(flags, origins) of (where, flags) layers, lowest first: a later layer's key replaces an earlier one's.

    ConfigError for a key not written as snake_case and for a secret flag (it would sit in the unit file)."""
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
    return flags, origins


def _fixed_flags(
    instance: dict[str, Any], inst_name: str, model_path: str, listen_host: str, nnodes: int
) -> dict[str, tuple[Any, str]]:
    """{key: (value, the setting it comes from)} of the flags no flags layer may set: model, address, placement."""
    fixed = {
        "model_path": (model_path, "sglang_model_path"),
        "host": (listen_host, "sglang_listen_host"),
        "port": (instance.get("port"), f"{inst_name}.port"),
    }
    # One model over several nodes: every node runs the same instance with its own rank.
    if nnodes > 1:
        for key in ("node_rank", "dist_init_addr"):
            if instance.get(key) in (None, ""):
                raise ConfigError(f"{inst_name}.{key} is not set, but {inst_name}.nnodes is {nnodes}")
        if not 0 <= int(instance["node_rank"]) < nnodes:
            raise ConfigError(f"{inst_name}.node_rank is {instance['node_rank']}, not in 0..{nnodes - 1}")
        fixed["nnodes"] = (nnodes, f"{inst_name}.nnodes")
        fixed["node_rank"] = (int(instance["node_rank"]), f"{inst_name}.node_rank")
        fixed["dist_init_addr"] = (instance["dist_init_addr"], f"{inst_name}.dist_init_addr")
    return fixed


def _fixed_argv(fixed: dict[str, tuple[Any, str]], flags: dict[str, Any], origins: dict[str, str]) -> list[str]:
    """The argv of the fixed flags, their origins recorded; ConfigError for one a flags layer sets too, or one unset."""
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
    return argv


def _layered_env(layers: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, str], dict[str, str]]:
    """(env, origins) of (where, variables) layers, lowest first, each value as the env file writes it.

    ConfigError for a secret (the env file is configuration; secrets go to the secrets file)."""
    env: dict[str, str] = {}
    env_origins: dict[str, str] = {}
    for where, layer in layers:
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
    return env, env_origins


RESERVED_NAMES = ("known-good", "validated", "locks", "pending", "secrets", "instances", "evidence")

# The fields of instance_record's record validation cannot do without: a record lacking one was not rendered here.
RECORD_KEYS = ("name", "port", "gpus", "server_argv", "python")


def placement(instance) -> tuple[int, int]:
    """(node_rank, nnodes) of an instance, its inventory item or its record: rank 0 of one node unless set."""
    return int(instance.get("node_rank") or 0), int(instance.get("nnodes") or 1)


def instance_record(
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
) -> dict[str, Any]:
    """The instance's record, rendered once: what the unit template, validation and the modules read."""
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
    node_rank, nnodes = placement(instance)
    return {
        "name": name,
        "unit": f"sglang-{name}.service",
        "unit_path": f"/etc/systemd/system/sglang-{name}.service",
        "env_path": f"{config_dir}/{name}.env",
        "secrets_path": f"{config_dir}/secrets/{name}.env",
        "pending_dir": f"{config_dir}/pending",
        "port": instance["port"],
        "gpus": list(instance["gpus"]),
        "nnodes": nnodes,
        "node_rank": node_rank,
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


def instances(
    items,
    profiles,
    instance_profiles,
    default_profile,
    model_path,
    common_flags=None,
    common_env=None,
    listen_host="0.0.0.0",
    venv="/opt/ml-env",
    launch_module="sglang.launch_server",
    config_dir="/etc/sglang",
    launcher="/usr/local/libexec/sglang-deploy/sglang-launch",
) -> list[dict[str, Any]]:
    """Every instance's record (sglang_instances in order): its profile is sglang_service_instance_profiles' for its
    name, else its own `profile`, else sglang_profile (`profiles` holds the tuned ones: with_tuned)."""
    out = []
    for index, item in enumerate(items or []):
        if not isinstance(item, dict):
            raise ConfigError(f"sglang_instances[{index}]: an instance (name, port, gpus), not {type(item).__name__}")
        own = instance_profiles or {}
        profile = own[item.get("name")] if item.get("name") in own else item.get("profile", default_profile)
        if profile is None:
            raise ConfigError(
                f"sglang_instances[{index}] ({item.get('name')}) has no profile: set sglang_profile, the instance's "
                "profile or sglang_service_instance_profiles"
            )
        out.append(
            instance_record(
                item, index, profiles, profile, model_path, common_flags, common_env, listen_host, venv,
                launch_module, config_dir, launcher,
            )
        )  # fmt: skip
    return out


# A lock file's line is "name==version", with its hashes when `make lock-sglang` wrote it (docs/locks.md).
LOCK_HASHES = re.compile(r" +--hash=[^ ]+")


def lock_requirements(requirements, lock_text: str) -> list[str]:
    """The sglang role's lock: sglang_requirements when it lists any, else the lock file's items without hashes,
    comments or blank lines (roles/sglang/tasks/preflight.yml reads it the same)."""
    if not isinstance(requirements, (list, tuple)):
        raise ConfigError(f'sglang_requirements: a list of "name==version" items, not {type(requirements).__name__}')
    if requirements:
        return list(requirements)
    lines = (LOCK_HASHES.sub("", line).strip() for line in lock_text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def software(
    python_version, sglang_version, install_profile, lock, env_lock, patches, generations_dir
) -> dict[str, str]:
    """sglang_software as the sglang role names it (preflight.yml, without the manifest): the generation's id from
    its identity (sglang_deploy.software), its virtualenv and the hashes of its lock and patch series (`patches`:
    [{name, content}] in the series' order)."""
    from .software import generation_id, lock_sha256, patch_series_sha256

    if not isinstance(env_lock, (list, tuple)):
        raise ConfigError(f'ml_env_requirements: a list of "name==version" items, not {type(env_lock).__name__}')
    identity = {
        "python_version": str(python_version),
        "sglang_version": str(sglang_version),
        "install_profile": install_profile,
        "lock_sha256": lock_sha256([*env_lock, *lock]),
        "patch_series_sha256": patch_series_sha256(patches),
    }
    generation = generation_id(identity)
    venv = f"{generations_dir}/{generation}"
    return {
        "generation": generation,
        "venv": venv,
        "python": f"{venv}/bin/python",
        "sglang_version": identity["sglang_version"],
        "lock_sha256": identity["lock_sha256"],
        "patch_series_sha256": identity["patch_series_sha256"],
    }
