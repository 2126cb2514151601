"""What systemd runs is exactly what was configured, whatever the values hold (issue #17).

The golden case hostile_values (tests/golden/render.yml, checked against a fresh render by tests/test_golden.py)
renders flags and environment values that the unit's ExecStart= and the EnvironmentFile= must quote or escape:
a space, ", ', $, %, a backslash, a lone ";", ${VAR} and %h that systemd must not expand, a newline, a leading
"#". Each is read back by systemd's documented rules (tests/support/systemd_rules.py) and, where systemd is
installed, by systemd itself: `systemd --test` loads the unit as PID 1 does, `systemd-analyze verify` is what
staging runs, the environment generator reads an environment file with the EnvironmentFile= parser. The argv
must equal the intended one exactly, and it is the instance record's argv, the one verify's drift check
expects to find running. And what systemd would execute is started, through the installed launcher, into a server
module that records its argv and environment: exactly the intended ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ansible_collections.sglang.deploy.plugins.filter.sglang_config import env_file_line, instance_record, systemd_quote
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import read_env_file
from support import REPO
from support.systemd_rules import (
    directive,
    environment_file,
    exec_argv,
    expand_variables,
    systemd_analyze_complaints,
    systemd_can_load_units,
    systemd_loaded_argv,
    systemd_reads_environment_file,
)

GOLDEN = REPO / "tests" / "golden" / "hostile_values"
UNIT_NAME = "sglang-hv.service"
UNIT = (GOLDEN / UNIT_NAME).read_text()
ENV = (GOLDEN / "hv.env").read_text()

SERVED_NAME = 'it\'s a "model" for $USER at 100% \\ and \\\\ two'  # ' " $ % \ and a doubled \, with spaces
INTENDED_ARGV = [
    "/opt/ml-env/bin/python",
    "/usr/local/libexec/sglang-deploy/sglang-launch",
    "sglang.launch_server",
    "--model-path",
    "/srv/models/a model",
    "--host",
    "0.0.0.0",
    "--port",
    "30000",
    "--chat-template",
    "/srv/templates/chat template.jinja",
    "--download-dir",
    "/srv/%h/%%n",  # specifiers, never expanded
    "--json-model-override-args",
    '{"rope_scaling": {"factor": 4.0, "type": "yarn"}}',
    "--served-model-name",
    SERVED_NAME,
    "--speculative-algorithm",
    "EAGLE3",
    "--tokenizer-path",
    "/srv/tok/${SGLANG_API_KEY}",  # a variable reference, never expanded (no secret lands on the command line)
    "--tool-call-parser",
    ";",  # a lone semicolon, never a command separator
    "--tp-size",
    "2",
]
INTENDED_ENV = {
    "CUDA_VISIBLE_DEVICES": "0,1",
    "HOSTILE_COMMENT": "# not a comment; ;nor this",
    "HOSTILE_EMPTY": "",
    "HOSTILE_LINES": "first line\nsecond line",
    "HOSTILE_QUOTES": 'it\'s a "value": $HOME ${PATH} `id` 100% \\ \\\\ end',
    "HOSTILE_SPACES": "  leading, inner  and trailing  ",
}
# Single values for the filter's own functions: each character class, alone and at a word's edges.
HOSTILE = [
    "a b",
    '"',
    "'",
    "$",
    "$$",
    "$HOME",
    "${HOME}",
    "%",
    "%%",
    "%h",
    "\\",
    "ends with a backslash\\",
    '\\"',
    ";",
    "",
    " leading and trailing ",
    "tab\there",
    "line one\nline two",
    "carriage\rreturn",
    "`id`",
    "#hash",
    "modèle-ü",
    "a=b,c:d@e+f",
]
SYSTEMD_ANALYZE = pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="no systemd-analyze here")
SYSTEMD = pytest.mark.skipif(not systemd_can_load_units(), reason="no systemd here that loads units unprivileged")


def runnable(unit: str) -> str:
    """The unit with each command's executable pointed at one that exists here, its arguments kept as rendered."""
    true = shutil.which("true") or "/bin/true"
    out = []
    for line in unit.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("ExecStart", "ExecStartPre"):
            line = f"{key}={true} {value.split(' ', 1)[1]}"
        out.append(line)
    return "\n".join(out) + "\n"


def hostile_case() -> dict:
    """The hostile_values case's inputs, as tests/golden/render.yml gives them to the filter."""
    plays = yaml.safe_load((REPO / "tests" / "golden" / "render.yml").read_text())
    task = next(t for t in plays[0]["tasks"] if (t.get("vars") or {}).get("case") == "hostile_values")
    return task["vars"]


# ------------------------------------------------------------------------------------------ the unit's ExecStart


