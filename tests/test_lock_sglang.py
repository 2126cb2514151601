"""tools/lock_sglang.py (`make lock-sglang`): a pip report to a hashed lock, the platform tags, pip's failures
explained (without the network), and the lock it makes for real: accepted by `pip install --require-hashes
--no-index` in a fresh virtualenv (the parser profile, from this machine's index; about 2 minutes).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import lock_sglang
from tools.lock_sglang import Group, LockError

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "lock_sglang.py"
H1, H2, H3 = "a" * 64, "b" * 64, "c" * 64


def item(name: str, version: str, url: str, sha256: str | None = None, legacy: str | None = None) -> dict:
    archive: dict = {}
    if sha256:
        archive["hashes"] = {"sha256": sha256}
    if legacy:
        archive["hash"] = legacy
    return {"metadata": {"name": name, "version": version}, "download_info": {"url": url, "archive_info": archive}}


def report(*items: dict) -> dict:
    return {"version": "1", "pip_version": "26.3", "install": list(items)}


# --- report -> lock lines ---------------------------------------------------------------------------------------


def test_report_becomes_sorted_name_version_hash_lines():
    rep = report(
        item("torch", "2.14.1", "https://files.example/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl", H1),
        item("Jinja2", "3.1.6", "https://files.example/jinja2-3.1.6-py3-none-any.whl", H2),
        item("nvidia-nccl-cu13", "2.30.7", "file:///opt/idx/nvidia_nccl_cu13-2.30.7-py3-none-any.whl", H3),
    )
    assert lock_sglang.lock_lines([rep]) == [
        f"Jinja2==3.1.6 --hash=sha256:{H2}",
        f"nvidia-nccl-cu13==2.30.7 --hash=sha256:{H3}",
        f"torch==2.14.1 --hash=sha256:{H1}",
    ]


def test_the_legacy_hash_field_serves_when_hashes_is_absent():
    rep = report(item("tqdm", "4.70.1", "https://files.example/tqdm.whl", legacy=f"sha256={H1}"))
    assert lock_sglang.lock_lines([rep]) == [f"tqdm==4.70.1 --hash=sha256:{H1}"]


def test_a_local_wheel_without_a_hash_is_hashed_from_disk(tmp_path):
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"not really a wheel")
    rep = report(item("torch", "2.13.0+cpu", wheel.as_uri()))
    want = hashlib.sha256(b"not really a wheel").hexdigest()
    assert lock_sglang.lock_lines([rep]) == [f"torch==2.13.0+cpu --hash=sha256:{want}"]


def test_a_remote_wheel_without_a_hash_is_refused():
    rep = report(item("tqdm", "4.70.1", "https://files.example/tqdm.whl"))
    with pytest.raises(LockError, match=r"^tqdm 4.70.1: no sha256 for https://files.example/tqdm.whl"):
        lock_sglang.lock_lines([rep])


def test_a_direct_url_or_vcs_source_is_refused():
    rep = report(
        {"metadata": {"name": "x", "version": "1"}, "download_info": {"url": "git+https://h/x", "vcs_info": {}}}
    )
    with pytest.raises(LockError, match="not an archive: a lock needs a wheel from an index"):
        lock_sglang.lock_lines([rep])


def test_two_sets_merge_and_must_agree():
    sglang = report(item("sglang", "0.5.23", "https://f/sglang.whl", H1))
    rest = report(
        item("Numpy", "2.4.6", "https://f/numpy.whl", H2), item("sglang", "0.5.23", "https://f/sglang.whl", H1)
    )
    assert lock_sglang.lock_lines([sglang, rest]) == [
        f"Numpy==2.4.6 --hash=sha256:{H2}",
        f"sglang==0.5.23 --hash=sha256:{H1}",
    ]
    other = report(item("numpy", "2.3.5", "https://f/numpy-old.whl", H3))
    with pytest.raises(LockError, match=r"^numpy: 2.4.6 in one set and 2.3.5 in another"):
        lock_sglang.lock_lines([rest, other])


def test_profiles_name_their_input_sets():
    assert lock_sglang.requirement_groups("0.5.22", "full") == [Group(("sglang==0.5.22",))]
    parser = lock_sglang.requirement_groups("0.5.23", "parser")
    assert parser[0] == Group(("sglang==0.5.23",), deps=False)
    assert parser[1].deps and "torch==2.13.0+cpu" in parser[1].requirements
    with pytest.raises(LockError, match="unknown profile 'gpu'"):
        lock_sglang.requirement_groups("0.5.23", "gpu")


def test_the_header_says_how_the_lock_was_made():
    lines = lock_sglang.header("0.5.23", "parser", "3.11", "manylinux_2_34_x86_64", "26.3")
    assert all(ln.startswith("# ") for ln in lines)
    assert "# Made with: make lock-sglang SGLANG_VERSION=0.5.23 PROFILE=parser PYTHON_VERSION=3.11" in lines[2]
    assert lines[3].startswith("# Input: sglang==0.5.23 (without its dependencies); py-spy numpy orjson")


# --- platform tags and pip's command line ---------------------------------------------------------------------


def test_a_manylinux_platform_expands_to_every_older_glibc_as_a_host_accepts():
    tags = lock_sglang.platform_tags("manylinux_2_34_x86_64")
    assert tags[:4] == [
        "manylinux_2_34_x86_64",
        "manylinux_2_33_x86_64",
        "manylinux_2_32_x86_64",
        "manylinux_2_31_x86_64",
    ]
    assert tags[-8:] == [
        "manylinux_2_10_x86_64",
        "manylinux_2_9_x86_64",
        "manylinux_2_8_x86_64",
        "manylinux_2_7_x86_64",
        "manylinux_2_6_x86_64",
        "manylinux_2_5_x86_64",
        "manylinux1_x86_64",
        "linux_x86_64",
    ]
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64"} <= set(tags) and len(tags) == len(set(tags)) == 34


def test_legacy_names_other_architectures_and_lists():
    assert lock_sglang.platform_tags("manylinux2014_aarch64") == [
        "manylinux_2_17_aarch64",
        "manylinux2014_aarch64",
        "linux_aarch64",
    ]
    assert lock_sglang.platform_tags("linux_x86_64, musllinux_1_2_x86_64") == ["linux_x86_64", "musllinux_1_2_x86_64"]
    assert lock_sglang.architecture("manylinux_2_28_aarch64") == "aarch64"


def test_wheels_beyond_the_roles_download_tags_are_found():
    rep = report(
        item("llguidance", "1.9.1", "https://f/llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl", H1),
        item("numpy", "2.3.5", "https://f/numpy-2.3.5-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", H2),
        item("tqdm", "4.70.1", "https://f/tqdm-4.70.1-py3-none-any.whl", H3),
        item("flash-attn-4", "4.0.0b36", "https://f/flash_attn_4-4.0.0b36-1-cp311-cp311-linux_x86_64.whl", H3),
    )
    platforms = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64"]
    assert lock_sglang.beyond_platforms([rep], platforms) == {
        "llguidance": ["manylinux_2_31_x86_64"],
        "flash-attn-4": ["linux_x86_64"],
    }
    assert lock_sglang.wheel_platforms("file:///w/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#x") == {
        "manylinux_2_28_x86_64"
    }
    assert "manylinux_2_28_x86_64" in lock_sglang.role_platforms()


def test_pip_is_asked_for_a_dry_run_report_for_the_target():
    argv = lock_sglang.pip_argv(
        Group(("sglang==0.5.23",), deps=False), Path("/t/r.json"), "3.12", ["manylinux_2_28_x86_64", "linux_x86_64"]
    )
    assert argv[:3] == [sys.executable, "-m", "pip"]
    assert argv[3:] == [
        "install",
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        "/t/r.json",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--only-binary=:all:",
        "--platform=manylinux_2_28_x86_64",
        "--platform=linux_x86_64",
        "--no-deps",
        "sglang==0.5.23",
    ]
    with_python = lock_sglang.pip_argv(Group(("x",)), Path("r"), "3.12", [], target_python="/usr/bin/python3.12")
    assert with_python[3:6] == ["--python", "/usr/bin/python3.12", "install"] and "--no-deps" not in with_python


# --- pip's failures, explained --------------------------------------------------------------------------------

NO_NCCL = """\
ERROR: Could not find a version that satisfies the requirement nvidia-nccl-cu13==2.30.7; platform_system == "Linux" \
(from torch==2.14.1->sglang==0.5.23) (from versions: 2.27.7, 2.28.3, 2.29.7)
ERROR: No matching distribution found for nvidia-nccl-cu13==2.30.7; platform_system == "Linux"
"""
NO_LLGUIDANCE = """\
ERROR: Ignored the following versions that require a different python version: 9.11.0 Requires-Python >=3.12
ERROR: Could not find a version that satisfies the requirement llguidance<2.0.0,>=1.7.6 (from sglang) \
(from versions: 0.0.1, 1.6.0, 1.6.1)
ERROR: No matching distribution found for llguidance<2.0.0,>=1.7.6
"""
CONFLICT = """\
ERROR: Cannot install sglang==0.5.9 and torch==2.9.1 because these package versions have conflicting dependencies.

