"""The launcher (sglang_deploy.launch, installed as sglang-launch): SGLang gets --api-key from the secrets
file's environment in-process, and the key is never on a command line another user could read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import launch
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.launch import server_argv

REPO = Path(__file__).resolve().parents[1]
KEY = "k3y-never-on-a-command-line"


def test_the_key_moves_from_the_environment_to_the_servers_argv():
    env = {"SGLANG_API_KEY": KEY, "OTHER": "1"}
    module, args = server_argv(["sglang.launch_server", "--port", "30000"], env)
    assert module == "sglang.launch_server" and args == ["--port", "30000", "--api-key", KEY]
    assert env == {"OTHER": "1"}, "the key leaves the environment: the server's children do not inherit it"


def test_without_a_key_the_flags_are_passed_as_they_are():
    assert server_argv(["m", "--a", "b"], {}) == ("m", ["--a", "b"])


def installed(tmp_path: Path) -> Path:
    """The host layout: the entry point beside the package files it imports."""
    lib = tmp_path / "libexec"
    (lib / "sglang_deploy").mkdir(parents=True)
    for name in ("__init__.py", "procinfo.py", "secret_rule.py", "launch.py"):
        shutil.copy(REPO / "plugins" / "module_utils" / "sglang_deploy" / name, lib / "sglang_deploy" / name)
    shutil.copy(REPO / "roles" / "sglang_service" / "files" / "sglang-launch", lib / "sglang-launch")
    return lib


def fake_server(tmp_path: Path) -> Path:
    """A directory holding a stand-in server module: it prints what it was given, and what the kernel shows as
    its command line."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "fake_server.py").write_text(
        "import json, os, sys\n"
        "if __name__ == '__main__':\n"
        "    cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "    print(json.dumps({'argv': sys.argv[1:], 'cmdline': cmdline, 'env': 'SGLANG_API_KEY' in os.environ,\n"
        "                      'path_clean': not any(p.endswith('libexec') for p in sys.path)}))\n"
    )
    return mods


def test_the_installed_launcher_runs_the_module_with_the_key_that_its_command_line_never_shows(tmp_path):
    lib = installed(tmp_path)
    mods = fake_server(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(mods), "SGLANG_API_KEY": KEY}
    out = subprocess.run(
        [sys.executable, str(lib / "sglang-launch"), "fake_server", "--port", "30000"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen = json.loads(out)
    assert seen["argv"] == ["--port", "30000", "--api-key", KEY]
    assert KEY not in seen["cmdline"] and "fake_server" in seen["cmdline"], "ps and /proc/PID/cmdline never show it"
    assert seen["env"] is False and seen["path_clean"] is True
    assert not list(lib.rglob("__pycache__")), "nothing written beside what Ansible installed"


def test_the_launcher_without_a_module_says_how_to_call_it(tmp_path):
    lib = installed(tmp_path)
    proc = subprocess.run([sys.executable, str(lib / "sglang-launch")], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: sglang-launch MODULE" in proc.stderr


def test_main_runs_the_module_as_python_m_does_with_the_key_appended(tmp_path):
    """launch.main from this repository's package (the installed copy above is the same file)."""
    mods = fake_server(tmp_path)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'plugins' / 'module_utils'}:{mods}", "SGLANG_API_KEY": KEY}
    code = "from sglang_deploy.launch import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "fake_server", "--port", "30000"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    seen = json.loads(out)
    assert seen["argv"] == ["--port", "30000", "--api-key", KEY] and seen["env"] is False
    assert KEY not in seen["cmdline"]


def test_main_without_a_module_says_how_to_call_it_before_touching_anything(monkeypatch):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    with pytest.raises(SystemExit, match="usage: sglang-launch MODULE"):
        launch.main([])
    assert os.environ["SGLANG_API_KEY"] == KEY
