"""plugins/module_utils/sglang_deploy/nccl (bus bandwidth, topology, floor, verdict, preflight), nccl_worker, plugins/modules/nccl_preflight.

Vectors (tests/vectors/nccl/): the lent 2 x H200 host's real `nvidia-smi topo -m` (with the ANSI
underlining nvidia-smi 580 prints into a pipe), `nvlink --status`, NCCL 2.28.9's own log lines
and the worker's JSON reports from that host; topologies of 1 GPU (sgl-project/sglang#645),
8 GPUs NV18 (NVIDIA/nccl#1453) and 8 GPUs on PCIe (NVIDIA/nccl#1439), transcribed from public
issues (each file names its source). No GPU, torch or lab needed; the gloo test runs the real
worker when SGD_TORCH_PYTHON names a python with torch.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import nccl, nccl_worker

REPO = Path(__file__).resolve().parents[1]
VEC = REPO / "tests" / "vectors" / "nccl"
MIB = 1 << 20
GIB = 1 << 30


def text(name: str) -> str:
    return (VEC / name).read_text()


def reports() -> dict:
    return json.loads(text("worker-reports-h200x2.json"))["cases"]


TOPO_2 = "topo-m-2gpu-h200-lent.txt"
TOPO_8 = "topo-m-8gpu-nv18-nccl-issue-1453.txt"
TOPO_1 = "topo-m-1gpu-sglang-pr-645.txt"
TOPO_PCIE = "topo-m-8gpu-pcie-nccl-issue-1439.txt"


# --- bus bandwidth (nccl-tests' definition) ---------------------------------------------------------------


def test_algbw_is_bytes_over_time_in_1e9_bytes_per_second():
    assert nccl.algbw_gbps(GIB, 3273.14e-6) == pytest.approx(328.046, abs=1e-3)  # the lent host, 1 GiB
    assert nccl.algbw_gbps(10**9, 1.0) == 1.0
    with pytest.raises(ValueError):
        nccl.algbw_gbps(MIB, 0)


@pytest.mark.parametrize(("n", "factor"), [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_all_reduce_factor_is_2_n_minus_1_over_n(n, factor):
    assert nccl.busbw_gbps(100.0, n) == pytest.approx(100.0 * factor)


def test_busbw_other_collectives_and_bad_rank_count():
    assert nccl.busbw_gbps(100.0, 8, "all_gather") == pytest.approx(87.5)
    assert nccl.busbw_gbps(100.0, 8, "broadcast") == 100.0
    with pytest.raises(ValueError):
        nccl.busbw_gbps(1.0, 0)


def test_sizes_double_from_1_mib_to_1_gib():
    got = nccl_worker.sizes(MIB, GIB)
    assert got[0] == MIB and got[-1] == GIB and len(got) == 11
    assert all(b == 2 * a for a, b in itertools.pairwise(got))
    assert nccl_worker.sizes(MIB, 3 * MIB) == [MIB, 2 * MIB]
    with pytest.raises(ValueError):
        nccl_worker.sizes(2 * MIB, MIB)


def test_table_rows_use_the_slowest_ranks_time():
    rows = nccl_worker.table([{"bytes": GIB, "iters": 45, "seconds": 3273.14e-6}], 2)
    assert rows == [{"bytes": GIB, "iters": 45, "time_us": 3273.14, "algbw_gbps": 328.046, "busbw_gbps": 328.046}]
    # Azure's 8-GPU floor in these terms: 431 GB/s busbw at 16 GB is 246 GB/s algbw, 69.6 ms per all-reduce.
    (row,) = nccl_worker.table([{"bytes": 16 * 10**9, "iters": 1, "seconds": 16 * 10**9 / 246.2857e9}], 8)
    assert row["busbw_gbps"] == pytest.approx(431.0, abs=0.01)


# --- nvidia-smi topo -m and nvlink --status -----------------------------------------------------------------


def test_topology_of_the_lent_host_with_ansi_underlining():
    raw = text(TOPO_2)
    assert "\x1b[4m" in raw  # recorded as nvidia-smi 580 printed it into a pipe
    topo = nccl.parse_topo(raw)
    assert topo["gpus"] == [0, 1]
    assert topo["pairs"] == [{"a": 0, "b": 1, "link": "NV18"}]
    assert topo["nics"] == []
    assert topo["cpu_affinity"] == {0: "0-31", 1: "0-31"}
    assert topo["numa_affinity"] == {0: "0", 1: "0"}


def test_topology_8_gpus_nv18_with_nics():
    topo = nccl.parse_topo(text(TOPO_8))
    assert topo["gpus"] == list(range(8))
    assert len(topo["pairs"]) == 28 and {p["link"] for p in topo["pairs"]} == {"NV18"}
    assert topo["nics"] == [f"NIC{i}" for i in range(9)]
    assert topo["cpu_affinity"][0] == "0-79" and topo["cpu_affinity"][7] == "80-159"
    assert topo["numa_affinity"][7] == "1"


def test_topology_1_gpu_from_check_env_output():
    topo = nccl.parse_topo(text(TOPO_1))
    assert topo["gpus"] == [0] and topo["pairs"] == [] and len(topo["nics"]) == 5
    assert topo["cpu_affinity"][0] == "32-63,96-127"


def test_topology_pcie_space_aligned():
    topo = nccl.parse_topo(text(TOPO_PCIE))
    links = {(p["a"], p["b"]): p["link"] for p in topo["pairs"]}
    assert links[(0, 1)] == "PIX" and links[(0, 2)] == "PHB" and links[(0, 4)] == "SYS" and links[(6, 7)] == "PIX"
    assert topo["cpu_affinity"][4] == "14-27,42-55"


def test_topology_refuses_what_is_not_a_matrix():
    with pytest.raises(ValueError, match="no GPU matrix"):
        nccl.parse_topo("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    with pytest.raises(ValueError, match="2 columns"):
        nccl.parse_topo("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \n")


def test_nvlink_status_of_the_lent_host():
    st = nccl.parse_nvlink_status(text("nvlink-status-2gpu-h200-lent.txt"))
    assert sorted(st) == [0, 1]
    for g in (0, 1):
        assert st[g]["links"] == 18 and st[g]["active"] == 18 and st[g]["inactive"] == 0
        assert set(st[g]["gbps"]) == {26.562}


def test_nvlink_status_inactive_links():
    st = nccl.parse_nvlink_status(
        "GPU 0: NVIDIA H200 (UUID: GPU-x)\n\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n\t Link 2: <inactive>\n"
    )
    assert st[0] == {"links": 3, "active": 1, "inactive": 2, "gbps": [26.562]}


# --- the floor ------------------------------------------------------------------------------------------------


def test_floor_two_h200_nv18():
    fl = nccl.derive_floor(
        nccl.parse_topo(text(TOPO_2)), None, nccl.parse_nvlink_status(text("nvlink-status-2gpu-h200-lent.txt"))
    )
    assert fl["basis"] == "nvlink" and fl["link"] == "NV18" and fl["gpus"] == [0, 1]
    assert fl["peak_gbps"] == 450.0 and fl["floor_gbps"] == 225.0
    why = "\n".join(fl["reasoning"])
    assert "every pair linked by NV18" in why and "18 x 25 = 450 GB/s" in why and "225 GB/s" in why
    assert "Azure" not in why  # the 8-GPU reference is for 8 GPUs


def test_floor_eight_gpus_cites_azures_h200_floor():
    fl = nccl.derive_floor(nccl.parse_topo(text(TOPO_8)))
    assert fl["floor_gbps"] == 225.0 and fl["gpus"] == list(range(8))
    assert any("431 GB/s" in ln and "16 GB" in ln and "nd96isr_h200_v5.conf" in ln for ln in fl["reasoning"])


def test_floor_instance_on_a_subset_of_gpus():
    fl = nccl.derive_floor(nccl.parse_topo(text(TOPO_8)), [4, 5, 6, 7])
    assert fl["gpus"] == [4, 5, 6, 7] and fl["floor_gbps"] == 225.0
    assert not any("Azure" in ln for ln in fl["reasoning"])


def test_floor_one_gpu_checks_nothing():
    fl = nccl.derive_floor(nccl.parse_topo(text(TOPO_1)))
    assert fl["floor_gbps"] is None and fl["basis"] == "single-gpu"
    assert "nothing to check" in fl["reasoning"][0]
    # The same for one GPU of a bigger host.
    assert nccl.derive_floor(nccl.parse_topo(text(TOPO_8)), [3])["basis"] == "single-gpu"


def test_floor_pcie_only():
    topo = nccl.parse_topo(text(TOPO_PCIE))
    fl = nccl.derive_floor(topo)
    assert fl["basis"] == "pcie" and fl["floor_gbps"] == 8.0
    assert fl["reasoning"][0] == (
        "GPUs [0, 1, 2, 3, 4, 5, 6, 7]: links PIX, PHB, SYS; the farthest pair, GPU0-GPU4, is SYS (no NVLink across NUMA "
        "nodes): the all-reduce ring goes over PCIe."
    )
    assert fl["link"] == "SYS"
    pair = nccl.derive_floor(topo, [0, 1])
    assert pair["link"] == "PIX" and pair["reasoning"][0].startswith("GPUs [0, 1]: GPU0-GPU1 is PIX (no NVLink)")


def test_floor_mixed_nvlink_and_pcie_takes_the_slowest_pair():
    topo = {
        "gpus": [0, 1, 2],
        "pairs": [{"a": 0, "b": 1, "link": "NV18"}, {"a": 0, "b": 2, "link": "SYS"}, {"a": 1, "b": 2, "link": "NV18"}],
    }
    assert nccl.derive_floor(topo)["basis"] == "pcie"
    mixed = {
        "gpus": [0, 1, 2],
        "pairs": [{"a": 0, "b": 1, "link": "NV18"}, {"a": 0, "b": 2, "link": "NV6"}, {"a": 1, "b": 2, "link": "NV18"}],
    }
    fl = nccl.derive_floor(mixed)
    assert fl["link"] == "NV6" and fl["floor_gbps"] == 75.0 and "slowest GPU0-GPU2" in fl["reasoning"][0]


def test_floor_lowered_to_the_links_nvlink_status_says_are_active():
    status = {
        0: {"links": 18, "active": 18, "inactive": 0, "gbps": []},
        1: {"links": 18, "active": 12, "inactive": 6, "gbps": []},
    }
    fl = nccl.derive_floor(nccl.parse_topo(text(TOPO_2)), None, status)
    assert fl["link"] == "NV12" and fl["floor_gbps"] == 150.0
    assert any("GPU 1 has 12 of 18 links active" in ln for ln in fl["reasoning"])
    dead = {g: {"links": 18, "active": 0, "inactive": 18, "gbps": []} for g in (0, 1)}
    assert nccl.derive_floor(nccl.parse_topo(text(TOPO_2)), None, dead)["basis"] == "pcie"


def test_operator_floor_replaces_the_derived_one():
    topo = nccl.parse_topo(text(TOPO_2))
    fl = nccl.derive_floor(topo, operator_floor=300)
    assert fl["basis"] == "operator" and fl["floor_gbps"] == 300.0
    assert (
        fl["reasoning"][0]
        == "Floor set by the operator: 300 GB/s; it replaces the derived one (derived: 225 GB/s, for reference)."
    )
    zero = nccl.derive_floor(topo, operator_floor=0)
    assert zero["floor_gbps"] == 0.0 and "report only" in zero["reasoning"][0]


def test_floor_errors_and_no_topology():
    with pytest.raises(ValueError, match=r"GPUs \[2\] are not in the topology"):
        nccl.derive_floor(nccl.parse_topo(text(TOPO_2)), [0, 2])
    fl = nccl.derive_floor(None, [0, 1])
    assert fl["basis"] == "unknown" and fl["floor_gbps"] is None


# --- NCCL's own lines -------------------------------------------------------------------------------------------


def test_nccl_log_of_a_default_run_on_the_lent_host():
    got = nccl_worker.parse_nccl_log(text("nccl-log-default-h200x2.txt"))
    assert got["nccl_version"] == "2.28.9+cuda13.0"
    assert got["transports"] == ["P2P/CUMEM"]
    assert got["channels"] == 24
    assert got["algo"][MIB] == {"algorithm": "RING", "protocol": "LL"}
    assert got["algo"][16 * MIB] == {"algorithm": "RING", "protocol": "SIMPLE"}
    assert got["warnings"] == []
    assert "NCCL_NVLS_ENABLE=0" in got["env_set"]


def test_nccl_log_of_a_refused_value_names_the_variable():
    got = nccl_worker.parse_nccl_log(text("nccl-log-bad-proto-h200x2.txt"))
    assert got["warnings"] == [
        'Unrecognized element token "bogus" when parsing "bogus" (NCCL had just read NCCL_PROTO=bogus)'
    ]
    assert "NCCL_PROTO=bogus" in got["env_set"]


def test_nccl_log_older_numeric_tuning_lines():
    got = nccl_worker.parse_nccl_log("h:1:1 [0] NCCL INFO 1048576 Bytes -> Algo 1 proto 2 time 12.500000\n" * 3)
    assert got["algo"] == {MIB: {"algorithm": "RING", "protocol": "SIMPLE"}}


def test_nccl_message_prefers_ncclS_warn_then_last_error():
    assert nccl_worker.nccl_message("x", ["a", "b"]) == "a; b"
    err = (
        "NCCL error in: NCCLUtils.cpp:93, invalid usage\nncclInvalidUsage: ...\nLast error:\nUnrecognized element token"
    )
    assert nccl_worker.nccl_message(err, []) == "Unrecognized element token"
    assert nccl_worker.nccl_message("RuntimeError: boom", []) is None
    assert nccl_worker.last_line("Traceback...\n  File x\nValueError: bad\n\n") == "ValueError: bad"


# --- the verdict on the lent host's real reports --------------------------------------------------------------


def floor_2gpu(op: float | None = None) -> dict:
    return nccl.derive_floor(nccl.parse_topo(text(TOPO_2)), operator_floor=op)


def test_judge_default_environment_passes():
    got = nccl.judge(reports()["default"]["result"], floor_2gpu())
    assert got["ok"] and got["status"] == "ok" and got["at_bytes"] == GIB
    assert got["busbw_gbps"] > 300
    assert got["message"].startswith("busbw 328 GB/s at 1 GiB (RING/SIMPLE, P2P/CUMEM), floor 225 GB/s")


def test_judge_seed_variables_fail_the_nv18_floor():
    got = nccl.judge(reports()["seed"]["result"], floor_2gpu())
    assert not got["ok"] and got["status"] == "failed"
    assert "RING/LL" in got["message"] and "below the floor of 225 GB/s (nvlink: NV18)" in got["message"]


def test_judge_refused_value_reports_ncclS_message():
    for case, value in (("bad_proto", "bogus"), ("bad_algo", "Nope")):
        got = nccl.judge(reports()[case]["result"], floor_2gpu())
        assert not got["ok"]
        assert got["message"].startswith(
            f'all-reduce on GPUs [0, 1] failed: NCCL: Unrecognized element token "{value}"'
        )
        assert "Traceback" not in got["message"]


def test_judge_host_memory_fallback_is_caught():
    got = nccl.judge(reports()["p2p_disabled"]["result"], floor_2gpu())
    assert not got["ok"] and "SHM/direct/direct" in got["message"] and got["busbw_gbps"] < 30


def test_judge_operator_floor_zero_reports_only_and_small_sizes_are_inconclusive():
    seed = reports()["seed"]["result"]
    assert nccl.judge(seed, floor_2gpu(0))["message"].endswith("no floor, not judged")
    small = {**seed, "sizes": seed["sizes"][:3], "truncated": True}
    got = nccl.judge(small, floor_2gpu())
    assert not got["ok"] and "only sizes up to 4 MiB measured (the budget ran out)" in got["message"]


def test_judge_wrong_sums_and_single_gpu():
    bad = {**reports()["default"]["result"], "sum_ok": False}
    assert nccl.judge(bad, floor_2gpu())["message"] == "all-reduce gave wrong sums"
    one = nccl.judge({}, nccl.derive_floor(nccl.parse_topo(text(TOPO_1))))
    assert one["ok"] and one["status"] == "skipped"


# --- preflight: the module's logic, with a fake runner ------------------------------------------------------------


class FakeRun:
    """subprocess.run for preflight: nvidia-smi answers from vectors, the worker prints `report`."""

    def __init__(self, report: dict | str | None, topo: str | None = TOPO_2):
        self.report, self.topo, self.calls = report, topo, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        if cmd[0] == "nvidia-smi":
            if cmd[1] == "topo":
                out = text(self.topo) if self.topo else ""
                return subprocess.CompletedProcess(cmd, 0 if self.topo else 9, out, "")
            return subprocess.CompletedProcess(cmd, 0, text("nvlink-status-2gpu-h200-lent.txt"), "")
        assert Path(cmd[1]).read_text() == nccl.worker_source()
        out = self.report if isinstance(self.report, str) else json.dumps(self.report)
        return subprocess.CompletedProcess(cmd, 0, out, "Traceback (most recent call last):\nImportError: no torch")


def test_preflight_runs_the_worker_with_the_instances_environment():
    fake = FakeRun(reports()["default"]["result"])
    got = nccl.preflight(
        "/opt/ml-env/bin/python",
        {"NCCL_PROTO": "Simple", "NCCL_MIN_NCHANNELS": 16},
        base_env={"PATH": "/usr/bin"},
        run=fake,
    )
    assert got["ok"] and got["floor"]["floor_gbps"] == 225.0 and got["topology"]["gpus"] == [0, 1]
    cmd, kw = fake.calls[-1]
    assert cmd[0] == "/opt/ml-env/bin/python" and cmd[2:] == [
        "--backend",
        "nccl",
        "--min-bytes",
        str(MIB),
        "--max-bytes",
        str(GIB),
        "--budget-s",
        "30.0",
    ]
    assert kw["env"] == {
        "PATH": "/usr/bin",
        "NCCL_PROTO": "Simple",
        "NCCL_MIN_NCHANNELS": "16",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    assert kw["timeout"] == 60.0
    assert [c[0][:2] for c in fake.calls[:2]] == [["nvidia-smi", "topo"], ["nvidia-smi", "nvlink"]]


def test_preflight_single_gpu_does_not_run_the_worker():
    fake = FakeRun(None)
    got = nccl.preflight("python", {}, gpus=[1], run=fake)
    assert got["status"] == "skipped" and got["result"] is None
    assert all(c[0][0] == "nvidia-smi" for c in fake.calls)


def test_preflight_worker_without_a_report_says_its_last_line():
    got = nccl.preflight("python", {}, run=FakeRun("not json"), base_env={})
    assert not got["ok"] and got["message"].endswith("the worker printed no report: ImportError: no torch")


def test_preflight_without_topology_needs_gpus_and_judges_against_the_operator_only():
    with pytest.raises(ValueError, match="no GPUs given"):
        nccl.preflight("python", {}, run=FakeRun(None, topo=None))
    got = nccl.preflight("python", {}, gpus=[0, 1], floor_gbps=100, run=FakeRun(reports()["seed"]["result"], topo=None))
    assert got["ok"] and got["floor"]["basis"] == "operator" and got["topology"] is None
    with pytest.raises(ValueError):
        nccl.preflight("python", {}, min_bytes=0, run=FakeRun(None))


def test_preflight_gloo_has_no_topology_and_no_cuda_devices():
    fake = FakeRun({"ok": True, "sum_ok": True, "sizes": [{"bytes": 64 * MIB, "busbw_gbps": 0.7}]})
    got = nccl.preflight("python", {"GLOO_SOCKET_IFNAME": "lo"}, backend="gloo", nprocs=2, base_env={}, run=fake)
    assert got["ok"] and got["message"].endswith("no floor, not judged")
    assert not any(c[0][0] == "nvidia-smi" for c in fake.calls)
    assert "CUDA_VISIBLE_DEVICES" not in fake.calls[-1][1]["env"] and "--nprocs" in fake.calls[-1][0]


# --- the worker's process plumbing (no torch needed) ---------------------------------------------------------------


def test_worker_source_is_the_file():
    assert nccl.worker_source() == (REPO / "plugins" / "module_utils" / "sglang_deploy" / "nccl_worker.py").read_text()


def test_worker_runs_its_ranks_and_reports_each_ranks_error_without_a_traceback(tmp_path):
    """The real worker file, copied as preflight copies it, with this venv's python (no torch): two ranks start,
    each fails at `import torch`, and the report says so in one line per rank."""
    pytest.importorskip("sys")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("torch is importable here: the ranks would run")
    worker = tmp_path / "nccl_worker.py"
    worker.write_text(nccl.worker_source())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(worker), "--backend", "gloo", "--nprocs", "2", "--budget-s", "20"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    report = json.loads(proc.stdout)
    assert proc.returncode == 1 and not report["ok"] and report["sizes"] == []
    assert report["error"] == "ModuleNotFoundError: No module named 'torch'"
    assert [(r["rank"], r["rc"]) for r in report["ranks"]] == [(0, 1), (1, 1)]
    assert report["timed_out"] is False and report["world_size"] == 2


def test_worker_report_names_a_rank_that_died_without_a_word():
    args = nccl_worker.parse_args(["--max-bytes", str(4 * MIB)])
    ranks = [
        {"rank": 0, "rc": -9, "killed": "after a peer failed"},
        {"rank": 1, "rc": 139, "tail": "Segmentation fault"},
    ]
    got = nccl_worker.report(args, 2, ranks, "", 6.0, True, {"NCCL_ALGO": "Ring", "PATH": "/bin"})
    assert got["error"] == "no size measured within the budget of 30s (a rank hung: rendezvous or NCCL init?)"
    got = nccl_worker.report(args, 2, ranks, "", 6.0, False, {"NCCL_ALGO": "Ring", "PATH": "/bin"})
    assert got["error"] == "rank 0 exited -9: no output" and got["env"] == {"NCCL_ALGO": "Ring"}


# A torch the ranks import instead of the real one (PYTHONPATH): each rank named in HANG sleeps as a rank stuck in
# rendezvous or NCCL init would; the others fail at once, as a rank without CUDA does.
FAKE_TORCH = """\
import os, sys, time
rank = sys.argv[sys.argv.index("--rank") + 1]
if rank in os.environ["HANG"].split(","):
    time.sleep(120)
