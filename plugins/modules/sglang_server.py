#!/usr/bin/python
"""Ansible module: the safe restart, rollback, verify and status of one SGLang instance (a thin adapter)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_server
short_description: Safe restart, rollback, verification and status of one SGLang systemd instance
description:
  - A thin adapter over the state machine in plugins/module_utils/sglang_deploy/ (restart.py says what a
    failure in each phase leads to, phases.py what each phase does, operate.py the rollback, verify and status).
  - C(restart) - lock -> preflight -> stop -> clean GPUs -> promote the pending configuration ->
    start and wait until ready (failing fast) -> a real generation -> verify -> record a known-good
    generation. A failure after the stop puts the newest known-good generation back, started and
    verified (unless I(rollback=false)); when that cannot be done the unit is left stopped.
  - C(rollback) puts back the known-good generation before the one on disk (the newest, for a unit a containment
    stopped) and restarts and verifies it.
  - C(verify) checks a running instance; C(status) reports it without load.
  - Holds the instance's lock (/run/sglang-deploy/locks) for a restart or rollback (a multi-node one's, as a lease between
    its phases too, I(group_token)); a second operation is refused at once (outcome C(locked)), naming the holder.
  - Supports check mode (a restart or rollback says C(would_restart) or C(would_roll_back), touching nothing).
options:
  action:
    description: C(restart), C(rollback), C(verify) or C(status) (above).
    type: str
    choices: [restart, rollback, verify, status]
    required: true
  instance:
    description:
      - The instance's rendered record (filter sglang_instance) - name, unit, unit_path, env_path,
        secrets_path, pending_dir, port, gpus, argv, profile, profiles_argv, nnodes, node_rank.
    type: dict
    required: true
  service_user:
    description: User the server runs as (whose processes I(stop_policy=own) may stop).
    type: str
    default: sglang
  state_dir:
    description: Where the known-good generations (C(known-good/)), evidence bundles and parser verdicts are kept.
    type: path
    default: /var/lib/sglang
  ready_timeout:
    description: Seconds a start may take until /health answers (model load, CUDA-graph capture).
    type: float
    default: 900.0
  gpu_timeout:
    description: Seconds the restart waits, polling, for the instance's GPUs to be clean after the stop.
    type: float
    default: 120.0
  gpu_interval:
    description: Seconds between two polls of that wait (above 0, at most 0.25; else the module fails).
    type: float
    default: 0.1
  max_used_mib:
    description: Used MiB per GPU that still counts as clean when no process is listed.
    type: int
    default: 1024
  stop_policy:
    description:
      - Offenders on the instance's GPUs after the stop. C(none) never stops them; C(own) stops those of the
        instance's own unit and the service user's that no unit owns (SIGTERM, then SIGKILL), never another
        unit's; C(force) stops anyone's, only when the operator says so.
    type: str
    choices: [none, own, force]
    default: own
  rollback:
    description: Put the newest known-good generation back, started and verified, when a restart fails after the stop.
    type: bool
    default: true
  known_good_keep:
    description: Known-good generations kept per instance.
    type: int
    default: 5
  prompt:
    description: The fixed prompt of the generation request.
    type: str
    default: The capital of France is
  max_new_tokens:
    description: Tokens the generation request asks for.
    type: int
    default: 16
  accept_length_min:
    description: Speculative decoding must average more accepted tokens per step than this (1.0 is none accepted).
    type: float
    default: 1.5
  load_requests:
    description: Requests of the short fixed load that measures output tokens/s and the accept length (0 skips it).
    type: int
    default: 4
  load_max_new_tokens:
    description: Tokens each load request asks for.
    type: int
    default: 64
  baseline_tokens_per_s:
    description: The profile's baseline output tokens/s; unset or 0, no regression check against it.
    type: float
  no_spec_tokens_per_s:
    description: The no-speculation profile's baseline tokens/s, which a speculative profile must reach; unset, none.
    type: float
  regression_threshold:
    description: Fraction below I(baseline_tokens_per_s) that counts as a regression.
    type: float
    default: 0.1
  regression_action:
    description: What a throughput regression does (C(fail) also rolls a restart back).
    type: str
    choices: [warn, fail]
    default: warn
  patch_manifest:
    description: SGLang's patch manifest, checked by verify; used when the unit's virtualenv holds no manifest of its own.
    type: path
  controller:
    description: Who runs the operation (shown to a refused second one).
    type: str
    default: ""
  command:
    description: What the controller runs (shown to a refused second one).
    type: str
    default: ""
  expected_config_hash:
    description:
      - The hash of the configuration this run staged (sglang_stage's C(config_hash)); a restart refuses to start
        another (another controller's).
    type: str
  phase:
    description:
      - C(all) for one node; an instance spanning nodes restarts in four tasks over every node (stop, start,
        confirm, record) and, when a rank failed, is rolled back on every node in three (rollback_*).
    type: str
    choices: [all, stop, start, confirm, record, rollback_stop, rollback_start, rollback_confirm]
    default: all
  group_ok:
    description:
      - The other ranks of a multi-node instance are in step; false, the stop refuses and the last rollback
        phase contains.
    type: bool
    default: true
  group_why:
    description: Why the group is out of step (a rank failed, a node left the run).
    type: str
    default: ""
  group_token:
    description:
      - A multi-node restart's run, the same on every node; its phases hold the lock between them as a lease on the
        node (plugins/module_utils/sglang_deploy/lock.py); any other operation is refused (C(locked)) while it is valid.
        Unset, no lease.
    type: str
  group_lease_s:
    description:
      - With I(group_token), how long the lease stays valid after each phase (sglang_service_group_lease_s); the
        stop takes it, the start, confirm and record go on only under it, the record or C(rollback_confirm)
        removes it.
    type: float
    default: 1470.0
  evidence:
    description:
      - When a start, generation or verification fails, take the crash evidence bundle (journal, py-spy of every
        rank, nvidia-smi -q, ...; sglang_deploy.evidence) before the rollback; its path is in C(evidence).
    type: bool
    default: true
  evidence_budget_s:
    description: The most seconds the bundle may add to a failed restart.
    type: float
    default: 10.0
  unit_content:
    description:
      - With I(env_content), this run's rendered configuration; a restart stages it (as sglang_stage does) under
        the lock it holds to its end, so no other operation can stage between the staging and the start.
    type: str
  env_content:
    description: See I(unit_content).
    type: str
  secrets_content:
    description: The secrets file's content (restart, with I(unit_content); always the current values; never logged).
    type: str
  validate_instances:
    description:
      - restart - every rendered instance record of the host, checked first, in this call, as sglang_validate checks
        them (its cached parser verdict; a refusal, outcome C(invalid_config), touches nothing). Unset, validated before.
    type: list
    elements: dict
  min_shm_mib:
    description: With I(validate_instances), the least size of /dev/shm in MiB.
    type: int
    default: 0
  detach:
    description:
      - restart, rollback - run in a worker detached from this call (plugins/module_utils/sglang_deploy/job.py) that reports
        its phase and model-load step as it goes; this call returns the result if it is there within
        I(progress_every), else the job and its progress (C(sglang_job)), which sglang_job then waits on.
      - Set by the action plugin (plugins/action/sglang_server.py) when the driver asks for live progress.
    type: bool
    default: false
  progress_every:
    description: With I(detach), the least seconds between two progress answers.
    type: float
    default: 2.0
  bench:
    description:
      - restart - autotune's benchmark (sglang_deploy.bench), run once verified and recorded, under the lock; not
        downtime. Only with I(phase=all).
    type: dict
    suboptions:
      concurrency:
        description: The concurrency levels, one measurement each per repeat (each at least 1).
        type: list
        elements: int
        default: [1]
      requests:
        description: Measured requests per level (at least 1).
        type: int
        default: 8
      max_new_tokens:
        description: Tokens each request generates (at least 1).
        type: int
        default: 64
      warmup:
        description: Unmeasured requests before each level.
        type: int
        default: 2
      timeout:
        description: Seconds each request may take.
        type: float
        default: 120.0
      repeat:
        description:
          - How many times every level is measured, the levels interleaved (at least 1). A level's figures are then
            the median of its repeats, with each repeat's output tok/s (C(samples)) and their mean's 95 % t-interval
            (C(interval)); the medians of tok/s, accept length, TTFT and ITL likewise (C(figure_samples),
            C(intervals)).
        type: int
        default: 1
  metrics_dir:
    description:
      - node_exporter's textfile collector directory. Where it exists, a restart, rollback or verify (not status,
        not in check mode) ends by writing its outcome, duration, downtime, measurements and known-good generation
        to C(sglang_deploy_<instance>.prom) there, atomically (sglang_deploy.metrics; docs/monitoring.md). Unset,
        or absent on the host, nothing is written.
      - Of a multi-node group's phases only its end on each node writes (C(record), C(rollback_confirm)), the
        outcome and known-good generation, without a duration or downtime, which no single phase sees.
    type: path
notes:
  - The action plugin of the same name takes one option of its own, C(reconnect_s) (default 120), never passed to
    the module - how long a detached job's progress is asked for again after the connection failed (0, no retry).
  - And one more, C(render) (default false), for I(action=status) only - without I(instance), the plugin renders
    every instance of C(sglang_service_instances_selected) from the host's variables as the role
    P(sglang.deploy.sglang_service#role) does and runs the module once for each; the result lists each one's under
    C(instances), and fails when one failed (roles/sglang_service/tasks/status.yml).
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Safe restart of one instance (rolled back to its known-good generation on failure)
  become: true
  sglang.deploy.sglang_server:
    action: restart
    instance: "{{ item }}"
    service_user: sglang
    ready_timeout: 900
    stop_policy: own
    controller: "{{ lookup('ansible.builtin.env', 'USER') }}@controller"
    command: ansible-playbook playbooks/restart.yml
    expected_config_hash: "{{ staged_hashes[item.name] }}"
  loop: "{{ sglang_rendered_instances }}"
  register: restarted

- name: Verify a running instance against its profile's baseline, failing on a regression
  become: true
  sglang.deploy.sglang_server:
    action: verify
    instance: "{{ item }}"
    baseline_tokens_per_s: "{{ item.baseline }}"
    regression_action: fail
  loop: "{{ sglang_rendered_instances }}"

- name: Report an instance without load
  become: true
  sglang.deploy.sglang_server:
    action: status
    instance: "{{ item }}"
  loop: "{{ sglang_rendered_instances }}"
  register: status

- name: Report every selected instance of the host in one task, rendered by the action plugin
  become: true
  sglang.deploy.sglang_server:
    action: status
    render: true
  register: status
"""

