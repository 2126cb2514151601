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
  - Speaks to either gateway (I(impl); docs/router.md, "The two gateways"), or to several at once (I(routers)).
    Runs where the routers' API answers (the rollout delegates it to the first router host). The worker is named
    by its URL; any spelling the router lists it under is the same worker (worker_urls.py's same_worker).
  - I(action=remove) removes every record of the worker by the UUID the router lists it with and waits until it
    is no longer listed (with smg, C(draining) counts as removed); a worker not listed FAILS unless I(missing_ok).
    Removal neither waits for nor cuts its in-flight requests; with I(drain), the same call then drains it.
  - I(action=drain) waits until the worker's C(sglang:num_running_reqs) + C(sglang:num_queue_reqs) said 0 for
    0.2 s (two reads at least), or its connection is refused. It FAILS at once when /metrics cannot say (SGLang
    serves it only with C(--enable-metrics)); at I(drain_timeout) when requests still run or reads keep failing.
  - I(action=add) adds the worker unless listed and waits until the router lists it healthy (fails at
    I(timeout)); I(action=wait_healthy) only waits; I(action=list) returns what the router lists.
  - I(action=inspect) reads, for each of I(worker_urls), whether the router lists it, whether it serves and whether
    it can be drained on evidence; it changes nothing. With I(fail_on_problems) it fails on any such problem.
  - I(action=measure) measures the worker's output tok/s as the safe restart's verify does; no router involved.
  - I(action=view) says what every gateway thinks of each of I(worker_urls); a gateway down is said, never a failure.
    Logic in plugins/module_utils/sglang_deploy/router_actions.py, router.py and gateways.py; see docs/rollout.md
    and docs/router.md.
options:
  action:
    description: What to do.
    type: str
    choices: [remove, add, drain, wait_healthy, list, inspect, measure, view]
    required: true
  impl:
    description: The gateway at I(router_url), C(sglang-router) (0.3.2) or C(smg) (1.13.0, the Shepherd Model
      Gateway); the client speaks each one's worker API as docs/router.md records it.
    type: str
    choices: [sglang-router, smg]
    default: sglang-router
  router_url:
    description: The router's base URL, as seen from where the module runs. This or I(routers) is required but for
      I(action=drain) and I(action=measure).
    type: str
  routers:
    description: Several gateways in front of the same workers, each acted on at once (module_utils gateways.py);
      the result says, under C(gateways), which carried the action out and why not.
    type: list
    elements: dict
    suboptions:
      name:
        description: The gateway's name in messages (its inventory host).
        type: str
      url:
        description: Its base URL as seen from where the module runs.
        type: str
        required: true
      impl:
        description: Its gateway (as I(impl)).
        type: str
        choices: [sglang-router, smg]
        default: sglang-router
      api_key:
        description: Its API key (else I(api_key)).
        type: str
      metrics_url:
        description: With I(action=view), its Prometheus endpoint's base URL (circuit states).
        type: str
      discovery_file:
        description:
          - smg only. The discovery file that gateway reads its workers from, on the host the module runs on.
          - I(action=remove) and I(action=add) edit it, not the worker API (smg adds back a worker deleted through the
            API while the file names it).
        type: path
  quorum:
    description: With I(routers), how many gateways must carry the action out (default all); fewer FAILS.
    type: int
  api_key:
    description: The router's API key (C(--api-key)), required on /workers when the router has one; with
      I(action=measure), the worker's. With smg, I(action=add) posts it as the worker's key too.
    type: str
  worker_url:
    description: The worker, as the inventory names it (any spelling the router's may differ by, above).
      Required but for I(action=list) and I(action=inspect).
    type: str
  worker_urls:
    description: With I(action=inspect) (required there), the workers to inspect, each as I(worker_url).
    type: list
    elements: str
  missing_ok:
    description: With I(action=remove), succeed (nothing removed) when the router does not list the worker.
    type: bool
    default: false
  fail_on_problems:
    description: With I(action=inspect), fail when a worker is not listed or cannot be drained on evidence.
    type: bool
    default: false
  timeout:
    description: Seconds to wait until the router no longer lists a removed worker, or lists an added one healthy;
      with I(action=inspect), each read's limit. A finite number, 0 or more.
    type: float
    default: 60.0
  drain_timeout:
    description: Seconds I(action=drain) (or I(action=remove) with I(drain)) waits for the worker's running and
      queued requests to finish.
    type: float
    default: 120.0
  drain:
    description: With I(action=remove), drain the worker once the router no longer lists it.
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
    description: With I(action=measure), the tokens of each generation.
    type: int
    default: 64
notes:
  - Check mode - remove and add read the router's list and send nothing; drain reads nothing (C(drained=null)).
author: sglang-deploy maintainers (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Take the worker out of the router and drain it
  sglang.deploy.sglang_router_worker:
    action: remove
    router_url: http://router-1:30000
    worker_url: http://gpu-node-3:30001
    drain: true
    drain_timeout: 300
  delegate_to: router-1

- name: Put it back once restarted, and wait until the router lists it healthy
  sglang.deploy.sglang_router_worker:
    action: add
    routers:
      - name: router-1
        url: http://router-1:30000
      - name: router-2
        url: http://router-2:30000
        impl: smg
        api_key: "{{ smg_api_key }}"
    worker_url: http://gpu-node-3:30001
    timeout: 120
  delegate_to: router-1

- name: Can each replica be taken out and drained on evidence? (changes nothing)
  sglang.deploy.sglang_router_worker:
    action: inspect
    router_url: http://router-1:30000
    worker_urls:
      - http://gpu-node-3:30001
      - http://gpu-node-4:30001
    fail_on_problems: true
  delegate_to: router-1
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
  description: With action=remove, every UUID removed (in check mode, that would be); empty when not listed.
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
      description: The last sglang:num_running_reqs read (summed over label sets); null when none.
      type: float
    queued:
      description: The last sglang:num_queue_reqs read; null when none was read.
      type: float
    why:
      description:
        - Why it ended - nothing running or queued, not serving, cannot be drained on evidence, the drain
          timeout (the last load or error), or check mode.
      type: str
    gateway_in_flight:
      description: With smg, its own count of the worker's requests in flight at the drain's last read (summed over
        the smg gateways of I(routers)); null once none lists it. Evidence only; absent with sglang-router.
      type: float
workers:
  description: With action=inspect, one entry per I(worker_urls), in their order; with remove, add, wait_healthy
    and list, what the router lists afterwards, each {url, id, healthy}.
  type: list
  elements: dict
  returned: remove (when it removed), add, wait_healthy, list, inspect
  contains:
    url:
      description: The worker (with inspect, as given; else as the router lists it).
      type: str
    id:
      description: Its UUID (not with inspect).
      type: str
    healthy:
      description: Whether the router lists it healthy and in rotation (not with inspect).
      type: bool
    status:
      description: With smg, its state (C(ready), C(draining), C(not_ready)).
      type: str
    listed:
      description: With inspect, whether the router lists it under any spelling.
      type: bool
    ids:
      description: With inspect, the UUIDs the router lists it with.
      type: list
      elements: str
    healthy_in_router:
      description: With inspect, whether a record of it is healthy; null when not listed.
      type: bool
    serving:
      description: With inspect, whether its own GET /health answered 200 within I(timeout).
      type: bool
    drainable:
      description: With inspect, whether its /metrics answered 200 with both load series.
      type: bool
    why:
      description: With inspect, why it is not serving or not drainable; empty when it is both.
      type: str
problems:
  description: With action=inspect, one sentence per worker not listed and per worker not drainable (each naming
    the worker); empty when none.
  type: list
  elements: str
  returned: inspect
gateways:
  description: With I(routers) of two or more, one entry per gateway, {name, url, ok, why} (why when not ok);
    inspect's workers then say each gateway's view under C(gateways) (by name, listed and healthy_in_router).
  type: list
  elements: dict
  returned: remove, add, wait_healthy, list, inspect (with two routers or more)
view:
  description: With action=view, one row per worker and gateway, {worker, gateway, listed, healthy, status,
    in_flight, circuit, why}; null where the gateway said nothing (in_flight with 0.3.2, all when it is down).
  type: list
  elements: dict
  returned: view
msg:
  description: When the module fails, the action, the worker and why.
  type: str
  returned: failure
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.gateways import act_all
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.http import HttpError
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.router import (
    DEFAULT_IMPL,
    GATEWAYS,
    RouterError,
)
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.router_actions import ActionFailed
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import Redactor

ACTIONS = ["remove", "add", "drain", "wait_healthy", "list", "inspect", "measure", "view"]
ON_ROUTERS = ("remove", "add", "wait_healthy", "list", "inspect", "view")  # router_url or routers wanted
GATEWAY = dict(
    name=dict(type="str"),
    url=dict(type="str", required=True),
    impl=dict(type="str", choices=list(GATEWAYS), default=DEFAULT_IMPL),
    api_key=dict(type="str", no_log=True),
    metrics_url=dict(type="str"),
    discovery_file=dict(type="path"),
)
ARGUMENT_SPEC = dict(
    action=dict(type="str", choices=ACTIONS, required=True),
    impl=dict(type="str", choices=list(GATEWAYS), default=DEFAULT_IMPL),  # router.py's table: one list of gateways
    router_url=dict(type="str"),
    routers=dict(type="list", elements="dict", options=GATEWAY),
    quorum=dict(type="int"),
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
    max_new_tokens=dict(type="int", default=64, no_log=False),  # a count of tokens: no secret (validate-modules)
)
REQUIRED_IF = (
    [("action", a, ["worker_url"]) for a in ("remove", "add", "drain", "wait_healthy", "measure")]
    + [("action", a, ["router_url", "routers"], True) for a in ON_ROUTERS]
    + [("action", a, ["worker_urls"]) for a in ("inspect", "view")]
)


def main():
    exclusive = [("router_url", "routers")]
    module = AnsibleModule(
        ARGUMENT_SPEC, required_if=REQUIRED_IF, mutually_exclusive=exclusive, supports_check_mode=True
    )
    what = f"{module.params['action']} {module.params['worker_url'] or ''}".rstrip()
    # A router's answer may echo the key in any escaping (JSON, a repr): Ansible's no_log masks the literal only.
    redact = Redactor([module.params["api_key"] or ""] + [g["api_key"] or "" for g in module.params["routers"] or []])
    try:
        result = act_all(module.params, module.check_mode)
    except ActionFailed as exc:  # the result too (the drain, the inspection)
        module.fail_json(**redact.scrub({**exc.result, "msg": f"{what}: {exc}"}))
    except (RouterError, HttpError) as exc:
        module.fail_json(msg=redact.values(f"{what}: {exc}"))
    module.exit_json(**redact.scrub(result))


if __name__ == "__main__":
    main()