The conflict is caused by:
    The user requested torch==2.9.1
    sglang 0.5.9 depends on torch==2.8.0

Additionally, some packages in these conflicts have no matching distributions available for your environment:
    torch

To fix this you could try to:
"""


def test_a_missing_pin_names_who_pins_it_and_what_the_index_has():
    text = lock_sglang.explain(NO_NCCL, "3.11", "manylinux_2_34_x86_64")
    assert text.startswith(
        'torch 2.14.1 requires nvidia-nccl-cu13==2.30.7; platform_system == "Linux", and no index here has a release'
        " of nvidia-nccl-cu13 that satisfies it with a wheel for CPython 3.11 on manylinux_2_34_x86_64 or an older tag"
        " (the newest with a usable wheel is 2.29.7)"
    )
    assert text.endswith("Try an earlier SGLang (`pip index versions sglang`) or an index that has what is missing.")


def test_a_direct_dependency_without_a_wheel_and_the_python_notes():
    text = lock_sglang.explain(NO_LLGUIDANCE, "3.11", "manylinux_2_28_x86_64")
    assert text.startswith("sglang requires llguidance<2.0.0,>=1.7.6, and no index here has a release of llguidance")
    assert "(the newest with a usable wheel is 1.6.1)" in text
    assert "Some releases were left out for needing another Python: 9.11.0 Requires-Python >=3.12." in text


def test_a_conflict_is_explained_with_pips_own_cause():
    text = lock_sglang.explain(CONFLICT, "3.11", "manylinux_2_34_x86_64")
    assert text.startswith(
        "The dependencies conflict, so no set satisfies them all:"
        " The user requested torch==2.9.1; sglang 0.5.9 depends on torch==2.8.0."
    )


def test_an_unknown_failure_points_at_pips_message():
    assert lock_sglang.explain("ERROR: something else\n", "3.11", "x").startswith(
        "pip could not make the set; its message is above."
    )


def test_the_noise_about_extra_file_indexes_is_left_out_of_pips_message():
    out = "WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory.\nERROR: y"
    assert lock_sglang.quiet(out) == "ERROR: y"


# --- the lock file the role reads -----------------------------------------------------------------------------


def test_every_shipped_lock_names_its_sglang_and_pins_every_line():
    locks = sorted((REPO / "roles" / "sglang" / "files" / "locks").glob("*.txt"))
    assert locks
    for lock in locks:
        version, profile = lock.stem.rsplit("-", 1)
        lines = [ln for ln in lock.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        names = [ln.split()[0] for ln in lines]
        assert f"sglang=={version}" in names, lock.name
        assert all("==" in n for n in names), lock.name
        hashed = [ln for ln in lines if "--hash=" in ln]
        assert hashed in ([], lines), f"{lock.name}: every line hashed or none"
        assert all(ln.count("--hash=sha256:") == 1 for ln in hashed), lock.name
        assert profile in ("full", "parser"), lock.name


# --- for real ---------------------------------------------------------------------------------------------------


def run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, text=True, capture_output=True, check=False, **kw)


def test_the_parser_lock_installs_with_require_hashes_and_no_index_in_a_fresh_venv(tmp_path):
    """As the role does: the wheels fetched on the controller, installed on the node with no index, hashes checked."""
    lock = tmp_path / "0.5.23-parser.txt"
    made = run([sys.executable, str(TOOL), "--sglang-version", "0.5.23", "--profile", "parser", "--output", str(lock)])
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"lock-sglang: {lock} (")
    lines = [ln for ln in lock.read_text().splitlines() if not ln.startswith("#")]
    assert "torch==2.13.0+cpu" in {ln.split()[0] for ln in lines}
    assert all(len(ln.split("--hash=sha256:")[1]) == 64 for ln in lines)

    wheels = tmp_path / "wheels"
    download = [sys.executable, "-m", "pip", "download", "-q", "--require-hashes", "--no-deps", "--only-binary=:all:"]
    fetched = run([*download, "-d", str(wheels), "-r", str(lock)])
    assert fetched.returncode == 0, fetched.stderr[-3000:]

    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0
    python = venv / "bin" / "python"
    offline = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile", "--no-index"]
    install += ["--find-links", str(wheels), "--require-hashes", "--no-deps"]
    installed = run([*install, "-r", str(lock)], env=offline)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # What the parser profile is for: SGLang's own argument parser runs.
    parsed = run(
        [
            str(python),
            "-c",
            "from sglang.srt.server_args import prepare_server_args as p; print(p(['--model-path', 'm']).tp_size)",
        ]
    )
    assert (parsed.returncode, parsed.stdout) == (0, "1\n"), parsed.stderr[-3000:]

    # And the hashes are checked: one changed digit and pip refuses the wheel.
    tqdm = next(ln for ln in lines if ln.startswith("tqdm=="))
    digest = tqdm.rsplit(":", 1)[1]
    bad = tmp_path / "bad.txt"
    bad.write_text(tqdm.replace(digest, ("0" if digest[0] != "0" else "1") + digest[1:]) + "\n")
    refused = run([*install, "--force-reinstall", "-r", str(bad)], env=offline)
    assert refused.returncode != 0
    assert "THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE" in refused.stderr


def test_the_role_downloads_for_every_tag_the_lock_was_resolved_for():
    """A lock resolved for the default platform has wheels tagged anywhere from manylinux1 to manylinux_2_34
    (nvidia-nccl-cu13 2.30.7: manylinux_2_18 only): ml_env must download for exactly those tags."""
    assert lock_sglang.role_platforms() == lock_sglang.platform_tags(lock_sglang.DEFAULT_PLATFORM)