RETURN = r"""
outcome:
  description: One of plugins/module_utils/sglang_deploy/outcomes.py (restarted, rolled_back, not_recovered, locked, ...).
  type: str
  returned: always
instance:
  description: The instance's name.
  type: str
  returned: always
unit:
  description: Its systemd unit.
  type: str
  returned: restart, rollback, status
profile:
  description: The profile restarted, rolled back to, or verified.
  type: str
  returned: restart, rollback, verify
phases:
  description: Each phase run - phase, at, seconds, ok, detail.
  type: list
  elements: dict
  returned: restart, rollback
downtime_s:
  description: Seconds from the first phase that touched the server to the end (0 when none did).
  type: float
  returned: restart, rollback
stopped_processes:
  description: Every process its GPU waits stopped (pid, user, unit, gpus, command, how, phase).
  type: list
  elements: dict
  returned: restart, rollback
failure:
  description: The phase that failed and its cause, with journal_tail, traceback, ... where there are.
  type: dict
  returned: on failure
rollback:
  description: attempted, why, to_generation, to_profile, config_hash, outcome, phases, failure.
  type: dict
  returned: when a rollback was considered
contained:
  description: How a not-recovered instance was left (stop, files, unit_state).
  type: dict
  returned: outcome not_recovered
verify:
  description: checks, running_profile, tokens_per_s, accept_length, ok, warnings, failed_checks.
  type: dict
  returned: when run
evidence:
  description: The crash evidence bundle on the host - path, bytes, items, seconds (or error).
  type: dict
  returned: when a start, generation or verification failed, with I(evidence)
known_good:
  description: The generation recorded (generation, config_hash, profile, software), or recorded false and why.
  type: dict
  returned: restarted, rolled back, status
lock:
  description: The lock's holder - operation, pid, command, controller, since (a group's lease - group_lease, its token and expiry).
  type: dict
  returned: locked, status
group_lease:
  description: With I(group_token), the lease renewed (token, expires, expires_at), ended (ended), or not (error).
  type: dict
  returned: a multi-node phase
pending:
  description: A configuration is staged, waiting for the safe restart.
  type: bool
  returned: status, check mode
note:
  description: What went wrong after the outcome was reached (the outcome stands).
  type: str
  returned: when something failed after the outcome
sglang_job:
  description: With I(detach), the job still running - its directory (progress and seq say how far).
  type: str
  returned: detach, while the job runs
progress:
  description: With I(detach), the job's progress (seq, phase, step, detail, last_line, since, steps).
  type: dict
  returned: detach, while the job runs
seq:
  description: With I(detach), the progress seq (sglang_job's I(seen)).
  type: int
  returned: detach, while the job runs
boot_id:
  description: With I(detach), the host's boot id (sglang_job's I(boot_id)).
  type: str
  returned: detach, while the job runs
steps:
  description: With I(detach), each model-load step of each start - phase, step, detail, seconds.
  type: list
  elements: dict
  returned: detach
metrics:
  description: The textfile the operation's metrics were written to; null where none was (no I(metrics_dir)).
  type: str
  returned: restart, rollback and verify, not in check mode
metrics_error:
  description: Why the metrics could not be written (the operation's own outcome stands).
  type: str
  returned: when writing the metrics failed
bench:
  description: With I(bench), sglang_deploy.bench.run's result; null when it could not run (bench_error).
  type: dict
  returned: restarted, with I(bench)
bench_error:
  description: Why the benchmark could not run.
  type: str
  returned: restarted, with I(bench), when it could not run
gpu_model:
  description: With I(bench), the GPUs' model as the preflight's nvidia-smi names them.
  type: str
  returned: restarted, with I(bench)
configured_profile:
  description: The profile the instance is configured with.
  type: str
  returned: status
state:
  description: The unit's state.
  type: str
  returned: status
running_profile:
  description: The profile the running server's argv matches (null when none does).
  type: str
  returned: status
drift:
  description: The running server's argv differs from the configured one.
  type: bool
  returned: status
restarts:
  description: systemd's NRestarts of the unit.
  type: int
  returned: status
main_pid:
  description: The unit's main pid (0 when stopped).
  type: int
  returned: status
enabled:
  description: The unit file's state (enabled, disabled, ...).
  type: str
  returned: status
gpu_memory_mib:
  description: Used memory of each of the instance's GPUs, by index.
  type: dict
  returned: status
health:
  description: Whether /health answers (null when the instance serves no HTTP here).
  type: bool
  returned: status
accept_length:
  description: The server's speculative accept length (null without speculation).
  type: float
  returned: status
jobs:
  description: The instance's restart workers the host still holds (job.of_instance) - state (running, ended, lost), phase, step, unit, journal.
  type: list
  elements: dict
  returned: status
instances:
  description: With the action plugin's C(render) (notes), each instance's result above, in order.
  type: list
  elements: dict
  returned: status with render
errors:
  description: Each part of the status that could not be read, and why.
  type: list
  elements: str
  returned: status
"""

