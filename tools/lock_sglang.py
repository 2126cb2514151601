#!/usr/bin/env python3
"""Resolve SGLang's complete lock for a target host, with pip's own resolver, and write it where the role finds it.

  make lock-sglang SGLANG_VERSION=0.5.23 PROFILE=full [PYTHON_VERSION=3.11] [PLATFORM=manylinux_2_34_x86_64]
  python tools/lock_sglang.py --sglang-version 0.5.23 --profile full [--python-version 3.11] [--platform ...]

pip resolves the set for the target's CPython version and platform (`pip install --dry-run --ignore-installed
--report --python-version --platform --only-binary=:all:`) from the indexes of this machine's pip configuration
(index-url, extra-index-url, find-links, constraint; PIP_* variables). The lock has one line per package,
`name==version --hash=sha256:...` (the hash of the wheel pip chose, from the report), sorted, under a header
saying how it was made; it goes to roles/sglang/files/locks/<version>-<profile>.txt (or --output).

The platform is the newest tag the host accepts (manylinux_2_34_x86_64: glibc 2.34 or newer); every older
manylinux tag of the same architecture is allowed too, as pip on that host would. Environment markers are
evaluated by the interpreter that runs pip: it must be the target's Python version (this one, or python3.X
on PATH through `pip --python`), on the target's architecture.

Profiles: full (SGLang and every dependency: GPU hosts); parser (SGLang without its dependencies, plus the
smallest set its argument parser needs on a CPU, torch the CPU build: lab nodes, flag validation).
When pip cannot resolve, its own message is printed, then what it means.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform as host_platform
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "roles" / "sglang" / "files" / "locks"
DEFAULT_PLATFORM = "manylinux_2_34_x86_64"
# What SGLang's argument parser (sglang.srt.server_args) imports on a CPU; torch is the CPU build. And py-spy
# (an SGLang dependency, in the full lock too): the crash evidence bundle dumps every rank with it.
PARSER_SET = [
    "py-spy",
    "numpy",
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "torch==2.13.0+cpu",
    "triton",
    "packaging",
    "pillow",
    "starlette",
    "pydantic",
    "pyzmq",
    "tqdm",
    "ipython",
    "aiohttp",
    "msgspec",
]
# Legacy manylinux names and the glibc they stand for (PEP 600).
LEGACY_MANYLINUX = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
LEGACY_GLIBC = {name: glibc for glibc, name in LEGACY_MANYLINUX.items()}


class LockError(Exception):
    """The lock could not be made; the message says why (pip's own message is printed before)."""


@dataclass(frozen=True)
class Group:
    """Requirements resolved together; deps=False: exactly these, without their dependencies."""

    requirements: tuple[str, ...]
    deps: bool = True


def requirement_groups(version: str, profile: str) -> list[Group]:
    if profile == "full":
        return [Group((f"sglang=={version}",))]
    if profile == "parser":
        return [Group((f"sglang=={version}",), deps=False), Group(tuple(PARSER_SET))]
    raise LockError(f"unknown profile {profile!r}: full or parser")


def platform_tags(platform: str) -> list[str]:
    """The tags a host of `platform` accepts, newest first: manylinux_2_N_arch expands to every older glibc.

    pip takes --platform literally (manylinux_2_34 alone refuses a manylinux_2_31 wheel), so every tag is given.
    A comma-separated list is expanded tag by tag; other tags (linux_x86_64, musllinux_...) stay as they are.
    """
    out: list[str] = []
    for tag in (t.strip() for t in platform.split(",") if t.strip()):
        legacy = re.fullmatch(r"(manylinux\d+)_(\w+)", tag)
        modern = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
        if legacy and legacy.group(1) in LEGACY_GLIBC:
            (major, minor), arch = LEGACY_GLIBC[legacy.group(1)], legacy.group(2)
        elif modern:
            major, minor, arch = int(modern.group(1)), int(modern.group(2)), modern.group(3)
        else:
            out.append(tag)
            continue
        # manylinux exists from glibc 2.5 on x86_64 and i686, from 2.17 on the other architectures.
        oldest = 5 if arch in ("x86_64", "i686") else 17
        for glibc in range(minor, oldest - 1, -1):
            out.append(f"manylinux_{major}_{glibc}_{arch}")
            if (major, glibc) in LEGACY_MANYLINUX:
                out.append(f"{LEGACY_MANYLINUX[(major, glibc)]}_{arch}")
        out.append(f"linux_{arch}")
    return list(dict.fromkeys(out))


def architecture(platform: str) -> str:
    m = re.search(r"(x86_64|aarch64|i686|ppc64le|s390x|armv7l)$", platform_tags(platform)[-1])
    return m.group(1) if m else platform


def pip_argv(
    group: Group, report: Path, python_version: str, tags: list[str], target_python: str | None = None
) -> list[str]:
    argv = [sys.executable, "-m", "pip"]
    if target_python:
        argv += ["--python", target_python]
    argv += ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
    argv += ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    argv += [f"--platform={t}" for t in tags]
    if not group.deps:
        argv.append("--no-deps")
    return argv + list(group.requirements)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def local_sha256(url: str) -> str | None:
    """sha256 of a wheel on this machine's disk (a find-links directory gives no hash of its own)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "file":
        return None
    path = Path(urllib.request.url2pathname(parsed.path))
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def lock_entries(reports: list[dict], hash_of=local_sha256) -> dict[str, tuple[str, str, str]]:
    """pip reports -> {canonical name: (name, version, sha256)}; a package in two reports must agree."""
    entries: dict[str, tuple[str, str, str]] = {}
    for report in reports:
        for item in report.get("install", []):
            name, version = item["metadata"]["name"], item["metadata"]["version"]
            info = item.get("download_info", {})
            url = info.get("url", "")
            if "archive_info" not in info:
                raise LockError(
                    f"{name} {version} comes from {url}, not an archive: a lock needs a wheel from an index"
                )
            sha256 = info["archive_info"].get("hashes", {}).get("sha256")
            if not sha256:
                legacy = info["archive_info"].get("hash", "")
                sha256 = legacy.split("=", 1)[1] if legacy.startswith("sha256=") else hash_of(url)
            if not sha256:
                raise LockError(f"{name} {version}: no sha256 for {url} (neither from the index nor on this disk)")
            key = canonical(name)
            if key in entries and entries[key][1:] != (version, sha256):
                raise LockError(f"{name}: {entries[key][1]} in one set and {version} in another; lock them together")
            entries[key] = (name, version, sha256)
    return entries


def lock_lines(reports: list[dict], hash_of=local_sha256) -> list[str]:
    """pip reports -> the lock's lines, `name==version --hash=sha256:...`, sorted by canonical name."""
    entries = lock_entries(reports, hash_of)
    return [f"{n}=={v} --hash=sha256:{h}" for _, (n, v, h) in sorted(entries.items())]


def wheel_platforms(url: str) -> set[str]:
    """The platform tags of a wheel, from its file name (name-version[-build]-python-abi-platform.whl)."""
    name = urllib.parse.unquote(url.rsplit("/", 1)[-1].split("#", 1)[0])
    if not name.endswith(".whl"):
        return set()
    return set(name[: -len(".whl")].split("-")[-1].split("."))


def beyond_platforms(reports: list[dict], platforms: list[str]) -> dict[str, list[str]]:
    """Packages whose chosen wheel fits none of `platforms` (a download with those tags would not find it)."""
    out: dict[str, list[str]] = {}
    for report in reports:
        for item in report.get("install", []):
            tags = wheel_platforms(item.get("download_info", {}).get("url", ""))
            if tags and "any" not in tags and not tags & set(platforms):
                out[item["metadata"]["name"]] = sorted(tags)
    return out


def role_platforms() -> list[str]:
    """ml_env_platforms, the tags the ml_env role downloads the lock's wheels for (its defaults)."""
    text = (REPO / "roles" / "ml_env" / "defaults" / "main.yml").read_text()
    block = re.search(r"^ml_env_platforms:\n((?:\s+- .+\n)+)", text, re.M)
    return re.findall(r"- (\S+)", block.group(1)) if block else []


def header(version: str, profile: str, python_version: str, platform: str, pip_version: str) -> list[str]:
    groups = requirement_groups(version, profile)
    inputs = "; ".join(" ".join(g.requirements) + ("" if g.deps else " (without its dependencies)") for g in groups)
    what = "SGLang and every dependency" if profile == "full" else "SGLang and what its argument parser needs on a CPU"
    return [
        f"# SGLang {version}, profile {profile}: {what}, for CPython {python_version} on {platform} (and older tags).",
        f"# Resolved by pip {pip_version} (pip install --dry-run --report); one sha256 per package: the wheel pip chose.",
        f"# Made with: make lock-sglang SGLANG_VERSION={version} PROFILE={profile} PYTHON_VERSION={python_version}"
        f" PLATFORM={platform}",
        f"# Input: {inputs}",
    ]


def explain(output: str, python_version: str, platform: str) -> str:
    """What pip's failure means, in one paragraph (pip's own message is printed as it is)."""
    where = f"CPython {python_version} on {platform} or an older tag"
    notes = []
    m = re.search(
        r"Could not find a version that satisfies the requirement (?P<req>.+?)"
        r"(?: \(from (?P<chain>[^)]*)\))? \(from versions: (?P<versions>[^)]*)\)",
        output,
    )
    if m:
        req = m.group("req").strip()
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]
        parent = (m.group("chain") or "").split("->")[0].strip()
        who = f"{parent.replace('==', ' ')} requires {req}" if parent else f"{req} was asked for"
        versions = [v.strip() for v in m.group("versions").split(",") if v.strip() and v.strip() != "none"]
        have = f"the newest with a usable wheel is {versions[-1]}" if versions else "none has a usable wheel"
        notes.append(
            f"{who}, and no index here has a release of {name} that satisfies it with a wheel for {where}"
            f" ({have}): the index lacks that release, or the release publishes no wheel for this target"
            f" (see `pip download --no-deps {name}` and the wheels on its index page)."
        )
    if "conflicting dependencies" in output or "ResolutionImpossible" in output:
        cause = re.search(r"The conflict is caused by:\n(?P<lines>(?:[ \t]+.+\n?)+)", output)
        lines = "; ".join(ln.strip() for ln in cause.group("lines").splitlines()) if cause else "see above"
        notes.append(f"The dependencies conflict, so no set satisfies them all: {lines}.")
    ignored = re.search(r"Ignored the following versions that require a different python version: (.+)", output)
    if ignored:
        notes.append(f"Some releases were left out for needing another Python: {ignored.group(1).strip()}.")
    if not notes:
        notes.append("pip could not make the set; its message is above.")
    return (
        " ".join(notes) + " Try an earlier SGLang (`pip index versions sglang`) or an index that has what is missing."
    )


