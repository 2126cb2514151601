"""plugins/module_utils/sglang_deploy/gpu (the GPU state, the verdict, the wait), procinfo, and plugins/modules/gpu_state.

Parsers run on the real H200 captures (tests/vectors); the wait and the stop policy on
the lab's simulated nvidia-smi (a PATH shim) with real processes holding its GPUs.
"""

from __future__ import annotations

import getpass
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import nvsim
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import gpu, procinfo
from support import started, wait_for
from support.gpus import UUIDS_2GPU, VEC, holding, run_gpu_state

TWO_GPUS_BUSY = (
    "2 GPUs: process 564 holds 8 GB on each GPU; process 565 holds 3 GB on GPU 1 and a 518 MiB context on GPU 0"
)


def vector(title: str, startswith: str, endswith: str = "") -> str:
    return next(out for cmd, out in VEC[title] if cmd.startswith(startswith) and cmd.endswith(endswith))


def test_real_capture_gpus_and_processes():
    gpus_out = vector(TWO_GPUS_BUSY, "nvidia-smi --query-gpu=index,uuid,name,pci.bus_id")
    # The module queries index,uuid,name,memory.used,memory.total: same fields, fewer columns.
    rows = [r.split(", ") for r in gpus_out.splitlines()]
    text = "\n".join(", ".join([r[0], r[1], r[2], r[4], r[5]]) for r in rows)
    parsed = gpu.parse_gpus(text)
    assert [(g["index"], g["uuid"], g["memory_used_mib"], g["memory_total_mib"]) for g in parsed] == [
        (0, UUIDS_2GPU[0], 8681, 143771),
        (1, UUIDS_2GPU[1], 11543, 143771),
    ]
    apps = gpu.parse_apps(
        vector(
            TWO_GPUS_BUSY, "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader"
        ),
        parsed,
    )
    assert [(a["pid"], a["gpu"], a["used_mib"], a["process_name"]) for a in apps] == [
        (564, 0, 8148, "python3"),
        (565, 0, 518, "python3"),
        (564, 1, 8148, "python3"),
        (565, 1, 3380, "python3"),
    ]