def test_the_rendered_execstart_is_the_intended_argv_by_systemds_rules():
    [value] = directive(UNIT, "ExecStart")
    assert exec_argv(value) == INTENDED_ARGV


@SYSTEMD
def test_systemd_loads_the_rendered_execstart_as_the_intended_argv():
    loaded = systemd_loaded_argv(UNIT, UNIT_NAME)
    # systemd expands "$" when it executes the command ("$$" is "$"): argv as the server sees it.
    assert [expand_variables(w) for w in loaded] == INTENDED_ARGV


@SYSTEMD_ANALYZE
def test_systemd_analyze_verify_accepts_the_rendered_command_line_with_its_arguments():
    """tests/test_golden.py verifies every golden unit with its commands replaced whole; here the arguments stay."""
    assert systemd_analyze_complaints(runnable(UNIT), UNIT_NAME) == []


# A server module named as the unit names SGLang's (sglang.launch_server): it records the argv and the environment
# it was started with, then exits. (The lab's stand-in needs SGLang's own parser, installed only on lab nodes.)
RECORDING_SERVER = """\
import json, os, sys
from pathlib import Path
Path(__file__).with_name("started.json").write_text(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ)}))
"""
API_KEY = 'k3y "with" $HOME, %h and a \\ backslash'  # the secrets file's value, as hostile as the others


