"""Extra-vars never on ansible-playbook's command line (#30): any local user reads /proc/PID/cmdline for the length
of a run. driver/runner.py gives each -e to ansible-playbook as a file of its own (0600, in a 0700 directory),
removed when the run ends, however it ends. Checked with the real ansible-runner and a stand-in ansible-playbook
on PATH, every process's command line on this machine read while it runs."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from driver import inventory, runner

ODD = "Zq9\\k'e\"y$H%h\nW.*+?[(|"
SECRET = "hf_RUNNERSECRET_7f3a91"

STUB = """#!{python}
# Stands in for ansible-playbook: reports its own command line and the -e @files it was given, then lingers.
import json, os, stat, sys, time
args = sys.argv[1:]
files = {{}}
for flag, value in zip(args, args[1:]):
    if flag == "-e" and value.startswith("@") and os.path.exists(value[1:]):
        path = value[1:]
        files[path] = {{
            "mode": stat.S_IMODE(os.stat(path).st_mode),
            "dir_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode),
        }}
with open("/proc/self/cmdline", "rb") as fh:
    cmdline = fh.read().decode(errors="replace")
with open(os.environ["STUB_REPORT"] + ".tmp", "w") as fh:
    json.dump({{"cmdline": cmdline, "files": files, "pid": os.getpid()}}, fh)
os.rename(os.environ["STUB_REPORT"] + ".tmp", os.environ["STUB_REPORT"])
time.sleep(float(os.environ["STUB_SLEEP"]))
"""

EXTRAVARS = [
    json.dumps({"sglang_service_secret_env": {"HF_TOKEN": SECRET}}),
    f"sglang_service_api_key={SECRET} n=16",
    f"{{api_key: {SECRET}}}",
    "@/nonexistent/operator.yml",
]


def command_lines() -> dict[int, str]:
    """Every process's command line on this machine, as any local user reads it."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue  # gone, or not ours to read
    return out


@pytest.fixture
def stub(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "ansible-playbook"
    script.write_text(STUB.format(python=sys.executable))
    script.chmod(0o755)
    report = tmp_path / "report.json"

    def job(sleep: float) -> runner.Job:
        return runner.Job(
            playbook="playbooks/status.yml",
            inventory="here,",
            extravars=list(EXTRAVARS),
            env={
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "STUB_REPORT": str(report),
                "STUB_SLEEP": str(sleep),
            },
        )

    return job, report


def test_no_extra_var_is_on_any_command_line_while_ansible_playbook_runs(stub):
    job, report = stub
    seen: dict[int, str] = {}

    def cancelled() -> bool:  # asked every POLL_S while the stand-in lingers: /proc read while it runs
        seen.update({pid: line for pid, line in command_lines().items() if line})  # a zombie's is empty
        return False

    outcome = runner.run(job(sleep=2.0), lambda event: None, cancelled)
    assert outcome.rc == 0, outcome
    doc = json.loads(report.read_text())
    assert doc["pid"] in seen, "the stand-in's command line was read while it ran"
    assert "ansible-playbook" in seen[doc["pid"]]
    leaks = {pid: line for pid, line in seen.items() if SECRET in line}
    assert not leaks, leaks
    assert SECRET not in doc["cmdline"]
    files = doc["files"]
    assert len(files) == 3, doc  # one per -e value; the operator's own @file stays a path
    assert "@/nonexistent/operator.yml" in doc["cmdline"].split("\0")
    for path, v in files.items():
        assert v["mode"] == 0o600 and v["dir_mode"] == 0o700, (path, v)
        assert not Path(path).exists() and not Path(path).parent.parent.exists(), "removed after the run"


def test_the_extra_vars_files_are_removed_when_the_run_is_interrupted(stub):
    job, report = stub

    def cancelled() -> bool:
        if report.exists():
            raise KeyboardInterrupt  # as a signal handler of the driver's caller would
        return False

    with pytest.raises(KeyboardInterrupt):
        runner.run(job(sleep=5.0), lambda event: None, cancelled)
    paths = [Path(p) for p in json.loads(report.read_text())["files"]]
    assert paths and not any(p.exists() or p.parent.parent.exists() for p in paths)


def test_the_files_say_what_the_command_line_said(tmp_path):
    """Each file loads, with Ansible's own loader, as ansible-playbook loads the -e argument it replaces."""
    from ansible.parsing.dataloader import DataLoader

    given = [
        json.dumps({"api_key": ODD, "n": 1}),
        "{a: [1, 2], b: {c: d}}",
        'k=v k2=\'a b\' k3="x\\"y" k4=' + json.dumps(ODD),
        "",
        "words only",
        "[1, 2]",
        "x=2",
    ]
    args = runner.extravars_args(given, tmp_path / "ev")
    assert args[::2] == ["-e"] * (len(given) - 1) and all(a.startswith("@") for a in args[1::2])
    for path in args[1::2]:
        assert stat.S_IMODE(os.stat(path[1:]).st_mode) == 0o600
    loader = DataLoader()
    every = [g for g in given if g and g != "[1, 2]"]  # a list is no mapping: Ansible refuses it either way
    files = [a for a, g in zip(args[1::2], [g for g in given if g], strict=True) if g != "[1, 2]"]
    assert inventory._extra_vars(loader, files) == inventory._extra_vars(loader, every)
    for one, path in zip(every, files, strict=True):
        assert inventory._extra_vars(loader, [path]) == inventory._extra_vars(loader, [one]), one