def test_the_model_of_an_instances_gpus_is_read_from_the_real_capture():
    gpus_out = vector(TWO_GPUS_BUSY, "nvidia-smi --query-gpu=index,uuid,name,pci.bus_id")
    rows = [r.split(", ") for r in gpus_out.splitlines()]
    snap = {"gpus": gpu.parse_gpus("\n".join(", ".join([r[0], r[1], r[2], r[4], r[5]]) for r in rows))}
    assert gpu.model_of(snap, [0, 1]) == gpu.model_of(snap, [1]) == "NVIDIA H200"
    assert gpu.model_of(snap, [7]) is None and gpu.model_of({"gpus": []}, [0]) is None
    mixed = {"gpus": [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H100 80GB HBM3"}]}
    assert gpu.model_of(mixed, [0, 1]) == "NVIDIA H100 80GB HBM3, NVIDIA H200"


def test_header_and_units_are_understood():
    with_units = vector(TWO_GPUS_BUSY, "nvidia-smi --query-compute-apps=", "--format=csv")
    gpus = [{"index": 0, "uuid": UUIDS_2GPU[0]}, {"index": 1, "uuid": UUIDS_2GPU[1]}]
    apps = gpu.parse_apps(with_units, gpus)
    assert [(a["pid"], a["gpu"], a["used_mib"]) for a in apps] == [
        (564, 0, 8148),
        (565, 0, 518),
        (564, 1, 8148),
        (565, 1, 3380),
    ]


def test_not_available_memory_is_none_not_a_crash():
    apps = gpu.parse_apps(f"77, {UUIDS_2GPU[0]}, [N/A], python3", [{"index": 0, "uuid": UUIDS_2GPU[0]}])
    assert apps[0]["used_mib"] is None and apps[0]["gpu"] == 0


@pytest.mark.parametrize("missing", ["[N/A]", "[Not Supported]"])
def test_unavailable_values_parse_as_none_in_every_numeric_field(missing):
    gpus_ = gpu.parse_gpus(f"{missing}, {UUIDS_2GPU[0]}, NVIDIA H200, {missing}, {missing}")
    assert gpus_ == [
        {"index": None, "uuid": UUIDS_2GPU[0], "name": "NVIDIA H200", "memory_used_mib": None, "memory_total_mib": None}
    ]
    apps = gpu.parse_apps(f"{missing}, {UUIDS_2GPU[0]}, {missing}, python3", [{"index": 0, "uuid": UUIDS_2GPU[0]}])
    assert [(a["pid"], a["gpu"], a["used_mib"]) for a in apps] == [(None, 0, None)]


def test_a_row_cut_short_is_an_nvidia_smi_error_not_a_traceback():
    with pytest.raises(gpu.NvidiaSmiError, match="a GPU row with 2 fields, expected 5: 0, GPU-x"):
        gpu.parse_gpus("0, GPU-x")


def test_a_process_name_with_commas_is_kept_whole():
    apps = gpu.parse_apps(f"77, {UUIDS_2GPU[0]}, 100, worker,rank0", [{"index": 0, "uuid": UUIDS_2GPU[0]}])
    assert apps[0]["process_name"] == "worker,rank0"


def test_gpu_keeps_every_public_name_sglang_gpu_had():
    names = [
        "GPU_QUERY",
        "APP_QUERY",
        "NvidiaSmiError",
        "parse_csv",
        "parse_gpus",
        "parse_apps",
        "run_nvidia_smi",
        "read_proc",
        "unit_of",
        "describe",
        "snapshot",
        "offenders",
        "may_stop",
        "alive",
        "terminate",
        "format_offender",
        "wait_clean",
    ]
    assert [n for n in names if not hasattr(gpu, n)] == []


# ---------------------------------------------------------------- the verdict on one snapshot


def snap_of(gpus_: list[tuple[int | None, int | None]], procs: list[tuple[int | None, int, int | None]] = ()) -> dict:
    """A snapshot: GPUs as (index, memory.used), processes as (pid, gpu, used MiB)."""
    return {
        "gpus": [{"index": i, "uuid": f"GPU-{i}", "memory_used_mib": used} for i, used in gpus_],
        "processes": [
            {"pid": pid, "gpu": g, "gpu_uuid": f"GPU-{g}", "used_mib": used, "process_name": "python3"}
            for pid, g, used in procs
        ],
    }


def test_verdict_clean_names_nothing():
    v = gpu.verdict(snap_of([(0, 3), (1, 0)]), [0, 1], 1024)
    assert v["clean"] and v["missing"] == v["lines"] == v["unknown_memory"] == []
    assert v["message"] == "GPUs [0, 1] clean"


def test_verdict_unknown_memory_is_not_busy_but_is_named():
    v = gpu.verdict(snap_of([(0, None), (1, 0)]), [0, 1], 1024)
    assert v["clean"] and v["busy"] == [] and v["unknown_memory"] == [0]
    assert (
        v["message"] == "GPUs [0, 1] clean (memory.used not reported for GPUs [0]: judged by their process lists alone)"
    )


def test_verdict_a_process_with_unknown_memory_still_offends():
    v = gpu.verdict(snap_of([(0, None)], [(77, 0, None)]), [0], 1024)
    assert not v["clean"] and [p["pid"] for p in v["offenders"]] == [77]
    assert v["lines"] == ["GPU 0: pid 77 holds ? MiB (user ?, unit ?, command python3)"]


def test_verdict_names_a_busy_gpu_once_with_its_process_and_alone_without():
    v = gpu.verdict(snap_of([(0, 9000), (1, 5000)], [(77, 0, 8148)]), [0, 1], 1024)
    assert [g["index"] for g in v["busy"]] == [0, 1]
    assert v["lines"] == [
        "GPU 0: pid 77 holds 8148 MiB (user ?, unit ?, command python3)",
        "GPU 1: 5000 MiB used with no process listed (memory still being released?)",
    ]


def test_verdict_other_gpus_and_processes_of_unknown_gpus_do_not_matter():
    v = gpu.verdict(snap_of([(0, 0), (1, 9000)], [(77, 1, 8148), (78, None, 100)]), [0], 1024)
    assert v["clean"]


def test_verdict_a_gpu_without_an_index_leaves_the_wanted_one_missing():
    v = gpu.verdict(snap_of([(None, 0), (1, 0)]), [0, 1], 1024)
    assert not v["clean"] and v["missing"] == [0]
    assert v["message"] == "GPUs [0] are not on this host (it has [1, ?])"


def test_a_process_without_a_pid_is_waited_for_never_stopped():
    snap = snap_of([(0, 100)], [(None, 0, 100)])
    ticks = iter(range(100))
    res = gpu.wait_clean(
        [0], timeout=3, policy="force", clock=lambda: next(ticks), sleep=lambda s: None, take_snapshot=lambda: snap
    )
    assert not res["clean"] and res["stopped"] == {} and len(res["refused"]) == 1 and res["polls"] > 1
    assert "GPU 0: pid ? holds 100 MiB" in res["message"]


@pytest.fixture
def sim(gpus, monkeypatch):
    state, env = gpus
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("LAB_GPU_STATE", state)
    return state


def test_snapshot_names_pid_user_unit_and_command_line(sim):
    with holding(sim, ["sleep", "30"], gpu=2, mib=4096) as holder:
        snap = gpu.snapshot()
    assert len(snap["gpus"]) == 4
    (proc,) = snap["processes"]
    assert (proc["pid"], proc["gpu"], proc["used_mib"]) == (holder.pid, 2, 4096)
    assert proc["user"] == getpass.getuser() and proc["cmdline"] == "sleep 30"


@pytest.mark.parametrize("mode,words", [("driver-mismatch", "reload the nvidia modules"), ("no-driver", "not loaded")])
def test_nvidia_smi_failures_are_explained(sim, mode, words):
    nvsim.lab_gpu(["fail", mode], path=sim)
    with pytest.raises(gpu.NvidiaSmiError) as exc:
        gpu.snapshot()
    assert "nvidia-smi failed" in str(exc.value) and words in str(exc.value)


def test_missing_nvidia_smi_is_explained(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(gpu.NvidiaSmiError, match="not installed"):
        gpu.snapshot()


def test_wait_returns_when_memory_is_released(sim):
    holder = subprocess.Popen(["sleep", "30"])
    nvsim.lab_gpu(
        ["hold", "--pid", str(holder.pid), "--gpu", "0", "--mib", "60000", "--release-seconds", "0.6"], path=sim
    )
    killed_at = time.monotonic()
    holder.kill()
    holder.wait()
    res = gpu.wait_clean([0], timeout=10, interval=0.05, max_used_mib=1024)
    assert res["clean"], res["message"]
    # Listed no more at once, but clean only once memory fell under 1024 MiB (about 0.59 s): at least one
    # poll saw it held (each poll runs nvidia-smi twice; on a loaded machine a poll takes 0.5 s, so 2 may be all).
    assert 0.4 < time.monotonic() - killed_at < 3 and res["polls"] >= 2


def test_timeout_names_every_offender_and_stops_nothing_by_default(sim):
    with holding(sim, ["sleep", "30"], gpu=1, mib=8148) as holder:
        res = gpu.wait_clean([0, 1], timeout=0.3, interval=0.05)
        assert holder.poll() is None  # still running: policy none
    assert not res["clean"] and res["stopped"] == {}
    assert f"GPU 1: pid {holder.pid} holds 8148 MiB (user {getpass.getuser()}" in res["message"]
    assert "command sleep 30" in res["message"] and "never stopped" in res["message"]


def test_other_gpus_do_not_matter(sim):
    with holding(sim, ["sleep", "30"], gpu=3, mib=8148):
        assert gpu.wait_clean([0, 1], timeout=0.2, interval=0.05)["clean"]


@pytest.fixture
def unitless(monkeypatch):
    """The test's processes are strays no unit owns, wherever pytest runs (a CI runner's service is another unit)."""
    monkeypatch.setattr(procinfo, "unit_of", lambda pid: None)


def test_policy_own_stops_the_service_users_process_but_not_others(sim, unitless):
    me = getpass.getuser()
    with holding(sim, ["sleep", "30"], gpu=0, mib=8148) as holder:
        res = gpu.wait_clean([0], timeout=5, interval=0.05, policy="own", service_user="someone-else")
        assert not res["clean"] and holder.poll() is None and res["refused"]
        res = gpu.wait_clean([0], timeout=5, interval=0.05, policy="own", service_user=me, kill_grace=2)
        assert res["clean"], res["message"]
        assert res["stopped"] == {holder.pid: "SIGTERM"} and holder.wait(timeout=5) == -15


def ignores_sigterm(pid: int) -> bool:
    """/proc/PID/status: SIGTERM is in the process's set of ignored signals."""
    status = Path(f"/proc/{pid}/status").read_text()
    ignored = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(ignored & (1 << (signal.SIGTERM - 1)))


def test_policy_own_escalates_to_sigkill(sim, unitless):
    with holding(
        sim,
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"],
        gpu=0,
        mib=100,
    ) as holder:
        wait_for("the holder to ignore SIGTERM", lambda: ignores_sigterm(holder.pid))
        res = gpu.wait_clean(
            [0], timeout=5, interval=0.05, policy="own", service_user=getpass.getuser(), kill_grace=0.5
        )
        assert res["clean"] and res["stopped"] == {holder.pid: "SIGKILL"}


def test_force_stops_anyone(sim):
    with holding(sim, ["sleep", "30"], gpu=0, mib=100) as holder:
        res = gpu.wait_clean([0], timeout=5, interval=0.05, policy="force", kill_grace=2)
        assert res["clean"] and holder.pid in res["stopped"]


def test_policy_own_never_stops_another_units_process_of_the_service_user(sim, monkeypatch):
    """Issue #29: every instance runs as the service user; a process of another instance's unit is not "own"."""
    me = getpass.getuser()
    monkeypatch.setattr(procinfo, "unit_of", lambda pid: "sglang-main.service")
    with holding(sim, ["sleep", "30"], gpu=0, mib=8148) as holder:
        res = gpu.wait_clean(
            [0], timeout=0.3, interval=0.05, policy="own", service_unit="sglang-bench.service", service_user=me
        )
        assert holder.poll() is None, "still running"
    assert not res["clean"] and res["stopped"] == {} and res["stopped_processes"] == []
    assert [p["pid"] for p in res["refused"]] == [holder.pid]
    assert "unit sglang-main.service" in res["message"] and "never stopped" in res["message"]


# A process of the service user as procinfo describes it; cases: (its unit, its user, policy, may it be stopped).
MINE, SVC = "sglang-bench.service", "sglang"
STOP_POLICY = [
    ("this unit", MINE, SVC, "own", True),
    ("this unit, another user (ExecStartPre=+)", MINE, "root", "own", True),
    ("another instance's unit", "sglang-main.service", SVC, "own", False),
    ("another service unit", "jupyter.service", SVC, "own", False),
    ("a transient scope (systemd-run --scope)", "run-r0123abc.scope", SVC, "own", False),
    ("a container's scope", "libpod-0123abcd.scope", SVC, "own", False),
    ("a user manager's service", "app.service", SVC, "own", False),
    ("no unit: a stray outside any unit", None, SVC, "own", True),
    ("a login session's scope", "session-4.scope", SVC, "own", True),
    ("no unit, another user", None, "alice", "own", False),
    ("a login session, another user", "session-4.scope", "alice", "own", False),
    ("hidden by /proc: no user, no unit", None, None, "own", False),
    ("another instance's unit, force", "sglang-main.service", SVC, "force", True),
    ("another user, force", "session-4.scope", "alice", "force", True),
    ("this unit, none", MINE, SVC, "none", False),
    ("no unit, none", None, SVC, "none", False),
]


@pytest.mark.parametrize("unit,user,policy,allowed", [c[1:] for c in STOP_POLICY], ids=[c[0] for c in STOP_POLICY])
def test_the_stop_policy_decides_by_unit_first_then_user(unit, user, policy, allowed):
    proc = {"pid": 4242, "gpu": 0, "user": user, "unit": unit}
    assert gpu.may_stop(proc, policy, MINE, SVC) is allowed


def test_what_the_wait_stopped_says_whose_it_was_and_how_it_ended(monkeypatch):
    """A stray of the service user on two GPUs, stopped once; another unit's process beside it, never."""
    rows = [
        {"pid": 71, "gpu": 0, "used_mib": 900, "user": SVC, "unit": None, "cmdline": "python stray.py"},
        {"pid": 71, "gpu": 1, "used_mib": 900, "user": SVC, "unit": None, "cmdline": "python stray.py"},
        {"pid": 72, "gpu": 1, "used_mib": 900, "user": SVC, "unit": "sglang-main.service", "cmdline": "python -m x"},
    ]
    live = {71, 72}

    def terminate(pids, grace, interval):
        live.difference_update(pids)
        return {pid: "SIGKILL" for pid in pids}

    def snap() -> dict:
        s = snap_of([(0, 900), (1, 1800)])
        return {**s, "processes": [r for r in rows if r["pid"] in live]}

    monkeypatch.setattr(gpu, "terminate", terminate)
    ticks = iter(range(100))
    res = gpu.wait_clean(
        [0, 1],
        3,
        policy="own",
        service_unit=MINE,
        service_user=SVC,
        clock=lambda: next(ticks),
        sleep=lambda s: None,
        take_snapshot=snap,
    )
    assert not res["clean"] and live == {72}
    assert res["stopped"] == {71: "SIGKILL"}
    assert res["stopped_processes"] == [
        {"pid": 71, "user": SVC, "unit": None, "gpus": [0, 1], "command": "python stray.py", "how": "SIGKILL"}
    ]


def test_a_missing_gpu_is_named(sim):
    res = gpu.wait_clean([0, 7], timeout=1, interval=0.05)
    assert (
        not res["clean"]
        and res["missing"] == [7]
        and "GPUs [7] are not on this host (it has [0, 1, 2, 3])" in res["message"]
    )


def test_module_reports_and_fails_with_offenders(gpus):
    state, env = gpus
    rc, out = run_gpu_state(env, {})
    assert rc == 0 and len(out["gpus"]) == 4 and out["processes"] == [] and not out["changed"]
    with holding(state, ["sleep", "30"], gpu=1, mib=8148) as holder:
        rc, out = run_gpu_state(env, {"wait": True, "gpus": [1], "timeout": 0.3})
    assert rc == 1 and out["failed"] and f"pid {holder.pid} holds 8148 MiB" in out["msg"]
    assert out["wait"]["offenders"][0]["pid"] == holder.pid


def test_module_refuses_slow_polling(gpus):
    _, env = gpus
    rc, out = run_gpu_state(env, {"wait": True, "interval": 1.0})
    assert rc == 1 and "interval is 1.0: poll at least every 0.25 s" in out["msg"]


# ---------------------------------------------------------------- procinfo


def test_cmdline_is_the_argv_and_empty_once_the_process_is_gone():
    argv = [sys.executable, "-c", "import time; time.sleep(30)", "two words", ""]
    proc = started(argv)
    try:
        assert procinfo.cmdline(proc.pid) == argv
    finally:
        proc.kill()
        proc.wait()
    assert procinfo.cmdline(proc.pid) == []


def test_describe_puts_the_command_on_one_line_cut_to_400_chars():
    proc = started([sys.executable, "-c", "import time\ntime.sleep(30)", "x" * 1000])
    try:
        info = procinfo.describe(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert info["user"] == getpass.getuser() and info["alive"] is True
    assert info["cmdline"] == f"{sys.executable} -c import time time.sleep(30) {'x' * 1000}"[:400]
    assert len(info["cmdline"]) == 400


def test_describe_of_a_gone_process_is_all_unknown():
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert procinfo.describe(proc.pid) == {"user": None, "unit": None, "cmdline": None, "alive": False}


def test_a_zombie_is_not_alive():
    proc = subprocess.Popen(["true"])
    try:
        wait_for(
            "the exited child to be a zombie",
            lambda: procinfo.read_proc(proc.pid, "stat").rsplit(") ", 1)[-1].startswith("Z"),
        )
        assert os.path.exists(f"/proc/{proc.pid}"), "not reaped yet: still in /proc"
        assert procinfo.alive(proc.pid) is False
    finally:
        proc.wait()


@pytest.mark.parametrize(
    "cgroup,unit",
    [
        ("0::/system.slice/sglang-main.service\n", "sglang-main.service"),
        ("0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope"),
        ("12:pids:/system.slice/sglang-main.service/worker\n0::/\n", "sglang-main.service"),
        ("0::/\n", None),
        ("", None),
    ],
)
def test_unit_of_reads_the_innermost_unit_from_the_cgroup(monkeypatch, cgroup, unit):
    monkeypatch.setattr(procinfo, "read_proc", lambda pid, name: cgroup if name == "cgroup" else "")
    assert procinfo.unit_of(1234) == unit


# ---------------------------------------------------------------- detection latency: the snapshot, the wait, an exit


def fake_nvidia_smi(tmp_path: Path, body: str) -> str:
    """A PATH holding only an `nvidia-smi` shell script with `body`; returns the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def test_a_snapshot_runs_its_two_queries_side_by_side(tmp_path, monkeypatch):
    """Each fake nvidia-smi waits until both have started: run one after the other, the first would wait alone
    until its 10 s are out and fail the snapshot."""
    marks = tmp_path / "marks"
    marks.mkdir()
    body = f"""q=$(echo "$1" | cut -d= -f1)
touch {marks}/"$q"
i=0
while [ "$(ls {marks} | wc -l)" -lt 2 ]; do i=$((i+1)); [ $i -gt 1000 ] && {{ echo "alone: $q" >&2; exit 3; }}; sleep 0.01; done
case "$q" in
  --query-gpu) echo "0, GPU-a, NVIDIA H200, 3, 143771" ;;
  *) echo "77, GPU-a, 5000, python3" ;;
esac
"""
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, body))
    snap = gpu.snapshot(describe_processes=False)
    assert [g["memory_used_mib"] for g in snap["gpus"]] == [3]
    assert [(p["pid"], p["gpu"]) for p in snap["processes"]] == [(77, 0)]
    assert sorted(os.listdir(marks)) == ["--query-compute-apps", "--query-gpu"]


def test_one_failing_query_fails_the_snapshot_with_its_message_and_leaves_no_process(tmp_path, monkeypatch):
    pids = tmp_path / "pids"
    # The failing query waits until the other has started (bounded): both must exist for "ended" to be shown.
    body = f"""echo $$ >>{pids}
case "$1" in
  --query-gpu*)
    i=0
    while [ "$(wc -l <{pids})" -lt 2 ] && [ $i -lt 1000 ]; do i=$((i+1)); sleep 0.01; done
    echo "Failed to initialize NVML: Driver/library version mismatch"; exit 18 ;;
  *) exec sleep 30 ;;