raise ImportError("fake torch: no CUDA on this host")
"""


@pytest.fixture
def fake_torch(tmp_path, monkeypatch):
    """fake_torch(hang="1"): the ranks the parent starts import FAKE_TORCH; the ranks in `hang` hang."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    def hang(ranks: str) -> None:
        monkeypatch.setenv("HANG", ranks)

    return hang


def test_worker_kills_the_ranks_still_running_a_grace_after_a_peer_failed(fake_torch):
    """The worker's parent, in this process: rank 0 fails, rank 1 would wait for it forever; it is killed
    --grace-s after the failure, not at the budget, and the report names both."""
    fake_torch("1")
    args = nccl_worker.parse_args(["--backend", "gloo", "--nprocs", "2", "--budget-s", "60", "--grace-s", "0.5"])
    args.keep_log = 300
    got = nccl_worker.launch(args)
    assert not got["ok"] and got["error"] == "ImportError: fake torch: no CUDA on this host"
    assert got["timed_out"] is True and got["elapsed_s"] < 30, "killed after the grace, long before the budget"
    by_rank = {r["rank"]: r for r in got["ranks"]}
    assert by_rank[0]["rc"] == 1 and "error_text" in by_rank[0]
    assert by_rank[1]["rc"] == -9 and by_rank[1]["killed"] == "after a peer failed"
    assert got["world_size"] == 2 and got["sizes"] == [] and got["truncated"] is True
    assert isinstance(got["log"], str) and len(got["log"]) <= 300


