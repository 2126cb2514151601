"""The gateway's launcher (roles/sglang_router/files/sglang-router-launch, the unit's ExecStart): its first argument is
the gateway's module, `smg` or `sglang_router` and nothing else; the API key moves from the secrets file's
environment to the gateway's own argument list in-process, never onto a command line, with either gateway."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from support import REPO
from support.smg import smg_venv

LAUNCHER = REPO / "roles" / "sglang_router" / "files" / "sglang-router-launch"
KEY = "k3y-never-on-a-command-line"
MODULES = ["smg", "sglang_router"]


def launcher():
    """The launcher as a module (its file has no .py suffix, as installed)."""
    loader = importlib.machinery.SourceFileLoader("sglang_router_launch", str(LAUNCHER))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.mark.parametrize("module", MODULES)
def test_the_key_moves_from_the_environment_to_the_gateways_argv(module):
    env = {"SGLANG_ROUTER_API_KEY": KEY, "OTHER": "1"}
    assert launcher().gateway_argv([module, "--port", "30000"], env) == (module, ["--port", "30000", "--api-key", KEY])
    assert env == {"OTHER": "1"}, "the key leaves the environment: the gateway's children do not inherit it"


@pytest.mark.parametrize("module", MODULES)
def test_without_a_key_the_flags_are_passed_as_they_are(module):
    env = {"SGLANG_ROUTER_API_KEY": ""}
    assert launcher().gateway_argv([module, "--a", "b"], env) == (module, ["--a", "b"])
    assert env == {}


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--port", "30000"],  # the flags without the module
        ["sglang"],
        ["smg.launch_router"],  # the module's package, not its launch_router
        ["sglang_router.launch_router"],
        ["SMG"],
        ["os"],
        ["sglang-router"],  # the impl's name, not its module
    ],
)
def test_anything_but_the_two_gateways_modules_is_refused(argv):
    with pytest.raises(SystemExit) as exc:
        launcher().gateway_argv(argv, {"SGLANG_ROUTER_API_KEY": KEY})
    assert "the first argument is the gateway's module, one of smg, sglang_router" in str(exc.value)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("flag", [["--api-key", "other"], ["--api-key=other"]])
def test_a_key_on_the_command_line_is_refused(module, flag):
    env = {"SGLANG_ROUTER_API_KEY": KEY}
    with pytest.raises(SystemExit) as exc:
        launcher().gateway_argv([module, "--port", "30000", *flag], env)
    assert "belongs in SGLANG_ROUTER_API_KEY" in str(exc.value)
    assert env == {"SGLANG_ROUTER_API_KEY": KEY}, "nothing taken out of the environment for a refused command line"


# A stand-in for a gateway's package: launch_router.parse_router_args / launch_router, as both gateways have them.
FAKE = """
import json, os, sys
def parse_router_args(argv):
    return list(argv)
def launch_router(args):
    print(json.dumps({"module": __name__, "args": args, "env_key": os.environ.get("SGLANG_ROUTER_API_KEY")}))
"""


@pytest.mark.parametrize("module", MODULES)
def test_the_launcher_runs_that_gateways_launch_router_with_the_key(tmp_path, module):
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text("")
    (tmp_path / module / "launch_router.py").write_text(FAKE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SGLANG_ROUTER_API_KEY": KEY}
    out = subprocess.run(
        [sys.executable, str(LAUNCHER), module, "--port", "30000"], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == {
        "module": f"{module}.launch_router",
        "args": ["--port", "30000", "--api-key", KEY],
        "env_key": None,
    }


def test_the_launcher_refuses_another_module_before_importing_anything(tmp_path):
    env = {**os.environ, "SGLANG_ROUTER_API_KEY": KEY}
    out = subprocess.run(
        [sys.executable, str(LAUNCHER), "json", "--port", "30000"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 1 and out.stdout == ""
    assert "the first argument is the gateway's module, one of smg, sglang_router; got 'json'" in out.stderr


def test_smgs_own_parser_reads_the_key_the_launcher_appends(tmp_path):
    """The real smg 1.13.0 (its own virtualenv): --api-key after the role's smg-only flags is its key."""
    code = (
        "import importlib.machinery, importlib.util, json, os, sys\n"
        "loader = importlib.machinery.SourceFileLoader('launch', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(importlib.util.spec_from_loader('launch', loader)); loader.exec_module(m)\n"
        "module, argv = m.gateway_argv(sys.argv[2:], os.environ)\n"
        "from smg.launch_router import parse_router_args\n"
        "a = parse_router_args(argv)\n"
        "print(json.dumps([module, a.api_key, a.worker_stall_secs, a.worker_wedge_secs, a.remove_unhealthy_workers]))\n"
    )
    flags = ["--worker-urls", "http://127.0.0.1:31001", "--worker-stall-secs", "5", "--worker-wedge-secs", "10"]
    python = smg_venv() / "bin" / "python"
    out = subprocess.run(
        [str(python), "-I", "-c", code, str(LAUNCHER), "smg", *flags, "--no-remove-unhealthy-workers"],
        env={**os.environ, "SGLANG_ROUTER_API_KEY": KEY},
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["smg", KEY, 5, 10, False]