esac
"""
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, body))
    # The failing query is reported at once, not the other's 30 s (nor the 30 s timeout), and the other is ended.
    with pytest.raises(gpu.NvidiaSmiError, match=r"exit 18.*reload the nvidia modules"):
        gpu.snapshot()
    assert len(pids.read_text().split()) == 2
    assert all(not procinfo.alive(int(p)) for p in pids.read_text().split())


def test_a_query_that_hangs_is_ended_at_the_timeout_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_nvidia_smi(tmp_path, "exec sleep 30\n"))
    with pytest.raises(gpu.NvidiaSmiError, match=r"did not answer within 0\.2s"):
        gpu.snapshot(timeout=0.2)


def test_the_wait_polls_every_interval_from_each_polls_start():
    """The snapshot's own time is not added to the interval: a 60 ms snapshot leaves a 40 ms sleep."""
    t = [0.0]
    slept: list[float] = []

    def snap() -> dict:
        t[0] += 0.06
        return snap_of([(0, 9000)])

    def sleep(s: float) -> None:
        slept.append(round(s, 6))
        t[0] += s

    res = gpu.wait_clean([0], timeout=0.5, interval=0.1, clock=lambda: t[0], sleep=sleep, take_snapshot=snap)
    assert not res["clean"] and slept and set(slept) == {0.04}


def test_wait_exit_wakes_when_the_process_exits_and_not_before(monkeypatch):
    proc = started(["sleep", "30"])
    try:
        assert procinfo.wait_exit(proc.pid, 0.05) is False  # still running: the whole timeout
        monkeypatch.setattr(procinfo.time, "sleep", lambda s: pytest.fail("a pidfd wait never sleeps"))
        proc.kill()
        assert procinfo.wait_exit(proc.pid, 30) is True  # woken by the exit (a zombie until reaped), not the 30 s
    finally:
        proc.kill()
        proc.wait()
    assert procinfo.wait_exit(proc.pid, 30) is True  # reaped: no such process


def test_wait_exit_without_pidfds_sleeps_the_timeout_and_asks_proc(monkeypatch):
    monkeypatch.delattr(procinfo.os, "pidfd_open")
    slept: list[float] = []
    monkeypatch.setattr(procinfo.time, "sleep", slept.append)
    assert procinfo.wait_exit(os.getpid(), 0.1) is False and slept == [0.1]
