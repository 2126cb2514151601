#!/usr/bin/python
"""Ansible module: wait on a detached restart or rollback (sglang_server detach) until it progresses or ends."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_job
short_description: The progress, then the result, of a detached sglang_server restart or rollback
description:
  - A thin adapter over plugins/module_utils/sglang_deploy/job.py. Waits on the host until the job's progress has
    changed past I(seen) and I(min_s) are out, or I(wait_s) are out, and returns it (C(sglang_job), C(progress),
    C(seq)); once the job has ended, returns its result exactly as sglang_server would have (failed unless the
    outcome is a success), again on every call for it (an answer lost with a dropped connection is asked for
    again), until a call with I(ack) removes the job's files.
  - Called by the action plugin plugins/action/sglang_server.py, one call per progress change, never per second.
  - No check mode (the job it answers for ran, or runs, as it was started).
options:
  job:
    description: The job's directory (C(sglang_job) in the previous answer), under /run/sglang-deploy/jobs.
    type: path
    required: true
  seen:
    description: The progress seq the controller has.
    type: int
    default: 0
  wait_s:
    description: The most seconds to wait for a change.
    type: float
    default: 30.0
  min_s:
    description: The least seconds before a progress answer (the result is at once).
    type: float
    default: 2.0
  boot_id:
    description:
      - The host's boot id in the previous answer. A job gone while the host has another one went with a reboot,
        and the failure says so.
    type: str
  ack:
    description:
      - The controller has the job's result; remove the job's files and answer C(acked) at once. Only an ended job's
        with its result written (a running worker's, or a killed one's, stay); a job already removed is no error.
    type: bool
    default: false
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Wait for the detached restart's next progress
  become: true
  sglang.deploy.sglang_job:
    job: "{{ started.sglang_job }}"
    seen: "{{ started.seq }}"
    boot_id: "{{ started.boot_id }}"
  register: progress

- name: Acknowledge its result (the job's files removed)
  become: true
  sglang.deploy.sglang_job:
    job: "{{ started.sglang_job }}"
    ack: true
"""

RETURN = r"""
sglang_job:
  description: The job's directory while it runs.
  type: str
  returned: running
seq:
  description: The progress seq of this answer (pass it as I(seen) next).
  type: int
  returned: running
boot_id:
  description: The host's boot id while the job runs.
  type: str
  returned: running
progress:
  description: seq, phase, step, detail, last_line, since, steps.
  type: dict
  returned: running
outcome:
  description: Once ended, the outcome of sglang_server's result, returned with all its other keys as sglang_server returns them.
  type: str
  returned: ended
lost_job:
  description: The job's directory, when its worker ended without a result (killed).
  type: str
  returned: ended without a result
acked:
  description: With I(ack), the job's directory (changed when its files were removed).
  type: str
  returned: ack
"""

import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import job as jobs


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            job=dict(type="path", required=True),
            seen=dict(type="int", default=0),
            wait_s=dict(type="float", default=30.0),
            min_s=dict(type="float", default=2.0),
            ack=dict(type="bool", default=False),
            boot_id=dict(type="str"),
        ),
        supports_check_mode=False,
    )
    p = module.params
    if os.path.dirname(os.path.normpath(p["job"])) != jobs.JOBS_DIR:  # a job's own directory, nothing else (ack)
        module.fail_json(msg=f"job: {p['job']} is not a job directory under {jobs.JOBS_DIR}")
    job = jobs.Job(p["job"])
    if p["ack"]:
        module.exit_json(changed=jobs.ack(job), acked=job.dir)
    if jobs.read_json(job.result) is None and job.pid() is None:
        module.fail_json(msg=jobs.gone(job, p["boot_id"], jobs.boot_id()))
    jobs.answer(module, jobs.wait(job, p["seen"], p["wait_s"], p["min_s"]))


if __name__ == "__main__":
    main()
