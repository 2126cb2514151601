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
  - Supports check mode (says whether it would patch; a package not installed yet would be patched after).
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
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Apply the patch series atomically
  become: true
  sglang.deploy.sglang_patch:
    site_packages: /opt/ml-env/lib/python3.11/site-packages
    version: 0.5.2
    patches:
      - name: 0001-fix-the-scheduler.patch
        content: "{{ lookup('ansible.builtin.file', 'patches/0001-fix-the-scheduler.patch') }}"
    manifest: /var/lib/sglang/patches.json

- name: Does the series apply to a candidate version? (changes nothing)
  sglang.deploy.sglang_patch:
    site_packages: /tmp/candidate/lib/python3.11/site-packages
    version: 0.5.3
    patches: "{{ sglang_patches }}"
    mode: report
  register: upgrade_check
"""

RETURN = r"""
manifest:
  description: Package, version, site_packages, each patch's sha256, each patched file's sha256 before and after, applied_at.
  type: dict
  returned: mode=apply, when the package is installed at I(version)
report:
  description: In report mode, per patch whether it applies and why not; empty otherwise.
  type: list
  elements: dict
  returned: always
"""

import traceback

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.patch import PatchError, patch_series


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
    try:
        result = patch_series(
            p["site_packages"],
            p["version"],
            p["patches"],
            package=p["package"],
            manifest=p["manifest"],
            mode=p["mode"],
            check_mode=module.check_mode,
        )
    except (PatchError, OSError) as exc:
        module.fail_json(msg=str(exc), report=[])
    except Exception as exc:  # contained: a result, never a traceback instead of one
        module.fail_json(
            msg=f"sglang_patch: unexpected {type(exc).__name__}: {exc}", report=[], exception=traceback.format_exc()
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