def test_worker_main_reports_ranks_killed_at_the_budget(fake_torch, capsys):
    fake_torch("0,1")
    rc = nccl_worker.main(["--backend", "gloo", "--nprocs", "2", "--budget-s", "1", "--max-bytes", str(4 * MIB)])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and not report["ok"] and report["timed_out"] is True
    assert report["error"] == "no size measured within the budget of 1s (a rank hung: rendezvous or NCCL init?)"
    assert [(r["rank"], r["rc"], r["killed"]) for r in report["ranks"]] == [
        (0, -9, "at the budget"),
        (1, -9, "at the budget"),
    ]
    assert report["budget_s"] == 1 and report["backend"] == "gloo"


def test_worker_counts_the_visible_gpus_or_asks_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,,3")
    assert nccl_worker._gpu_count() == 3
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert nccl_worker._gpu_count() == 0, "no nvidia-smi: no GPU"
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-a)'\necho 'GPU 1: NVIDIA H200 (UUID: GPU-b)'\n")
    smi.chmod(0o755)
    assert nccl_worker._gpu_count() == 2


def test_worker_reads_a_ranks_result_or_nothing(tmp_path):
    (tmp_path / "ok.json").write_text('{"rank": 0, "results": []}')
    (tmp_path / "cut.json").write_text('{"rank": 0, "resu')  # killed while writing it
    assert nccl_worker._read_json(str(tmp_path / "ok.json")) == {"rank": 0, "results": []}
    assert nccl_worker._read_json(str(tmp_path / "cut.json")) is None
    assert nccl_worker._read_json(str(tmp_path / "none.json")) is None


