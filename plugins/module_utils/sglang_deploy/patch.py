"""The atomic, recorded patch series: apply an ordered series of local patches to an installed
Python package, or report whether each applies (the upgrade check).

The series is applied to copies of the files it touches; every patched Python file must compile
before any installed file is replaced. The pristine state of a file comes from the wheel's
RECORD, the patched state from the manifest written here, so a second run changes nothing and a
hand-edited file is refused. No Ansible here: plugins/modules/sglang_patch.py is the adapter.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

from .durable import write_atomic


class PatchError(Exception):
    """The series cannot be applied; nothing was changed. The message says why and what to do."""


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _normalise(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def dist_info(site_packages, package):
    """The package's <name>-<version>.dist-info directory in site_packages."""
    norm = _normalise(package)
    for entry in sorted(os.listdir(site_packages)):
        if entry.endswith(".dist-info") and _normalise(entry[: -len(".dist-info")].rsplit("-", 1)[0]) == norm:
            return os.path.join(site_packages, entry)
    raise PatchError(f"{package} is not installed in {site_packages}")


def installed_version(info_dir):
    with open(os.path.join(info_dir, "METADATA"), encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    raise PatchError(f"no Version in {info_dir}/METADATA")


def record_hashes(info_dir):
    """{relative path: sha256 hex} of the files as the wheel installed them."""
    hashes = {}
    with open(os.path.join(info_dir, "RECORD"), encoding="utf-8") as fh:
        for line in fh:
            parts = line.rstrip("\n").rsplit(",", 2)
            if len(parts) == 3 and parts[1].startswith("sha256="):
                digest = parts[1][len("sha256=") :]
                raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
                hashes[parts[0]] = raw.hex()
    return hashes


def files_of(patch):
    files = re.findall(r"^\+\+\+ b/(\S+)", patch["content"], re.M)
    if not files:
        raise PatchError(f"patch {patch['name']}: no '+++ b/<path>' line: not a unified diff with a/ b/ paths")
    return files


def run_patch(workdir, patch, reverse=False):
    """Apply one patch in workdir; return (ok, output)."""
    args = ["patch", "-p1", "--batch", "--no-backup-if-mismatch", "-d", workdir]
    args += ["--reverse"] if reverse else ["--forward"]
    proc = subprocess.run(args, input=patch["content"], text=True, capture_output=True, check=False)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def explain_failure(output):
    """'<file>: hunk #N FAILED at line L' (and the like) from patch's output."""
    current = None
    problems = []
    for line in output.splitlines():
        m = re.match(r"patching file (\S+)", line)
        if m:
            current = m.group(1)
            continue
        m = re.match(r"Hunk #(\d+) FAILED at (\d+)", line)
        if m:
            problems.append(f"{current}: hunk #{m.group(1)} FAILED at line {m.group(2)}")
        elif "Reversed (or previously applied) patch detected" in line:
            problems.append(f"{current}: already applied (reversed patch detected)")
        elif line.startswith("can't find file") or "No such file" in line:
            problems.append(f"{current or line}: file not found")
    if problems:
        return "; ".join(problems)
    return output.splitlines()[-1] if output else "patch failed"


def stage(site_packages, targets, workdir):
    """Copy the files the series touches into workdir."""
    for rel in targets:
        src = os.path.join(site_packages, rel)
        if not os.path.exists(src):
            raise PatchError(f"{rel} does not exist in {site_packages}")
        dst = os.path.join(workdir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)


def compile_all(workdir, targets):
    for rel in targets:
        if rel.endswith(".py"):
            with open(os.path.join(workdir, rel), encoding="utf-8") as fh:
                source = fh.read()
            try:
                compile(source, rel, "exec")
            except SyntaxError as exc:
                raise PatchError(f"{rel} does not compile after patching: {exc}") from exc


def report(site, patches, targets):
    """Per patch, in order: whether it applies on top of the ones before it, and why not."""
    out = []
    with tempfile.TemporaryDirectory(prefix="sglang-patch-") as work:
        stage(site, targets, work)
        for patch in patches:
            ok, output = run_patch(work, patch)
            out.append({"name": patch["name"], "applies": ok, "detail": "" if ok else explain_failure(output)})
    return out


def read_manifest(path):
    if not path or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_manifest(path, manifest):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n", 0o644)


def _undo_to_pristine(work, patches, targets, not_pristine, record, package, version):
    """Files not as the wheel installed them: applied by an earlier run whose manifest is gone or
    was for another series? Undo the series on the copies; that must give the wheel's files."""
    for patch in reversed(patches):
        ok, _ = run_patch(work, patch, reverse=True)
        if not ok:
            break
    restored = {rel: sha256_file(os.path.join(work, rel)) for rel in targets}
    if any(restored[rel] != record.get(rel) for rel in targets):
        raise PatchError(
            f"{', '.join(not_pristine)}: neither as {package} {version} installed it (RECORD) nor as this series "
            "patches it; edited by hand? Reinstall with "
            f"`pip install --force-reinstall --no-deps {package}=={version}` and run again. Nothing was changed."
        )


def apply(site, package, version, patches, targets, record, manifest_path, check_mode):
    """Apply the series atomically; a result dict {changed, manifest, report}."""
    series = [{"name": x["name"], "sha256": sha256_text(x["content"])} for x in patches]
    current = {rel: sha256_file(os.path.join(site, rel)) for rel in targets if os.path.exists(os.path.join(site, rel))}
    manifest = read_manifest(manifest_path)
    if (
        manifest
        and manifest.get("version") == version
        and manifest.get("patches") == series
        and all(current.get(rel) == manifest.get("files", {}).get(rel, {}).get("after") for rel in targets)
    ):
        return {"changed": False, "manifest": manifest, "report": []}

    with tempfile.TemporaryDirectory(prefix="sglang-patch-") as work:
        stage(site, targets, work)
        not_pristine = [rel for rel in targets if current.get(rel) != record.get(rel)]
        if not_pristine:
            _undo_to_pristine(work, patches, targets, not_pristine, record, package, version)
        before = {rel: sha256_file(os.path.join(work, rel)) for rel in targets}
        for patch in patches:
            ok, output = run_patch(work, patch)
            if not ok:
                raise PatchError(
                    f"patch {patch['name']} does not apply to {package} {version}: {explain_failure(output)}. "
                    "Nothing was changed."
                )
        compile_all(work, targets)
        after = {rel: sha256_file(os.path.join(work, rel)) for rel in targets}
        new_manifest = {
            "package": package,
            "version": version,
            "site_packages": site,
            "patches": series,
            "files": {rel: {"before": before[rel], "after": after[rel]} for rel in targets},
            "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if check_mode:
            return {"changed": True, "manifest": new_manifest, "report": []}
        # Every file is ready and compiles: now replace the installed ones.
        for rel in targets:
            if current.get(rel) == after[rel]:
                continue
            dst = os.path.join(site, rel)
            tmp = f"{dst}.sglang-deploy.tmp"
            shutil.copy2(os.path.join(work, rel), tmp)
            os.chmod(tmp, os.stat(dst).st_mode & 0o7777)
            os.replace(tmp, dst)
    if manifest_path:
        write_manifest(manifest_path, new_manifest)
    return {"changed": True, "manifest": new_manifest, "report": []}


def patch_series(site_packages, version, patches, package="sglang", manifest=None, mode="apply", check_mode=False):
    """Apply the series (mode apply) or report whether each patch applies (mode report).

    Returns the module's result: {changed, manifest?, report, msg?}. Raises PatchError when the
    series cannot be applied; then nothing was changed.
    """
    for patch in patches:
        if not isinstance(patch.get("name"), str) or not isinstance(patch.get("content"), str):
            raise PatchError("every item of patches needs a 'name' and a 'content'")
    try:
        info = dist_info(site_packages, package)
        installed = installed_version(info)
    except (PatchError, OSError) as exc:
        if check_mode:  # the install before us would have happened
            return {"changed": True, "msg": f"not installed yet ({exc}); would patch after installing", "report": []}
        raise PatchError(str(exc)) from exc
    if installed != version and check_mode and mode == "apply":
        msg = f"{package} {installed} installed; would patch after installing {version}"
        return {"changed": True, "msg": msg, "report": []}
    if installed != version:
        raise PatchError(
            f"{package} {installed} is installed in {site_packages}, but the series is for {version}: "
            "install the version the series is for, or rebase the series (see the upgrade check)"
        )
    record = record_hashes(info)
    targets = sorted({f for patch in patches for f in files_of(patch)})
    if mode == "report":
        return {"changed": False, "report": report(site_packages, patches, targets)}
    return apply(site_packages, package, installed, patches, targets, record, manifest, check_mode)
