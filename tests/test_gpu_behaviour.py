"""nvidia-smi as the GPU wait runs it, and the stops it makes (issue #31: the behaviours behind the mutants the
unit suite let survive in sglang_deploy/gpu.py).

nvidia-smi is a script on PATH that prints what a real one does in each case (its exit codes: 9 when it cannot
talk to the driver, as NVIDIA's documentation of nvidia-smi lists them); the processes stopped are real ones.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import gpu


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """write(body): nvidia-smi on PATH runs `body` (sh), with its arguments as "$@"."""
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def write(body: str) -> None:
        path = bindir / "nvidia-smi"
        path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
        path.chmod(0o755)

    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return write


def test_one_query_returns_its_own_output(smi):
    smi('echo "asked: $*"\n')
    assert gpu.run_nvidia_smi("--query-gpu=index", "--format=csv") == "asked: --query-gpu=index --format=csv\n"


def test_queries_side_by_side_return_each_its_own_output_in_order(smi):
    smi('echo "asked: $*"\n')
    assert gpu.run_nvidia_smi_together([["-a"], ["-b", "c"]]) == ["asked: -a\n", "asked: -b c\n"]


def test_one_query_is_given_up_on_after_its_timeout(smi):
    smi("exec sleep 5\n")
    with pytest.raises(gpu.NvidiaSmiError, match=r"did not answer within 0\.3s \(a hung GPU or driver\?\)"):
        gpu.run_nvidia_smi("-L", timeout=0.3)


@pytest.mark.parametrize(
    ("code", "said", "message"),
    [
        (
            9,
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
            "nvidia-smi failed (exit 9): NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
            "driver. The NVIDIA kernel driver is not loaded.",
        ),
        (9, "No devices were found", "nvidia-smi failed (exit 9): No devices were found The NVIDIA kernel driver is not loaded."),
        (
            255,
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.",
            "nvidia-smi failed (exit 255): NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
            "driver. The NVIDIA kernel driver is not loaded.",
        ),
        (
            18,
            "Failed to initialize NVML: Driver/library version mismatch",
            "nvidia-smi failed (exit 18): Failed to initialize NVML: Driver/library version mismatch The kernel "
            "driver and the NVML library differ: reboot, or reload the nvidia modules.",
        ),
        (15, "Unable to determine the device handle for GPU0000:1B:00.0:   Unknown Error",
         "nvidia-smi failed (exit 15): Unable to determine the device handle for GPU0000:1B:00.0: Unknown Error"),
    ],
)  # fmt: skip
def test_a_failure_is_nvidia_smis_own_words_in_one_line_and_a_hint_at_its_cause(smi, code, said, message):
    smi(f'echo "{said}" >&2\nexit {code}\n')
    with pytest.raises(gpu.NvidiaSmiError) as err:
        gpu.run_nvidia_smi("-L")
    assert str(err.value) == message


def sleeper(*, ignore_term: bool = False) -> subprocess.Popen:
    """A real process; one that ignores SIGTERM outlives the grace and needs SIGKILL. Ready once it said so."""
    code = "import signal, sys, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_terminate_says_how_each_process_ended(monkeypatch):
    polite, stubborn = sleeper(), sleeper(ignore_term=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    # procinfo.alive reads /proc: a child that died stays a zombie until reaped, so reap as the kernel would.
    monkeypatch.setattr(
        gpu.procinfo, "alive", lambda pid: next(p for p in (polite, stubborn, gone) if p.pid == pid).poll() is None
    )
    out = gpu.terminate([polite.pid, stubborn.pid, gone.pid], grace=0.5, interval=0.05)
    assert out == {polite.pid: "SIGTERM", stubborn.pid: "SIGKILL", gone.pid: "gone"}
    assert polite.wait(timeout=5) == -signal.SIGTERM and stubborn.wait(timeout=5) == -signal.SIGKILL


def test_a_stopped_process_without_a_command_line_is_named_by_nvidia_smis_process_name(monkeypatch):
    victim = sleeper()
    row = {"pid": victim.pid, "gpu": 3, "gpu_uuid": "GPU-3", "used_mib": 500, "process_name": "python3"}
    snaps = iter(
        [
            {"gpus": [{"index": 3, "uuid": "GPU-3", "memory_used_mib": 600}], "processes": [row]},
            {"gpus": [{"index": 3, "uuid": "GPU-3", "memory_used_mib": 0}], "processes": []},
        ]
    )
    monkeypatch.setattr(gpu.procinfo, "alive", lambda pid: victim.poll() is None)
    res = gpu.wait_clean(
        [3], timeout=30, interval=0.01, policy="force", kill_grace=5, take_snapshot=lambda: next(snaps)
    )
    assert res["clean"] and res["stopped_processes"] == [
        {"pid": victim.pid, "user": None, "unit": None, "gpus": [3], "command": "python3", "how": "SIGTERM"}
    ]


def snap(gpus: list[tuple], procs: list[tuple] = ()) -> dict:
    """GPUs as (index, memory.used, name), processes as (pid, gpu, used MiB)."""
    return {
        "gpus": [{"index": i, "uuid": f"GPU-{i}", "name": n, "memory_used_mib": used} for i, used, n in gpus],
        "processes": [
            {"pid": pid, "gpu": g, "gpu_uuid": f"GPU-{g}", "used_mib": used, "process_name": "python3"}
            for pid, g, used in procs
        ],
    }


@pytest.mark.parametrize(("used", "clean"), [(1023, True), (1024, True), (1025, False)])
def test_memory_at_the_threshold_is_clean_and_above_it_is_not(used, clean):
    v = gpu.verdict(snap([(0, used, "H200")]), [0], 1024)
    assert v["clean"] is clean and [g["index"] for g in v["busy"]] == ([] if clean else [0])
    assert v["message"] == (
        "GPUs [0] clean"
        if clean
        else f"GPUs [0] not clean: GPU 0: {used} MiB used with no process listed (memory still being released?)"
    )


def test_processes_and_memory_on_gpus_not_wanted_are_not_the_instances_business():
    s = snap([(0, 0, "H200"), (1, 70000, "H200"), (2, 0, "H200")], [(501, 1, 69000), (502, 2, 100)])
    v = gpu.verdict(s, [0], 1024)
    assert v["clean"] and v["offenders"] == [] and v["busy"] == [] and v["message"] == "GPUs [0] clean"
    v = gpu.verdict(s, [0, 2], 1024)
    assert [p["pid"] for p in v["offenders"]] == [502] and v["busy"] == []


def test_missing_gpus_are_named_with_what_the_host_has():
    v = gpu.verdict(snap([(0, 0, "H200"), (None, 0, "H200")]), [0, 1, 7], 1024)
    assert v["missing"] == [1, 7] and not v["clean"]
    assert v["message"] == "GPUs [1, 7] are not on this host (it has [0, ?])"


def test_the_model_is_the_names_of_the_wanted_gpus_only():
    s = snap([(0, 0, "NVIDIA H200"), (1, 0, "NVIDIA H100 80GB HBM3"), (2, 0, "NVIDIA H200")])
    assert gpu.model_of(s, [0, 2]) == "NVIDIA H200"
    assert gpu.model_of(s, [0, 1]) == "NVIDIA H100 80GB HBM3, NVIDIA H200"
    assert gpu.model_of(s, [5]) is None and gpu.model_of({}, [0]) is None


class Clock:
    """A clock that moves only when slept on, or by `cost` per snapshot (nvidia-smi's own time)."""

    def __init__(self, cost: float = 0.0):
        self.t, self.cost, self.sleeps = 100.0, cost, []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 6))
        self.t += seconds


