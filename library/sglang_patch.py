#!/usr/bin/python
"""Apply an ordered series of local patches to an installed Python package, atomically."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_patch
short_description: Apply an ordered patch series to an installed package, atomically and idempotently
description:
  - Applies the series to copies of the files it touches, checks that every patched Python file
    compiles, and only then replaces the installed files. If any patch fails, nothing is changed and
    the error names the patch, the file and the hunk.
  - Knows the pristine state of every file from the wheel's C(RECORD), and the patched state from the
    manifest it writes, so a second run changes nothing and a hand-edited file is refused.
  - With I(mode=report) it changes nothing and reports, patch by patch, whether the series applies
    (the upgrade check for a candidate version).
options:
  site_packages:
    description: The site-packages directory holding the package.
    type: path
    required: true
  package:
    description: Distribution name (its C(<name>-<version>.dist-info) is read).
    type: str
    default: sglang
  version:
    description: Version the series is for; the installed distribution must match.
    type: str
    required: true
  patches:
    description: The series in order, each with C(name) and C(content) (a unified diff, paths C(a/...) and C(b/...)).
    type: list
    elements: dict
    required: true
  manifest:
    description: Where the manifest of the applied series is kept (not written in report mode).
    type: path
  mode:
    description: C(apply) the series, or C(report) whether each patch applies without changing anything.
    type: str
    choices: [apply, report]
    default: apply
author: sglang-deploy
"""

RETURN = r"""
manifest:
  description: Package version, each patch's sha256, and each patched file's sha256 before and after.
  type: dict
  returned: success
report:
  description: In report mode, per patch whether it applies and why not.
  type: list
  returned: always
"""

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule


class PatchError(Exception):
    pass


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_text(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def dist_info(site_packages, package):
    norm = re.sub(r"[-_.]+", "_", package).lower()
    for entry in os.listdir(site_packages):
        if entry.endswith(".dist-info") and re.sub(r"[-_.]+", "_", entry[: -len(".dist-info")].rsplit("-", 1)[0]).lower() == norm:
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


def explain_failure(patch, output):
    """'<file>: hunk #N FAILED at L' from patch's output."""
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
    return "; ".join(problems) or output.splitlines()[-1] if output else "patch failed"


def stage(site_packages, targets, workdir):
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
            path = os.path.join(workdir, rel)
            with open(path, encoding="utf-8") as fh:
                source = fh.read()
            try:
                compile(source, rel, "exec")
            except SyntaxError as exc:
                raise PatchError(f"{rel} does not compile after patching: {exc}") from exc


def main():
    module = AnsibleModule(
        argument_spec=dict(
            site_packages=dict(type="path", required=True),
            package=dict(type="str", default="sglang"),
            version=dict(type="str", required=True),
            patches=dict(type="list", elements="dict", required=True),
            manifest=dict(type="path"),
            mode=dict(type="str", choices=["apply", "report"], default="apply"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    site = p["site_packages"]
    patches = p["patches"]
    for patch in patches:
        if not isinstance(patch.get("name"), str) or not isinstance(patch.get("content"), str):
            module.fail_json(msg="every item of patches needs a 'name' and a 'content'")
    try:
        try:
            info = dist_info(site, p["package"])
            version = installed_version(info)
        except (PatchError, OSError) as exc:
            if module.check_mode:  # the install before us would have happened
                module.exit_json(changed=True, msg=f"not installed yet ({exc}); would patch after installing", report=[])
            raise PatchError(str(exc)) from exc
        if version != p["version"] and module.check_mode and p["mode"] == "apply":
            module.exit_json(changed=True, msg=f"{p['package']} {version} installed; would patch after installing {p['version']}", report=[])
        if version != p["version"]:
            raise PatchError(
                f"{p['package']} {version} is installed in {site}, but the series is for {p['version']}: "
                "install the version the series is for, or rebase the series (see the upgrade check)"
            )
        record = record_hashes(info)
        targets = sorted({f for patch in patches for f in files_of(patch)})
        if p["mode"] == "report":
            module.exit_json(changed=False, report=report(site, patches, targets))
        result = apply(module, site, p, patches, targets, record, version)
    except PatchError as exc:
        module.fail_json(msg=str(exc), report=[])
    module.exit_json(**result)


def report(site, patches, targets):
    out = []
    with tempfile.TemporaryDirectory(prefix="sglang-patch-") as work:
        stage(site, targets, work)
        for patch in patches:
            ok, output = run_patch(work, patch)
            out.append({"name": patch["name"], "applies": ok, "detail": "" if ok else explain_failure(patch, output)})
    return out


def apply(module, site, p, patches, targets, record, version):
    series = [{"name": x["name"], "sha256": sha256_text(x["content"])} for x in patches]
    current = {rel: sha256_file(os.path.join(site, rel)) for rel in targets if os.path.exists(os.path.join(site, rel))}
    manifest = None
    if p["manifest"] and os.path.exists(p["manifest"]):
        with open(p["manifest"], encoding="utf-8") as fh:
            manifest = json.load(fh)
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
            # Applied by an earlier run whose manifest is gone or was for another series?
            # Undo the series on the copies; if that gives the wheel's files, start from there.
            for patch in reversed(patches):
                ok, _ = run_patch(work, patch, reverse=True)
                if not ok:
                    break
            restored = {rel: sha256_file(os.path.join(work, rel)) for rel in targets}
            if any(restored[rel] != record.get(rel) for rel in targets):
                bad = ", ".join(not_pristine)
                raise PatchError(
                    f"{bad}: neither as {p['package']} {version} installed it (RECORD) nor as this series patches it; "
                    f"edited by hand? Reinstall with `pip install --force-reinstall --no-deps {p['package']}=={version}` "
                    "and run again. Nothing was changed."
                )
        before = {rel: sha256_file(os.path.join(work, rel)) for rel in targets}
        for patch in patches:
            ok, output = run_patch(work, patch)
            if not ok:
                raise PatchError(
                    f"patch {patch['name']} does not apply to {p['package']} {version}: "
                    f"{explain_failure(patch, output)}. Nothing was changed."
                )
        compile_all(work, targets)
        after = {rel: sha256_file(os.path.join(work, rel)) for rel in targets}
        new_manifest = {
            "package": p["package"],
            "version": version,
            "site_packages": site,
            "patches": series,
            "files": {rel: {"before": before[rel], "after": after[rel]} for rel in targets},
            "applied_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if module.check_mode:
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
    if p["manifest"]:
        os.makedirs(os.path.dirname(p["manifest"]), exist_ok=True)
        tmp = f"{p['manifest']}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(new_manifest, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, p["manifest"])
    return {"changed": True, "manifest": new_manifest, "report": []}


if __name__ == "__main__":
    main()