def quiet(output: str) -> str:
    """pip's output without its notes about extra file:// indexes that lack a project (noise, not the failure)."""
    return "\n".join(ln for ln in output.splitlines() if not re.match(r"WARNING: Location '.*' is ignored", ln))


def target_interpreter(python_version: str) -> str | None:
    """The interpreter whose markers pip evaluates: None for this one; else python3.X on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == python_version:
        return None
    found = shutil.which(f"python{python_version}")
    if not found:
        raise LockError(
            f"environment markers are evaluated by the interpreter pip runs for: this one is "
            f"{sys.version_info.major}.{sys.version_info.minor}, the target {python_version}, and there is no "
            f"python{python_version} on PATH (install it, or run this on a controller that has it)"
        )
    return found


def resolve(group: Group, python_version: str, tags: list[str], platform: str, workdir: Path) -> dict:
    report = workdir / f"report-{len(list(workdir.iterdir()))}.json"
    argv = pip_argv(group, report, python_version, tags, target_interpreter(python_version))
    proc = subprocess.run(argv, text=True, capture_output=True, check=False)
    if proc.returncode != 0:
        print(quiet(proc.stdout + proc.stderr).strip(), file=sys.stderr)
        raise LockError(explain(proc.stdout + proc.stderr, python_version, platform))
    return json.loads(report.read_text())


def make_lock(version: str, profile: str, python_version: str, platform: str) -> str:
    arch = architecture(platform)
    if arch != host_platform.machine():
        raise LockError(
            f"environment markers are evaluated for this machine ({host_platform.machine()}), the target is {arch}: "
            f"run this on a controller of the target's architecture"
        )
    tags = platform_tags(platform)
    with tempfile.TemporaryDirectory(prefix="lock-sglang-") as tmp:
        reports = [resolve(g, python_version, tags, platform, Path(tmp)) for g in requirement_groups(version, profile)]
    lines = lock_lines(reports)
    beyond = beyond_platforms(reports, role_platforms())
    if beyond:
        wheels = ", ".join(f"{n} ({'.'.join(t)})" for n, t in sorted(beyond.items()))
        print(
            f"lock-sglang: note: the ml_env role downloads wheels for ml_env_platforms (its defaults), which fit none "
            f"of these: {wheels}; give the fleet ml_env_platforms that include them (group_vars), as: "
            f"{json.dumps(platform_tags(platform))}",
            file=sys.stderr,
        )
    if f"sglang=={version}" not in {ln.split(" ", 1)[0].lower() for ln in lines}:
        raise LockError(f"pip resolved no sglang=={version}")
    pip_version = reports[0].get("pip_version", "?")
    return "\n".join([*header(version, profile, python_version, platform, pip_version), *lines]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-version", required=True, help="the SGLang release, x.y.z")
    parser.add_argument("--profile", default="full", choices=["full", "parser"])
    parser.add_argument("--python-version", default="3.11", help="the target's CPython, X.Y (default 3.11)")
    parser.add_argument(
        "--platform",
        default=DEFAULT_PLATFORM,
        help=f"the newest platform tag the target accepts (default {DEFAULT_PLATFORM}: glibc 2.34 or newer)",
    )
    parser.add_argument("--output", type=Path, help="default: roles/sglang/files/locks/<version>-<profile>.txt")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+", args.python_version):
        parser.error(f"--python-version {args.python_version!r}: X.Y, for example 3.11")
    output = args.output or LOCKS / f"{args.sglang_version}-{args.profile}.txt"
    try:
        text = make_lock(args.sglang_version, args.profile, args.python_version, args.platform)
    except LockError as exc:
        print(f"lock-sglang: sglang {args.sglang_version} ({args.profile}) does not resolve: {exc}", file=sys.stderr)
        return 1
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(output)
    count = sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))
    print(f"lock-sglang: {output} ({count} packages, each with its sha256)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
