"""The lab's simulated nvidia-smi (a test double) against real H200 output.

The vectors are tests/vectors/nvidia-smi-h200.md, a verbatim copy of
../shared/reference/nvidia-smi-h200.md captured on real GPUs. Each case builds
the simulator state that the capture describes and compares the output field by
field, then byte for byte.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

import nvsim
from support import REPO
from support.gpus import UUID_1GPU, UUIDS_2GPU, VEC, VECTORS, expected_text

SHARED = REPO.parent / "shared" / "reference" / "nvidia-smi-h200.md"


def make_state(tmp_path: Path, uuids: list[str], apps: list[tuple[int, int, int]] = (), overhead: int = 15) -> str:
    state = nvsim.default_state(len(uuids), seed="test")
    for gpu, uuid in zip(state["gpus"], uuids, strict=True):
        gpu["uuid"] = uuid
    state["context_overhead_mib"] = overhead
    for pid, gpu, mib in apps:
        # Pinned: the captured pids are not alive on this machine.
        state["apps"].append(
            {"pid": pid, "gpu": gpu, "used_mib": mib, "name": "python3", "pinned": True, "released_at": None}
        )
    path = tmp_path / "state.json"
    nvsim.write_state(state, str(path))
    return str(path)


def run(path: str, cmd: str, now: float | None = None) -> tuple[int, str]:
    code, out, err = nvsim.nvidia_smi(cmd.split()[1:], path=path, now=now)
    return code, out + err


def assert_same(actual: str, expected: str) -> None:
    a_lines, e_lines = actual.splitlines(), expected.splitlines()
    assert len(a_lines) == len(e_lines), f"line count {len(a_lines)} != {len(e_lines)}:\n{actual}"
    for n, (a, e) in enumerate(zip(a_lines, e_lines, strict=True)):
        assert a.split(", ") == e.split(", "), f"line {n}: fields differ"
    assert actual == expected


def test_vectors_are_a_verbatim_copy_of_the_shared_reference():
    if not SHARED.exists():
        pytest.skip(f"{SHARED} is not beside this checkout")
    assert VECTORS.read_bytes() == SHARED.read_bytes()


@pytest.mark.parametrize(
    "title,uuids,apps,overhead",
    [
        ("1 GPU, idle", [UUID_1GPU], [], 15),
        ("1 GPU, one python3 process holding 20 GB (torch.empty on cuda)", [UUID_1GPU], [(431, 0, 19592)], 9),
        ("2 GPUs: idle, with header and units", UUIDS_2GPU, [], 15),
        (
            "2 GPUs: process 564 holds 8 GB on each GPU; process 565 holds 3 GB on GPU 1 and a 518 MiB context on GPU 0",
            UUIDS_2GPU,
            [(564, 0, 8148), (564, 1, 8148), (565, 1, 3380), (565, 0, 518)],
            15,
        ),
    ],
)
def test_csv_queries_match_real_output(tmp_path, title, uuids, apps, overhead):
    cases = VEC[title]
    assert cases, f"no commands parsed for {title!r}"
    path = make_state(tmp_path, uuids, apps, overhead)
    for cmd, raw in cases:
        code, out = run(path, cmd)
        assert code == 0, out
        assert_same(out, expected_text(raw))


def test_plain_nvidia_smi_is_byte_identical(tmp_path):
    ((cmd, raw),) = VEC["2 GPUs: plain nvidia-smi, idle"]
    path = make_state(tmp_path, UUIDS_2GPU)
    state = json.loads(Path(path).read_text())
    state["gpus"][0].update(temperature_c=36, power_w=78)
    state["gpus"][1].update(temperature_c=33, power_w=79)
    nvsim.write_state(state, path)
    stamp = raw.splitlines()[0].strip()
    now = time.mktime(time.strptime(stamp, "%a %b %d %H:%M:%S %Y"))
    code, out = run(path, cmd, now=now)
    assert code == 0
    assert out == expected_text(raw)


def test_plain_nvidia_smi_lists_processes_in_the_table_width(tmp_path):
    path = make_state(tmp_path, UUIDS_2GPU, [(564, 0, 8148), (565, 1, 3380)])
    _, out = run(path, "nvidia-smi")
    rows = [line for line in out.splitlines() if re.match(r"^\|\s+\d+\s+N/A\s+N/A\s+\d+\s+C\s", line)]
    assert [r.split()[4] for r in rows] == ["564", "565"]
    assert all(len(line) == 91 for line in out.splitlines()[1:] if line)
    assert "No running processes found" not in out


def test_a_killed_process_vanishes_at_the_next_query(tmp_path):
    """Reference 'Release timing': after SIGKILL the next poll shows no app and 0 MiB."""
    path = make_state(tmp_path, [UUID_1GPU])
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert nvsim.lab_gpu(["hold", "--pid", str(proc.pid), "--gpu", "0", "--mib", "29136"], path=path) == 0
        _, apps = run(path, "nvidia-smi --query-compute-apps=pid --format=csv,noheader,nounits")
        assert apps == f"{proc.pid}\n"
        _, used = run(path, "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits")
        assert used == "29151\n"
    finally:
        proc.kill()
        proc.wait()
    assert run(path, "nvidia-smi --query-compute-apps=pid --format=csv,noheader,nounits") == (0, "")
    assert run(path, "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits") == (0, "0\n")


def test_slow_release_unlists_the_app_but_memory_falls_over_time(tmp_path):
    path = make_state(tmp_path, [UUID_1GPU])
    nvsim.lab_gpu(
        ["hold", "--pid", "999999", "--gpu", "0", "--mib", "10000", "--release-seconds", "4", "--pinned"], path=path
    )
    nvsim.lab_gpu(["release", "--pid", "999999"], path=path)
    released = json.loads(Path(path).read_text())["apps"][0]["released_at"]
    q_apps = "nvidia-smi --query-compute-apps=pid --format=csv,noheader"
    q_used = "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits"
    assert run(path, q_apps, now=released + 1) == (0, "")
    assert run(path, q_used, now=released + 1) == (0, "7500\n")
    assert run(path, q_used, now=released + 3) == (0, "2500\n")
    assert run(path, q_used, now=released + 4.01) == (0, "0\n")


def test_a_pinned_stray_stays_listed(tmp_path):
    path = make_state(tmp_path, UUIDS_2GPU)
    nvsim.lab_gpu(["hold", "--pid", "4242", "--gpu", "1", "--mib", "512", "--pinned", "--name", "stray"], path=path)
    _, out = run(
        path, "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory,process_name --format=csv,noheader,nounits"
    )
    assert out == f"4242, {UUIDS_2GPU[1]}, 512, stray\n"


@pytest.mark.parametrize(
    "mode,code,message",
    [
        ("no-driver", 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver"),
        ("driver-mismatch", 18, "Failed to initialize NVML: Driver/library version mismatch"),
    ],
)
def test_nvidia_smi_failures(tmp_path, mode, code, message):
    path = make_state(tmp_path, [UUID_1GPU])
    nvsim.lab_gpu(["fail", mode], path=path)
    got_code, out = run(path, "nvidia-smi --query-gpu=index --format=csv")
    assert got_code == code
    assert out.startswith(message)
    nvsim.lab_gpu(["fail", "none"], path=path)
    assert run(path, "nvidia-smi --query-gpu=index --format=csv,noheader") == (0, "0\n")


def test_no_state_file_means_no_driver(tmp_path):
    code, out = run(str(tmp_path / "absent.json"), "nvidia-smi")
    assert code == 9
    assert "couldn't communicate with the NVIDIA driver" in out


def test_unknown_field_is_refused_like_the_real_one(tmp_path):
    path = make_state(tmp_path, [UUID_1GPU])
    assert run(path, "nvidia-smi --query-gpu=index,bogus --format=csv") == (
        2,
        'Field "bogus" is not a valid field to query.\n',
    )


def test_gpu_selection_and_list(tmp_path):
    path = make_state(tmp_path, UUIDS_2GPU)
    assert run(path, "nvidia-smi -i 1 --query-gpu=index,uuid --format=csv,noheader") == (0, f"1, {UUIDS_2GPU[1]}\n")
    assert run(path, "nvidia-smi -L") == (
        0,
        f"GPU 0: NVIDIA H200 (UUID: {UUIDS_2GPU[0]})\nGPU 1: NVIDIA H200 (UUID: {UUIDS_2GPU[1]})\n",
    )


def test_hold_on_a_missing_gpu_names_the_flag(tmp_path, capsys):
    path = make_state(tmp_path, UUIDS_2GPU)
    with pytest.raises(SystemExit) as exc:
        nvsim.lab_gpu(["hold", "--pid", "1", "--gpu", "7", "--mib", "1"], path=path)
    assert exc.value.code == 2
    assert "--gpu: no simulated GPU [7]" in capsys.readouterr().err


def test_init_makes_distinct_stable_uuids(tmp_path):
    path = str(tmp_path / "s.json")
    nvsim.lab_gpu(["init", "--gpus", "8", "--seed", "lab-node1"], path=path)
    _, out = run(path, "nvidia-smi --query-gpu=uuid --format=csv,noheader")
    uuids = out.split()
    assert len(set(uuids)) == 8
    assert all(re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", u) for u in uuids)
    nvsim.lab_gpu(["init", "--gpus", "8", "--seed", "lab-node1", "--force"], path=path)
    assert run(path, "nvidia-smi --query-gpu=uuid --format=csv,noheader")[1] == out


def test_driver_version_can_be_set(tmp_path):
    path = make_state(tmp_path, [UUID_1GPU])
    nvsim.lab_gpu(["driver", "570.86.15"], path=path)
    assert run(path, "nvidia-smi --query-gpu=driver_version --format=csv,noheader") == (0, "570.86.15\n")
    assert "Driver Version: 570.86.15" in run(path, "nvidia-smi")[1]