@pytest.mark.skipif(not os.environ.get("SGD_TORCH_PYTHON"), reason="SGD_TORCH_PYTHON (a python with torch) not set")
def test_gloo_on_cpu_for_real():
    got = nccl.preflight(
        os.environ["SGD_TORCH_PYTHON"], {}, backend="gloo", nprocs=2, max_bytes=64 * MIB, floor_gbps=0.01
    )
    assert got["ok"], got["message"]
    assert got["result"]["sum_ok"] and [r["bytes"] for r in got["result"]["sizes"]] == [MIB << i for i in range(7)]
    bad = nccl.preflight(
        os.environ["SGD_TORCH_PYTHON"], {"GLOO_SOCKET_IFNAME": "nonexistent0"}, backend="gloo", max_bytes=MIB
    )
    assert not bad["ok"] and "Unable to find address for: nonexistent0" in bad["message"]


# --- plugins/modules/nccl_preflight.py as Ansible runs it --------------------------------------------------------------------

RUNNER = """\
import sys
sys.argv = ['nccl_preflight', {argfile!r}]
exec(compile(open({module!r}).read(), {module!r}, 'exec'), {{'__name__': '__main__'}})
"""


def run_module(tmp_path: Path, args: dict, report: dict | None) -> tuple[int, dict]:
    fake_python = tmp_path / "python"
    (tmp_path / "report.json").write_text(json.dumps(report))
    fake_python.write_text(f"#!/bin/sh\ncat {tmp_path / 'report.json'}\n")
    fake_python.chmod(0o755)
    argfile = tmp_path / "args.json"
    args = {
        "python": str(fake_python),
        "topology": text(TOPO_2),
        "nvlink_status": text("nvlink-status-2gpu-h200-lent.txt"),
        **args,
    }
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    runner = tmp_path / "runner.py"
    runner.write_text(
        RUNNER.format(argfile=str(argfile), module=str(REPO / "plugins" / "modules" / "nccl_preflight.py"))
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "collections")}
    proc = subprocess.run([sys.executable, str(runner)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_module_passes_on_the_default_report(tmp_path):
    rc, out = run_module(tmp_path, {"env": {"NCCL_DEBUG": "WARN"}}, reports()["default"]["result"])
    assert rc == 0 and out["ok"] and out["status"] == "ok" and not out["changed"]
    assert out["msg"] == out["message"] and out["busbw_gbps"] > 300 and out["at_bytes"] == GIB
    assert out["floor"]["floor_gbps"] == 225.0 and out["topology"]["cpu_affinity"] == {"0": "0-31", "1": "0-31"}
    assert out["nvlink"]["0"]["active"] == 18 and out["result"]["sizes"][-1]["algorithm"] == "RING"


def test_module_fails_with_ncclS_message(tmp_path):
    rc, out = run_module(tmp_path, {"env": {"NCCL_PROTO": "bogus"}}, reports()["bad_proto"]["result"])
    assert rc == 1 and out["failed"] and not out["ok"]
    assert out["msg"].startswith('all-reduce on GPUs [0, 1] failed: NCCL: Unrecognized element token "bogus"')


def test_module_one_gpu_is_skipped_and_bad_sizes_fail(tmp_path):
    rc, out = run_module(tmp_path, {"gpus": [0]}, None)
    assert rc == 0 and out["status"] == "skipped" and out["result"] is None
    rc, out = run_module(tmp_path, {"min_bytes": 0}, None)
    assert rc == 1 and out["outcome"] == "invalid_config"
    assert out["msg"] == "need 0 < min_bytes <= max_bytes, got 0, 1073741824"
