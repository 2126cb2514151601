#!/usr/bin/python
"""One worker of the gateway (sglang-router or smg): take it out, drain it, put it back, wait until healthy; inspect
what serves."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_router_worker
short_description: Take an SGLang worker out of the gateway (sglang-router 0.3.2 or smg 1.13.0), drain it, put it
  back; inspect workers
description:
  - Speaks to either gateway, as I(impl) names it; the differences (docs/router.md, "The two gateways") are
    handled here, so every action means the same with both. With smg, an added worker is posted with the key
    (smg gives a worker posted without one no key), a C(409) for a URL already listed means already there, a
    worker listed C(draining) counts as removed (out of rotation; smg lists it until its 5 s settle time ends),
    and the gateway's own in-flight count for the worker joins the drain's result.
  - Runs where the router's API answers (playbooks/rollout.yml delegates it to the router host, on its loopback).
    The worker is named by its URL (C(http://<host>:<port>)); the router may list it under another spelling (an
    address for a host name, an upper-case scheme or host, the default port written out or not, a trailing
    slash, IPv6 brackets), the same worker here (names resolved where the module runs, as the router does).
  - I(action=remove) removes the worker by the UUID the router lists it with (0.3.2 refuses a URL), every record
    of it when it is registered under two spellings, and waits until it is no longer listed. A worker the
    router does not list under any spelling FAILS (the message names what the router lists), unless
    I(missing_ok). With smg, the wait ends once the worker is C(draining) (out of rotation), and a worker
    already draining is not removed again. Removal neither waits for nor cuts its in-flight requests; with I(drain), the same call then
    drains it as I(action=drain) does (one module call of a rollout's step, not two).
  - I(action=drain) waits until the worker's C(sglang:num_running_reqs) + C(sglang:num_queue_reqs) (its
    /metrics, both series read, summed over their label sets) has said 0 for 0.2 s (two reads at least), or a
    connection to it is refused (nothing listens, the server is gone). It FAILS when it cannot say so (the drain
    in the failed result), at once when /metrics answers 404 or lacks either series (SGLang serves them only
    with C(--enable-metrics)); at I(drain_timeout) when requests still run, or when the reads keep failing
    otherwise (a 503, a timeout, a reset connection is not evidence that nothing runs).
  - I(action=add) adds the worker (C(POST /workers)) unless the router lists it under any spelling, and waits
    until the router lists it as healthy; fails at I(timeout). With smg, a worker still listed C(draining) is
    waited out (up to I(timeout)) before it is posted again. I(action=wait_healthy) only waits.
    I(action=list) returns what the router lists.
  - I(action=inspect) reads, for each of I(worker_urls), whether the router lists it (any spelling), whether
    the worker itself serves (its GET /health answers 200 within I(timeout)) and whether it can be
    drained on evidence (its /metrics answers 200 with both series); it changes nothing and runs in check
    mode too. With I(fail_on_problems) it fails when one is not listed or not drainable, after reading a
    /metrics that answers neither way (a 503, a timeout) again for 10 s.
  - I(action=measure) measures the worker's output tok/s as the safe restart's verify does (I(requests)
    generations of I(max_new_tokens) tokens, one after another); no router is involved.
  - Logic in module_utils/sglang_deploy/router.py. See docs/rollout.md and docs/router.md.
options:
  action:
    description: What to do.
    type: str
    choices: [remove, add, drain, wait_healthy, list, inspect, measure]
    required: true
  impl:
    description: The gateway at I(router_url), C(sglang-router) (0.3.2) or C(smg) (1.13.0, the Shepherd Model
      Gateway); the client speaks each one's worker API as docs/router.md records it.
    type: str
    choices: [sglang-router, smg]
    default: sglang-router
  router_url:
    description: The router's base URL, as seen from where the module runs. Required but for I(action=drain) and
      I(action=measure); with I(action=drain) and smg, its in-flight count for the worker joins the result.
    type: str
  api_key:
    description: The router's API key (C(--api-key)), required on /workers when the router has one; with
      I(action=measure), the worker's. With smg, I(action=add) posts it as the worker's key too (the role makes
      the router's key the workers' by default).
    type: str
  worker_url:
    description: The worker, as the inventory names it (any spelling the router's may differ by, above).
      Required but for I(action=list) and I(action=inspect).
    type: str
  worker_urls:
    description: With I(action=inspect), the workers to inspect, each as I(worker_url). Required with
      I(action=inspect).
    type: list
    elements: str
  missing_ok:
    description: With I(action=remove), succeed (C(changed=false), nothing removed) when the router lists the
      worker under no spelling, where it fails by default.
    type: bool
    default: false
  fail_on_problems:
    description: With I(action=inspect), fail (msg the problems joined with C(; )) when a worker is not listed or
      cannot be drained on evidence.
    type: bool
    default: false
  timeout:
    description: Seconds to wait until the router no longer lists a removed worker, or lists an added one healthy;
      with I(action=inspect), seconds each read of a worker's /health and /metrics may take (5 is plenty).
    type: float
    default: 60
  drain_timeout:
    description: Seconds I(action=drain) (or I(action=remove) with I(drain)) waits for the worker's running and
      queued requests to finish.
    type: float
    default: 120
  drain:
    description: With I(action=remove), drain the worker once the router no longer lists it (also when it was
      not listed, with I(missing_ok)).
    type: bool
    default: false
  prompt:
    description: With I(action=measure), the prompt.
    type: str
    default: "The capital of France is"
  requests:
    description: With I(action=measure), how many generations.
    type: int
    default: 4
  max_new_tokens:
    description: With I(action=measure), the tokens of each.
    type: int
    default: 64
notes:
  - Check mode - I(action=remove) and I(action=add) read the router's list (an unlisted worker fails remove there
    too) and send nothing; I(action=drain) reads nothing (C(drained=null)); inspect and list run as always.
author: sglang-deploy
"""

