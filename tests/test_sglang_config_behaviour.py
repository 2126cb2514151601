"""plugins/filter/sglang_config.py as the roles and the driver read it (issue #31: the behaviours behind the mutants
the unit suite let survive): the instance record whole, each field the unit template, validation and the modules
read; the tensor-parallel size each setting gives; the environment's layers, unsets and booleans; a refused flag
set and unset; multi-node ranks at each end; each refusal's message as the operator reads it; the sweep's plan
(its fingerprint, its notes, the software it names); and the filters as Ansible calls them, by name, with their
own defaults and their errors as AnsibleFilterError.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from ansible_collections.sglang.deploy.plugins.filter.sglang_config import (
    ConfigError,
    FilterModule,
    env_file_line,
    instance_record,
    server_config,
    systemd_quote,
    tune_plan,
    with_tuned,
)
from ansible_collections.sglang.deploy.plugins.filter.sglang_monitoring import FilterModule as MonitoringFilters
from ansible_collections.sglang.deploy.plugins.filter.sglang_restart import FilterModule as RestartFilters
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.worker_urls import worker_url

REPO = Path(__file__).resolve().parents[1]
ONE = {"name": "main", "port": 30000, "gpus": [0]}
VENV, LAUNCHER, MODULE, CONFIG = "/srv/venv", "/l/sglang-launch", "sglang.launch_server", "/etc/sg"


def refused(*args, **kw) -> str:
    with pytest.raises(ConfigError) as exc:
        server_config(*args, **kw)
    return str(exc.value)


def flag_values(argv: list[str], flag: str) -> list[str] | None:
    """The words after `flag` up to the next flag; None when the flag is not there."""
    if flag not in argv:
        return None
    rest = argv[argv.index(flag) + 1 :]
    return list(next((rest[:i] for i, w in enumerate(rest) if w.startswith("--")), rest))


def record(instance=None, index=0, profiles=None, profile="a", flags=None, env=None, listen_host="0.0.0.0"):
    return instance_record(
        instance or ONE,
        index,
        profiles if profiles is not None else {"a": {}},
        profile,
        "/m",
        flags,
        env,
        listen_host,
        VENV,
        MODULE,
        CONFIG,
        LAUNCHER,
    )


# ------------------------------------------------------------------ server_config: the command line


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([0.1, 0.5], ["0.1", "0.5"]),
        (("a", 2), ["a", "2"]),
        ([], None),
        ({"b": 1, "a": [2]}, ['{"a": [2], "b": 1}']),
        (True, []),
        (False, None),
        (None, None),
        (0, ["0"]),
    ],
)
def test_each_kind_of_flag_value_renders_as_sglangs_parser_reads_it(value, words):
    """A list is one word per item (nargs), an empty one no flag at all; a mapping one JSON word, keys sorted; true
    the bare flag, false or null no flag; anything else one word, 0 included."""
    argv = server_config(ONE, {"a": {"flags": {"bucket_time_to_first_token": value}}}, "a", "/m")["argv"]
    assert flag_values(argv, "--bucket-time-to-first-token") == words


@pytest.mark.parametrize(
    ("gpus", "flags", "nnodes", "tp"),
    [
        (8, {}, 1, "8"),
        (8, {"dp_size": 2}, 1, "4"),
        (8, {"pp_size": 2}, 1, "4"),
        (8, {"dp_size": 2, "pp_size": 2}, 1, "2"),
        (8, {"dp_size": 2}, 2, "8"),
        (1, {"dp_size": 2}, 1, "1"),  # fewer GPUs than data-parallel ranks: never a size of 0
        (8, {"tp_size": 2}, 1, "2"),  # the operator's own size wins over the GPUs'
    ],
)
def test_the_tensor_parallel_size_is_the_gpus_over_the_other_parallel_sizes(gpus, flags, nnodes, tp):
    inst = {**ONE, "gpus": list(range(gpus))}
    if nnodes > 1:
        inst.update(nnodes=nnodes, node_rank=0, dist_init_addr="10.0.0.1:5000")
    conf = server_config(inst, {"a": {"flags": flags}}, "a", "/m")
    assert flag_values(conf["argv"], "--tp-size") == [tp]
    assert conf["argv"].count("--tp-size") == 1
    want = "sglang_profiles.a.flags.tp_size" if "tp_size" in flags else "sglang_instances[0].gpus (one tensor-parallel"
    assert conf["origins"]["--tp-size"].startswith(want)


def test_the_short_tp_flag_is_the_operators_size_and_no_tp_size_is_added():
    conf = server_config({**ONE, "gpus": [0, 1, 2, 3]}, {"a": {"flags": {"tp": 2}}}, "a", "/m")
    assert flag_values(conf["argv"], "--tp") == ["2"]
    assert "--tp-size" not in conf["argv"] and "--tp-size" not in conf["origins"]


def test_the_fixed_flags_name_the_variables_they_come_from():
    conf = server_config(ONE, {"a": {}}, "a", "/models/m", listen_host="::", instance_index=3)
    assert conf["argv"][:6] == ["--model-path", "/models/m", "--host", "::", "--port", "30000"]
    assert {k: conf["origins"][k] for k in ("--model-path", "--host", "--port")} == {
        "--model-path": "sglang_model_path",
        "--host": "sglang_listen_host",
        "--port": "sglang_instances[3].port",
    }
    assert conf["env_origins"] == {"CUDA_VISIBLE_DEVICES": "sglang_instances[3].gpus"}
    assert conf["profile"] == "a"
    assert set(conf) == {"argv", "origins", "env", "env_origins", "profile"}


@pytest.mark.parametrize("value", [None, False])
def test_a_refused_flag_left_unset_renders_nothing(value):
    """null and false are the ways group_vars leave api_key unset: nothing is refused, nothing rendered."""
    conf = server_config(ONE, {"a": {"flags": {"api_key": value, "admin_api_key": value}}}, "a", "/m")
    assert "--api-key" not in conf["argv"] and "--admin-api-key" not in conf["argv"]


def test_a_refused_flag_set_empty_is_no_key_and_not_refused():
    """'' carries no secret: it renders as an empty word (SGLang's no key; the launcher's key, appended after
    it, is the one argparse keeps), never refused."""
    conf = server_config(ONE, {"a": {"flags": {"api_key": ""}}}, "a", "/m")
    assert flag_values(conf["argv"], "--api-key") == [""]


@pytest.mark.parametrize("value", [True, "k-1", 0.5])
def test_a_refused_flag_given_any_value_is_refused(value):
    message = refused(ONE, {"a": {}}, "a", "/m", {"admin_api_key": value})
    assert message.startswith("sglang_server_flags.admin_api_key: a secret on a command line")


# ------------------------------------------------------------------ server_config: the environment


def test_the_environment_layers_unset_with_null_and_write_booleans_as_systemd_services_read_them():
    conf = server_config(
        ONE,
        {"a": {"env": {"NCCL_ALGO": None, "LOWER_ONLY": None, "ON": True}}},
        "a",
        "/m",
        None,
        {"NCCL_ALGO": "Ring", "KEEP": "x", "OFF": False},
    )
    assert conf["env"] == {"KEEP": "x", "OFF": "0", "ON": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert conf["env_origins"] == {
        "KEEP": "sglang_server_env.KEEP",
        "OFF": "sglang_server_env.OFF",
        "ON": "sglang_profiles.a.env.ON",
        "CUDA_VISIBLE_DEVICES": "sglang_instances[0].gpus",
    }


def test_a_null_unsets_only_its_own_name_and_the_rest_of_its_layer_still_applies():
    conf = server_config({**ONE, "env": {"NOT_SET_BELOW": None, "AFTER": 1}}, {"a": {}}, "a", "/m")
    assert conf["env"] == {"AFTER": "1", "CUDA_VISIBLE_DEVICES": "0"}
    assert conf["env_origins"]["AFTER"] == "sglang_instances[0].env.AFTER"


# ------------------------------------------------------------------ server_config: multi-node


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_every_rank_of_a_three_node_instance_renders_its_own_rank(rank):
    inst = {**ONE, "nnodes": 3, "node_rank": rank, "dist_init_addr": "10.0.0.1:5000"}
    argv = server_config(inst, {"a": {}}, "a", "/m")["argv"]
    assert argv[6:12] == ["--nnodes", "3", "--node-rank", str(rank), "--dist-init-addr", "10.0.0.1:5000"]


@pytest.mark.parametrize(
    ("inst", "message"),
    [
        ({"node_rank": 3, "dist_init_addr": "a:1"}, "sglang_instances[0].node_rank is 3, not in 0..2"),
        ({"node_rank": -1, "dist_init_addr": "a:1"}, "sglang_instances[0].node_rank is -1, not in 0..2"),
        ({"node_rank": "", "dist_init_addr": "a:1"}, "sglang_instances[0].node_rank is not set, but "),
        ({"node_rank": 0, "dist_init_addr": ""}, "sglang_instances[0].dist_init_addr is not set, but "),
    ],
)
def test_a_rank_outside_the_nodes_or_a_setting_left_empty_is_refused(inst, message):
    got = refused({**ONE, "nnodes": 3, **inst}, {"a": {}}, "a", "/m")
    assert got.startswith(message), got
    if "not set" in message:
        assert got.endswith("sglang_instances[0].nnodes is 3"), got


# ------------------------------------------------------------------ server_config: refusals as the operator reads them


def test_an_unknown_profile_lists_the_known_ones():
    got = refused(ONE, {"b": {}, "a": {}}, "nope", "/m")
    assert got == "sglang_profile 'nope' is not in sglang_profiles (known: a, b)"


def test_an_instance_without_a_name_or_gpus_is_named_by_its_place():
    assert refused({"port": 1}, {"a": {}}, "a", "/m") == "sglang_instances[0] (?) has no gpus"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", "0.0.0.0"), "sglang_model_path is not set"),
        (("/m", ""), "sglang_listen_host is not set"),
    ],
)
def test_an_empty_model_path_or_listen_host_is_refused_by_its_variable(args, message):
    assert refused(ONE, {"a": {}}, "a", args[0], listen_host=args[1]) == message


def test_a_fixed_flag_set_in_the_flags_names_both_places_by_its_command_line_spelling():
    got = refused(ONE, {"a": {"flags": {"model_path": "/x"}}}, "a", "/m")
    assert (
        got
        == "sglang_profiles.a.flags.model_path: --model-path is set from sglang_model_path; remove it from the flags"
    )


# ------------------------------------------------------------------ instance_record: the record whole


def test_the_record_holds_every_field_the_unit_validation_and_the_modules_read():
    profiles = {"a": {"flags": {"x_flag": 1}, "baseline": {"output_tokens_per_s": 812.5}}, "b": {}}
    got = record({"name": "main", "port": 30000, "gpus": (2, 3)}, index=1, profiles=profiles)
    server_argv = ["--model-path", "/m", "--host", "0.0.0.0", "--port", "30000", "--tp-size", "2", "--x-flag", "1"]
    prefix = [f"{VENV}/bin/python", LAUNCHER, MODULE]
    assert got == {
        "name": "main",
        "unit": "sglang-main.service",
        "unit_path": "/etc/systemd/system/sglang-main.service",
        "env_path": "/etc/sg/main.env",
        "secrets_path": "/etc/sg/secrets/main.env",
        "pending_dir": "/etc/sg/pending",
        "port": 30000,
        "gpus": [2, 3],
        "nnodes": 1,
        "node_rank": 0,
        "dist_init_addr": None,
        "profile": "a",
        "python": "/srv/venv/bin/python",
        "server_argv": server_argv,
        "argv": prefix + server_argv,
        "origins": {
            "--model-path": "sglang_model_path",
            "--host": "sglang_listen_host",
            "--port": "sglang_instances[1].port",
            "--tp-size": "sglang_instances[1].gpus (one tensor-parallel rank per GPU)",
            "--x-flag": "sglang_profiles.a.flags.x_flag",
        },
        "env": {"CUDA_VISIBLE_DEVICES": "2,3"},
        "env_origins": {"CUDA_VISIBLE_DEVICES": "sglang_instances[1].gpus"},
        "profiles_argv": {"a": prefix + server_argv, "b": prefix + server_argv[:8]},
        "baseline": 812.5,
    }


def test_a_multi_node_record_carries_its_nodes_rank_and_rendezvous():
    inst = {**ONE, "nnodes": 2, "node_rank": 1, "dist_init_addr": "[fd00::1]:5000"}
    got = record(inst)
    assert (got["nnodes"], got["node_rank"], got["dist_init_addr"]) == (2, 1, "[fd00::1]:5000")
    rank0 = record({**inst, "node_rank": 0})
    assert (rank0["nnodes"], rank0["node_rank"], rank0["dist_init_addr"]) == (2, 0, "[fd00::1]:5000")


@pytest.mark.parametrize(
    ("profile", "baseline"),
    [(None, None), ({"baseline": None}, None), ({"baseline": {"output_tokens_per_s": 90}}, 90), ({"flags": {}}, None)],
)
def test_the_records_baseline_is_its_profiles_measured_throughput_or_none(profile, baseline):
    assert record(profiles={"a": profile})["baseline"] == baseline


def test_the_common_layers_and_the_instances_place_reach_the_record_and_every_profiles_command_line():
    got = record(index=2, profiles={"a": {}, "b": {"flags": {"y_flag": 2}}}, flags={"z_flag": 3}, env={"E": "v"})
    assert flag_values(got["argv"], "--z-flag") == ["3"]
    assert got["origins"]["--z-flag"] == "sglang_server_flags.z_flag"
    assert got["origins"]["--port"] == "sglang_instances[2].port"
    assert got["env"] == {"E": "v", "CUDA_VISIBLE_DEVICES": "0"}
    assert got["env_origins"]["E"] == "sglang_server_env.E"
    b = got["profiles_argv"]["b"]
    assert flag_values(b, "--z-flag") == ["3"] and flag_values(b, "--y-flag") == ["2"]


def test_a_profile_that_cannot_render_is_left_out_of_the_profiles_argv_and_the_rest_still_are():
    """sglang_server_env's CUDA_VISIBLE_DEVICES renders only under a profile that unsets it: the others cannot
    start this instance, so verify cannot name them; a profile listed after one that fails is still there."""
    profiles = {"bad": {"flags": {"--oops": 1}}, "plain": {}, "a": {"env": {"CUDA_VISIBLE_DEVICES": None}}, "z": {}}
    got = record(profiles=profiles, env={"CUDA_VISIBLE_DEVICES": "7"})
    assert set(got["profiles_argv"]) == {"a"}
    assert record(profiles={"bad": {"flags": {"--oops": 1}}, "a": {}, "z": {}})["profiles_argv"].keys() == {"a", "z"}


@pytest.mark.parametrize(
    ("inst", "shown"),
    [({"port": 1, "gpus": [0]}, "''"), ({"name": "locks", "port": 1, "gpus": [0]}, "'locks'")],
)
def test_a_missing_or_reserved_instance_name_is_refused_listing_the_reserved_ones(inst, shown):
    with pytest.raises(ConfigError) as exc:
        record(inst)
    assert str(exc.value) == (
        f"sglang_instances[0].name {shown}: use lowercase letters, digits, '-' and '_' (it names the unit, its "
        "files and its lock), not one of known-good, validated, locks, pending, secrets, instances, evidence"
    )


# ------------------------------------------------------------------ tune_plan


EAGLE3 = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2, "speculative_eagle_topk": 1}


def plan_of(instances=None, profiles=None, flags=None, env=None, grid=None, identity=None, software=None):
    return tune_plan(
        instances or [ONE],
        "main",
        profiles or {"p": {"flags": EAGLE3}},
        "p",
        flags,
        env,
        grid or {"speculative_num_steps": [1, 3]},
        identity,
        software,
    )


def test_the_plan_names_the_software_it_rendered_with_and_each_combinations_notes():
    software = {"generation": 4, "venv": "/opt/sw/4"}
    out = plan_of(grid={"speculative_num_steps": [1, 3], "speculative_num_draft_tokens": [6]}, software=software)
    assert out["software"] == software
    assert [c["notes"] for c in out["combinations"]] == [
        [],
        ["speculative_num_draft_tokens 6 -> 2: SGLang sets steps + 1 when topk is 1"],
        ["speculative_num_draft_tokens 6 -> 4: SGLang sets steps + 1 when topk is 1"],
    ]


def test_the_fingerprint_changes_with_each_part_of_the_starting_configuration():
    """A sweep resumes only from the same start: the flags and the environment of every layer, and the identity."""
    prints = {
        "start": plan_of()["fingerprint"],
        "common flags": plan_of(flags={"cuda_graph_max_bs_decode": 64})["fingerprint"],
        "profile flags": plan_of(profiles={"p": {"flags": {**EAGLE3, "mem_fraction_static": 0.8}}})["fingerprint"],
        "common env": plan_of(env={"NCCL_ALGO": "Ring"})["fingerprint"],
        "profile env": plan_of(profiles={"p": {"flags": EAGLE3, "env": {"NCCL_ALGO": "Tree"}}})["fingerprint"],
        "instance env": plan_of(instances=[{**ONE, "env": {"NCCL_ALGO": "CollnetDirect"}}])["fingerprint"],
        "identity": plan_of(identity={"model": "/m"})["fingerprint"],
    }
    assert len(set(prints.values())) == len(prints), prints
    assert plan_of(identity={"model": "/m"})["fingerprint"] == prints["identity"], "the same start, the same print"


def test_a_grid_key_the_instances_own_environment_sets_is_refused():
    with pytest.raises(ConfigError) as exc:
        plan_of(instances=[{**ONE, "env": {"NCCL_PROTO": "LL"}}], grid={"NCCL_PROTO": ["", "Simple"]})
    assert str(exc.value).startswith("grid key 'NCCL_PROTO' is set by sglang_instances[0].env.NCCL_PROTO, ")


def test_an_unknown_tune_instance_lists_the_hosts_instances():
    with pytest.raises(ConfigError) as exc:
        tune_plan([{"name": "a"}, {"name": "main"}], "other", {"p": {}}, "p")
    assert str(exc.value) == "sglang_tune.instance 'other' is not one of this host's sglang_instances (a, main)"


# ------------------------------------------------------------------ the filters as Ansible calls them


def used_filters() -> set[str]:
    """Every filter of this plugin that a role, a playbook or a golden render calls (`| sglang.deploy.name`: the
    one name an installed collection has for it; none by its short name)."""
    ours = {"systemd_quote", "env_file_line"}
    found = set()
    for path in [*REPO.glob("roles/**/*.yml"), *REPO.glob("roles/**/*.j2"), *REPO.glob("playbooks/**/*.yml")]:
        if "files" in path.relative_to(REPO).parts:  # copied or loaded as they are, never templated (PromQL's `|`)
            continue
        text = path.read_text()
        found |= set(re.findall(r"\|\s*sglang\.deploy\.(\w+)", text))
        short = [m for m in re.findall(r"\|[ \t]*(\w+)\b(?!\.)", text) if m.startswith("sglang_") or m in ours]
        assert not short, f"{path.relative_to(REPO)} calls {short} by the short name"
    return found


def test_every_filter_the_roles_call_is_provided_under_its_name():
    filters = FilterModule().filters()
    assert used_filters() == {
        "sglang_instance",  # tune_plan.yml's, one combination
        "sglang_instances",  # sglang_service's vars/main.yml
        "sglang_tune_plan",
        "sglang_with_tuned",
        "sglang_worker_url",
        "sglang_count_of",  # playbooks/vars/rollout.yml's
        "sglang_rollout_routers",
        "systemd_quote",
        "env_file_line",
        "sglang_scrape_configs",  # plugins/filter/sglang_monitoring.py's
        "sglang_alert_rules",
        "sglang_multinode_plan",  # plugins/filter/sglang_restart.py's
    }
    # and the one docs/layout.md names for rendering an instance's argv and environment by hand
    assert "`sglang_server_config`" in (REPO / "docs" / "layout.md").read_text()
    monitoring = set(MonitoringFilters().filters())
    restart = set(RestartFilters().filters())
    assert set(filters) == (used_filters() - monitoring - restart) | {"sglang_server_config"}
    assert monitoring <= used_filters() and restart <= used_filters()
    assert filters["systemd_quote"] is systemd_quote and filters["sglang_worker_url"] is worker_url
    assert (
        filters["env_file_line"](("NAME", 'a "b" $c')) == env_file_line("NAME", 'a "b" $c') == 'NAME="a \\"b\\" \\$c"'
    )


def test_the_with_tuned_and_tune_plan_filters_take_ansibles_positional_and_keyword_arguments():
    filters = FilterModule().filters()
    host_vars = {"sglang_tuned_profile_fast": {"flags": {"x": 1}}}
    assert filters["sglang_with_tuned"]({"p": {}}, host_vars) == with_tuned({"p": {}}, host_vars)
    assert filters["sglang_with_tuned"]({"p": {}}, host_vars=host_vars) == with_tuned({"p": {}}, host_vars)
    args = ([ONE], "main", {"p": {"flags": EAGLE3}}, "p")
    grid = {"speculative_num_steps": [1, 3]}
    want = tune_plan(*args, None, None, grid, {"model": "/m"}, {"generation": 2})
    assert filters["sglang_tune_plan"](*args, None, None, grid, {"model": "/m"}, {"generation": 2}) == want
    assert filters["sglang_tune_plan"](*args, grid=grid, identity={"model": "/m"}, software={"generation": 2}) == want


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("sglang_with_tuned", ({"fast": {}}, {"sglang_tuned_profile_fast": {}}), "sglang_tuned_profile_fast: "),
        ("sglang_tune_plan", ([ONE], "other", {"p": {}}, "p"), "sglang_tune.instance 'other' is not one of "),
        ("sglang_server_config", (ONE, {"a": {}}, "nope", "/m"), "sglang_profile 'nope' is not in sglang_profiles"),
        ("sglang_instance", ({"port": 1, "gpus": [0]}, 0, {"a": {}}, "a", "/m"), "sglang_instances[0].name '': "),
    ],
)
def test_a_filters_refusal_reaches_the_play_as_its_message(name, args, message):
    with pytest.raises(AnsibleFilterError) as exc:
        FilterModule().filters()[name](*args)
    assert str(exc.value).startswith(message), str(exc.value)
    assert isinstance(exc.value.__cause__, ConfigError) and str(exc.value) == str(exc.value.__cause__)


def test_the_sglang_instance_filter_renders_the_record_of_every_argument_it_is_given():
    args = (
        {**ONE, "gpus": [4, 5]},
        3,
        {"a": {"flags": {"x_flag": 1}}, "b": {}},
        "b",
        "/models/m",
        {"y_flag": 2},
        {"E": "v"},
        "127.0.0.1",
        VENV,
        "sglang.other_server",
        CONFIG,
        LAUNCHER,
    )
    got = FilterModule().filters()["sglang_instance"](*args)
    assert got == instance_record(*args)
    assert got["argv"][:3] == [f"{VENV}/bin/python", LAUNCHER, "sglang.other_server"]
    assert got["origins"]["--port"] == "sglang_instances[3].port" and got["env"]["E"] == "v"
    assert flag_values(got["argv"], "--host") == ["127.0.0.1"] and flag_values(got["argv"], "--y-flag") == ["2"]
    assert got["env_path"] == "/etc/sg/main.env" and got["profile"] == "b"


def test_the_sglang_instance_filters_defaults_are_the_roles_defaults():
    """A template that passes only the instance, its place, the profiles and the model gets what the role renders
    with its own defaults (roles/sglang_service/defaults/main.yml, group_vars' sglang_listen_host)."""
    defaults = yaml.safe_load((REPO / "roles" / "sglang_service" / "defaults" / "main.yml").read_text())
    group_vars = yaml.safe_load((REPO / "group_vars" / "all.yml").read_text())
    assert "'/opt/ml-env'" in defaults["sglang_service_venv"]
    assert "'/etc/sglang'" in defaults["sglang_service_config_dir"]
    role = (
        group_vars["sglang_listen_host"],
        "/opt/ml-env",
        defaults["sglang_service_launch_module"],
        "/etc/sglang",
        defaults["sglang_service_launcher_path"],
    )
    profiles = {"a": {}}
    got = FilterModule().filters()["sglang_instance"](ONE, 0, profiles, "a", "/m")
    assert got == instance_record(ONE, 0, profiles, "a", "/m", None, None, *role)
    assert got["argv"][:3] == [
        "/opt/ml-env/bin/python",
        "/usr/local/libexec/sglang-deploy/sglang-launch",
        "sglang.launch_server",
    ]
    assert got["env_path"] == "/etc/sglang/main.env" and flag_values(got["argv"], "--host") == ["0.0.0.0"]


def test_the_sglang_server_config_filter_renders_every_argument_and_defaults_to_the_first_instance_on_all_addresses():
    f = FilterModule().filters()["sglang_server_config"]
    args = ({**ONE, "gpus": [4, 5]}, {"a": {"flags": {"x_flag": 1}}}, "a", "/models/m", {"y_flag": 2}, {"E": "v"})
    got = f(*args, "127.0.0.1", 2)
    assert got == server_config(*args, "127.0.0.1", 2)
    assert flag_values(got["argv"], "--model-path") == ["/models/m"] and flag_values(got["argv"], "--y-flag") == ["2"]
    assert flag_values(got["argv"], "--x-flag") == ["1"] and got["env"]["E"] == "v"
    assert got["origins"]["--port"] == "sglang_instances[2].port" and got["env"]["CUDA_VISIBLE_DEVICES"] == "4,5"
    plain = f(ONE, {"a": {}}, "a", "/m")
    assert flag_values(plain["argv"], "--host") == ["0.0.0.0"]
    assert plain["origins"]["--port"] == "sglang_instances[0].port"