def test_the_wait_polls_every_interval_from_each_polls_start_until_its_timeout():
    clock = Clock()
    held = snap([(0, 9000, "H200")])

    def take():
        clock.t += 0.03  # each snapshot takes 30 ms: the sleep after it is the rest of the interval
        return held

    res = gpu.wait_clean([0], timeout=0.5, interval=0.1, clock=clock, sleep=clock.sleep, take_snapshot=take)
    assert not res["clean"] and set(clock.sleeps) == {0.07}
    # polls at 0, 0.1, ..., 0.5 from the start: the last one at the deadline still counts
    assert res["polls"] == 6 and res["waited_s"] == pytest.approx(0.53)
    assert res["message"].startswith("GPUs [0] not clean after 0.5s: GPU 0: 9000 MiB used with no process listed")


def test_a_snapshot_slower_than_the_interval_is_followed_by_the_next_at_once():
    clock = Clock()

    def take():
        clock.t += 0.25
        return snap([(0, 9000, "H200")])

    res = gpu.wait_clean([0], timeout=0.6, interval=0.1, clock=clock, sleep=clock.sleep, take_snapshot=take)
    assert set(clock.sleeps) == {0.0} and res["polls"] == 3


def test_the_wait_ends_at_the_first_clean_poll():
    clock = Clock()
    polls = iter([snap([(0, 9000, "H200")]), snap([(0, 10, "H200")]), snap([(0, 9000, "H200")])])
    res = gpu.wait_clean(
        [0], timeout=30, interval=0.1, clock=clock, sleep=clock.sleep, take_snapshot=lambda: next(polls)
    )
    assert res["clean"] and res["polls"] == 2 and res["waited_s"] == pytest.approx(0.1)
    assert res["message"] == "GPUs [0] clean" and res["stopped"] == {} and res["gpus"][0]["memory_used_mib"] == 10


