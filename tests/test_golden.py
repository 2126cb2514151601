"""The rendered unit and environment file of every shipped profile, against golden copies.

A change to a profile, the renderer or the templates shows here as a diff to review;
UPDATE_GOLDEN=1 rewrites the copies."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden"
PROFILES = sorted(yaml.safe_load((REPO / "group_vars" / "all.yml").read_text())["sglang_profiles"])
# Each case's directory and instance: every profile as instance main, one model over two nodes (instance mn,
# rank 0 of 2, profile eagle3_topk1) with the RDMA devices allowed by default and turned off, and an instance
# whose flags and environment need quoting and escaping (instance hv; tests/test_unit_escaping.py reads them
# back by systemd's rules) (tests/golden/render.yml).
CASES = {**{p: "main" for p in PROFILES}, "multinode": "mn", "multinode_no_rdma": "mn", "hostile_values": "hv"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    out = tmp_path_factory.mktemp("rendered")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            "localhost,",
            "tests/golden/render.yml",
            "-e",
            f"out_dir={out}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    if os.environ.get("UPDATE_GOLDEN") == "1":
        for case in CASES:
            shutil.copytree(out / case, GOLDEN / case, dirs_exist_ok=True)
    return out


def unit(case: str) -> str:
    return (GOLDEN / case / f"sglang-{CASES[case]}.service").read_text()


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["unit", "env"])
def test_rendered_matches_golden(rendered, case, kind):
    name = f"sglang-{CASES[case]}.service" if kind == "unit" else f"{CASES[case]}.env"
    got = (rendered / case / name).read_text()
    want = (GOLDEN / case / name).read_text()
    assert got == want, "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "rendered"))


def test_the_golden_units_differ_where_the_profiles_do():
    units = {p: (GOLDEN / p / "sglang-main.service").read_text() for p in PROFILES}
    assert "--speculative-num-steps 3 " in units["eagle3_5tok_cuda_graph"]
    assert "--speculative-num-steps 2 " in units["eagle3_topk1"]
    assert "--speculative" not in units["baseline_no_spec"]
    assert 'NCCL_PROTO="LL"' in (GOLDEN / "eagle3_5tok_cuda_graph" / "main.env").read_text()


RDMA = ["DeviceAllow=char-infiniband_verbs rw", "DeviceAllow=/dev/infiniband/rdma_cm rw"]


def test_a_multi_node_unit_reaches_its_fabric_unless_turned_off():
    for line in RDMA:
        assert line in unit("multinode").splitlines()
        assert line not in unit("multinode_no_rdma")
        for profile in PROFILES:
            assert line not in unit(profile), "auto: a single-node instance gets no RDMA device"
    assert "--nnodes 2 " in unit("multinode") and "--node-rank 0 " in unit("multinode")
    # The modules first: DeviceAllow= resolves groups and paths when the unit starts (systemd.resource-control(5)).
    modules = "modprobe@ib_uverbs.service modprobe@rdma_ucm.service"
    assert f"Wants={modules}" in unit("multinode") and f"After={modules}" in unit("multinode")
    assert "modprobe@" not in unit("multinode_no_rdma")


@pytest.mark.parametrize("case", CASES)
def test_a_denied_system_call_fails_with_eperm_and_pidfd_getfd_is_allowed(case):
    lines = unit(case).splitlines()
    filters = [line for line in lines if line.startswith("SystemCallFilter=")]
    # The first assignment is an allow-list; later ones remove (~) or add back, in order (systemd.exec(5)).
    assert filters[0] == "SystemCallFilter=@system-service"
    assert "@debug" in filters[1] and filters[1].startswith("SystemCallFilter=~")
    assert filters[2:] == ["SystemCallFilter=pidfd_getfd"], "after the deny line, or ~@debug would take it away"
    assert "SystemCallErrorNumber=EPERM" in lines


def verifiable(text: str) -> str:
    """The unit with its commands pointed at a file that exists here (systemd-analyze verify checks that they do)."""
    true = shutil.which("true") or "/bin/true"
    out = []
    for line in text.splitlines():
        key, sep, _ = line.partition("=")
        out.append(f"{key}={true}" if sep and key in ("ExecStart", "ExecStartPre") else line)
    return "\n".join(out) + "\n"


def verify_complaints(text: str, name: str, tmp_path: Path) -> list[str]:
    """systemd-analyze verify, as staging runs it (plugins/module_utils/sglang_deploy/stage.py), on a copy whose commands
    exist here. It exits 0 on a line it ignores ("Invalid device rights 'verbs rw', ignoring."): its stderr counts."""
    path = tmp_path / name
    path.write_text(verifiable(text))
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", f"{path}:{name}"], capture_output=True, text=True, check=False
    )
    return [line for line in proc.stderr.splitlines() if name in line or "Unknown" in line] + (
        [f"exit {proc.returncode}"] if proc.returncode else []
    )


NO_SYSTEMD_ANALYZE = pytest.mark.skipif(
    not shutil.which("systemd-analyze"), reason="no systemd-analyze here (staging runs it on the lab nodes)"
)


@NO_SYSTEMD_ANALYZE
@pytest.mark.parametrize("case", CASES)
def test_systemd_analyze_verify_accepts_the_unit(case, tmp_path):
    assert verify_complaints(unit(case), f"sglang-{CASES[case]}.service", tmp_path) == []


@NO_SYSTEMD_ANALYZE
def test_systemd_analyze_verify_would_name_a_device_or_errno_it_ignores(tmp_path):
    text = unit("multinode").replace("char-infiniband_verbs rw", "/dev/infiniband/* rw x")
    text = text.replace("SystemCallErrorNumber=EPERM", "SystemCallErrorNumber=EBOGUS")
    complaints = verify_complaints(text, "sglang-mn.service", tmp_path)
    assert len(complaints) == 2 and "EBOGUS" in complaints[1], complaints


# SGLang 0.5.23's own stop (sglang/srt/managers/tokenizer_manager.py): TokenizerManager.sigterm_watchdog notices a
# SIGTERM at its next 5 s poll, drains, then gives its schedulers _SCHEDULER_EXIT_TIMEOUT_SECS (15 s) to release.
SGLANG_STOP_FLOOR_S = 5 + 15


@pytest.mark.parametrize("case", CASES)
def test_a_stop_signals_the_main_process_only_and_gives_sglang_its_drain(case):
    """Issue #29: KillMode=control-group sends SIGTERM to every process of the unit at once; SGLang's schedulers
    have no SIGTERM handler and die mid-forward, and the server kills itself with every request in flight. mixed:
    SIGTERM to the main process alone (it drains), SIGKILL to every process left at the end."""
    lines = unit(case).splitlines()
    assert [line for line in lines if line.startswith("KillMode=")] == ["KillMode=mixed"]
    assert "KillSignal=SIGTERM" in lines
    assert not any(line.startswith(("SendSIGKILL=", "FinalKillSignal=")) for line in lines), "the final SIGKILL stays"
    (timeout,) = [int(line.split("=", 1)[1]) for line in lines if line.startswith("TimeoutStopSec=")]
    assert timeout >= SGLANG_STOP_FLOOR_S + 120, "the default gives running requests a rollout's drain budget (120 s)"


def stop_timeout_check(tmp_path: Path, **values) -> subprocess.CompletedProcess:
    """render.yml's stop-timeout assert, the task as the role has it, run on the controller with these values."""
    tasks = yaml.safe_load((REPO / "roles" / "sglang_service" / "tasks" / "render.yml").read_text())
    (task,) = [t for t in tasks if "sglang_service_stop_timeout" in t["name"]]
    play = [{"hosts": "localhost", "connection": "local", "gather_facts": False, "vars": values, "tasks": [task]}]
    (tmp_path / "check.yml").write_text(yaml.safe_dump(play))
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0"}
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", str(tmp_path / "check.yml")],
        cwd=REPO,
        env={**env, "ANSIBLE_PYTHON_INTERPRETER": sys.executable},
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize(
    "module,timeout,ok",
    [
        ("sglang.launch_server", 150, True),
        ("sglang.launch_server", SGLANG_STOP_FLOOR_S, True),
        ("sglang.launch_server", SGLANG_STOP_FLOOR_S - 1, False),
        ("lab_sglang_standin", 5, True),  # the lab's stand-in drains at once (lab/lab.py sets 5)
        ("lab_sglang_standin", 0, False),  # 0 turns systemd's stop timeout off
    ],
)
def test_a_stop_timeout_too_short_for_sglangs_drain_is_refused_naming_the_variable(tmp_path, module, timeout, ok):
    proc = stop_timeout_check(tmp_path, sglang_service_launch_module=module, sglang_service_stop_timeout=timeout)
    assert (proc.returncode == 0) is ok, proc.stdout[-2000:]
    if not ok:
        assert f"sglang_service_stop_timeout={timeout} (the unit's TimeoutStopSec) is too short" in proc.stdout
