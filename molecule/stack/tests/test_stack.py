"""CUDA 13 from NVIDIA's wheels, ml-env, SGLang 0.5.23 with its patch series, on a lab node."""

import hashlib
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SERIES = sorted((REPO / "roles" / "sglang" / "files" / "patches" / "0.5.23").glob("*.patch"))
SITE = "/opt/ml-env/lib/python3.11/site-packages"
PY = "/opt/ml-env/bin/python"


def test_nvcc_from_nvidia_wheels_reports_13_0(host):
    out = host.check_output("bash -lc 'nvcc --version'")
    assert "Cuda compilation tools, release 13.0, V13.0.88" in out
    assert host.check_output("bash -lc 'echo $CUDA_HOME'") == "/usr/local/cuda-13.0"
    link = host.file("/usr/local/cuda-13.0")
    assert link.is_symlink
    assert link.linked_to == "/opt/cuda/13.0/lib/python3.11/site-packages/nvidia/cu13"


def test_cuda_runtime_is_on_the_loader_path(host):
    assert host.file("/etc/ld.so.conf.d/cuda-13-0.conf").content_string.strip().endswith("/usr/local/cuda-13.0/lib")
    assert "libcudart.so.13" in host.check_output("ldconfig -p")


def test_ml_env_is_root_owned_and_not_writable_by_the_service_user(host):
    venv = host.file("/opt/ml-env")
    assert venv.user == "root"
    assert host.run("sudo -u sglang test -w /opt/ml-env/lib").rc != 0
    assert host.run("sudo -u sglang test -r %s/sglang/__init__.py" % SITE).rc == 0


def test_real_sglang_parser_runs_on_the_node(host):
    script = (
        "import argparse, sglang; from sglang.srt.server_args import ServerArgs;"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p);"
        "a = p.parse_args(['--model-path', '/m', '--tp', '8', '--speculative-algorithm', 'EAGLE3']);"
        "print(sglang.__version__, len(p._actions), a.tp_size, a.speculative_algorithm)"
    )
    assert host.check_output(f'{PY} -c "{script}"') == "0.5.23 532 8 EAGLE3"


def test_manifest_records_version_patches_and_files(host):
    manifest = json.loads(host.file("/var/lib/sglang/patches.json").content_string)
    assert manifest["version"] == "0.5.23"
    assert manifest["patches"] == [
        {"name": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in SERIES
    ]
    rel = "sglang/srt/speculative/eagle_worker_v2.py"
    assert list(manifest["files"]) == [rel]
    installed = host.check_output(f"sha256sum {SITE}/{rel}").split()[0]
    assert manifest["files"][rel]["after"] == installed
    assert manifest["files"][rel]["before"] != installed


def test_patched_file_initialises_attributes_first_and_compiles(host):
    src = host.file(f"{SITE}/sglang/srt/speculative/eagle_worker_v2.py").content_string
    init = src.index("class EAGLEWorkerV2")
    body = src[init:]
    assert body.index("self.adaptive_controller: Optional[AdaptiveController] = None") < body.index("EagleDraftWorker(")
    assert host.run(f"{PY} -m py_compile {SITE}/sglang/srt/speculative/eagle_worker_v2.py").rc == 0


def test_a_series_that_does_not_apply_changes_nothing(host):
    error = host.file("/root/conflict-error.txt").content_string
    assert (
        "patch 0002-does-not-apply.patch does not apply to sglang 0.5.23: "
        "sglang/srt/speculative/eagle_worker_v2.py: hunk #1 FAILED at line 1300" in error
    )
    assert "Nothing was changed." in error
    before, after = host.file("/root/conflict-tree-hashes.txt").content_string.split()
    assert before == after


def test_nodes_install_with_no_index(host):
    wheels = host.check_output("ls /var/cache/sglang-deploy/wheelhouse/")
    assert "sglang-0.5.23-parser-" in wheels and "cuda-13.0-" in wheels


def test_service_unit_is_enabled_hardened_and_not_started(host):
    unit = host.service("sglang-main")
    assert unit.is_enabled
    assert not unit.is_running
    text = host.file("/etc/systemd/system/sglang-main.service").content_string
    assert "ExecStartPre=/usr/local/libexec/sglang-gpu-gate --gpus 0,1,2,3,4,5,6,7 " in text
    assert "--speculative-algorithm EAGLE3" in text and "--speculative-num-steps 2" in text
    out = host.check_output("systemd-analyze security --no-pager sglang-main.service")
    # docs/unit-security.md records 1.6 (1.5 before @resources had to be allowed for SGLang).
    assert "Overall exposure level for sglang-main.service: 1.6 OK" in out