def test_missing_gpus_end_the_verdict_with_nothing_else_judged():
    v = gpu.verdict(snap([(0, 90000, "H200")], [(7, 0, 100)]), [0, 5], 1024)
    assert v == {
        "clean": False,
        "missing": [5],
        "offenders": [],
        "busy": [],
        "unknown_memory": [],
        "lines": [],
        "note": "",
        "message": "GPUs [5] are not on this host (it has [0])",
    }


def test_every_offender_is_named_in_one_message():
    v = gpu.verdict(snap([(0, 5000, "H200"), (1, 3000, "H200")], [(7, 0, 100)]), [0, 1], 1024)
    assert v["message"] == (
        "GPUs [0, 1] not clean: GPU 0: pid 7 holds 100 MiB (user ?, unit ?, command python3); "
        "GPU 1: 3000 MiB used with no process listed (memory still being released?)"
    )
    nameless = {"pid": None, "gpu": 2, "used_mib": None}
    assert gpu.format_offender(nameless) == "GPU 2: pid ? holds ? MiB (user ?, unit ?, command ?)"


def test_by_default_the_wait_polls_ten_times_a_second():
    clock = Clock()
    res = gpu.wait_clean(
        [0], timeout=0.45, clock=clock, sleep=clock.sleep, take_snapshot=lambda: snap([(0, 9000, "H200")])
    )
    assert set(clock.sleeps) == {0.1} and res["polls"] == 6  # at 0, 0.1, ..., 0.5


def test_the_deadline_itself_is_the_last_poll():
    clock = Clock()
    res = gpu.wait_clean(
        [0], timeout=0.5, interval=0.25, clock=clock, sleep=clock.sleep, take_snapshot=lambda: snap([(0, 9000, "H200")])
    )
    assert res["polls"] == 3 and res["waited_s"] == 0.5  # at 0, 0.25 and 0.5: not once more after it


def test_under_force_nothing_is_refused_and_a_process_that_stays_is_named_without_the_hint(monkeypatch):
    victim = sleeper()
    held = snap([(0, 9000, "H200")], [(victim.pid, 0, 8000)])
    monkeypatch.setattr(gpu.procinfo, "alive", lambda pid: victim.poll() is None)
    clock = Clock()
    res = gpu.wait_clean(
        [0], timeout=0.2, interval=0.1, policy="force", kill_grace=5, clock=clock, sleep=clock.sleep,
        take_snapshot=lambda: held,  # nvidia-smi still lists it (a zombie holding its memory)
    )  # fmt: skip
    assert res["refused"] == [] and res["stopped"] == {victim.pid: "SIGTERM"}
    assert res["message"] == (
        f"GPUs [0] not clean after 0.2s: GPU 0: pid {victim.pid} holds 8000 MiB (user ?, unit ?, command python3)."
    )
    assert res["processes"] == held["processes"] and res["gpus"] == held["gpus"]


def test_a_process_that_appears_after_a_first_stop_is_stopped_too_and_both_are_reported(monkeypatch):
    first, second = sleeper(), sleeper()
    snaps = iter(
        [
            snap([(0, 9000, "H200")], [(first.pid, 0, 8000)]),
            snap([(0, 9000, "H200")], [(second.pid, 0, 8000)]),
            snap([(0, 0, "H200")]),
        ]
    )
    monkeypatch.setattr(gpu.procinfo, "alive", lambda pid: {first.pid: first, second.pid: second}[pid].poll() is None)
    clock = Clock()
    res = gpu.wait_clean(
        [0], timeout=5, interval=0.1, policy="force", kill_grace=5, clock=clock, sleep=clock.sleep,
        take_snapshot=lambda: next(snaps),
    )  # fmt: skip
    assert res["clean"] and res["stopped"] == {first.pid: "SIGTERM", second.pid: "SIGTERM"}
    assert [p["pid"] for p in res["stopped_processes"]] == [first.pid, second.pid]


def test_units_holding_the_gpus_are_named_whose_instance_only_under_the_instances_naming():
    held = {
        "sglang-other.service": [{"pid": 12, "gpu": 5}, {"pid": 11, "gpu": 4}],
        "dcgm.service": [{"pid": None, "gpu": 1}],
    }
    assert gpu.units_held(held, "sglang-main.service", "main") == (
        "sglang-other.service (sglang instance other): pids 11, 12 on GPUs [4, 5]; dcgm.service: pids ? on GPUs [1]"
    )
    # a unit not named <prefix><instance>.service: no other unit is taken for an instance
    assert gpu.units_held(held, "custom.service", "main").startswith("sglang-other.service: pids 11, 12")