import functools
from dataclasses import fields

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.common.parameters import remove_values

from ansible_collections.sglang.deploy.plugins.module_utils import sglang_deploy
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import bench, metrics, outcomes
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import job as jobs
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.checks import Thresholds
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.failure import install_signal_handlers
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.instance import (
    Instance,
    env_secrets,
    parse_env,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.machine import Machine, Settings
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.operate import rollback, status, verify
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.phases import GROUP_ENDS, MULTINODE_PHASES
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.restart import restart

# The module's parameters that are the state machine's settings as they are (the rest it builds itself).
THRESHOLDS = [f.name for f in fields(Thresholds)]
BUILT = ("rendered", "secrets", "validate_instances", "bench", "check_mode", "thresholds")
SETTINGS = [f.name for f in fields(Settings) if f.name not in BUILT]


def with_stopped(action):
    """The action, its result also listing every process its GPU waits stopped (for the driver to name)."""
    return lambda m: (res := action(m)) | {"stopped_processes": Machine.stopped_in(res)}


ACTIONS = {"restart": with_stopped(restart), "rollback": with_stopped(rollback), "verify": verify, "status": status}

ARGUMENT_SPEC = dict(
    action=dict(type="str", choices=list(ACTIONS), required=True),
    instance=dict(type="dict", required=True),
    service_user=dict(type="str", default="sglang"),
    state_dir=dict(type="path", default="/var/lib/sglang"),
    ready_timeout=dict(type="float", default=900.0),
    gpu_timeout=dict(type="float", default=120.0),
    gpu_interval=dict(type="float", default=0.1),
    max_used_mib=dict(type="int", default=1024),
    stop_policy=dict(type="str", choices=["none", "own", "force"], default="own"),
    rollback=dict(type="bool", default=True),
    known_good_keep=dict(type="int", default=5),
    prompt=dict(type="str", default="The capital of France is"),
    # no_log=False: counts of tokens and a run's name, no secret (validate-modules suspects the word "token").
    max_new_tokens=dict(type="int", default=16, no_log=False),
    accept_length_min=dict(type="float", default=1.5),
    load_requests=dict(type="int", default=4),
    load_max_new_tokens=dict(type="int", default=64, no_log=False),
    baseline_tokens_per_s=dict(type="float", no_log=False),
    no_spec_tokens_per_s=dict(type="float", no_log=False),
    regression_threshold=dict(type="float", default=0.1),
    regression_action=dict(type="str", choices=["warn", "fail"], default="warn"),
    patch_manifest=dict(type="path"),
    controller=dict(type="str", default=""),
    command=dict(type="str", default=""),
    expected_config_hash=dict(type="str"),
    phase=dict(type="str", choices=["all", *MULTINODE_PHASES], default="all"),
    group_ok=dict(type="bool", default=True),
    group_why=dict(type="str", default=""),
    group_token=dict(type="str", no_log=False),  # a run's name, shown in the lock's holder: no secret
    group_lease_s=dict(type="float", default=1470.0),
    evidence=dict(type="bool", default=True),
    evidence_budget_s=dict(type="float", default=10.0),
    unit_content=dict(type="str"),
    env_content=dict(type="str"),
    secrets_content=dict(type="str", no_log=True),
    validate_instances=dict(type="list", elements="dict"),
    min_shm_mib=dict(type="int", default=0),
    detach=dict(type="bool", default=False),
    progress_every=dict(type="float", default=2.0),
    bench=dict(type="dict", options=bench.OPTIONS),
    metrics_dir=dict(type="path"),
)


def _refuse_invalid(module: AnsibleModule) -> None:
    """Fail the task, before anything is touched, for a GPU poll interval out of range or a bench it cannot run."""
    p = module.params
    if not 0 < p["gpu_interval"] <= 0.25:
        module.fail_json(
            msg=f"gpu_interval is {p['gpu_interval']}: poll at least every 0.25 s", outcome=outcomes.INVALID_CONFIG
        )
    try:
        if p["bench"] is not None:
            bench.check(**p["bench"])
            if p["phase"] != "all":
                raise ValueError(f"not in a multi-node restart's phase {p['phase']} (one node's restart only)")
    except ValueError as exc:
        module.fail_json(msg=f"bench: {exc}: nothing was restarted", outcome=outcomes.INVALID_CONFIG)


def _instance(module: AnsibleModule) -> Instance:
    """The instance record as the state machine reads it; the task failed for one that was not rendered."""
    p = module.params
    try:
        return Instance.from_params({**p["instance"], "service_user": p["service_user"], "state_dir": p["state_dir"]})
    except (TypeError, ValueError) as exc:
        module.fail_json(msg=f"instance: not a rendered instance record ({exc})", outcome=outcomes.INVALID_CONFIG)


def _settings(module: AnsibleModule, inst: Instance) -> Settings:
    """The state machine's settings: the parameters that are settings as they are, and those built here (the
    rendered files and the bench for a restart only, the secrets with the rendered files, the thresholds)."""
    p = module.params
    both = p["unit_content"] is not None and p["env_content"] is not None
    rendered = {inst.unit_path: p["unit_content"], inst.env_path: p["env_content"]} if both else None
    return Settings(
        check_mode=module.check_mode,
        rendered=rendered if p["action"] == "restart" else None,
        secrets=p["secrets_content"] if rendered is not None else None,
        validate_instances=p["validate_instances"] if p["action"] == "restart" else None,
        thresholds=Thresholds(**{k: p[k] for k in THRESHOLDS}),
        bench=p["bench"] if p["action"] == "restart" else None,
        **{k: p[k] for k in SETTINGS},
    )


def _recorded_action(module: AnsibleModule):
    """The action, its outcome written to the metrics directory where this call ends a restart (metrics.recorded)."""
    p = module.params
    # A multi-node group's phases each see part of its restart: a whole one is written (phase all), and a group's
    # end on each node (its outcome and known-good generation; its duration and downtime no phase saw whole).
    ends = p["phase"] == "all" or p["phase"] in GROUP_ENDS
    directory = p["metrics_dir"] if ends and not module.check_mode else None
    return metrics.recorded(
        p["action"], ACTIONS[p["action"]], directory, {k: p[k] for k in THRESHOLDS}, whole=p["phase"] == "all"
    )


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    module.no_log_values.update(in_env := env_secrets(p["instance"], p["env_content"]))  # before any failure
    _refuse_invalid(module)
    inst = _instance(module)
    # SGLang logs its server_args (the API key included, as a repr) and a journal tail goes into failures: every
    # secret, this run's too (a rotated key), is stripped from what this module returns, in every form it takes.
    redact = inst.redactor([*parse_env(p["secrets_content"] or "").values(), *in_env])
    module.no_log_values.update(redact.raw)
    settings = _settings(module, inst)
    machine = Machine(inst, settings, action=p["action"])
    if settings.bench:  # the benchmark port measures each level `repeat` times (the state machine passes the rest)
        machine.ports.bench = functools.partial(bench.run, repeat=settings.bench["repeat"])
    action = _recorded_action(module)
    if p["detach"] and p["action"] in ("restart", "rollback") and not module.check_mode:
        # The worker outlives this call's module files: every sglang_deploy module imported first.
        jobs.preload(sglang_deploy)
        said = jobs.start(
            machine,
            lambda: action(machine),
            lambda res: outcomes.succeeded(p["action"], res["outcome"]),
            mask=lambda doc: remove_values(redact.scrub(doc), module.no_log_values),
            every=p["progress_every"],
            on_start=install_signal_handlers,
        )
        jobs.answer(module, said)
    if p["action"] in ("restart", "rollback"):
        install_signal_handlers()
    res = action(machine)
    jobs.answer(module, {"done": True, "ok": outcomes.succeeded(p["action"], res["outcome"]), "res": redact.scrub(res)})


if __name__ == "__main__":
    main()
