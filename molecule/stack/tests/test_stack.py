"""CUDA 13 from NVIDIA's wheels, ml-env, SGLang 0.5.23 with its patch series, on a lab node,
in software generations (one virtualenv each, /opt/ml-env the link to the current one)."""

import hashlib
import json
import re
from pathlib import Path

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import (
    software,  # collections/ is on the path: pytest.ini's pythonpath (the rootdir's)
)

REPO = Path(__file__).resolve().parents[3]

SERIES = sorted((REPO / "roles" / "sglang" / "files" / "patches" / "0.5.23").glob("*.patch"))
FIRST_ONLY = sorted((REPO / "molecule" / "stack" / "fixtures" / "first-only").glob("*.patch"))
CONFLICT = sorted((REPO / "molecule" / "stack" / "fixtures" / "conflict").glob("*.patch"))
LOCK = [
    line.strip()
    for line in (REPO / "roles" / "sglang" / "files" / "locks" / "0.5.23-parser.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
GENS = "/opt/ml-env.d"
SITE = "/opt/ml-env/lib/python3.11/site-packages"
PY = "/opt/ml-env/bin/python"


def identity(series):
    """What the sglang role records for the lab's converge (ml_env_requirements empty, parser profile)."""
    patches = [{"name": p.name, "content": p.read_text()} for p in series]
    return {
        "python_version": "3.11",
        "sglang_version": "0.5.23",
        "install_profile": "parser",
        "lock_sha256": software.lock_sha256(LOCK),
        "patch_series_sha256": software.patch_series_sha256(patches),
    }


A = software.generation_id(identity(SERIES))
B = software.generation_id(identity(FIRST_ONLY))
C = software.generation_id(identity(CONFLICT))


def record(host, gen):
    return json.loads(host.file(f"{GENS}/{gen}/sglang-deploy/generation.json").content_string)


def test_the_link_points_at_the_current_generation(host):
    link = host.file("/opt/ml-env")
    assert link.is_symlink
    assert link.linked_to == f"{GENS}/{A}"
    gens = host.file(GENS)
    assert gens.user == "root" and gens.mode == 0o755


def test_generation_json_says_what_the_generation_holds(host):
    rec = record(host, A)
    created = rec.pop("created")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", created)
    assert rec == dict(identity(SERIES), generation=A)
    assert software.generation_id(rec) == A  # the record says how its id was made


def test_a_second_generation_is_kept_and_an_incomplete_one_pruned(host):
    assert sorted(host.file(GENS).listdir()) == sorted([A, B])
    rec = record(host, B)
    assert rec["generation"] == B and rec["patch_series_sha256"] == identity(FIRST_ONLY)["patch_series_sha256"]
    manifest = json.loads(host.file(f"{GENS}/{B}/sglang-deploy/patches.json").content_string)
    assert [p["name"] for p in manifest["patches"]] == [p.name for p in FIRST_ONLY]
    seen = json.loads(host.file("/root/generation-b.json").content_string)
    assert seen["b"]["generation"] == B and seen["c"]["generation"] == C
    assert seen["b"]["venv"] == f"{GENS}/{B}" and seen["b"]["manifest"] == f"{GENS}/{B}/sglang-deploy/patches.json"
    removed = {e["name"]: e["reason"] for e in seen["pruned"]["removed"]}
    assert removed == {C: "incomplete: no sglang-deploy/generation.json (an install that failed or was interrupted)"}
    kept = {e["name"]: e["reason"] for e in seen["pruned"]["kept"]}
    assert kept[B] == "current: the generation just installed"
    # A is also the newest other (keep=2), but first of all the converged unit runs it.
    assert kept[A] == "referenced by /etc/systemd/system/sglang-main.service"


def test_pruning_never_removes_a_generation_a_record_names(host):
    answers = json.loads(host.file("/root/prune-keep-1.json").content_string)
    ref = answers["referenced"]
    assert ref["changed"] is False and ref["removed"] == []
    kept = {e["name"]: e["reason"] for e in ref["kept"]}
    assert kept[B] == "referenced by /var/lib/sglang/known-good/molecule-reference/generations/reference.json"
    free = answers["unreferenced"]
    assert free["changed"] is True and [e["name"] for e in free["removed"]] == [B]  # check mode: still there
    assert "referenced by no unit or record" in free["removed"][0]["reason"]
    assert host.file(f"{GENS}/{B}").is_directory
    assert not host.file("/var/lib/sglang/known-good/molecule-reference").exists


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
    venv = host.file(f"{GENS}/{A}")
    assert venv.user == "root"
    assert host.run("sudo -u sglang test -w /opt/ml-env/lib").rc != 0
    assert host.run(f"sudo -u sglang test -w {GENS}").rc != 0
    assert host.run(f"sudo -u sglang test -r {SITE}/sglang/__init__.py").rc == 0


def test_real_sglang_parser_runs_on_the_node(host):
    script = (
        "import argparse, sglang; from sglang.srt.server_args import ServerArgs;"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p);"
        "a = p.parse_args(['--model-path', '/m', '--tp', '8', '--speculative-algorithm', 'EAGLE3']);"
        "print(sglang.__version__, len(p._actions), a.tp_size, a.speculative_algorithm)"
    )
    assert host.check_output(f'{PY} -c "{script}"') == "0.5.23 532 8 EAGLE3"


def test_manifest_in_the_generation_records_version_patches_and_files(host):
    manifest = json.loads(host.file(f"{GENS}/{A}/sglang-deploy/patches.json").content_string)
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
    wheel, a_before, c, a_after = host.file("/root/conflict-tree-hashes.txt").content_string.split()
    assert c == wheel, "the failed generation's SGLang is as the wheel has it"
    assert a_after == a_before != wheel, "the current generation (patched) is not touched"


def test_nodes_install_with_no_index(host):
    wheels = host.check_output("ls /var/cache/sglang-deploy/wheelhouse/")
    assert "sglang-0.5.23-parser-" in wheels and "cuda-13.0-" in wheels


def test_service_unit_is_hardened_not_started_and_not_enabled_before_a_verified_restart(host):
    unit = host.service("sglang-main")
    assert not unit.is_enabled, "never verified: a boot must not start it (a verified restart enables it)"
    assert not unit.is_running
    text = host.file("/etc/systemd/system/sglang-main.service").content_string
    assert "ExecStartPre=/usr/local/libexec/sglang-deploy/sglang-gpu-gate --gpus 0,1,2,3,4,5,6,7 " in text
    assert f"ExecStart={GENS}/{A}/bin/python " in text  # the unit names its software generation (sglang_software)
    assert host.file("/usr/local/libexec/sglang-deploy/sglang_deploy/gpu.py").exists
    assert "--speculative-algorithm EAGLE3" in text and "--speculative-num-steps 2" in text
    out = host.check_output("systemd-analyze security --no-pager sglang-main.service")
    # docs/unit-security.md records 1.7 (1.6 before pidfd_getfd was allowed back for CUDA IPC, 1.5 before
    # @resources had to be allowed for SGLang).
    assert "Overall exposure level for sglang-main.service: 1.7 OK" in out