RETURN = r"""
worker_url:
  description: The worker acted on, as given.
  type: str
  returned: remove, add, drain, wait_healthy, measure
worker_id:
  description: The UUID the router lists (listed) the worker with (the first, when it is registered twice); null
    when it was not listed.
  type: str
  returned: remove, add
worker_ids:
  description: With action=remove, every UUID removed (or, in check mode, that would be), more than one when the
    router listed the worker under two spellings; empty when it was not listed (missing_ok).
  type: list
  elements: str
  returned: remove
seconds:
  description: How long the wait took (until gone, healthy or drained).
  type: float
  returned: remove (when it removed), add, drain, wait_healthy
tokens_per_s:
  description: With action=measure, the output tok/s.
  type: float
  returned: measure
requests:
  description: With action=measure, the generations measured.
  type: int
  returned: measure
drain:
  description: With action=drain (or remove with drain), also in the failed result when not drained.
  type: dict
  returned: drain, remove with drain
  contains:
    drained:
      description: Whether the worker has nothing left to run (on evidence); null in check mode.
      type: bool
    seconds:
      description: How long the drain took.
      type: float
    running:
      description: The last sglang:num_running_reqs read (summed over its label sets); null when none was read.
      type: float
    queued:
      description: The last sglang:num_queue_reqs read; null when none was read.
      type: float
    why:
      description: "Why it ended: C(no running or queued requests); C(not serving: connection refused); C(cannot be
        drained on evidence: ...) (naming --enable-metrics); C(drain timeout (120 s): ...) (the last load read, or
        the last error); C(check mode)."
      type: str
    gateway_in_flight:
      description: With smg (and a I(router_url)), the gateway's own count of the worker's requests in flight at
        the drain's last read (its listing's C(load)); null once smg no longer lists the worker (it drops it, and
        the count, when its settle time ends, whatever still runs there). Evidence beside the worker's own
        gauges, which alone decide. Absent with sglang-router, which keeps no such count.
      type: float
workers:
  description: With action=inspect, one entry per I(worker_urls), in their order; with remove, add, wait_healthy
    and list, what the router lists afterwards, each {url, id, healthy}.
  type: list
  elements: dict
  returned: remove (when it removed), add, wait_healthy, list, inspect
  contains:
    url:
      description: The worker (inspect, as given; else as the router lists it).
      type: str
    id:
      description: Its UUID (not inspect).
      type: str
    healthy:
      description: Whether the router lists it healthy and in rotation (not inspect).
      type: bool
    status:
      description: With smg, its state as smg lists it (C(ready), C(draining), C(not_ready)); absent with
        sglang-router (not inspect).
      type: str
    listed:
      description: (inspect) Whether the router lists it under any spelling.
      type: bool
    ids:
      description: (inspect) The UUIDs the router lists it with (more than one when registered twice).
      type: list
      elements: str
    healthy_in_router:
      description: (inspect) Whether one of its records is healthy in the router; null when not listed.
      type: bool
    serving:
      description: (inspect) Whether its own GET /health answered 200 within I(timeout).
      type: bool
    drainable:
      description: (inspect) Whether its /metrics answered 200 with sglang:num_running_reqs and
        sglang:num_queue_reqs.
      type: bool
    why:
      description: (inspect) Why it is not serving or not drainable; empty when it is both.
      type: str
problems:
  description: With action=inspect, one sentence per worker not listed and per worker not drainable (each naming
    the worker); empty when none.
  type: list
  elements: str
  returned: inspect
msg:
  description: When the module fails, the action, the worker and why (a remove of an unlisted worker names what
    the router lists; a drain not drained its why; inspect with fail_on_problems its problems).
  type: str
  returned: failure
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_deploy.http import HttpError
from ansible.module_utils.sglang_deploy.router import DEFAULT_IMPL, GATEWAYS, ActionFailed, RouterError, act
from ansible.module_utils.sglang_deploy.secret_rule import Redactor

ARGUMENT_SPEC = dict(
    action=dict(
        type="str", choices=["remove", "add", "drain", "wait_healthy", "list", "inspect", "measure"], required=True
    ),
    impl=dict(type="str", choices=list(GATEWAYS), default=DEFAULT_IMPL),  # router.py's table: one list of gateways
    router_url=dict(type="str"),
    api_key=dict(type="str", no_log=True),
    worker_url=dict(type="str"),
    worker_urls=dict(type="list", elements="str"),
    missing_ok=dict(type="bool", default=False),
    fail_on_problems=dict(type="bool", default=False),
    timeout=dict(type="float", default=60.0),
    drain_timeout=dict(type="float", default=120.0),
    drain=dict(type="bool", default=False),
    prompt=dict(type="str", default="The capital of France is"),
    requests=dict(type="int", default=4),
    max_new_tokens=dict(type="int", default=64),
)
REQUIRED_IF = (
    [("action", a, ["worker_url"]) for a in ("remove", "add", "drain", "wait_healthy", "measure")]
    + [("action", a, ["router_url"]) for a in ("remove", "add", "wait_healthy", "list", "inspect")]
    + [("action", "inspect", ["worker_urls"])]
)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, required_if=REQUIRED_IF, supports_check_mode=True)
    for name in ("timeout", "drain_timeout"):  # Ansible's float takes nan and inf: a wait that never ends
        if not 0 <= module.params[name] < float("inf"):
            module.fail_json(msg=f"{name}={module.params[name]!r}: a number of seconds, 0 or more, is wanted")
    what = f"{module.params['action']} {module.params['worker_url'] or ''}".rstrip()
    # A router's answer may echo the key in any escaping (JSON, a repr): Ansible's no_log masks the literal only.
    redact = Redactor([module.params["api_key"] or ""])
    try:
        result = act(module.params, module.check_mode)
    except ActionFailed as exc:  # the result too (the drain, the inspection)
        module.fail_json(**redact.scrub({**exc.result, "msg": f"{what}: {exc}"}))
    except (RouterError, HttpError) as exc:
        module.fail_json(msg=redact.values(f"{what}: {exc}"))
    module.exit_json(**redact.scrub(result))


if __name__ == "__main__":
    main()