@SYSTEMD
def test_the_server_started_from_the_rendered_unit_gets_the_intended_argv_and_environment(tmp_path):
    """The unit's command as systemd loads it, "$" expanded as systemd does when it executes it, with the
    environment file and the secrets file as EnvironmentFile= reads them, is started: the installed launcher
    (roles/sglang_service/files/sglang-launch) runs the server module, which must get exactly the intended flags,
    then --api-key from the secrets file, and exactly the intended environment (the key taken out of it)."""
    lib = tmp_path / "libexec" / "sglang-deploy"
    (lib / "sglang_deploy").mkdir(parents=True)
    for name in ("__init__.py", "procinfo.py", "secret_rule.py", "launch.py"):
        shutil.copy(REPO / "plugins" / "module_utils" / "sglang_deploy" / name, lib / "sglang_deploy" / name)
    shutil.copy(REPO / "roles" / "sglang_service" / "files" / "sglang-launch", lib / "sglang-launch")
    server = tmp_path / "site" / "sglang"
    server.mkdir(parents=True)
    (server / "__init__.py").write_text("")
    (server / "launch_server.py").write_text(RECORDING_SERVER)
    secrets = env_file_line("SGLANG_API_KEY", API_KEY) + "\n"
    assert environment_file(secrets) == {"SGLANG_API_KEY": API_KEY}

    loaded = systemd_loaded_argv(UNIT, UNIT_NAME)
    python, launcher, *rest = [expand_variables(w) for w in loaded]
    assert (python, launcher) == tuple(INTENDED_ARGV[:2]), "the venv's python running the installed launcher"
    environment = {
        **environment_file(ENV),
        **environment_file(secrets),
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(tmp_path / "site"),
    }
    proc = subprocess.run(
        [sys.executable, str(lib / "sglang-launch"), *rest],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    started = json.loads((server / "started.json").read_text())
    assert started["argv"] == [*INTENDED_ARGV[3:], "--api-key", API_KEY]
    assert {k: started["env"].get(k) for k in INTENDED_ENV} == INTENDED_ENV
    assert "SGLANG_API_KEY" not in started["env"], "the key leaves the environment: the server's children lack it"


def test_the_instance_records_argv_is_what_systemd_runs():
    """Verify's drift check compares the running command line with the record's argv: they must be the same."""
    case = hostile_case()
    record = instance_record(
        case["_instance"],
        0,
        case["sglang_profiles"],
        case["profile"],
        case["sglang_model_path"],
        case["sglang_server_flags"],
        case["sglang_server_env"],
        "0.0.0.0",
        "/opt/ml-env",
        "sglang.launch_server",
        "/etc/sglang",
        "/usr/local/libexec/sglang-deploy/sglang-launch",
    )
    assert record["argv"] == INTENDED_ARGV
    assert record["env"] == INTENDED_ENV
    [value] = directive(UNIT, "ExecStart")
    assert value == systemd_quote(record["argv"]), "the golden unit is this record, rendered"


@pytest.mark.parametrize("value", HOSTILE, ids=[repr(v) for v in HOSTILE])
def test_systemd_quote_gives_back_each_value_by_systemds_rules(value):
    line = systemd_quote(["/usr/bin/prog", value, "after"])
    assert "\n" not in line and "\r" not in line, "one line of the unit file"
    assert exec_argv(line) == ["/usr/bin/prog", value, "after"]


@SYSTEMD
def test_systemd_loads_every_quoted_value_back():
    argv = ["/usr/bin/prog", *HOSTILE]
    loaded = systemd_loaded_argv(f"[Service]\nExecStart={systemd_quote(argv)}\n", "quoted.service")
    assert [expand_variables(w) for w in loaded] == argv


@SYSTEMD_ANALYZE
def test_systemd_analyze_verify_accepts_every_quoted_value():
    true = shutil.which("true") or "/bin/true"
    unit = f"[Service]\nExecStart={systemd_quote([true, *HOSTILE])}\n"
    assert systemd_analyze_complaints(unit, "quoted.service") == []


# ------------------------------------------------------------------------------------------ the environment file


def test_the_rendered_environment_file_gives_back_the_intended_values_by_systemds_rules():
    assert environment_file(ENV) == INTENDED_ENV


@pytest.mark.skipif(
    not Path("/usr/lib/systemd/user-environment-generators/30-systemd-environment-d-generator").exists(),
    reason="no systemd environment generator here",
)
def test_systemds_environment_file_parser_reads_the_rendered_values():
    """The generator reads with EnvironmentFile='s parser, then expands "$" and drops empty values: those aside."""
    read = systemd_reads_environment_file(ENV)
    comparable = {k: v for k, v in INTENDED_ENV.items() if v and "$" not in v}
    assert {k: read.get(k) for k in comparable} == comparable
    assert len(comparable) == 4


@pytest.mark.parametrize("value", HOSTILE, ids=[repr(v) for v in HOSTILE])
def test_env_file_line_gives_back_each_value_by_systemds_rules(value):
    assert environment_file(env_file_line("NAME", value) + "\nNEXT=1\n") == {"NAME": value, "NEXT": "1"}


SINGLE_LINE = [v for v in HOSTILE if "\n" not in v and "\r" not in v]


@pytest.mark.parametrize("value", SINGLE_LINE, ids=[repr(v) for v in SINGLE_LINE])
def test_the_modules_read_a_secret_back_as_systemd_gives_it_to_the_server(value, tmp_path):
    """The launcher gets SGLANG_API_KEY from systemd; verify and status send the key read_env_file reads, and the
    module strips every value it reads from what it returns: both must be the value systemd passes."""
    path = tmp_path / "secrets.env"
    path.write_text(env_file_line("SGLANG_API_KEY", value) + "\n")
    assert read_env_file(str(path)) == environment_file(path.read_text()) == {"SGLANG_API_KEY": value}


def test_the_modules_read_a_multi_line_secret_back_whole(tmp_path):
    path = tmp_path / "secrets.env"
    path.write_text(env_file_line("TOKEN", "line one\nline two") + "\n")
    assert read_env_file(str(path)) == environment_file(path.read_text()) == {"TOKEN": "line one\nline two"}


BAD_PROFILE_NAMES = ["50%", "fast\nExecStartPre=/bin/sh -c evil", "two words"]


def record_of(profiles: dict, profile: str) -> dict:
    return instance_record(
        {"name": "main", "port": 30000, "gpus": [0]},
        0,
        profiles,
        profile,
        "/models/m",
        {},
        {},
        "0.0.0.0",
        "/opt/ml-env",
        "sglang.launch_server",
        "/etc/sglang",
        "/usr/local/libexec/sglang-deploy/sglang-launch",
    )


@pytest.mark.parametrize("bad", BAD_PROFILE_NAMES, ids=["percent", "newline", "space"])
def test_a_profile_name_the_unit_cannot_hold_is_refused_before_rendering(bad):
    """A profile's name goes raw into the unit's Description=: a '%' is a specifier (systemd-analyze refuses it), a
    newline starts a directive of its own. Refused as an instance name is, naming the variable and the profile
    (issue #30); a bad name is refused even when another profile is the one selected."""
    from ansible_collections.sglang.deploy.plugins.filter.sglang_config import ConfigError, with_tuned

    assert record_of({"fast": {}}, "fast")["profile"] == "fast"
    for selected in (bad, "fast"):
        with pytest.raises(ConfigError, match=r"^sglang_profiles: the profile name ") as refused:
            record_of({"fast": {}, bad: {}}, selected)
        assert repr(bad) in str(refused.value)
    with pytest.raises(ConfigError, match=r"^sglang_instances\[0\] \(main\): its profile ") as refused:
        record_of({"fast": {}}, bad)  # the selected profile, checked before "not in sglang_profiles"
    assert repr(bad) in str(refused.value)
    with pytest.raises(ConfigError, match=r"^sglang_tuned_profile_") as refused:
        with_tuned({"fast": {}}, {f"sglang_tuned_profile_{bad}": {"flags": {}}})
    assert repr(bad) in str(refused.value)