def test_nvidia_smis_rows_parse_with_or_without_a_header_and_name_a_short_row():
    gpus = gpu.parse_gpus(
        "index, uuid, name, memory.used [MiB], memory.total [MiB]\n0, GPU-a, NVIDIA H200, 4 MiB, 143771 MiB\n"
    )
    assert gpus == [
        {"index": 0, "uuid": "GPU-a", "name": "NVIDIA H200", "memory_used_mib": 4, "memory_total_mib": 143771}
    ]
    apps = gpu.parse_apps("pid, gpu_uuid, used_gpu_memory [MiB], process_name\n41, GPU-a, 900 MiB, python3\n", gpus)
    assert apps == [{"pid": 41, "gpu": 0, "gpu_uuid": "GPU-a", "used_mib": 900, "process_name": "python3"}]
    with pytest.raises(gpu.NvidiaSmiError, match=r"printed a compute process row with 2 fields, expected 3: 41, GPU-a"):
        gpu.parse_apps("41, GPU-a\n", gpus)


def test_each_process_of_a_snapshot_is_described_as_itself(smi, monkeypatch):
    smi(
        """
        case "$1" in
          --query-gpu=*) echo "0, GPU-a, NVIDIA H200, 9000, 143771" ;;
          *) printf '41, GPU-a, 100, python3\\n42, GPU-a, 200, python3\\n41, GPU-b, 5, python3\\n' ;;
        esac
        """
    )
    described = []
    monkeypatch.setattr(gpu.procinfo, "describe", lambda pid: described.append(pid) or {"user": f"u{pid}"})
    got = gpu.snapshot()
    assert [(p["pid"], p["user"]) for p in got["processes"]] == [(41, "u41"), (42, "u42"), (41, "u41")]
    assert described == [41, 42]  # once per process, not per row
    assert gpu.snapshot(describe_processes=False)["processes"][0].get("user") is None


def test_an_nvidia_smi_that_cannot_be_run_is_explained(smi, tmp_path):
    smi("exit 0\n")
    (tmp_path / "bin" / "nvidia-smi").chmod(0o644)  # there, not executable
    with pytest.raises(gpu.NvidiaSmiError, match=r"nvidia-smi could not be run: .*Permission denied"):
        gpu.snapshot()


def test_by_default_more_than_1024_mib_on_a_wanted_gpu_is_not_clean():
    clock = Clock()
    for used, clean in ((1024, True), (1025, False)):
        res = gpu.wait_clean(
            [0], timeout=0, clock=clock, sleep=clock.sleep, take_snapshot=lambda used=used: snap([(0, used, "H200")])
        )
        assert res["clean"] is clean


def test_the_timeout_names_every_offender_and_why_the_others_users_were_not_stopped():
    s = snap([(0, 9000, "H200"), (1, 0, "H200")], [(7, 0, 100), (8, 1, 200)])
    clock = Clock()
    res = gpu.wait_clean([0, 1], timeout=0, clock=clock, sleep=clock.sleep, take_snapshot=lambda: s)
    assert res["message"] == (
        "GPUs [0, 1] not clean after 0s: GPU 0: pid 7 holds 100 MiB (user ?, unit ?, command python3); "
        "GPU 1: pid 8 holds 200 MiB (user ?, unit ?, command python3). Processes of other users or units are never "
        "stopped: stop them yourself, or rerun with the stop policy 'force' to have them killed."
    )


def test_under_own_the_units_and_the_service_users_strays_are_not_refused(monkeypatch):
    ours, stray = sleeper(), sleeper()
    rows = snap([(0, 9000, "H200")], [(ours.pid, 0, 100), (stray.pid, 0, 100)])
    rows["processes"][0].update(unit="sglang-m.service", user="bob")
    rows["processes"][1].update(unit=None, user="sglang")
    monkeypatch.setattr(gpu.procinfo, "alive", lambda pid: {ours.pid: ours, stray.pid: stray}[pid].poll() is None)
    clock = Clock()
    res = gpu.wait_clean(
        [0], timeout=0.1, interval=0.1, policy="own", service_unit="sglang-m.service", service_user="sglang",
        kill_grace=5, clock=clock, sleep=clock.sleep, take_snapshot=lambda: rows,  # still listed: not clean
    )  # fmt: skip
    assert res["refused"] == [] and set(res["stopped"]) == {ours.pid, stray.pid}
    assert "never stopped" not in res["message"]
