#!/usr/bin/python
"""One worker of sglang-router: take it out, drain it, put it back, wait until the router reports it healthy."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: sglang_router_worker
short_description: Take an SGLang worker out of sglang-router 0.3.2, drain it, put it back
description:
  - Runs where the router's API answers; playbooks/rollout.yml delegates it to the router host and calls the
    router on its loopback (the role's router listens on 0.0.0.0, but a fleet's firewall may keep its port to
    the host). The worker is named by the URL the router lists it under (C(http://<host>:<port>)).
  - I(action=remove) removes the worker by the UUID the router lists it with (0.3.2 refuses a URL) and waits
    until it is no longer listed. Removal neither waits for nor cuts its in-flight requests; with I(drain), the
    same call then drains it as I(action=drain) does (one module call of a rollout's step, not two).
  - I(action=drain) waits until the worker's C(sglang:num_running_reqs) (its /metrics) is 0, or I(drain_timeout);
    never fails (the safe restart's stop waits for requests still running, as SGLang's SIGTERM handler does).
  - I(action=add) adds the worker (C(POST /workers)) and waits until the router lists it as healthy; fails at
    I(timeout). I(action=wait_healthy) only waits. I(action=list) returns what the router lists.
  - I(action=measure) measures the worker's output tok/s as the safe restart's verify does (I(requests)
    generations of I(max_new_tokens) tokens, one after another); no router is involved.
  - Logic in module_utils/sglang_deploy/router.py. See docs/rollout.md.
options:
  action:
    description: What to do.
    type: str
    choices: [remove, add, drain, wait_healthy, list, measure]
    required: true
  router_url:
    description: The router's base URL, as seen from where the module runs. Required but for I(action=drain) and
      I(action=measure).
    type: str
  api_key:
    description: The router's API key (C(--api-key)), required on /workers when the router has one; with
      I(action=measure), the worker's.
    type: str
  worker_url:
    description: The worker, as the router lists it. Required but for I(action=list).
    type: str
  timeout:
    description: Seconds to wait until the router no longer lists a removed worker, or lists an added one healthy.
    type: float
    default: 60
  drain_timeout:
    description: Seconds I(action=drain) (or I(action=remove) with I(drain)) waits for the worker's running
      requests to finish.
    type: float
    default: 120
  drain:
    description: With I(action=remove), drain the worker once the router no longer lists it (also when it was
      not listed).
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
author: sglang-deploy
"""

RETURN = r"""
worker_url:
  description: The worker acted on.
  type: str
  returned: always but list
worker_id:
  description: The UUID the router lists (listed) the worker with; null when it was not listed.
  type: str
  returned: remove, add
seconds:
  description: How long the wait took (until gone, healthy or drained).
  type: float
  returned: remove, add, drain, wait_healthy
tokens_per_s:
  description: With action=measure, the output tok/s.
  type: float
  returned: measure
drain:
  description: With action=drain (or remove with drain), {drained, seconds, running, why}.
  type: dict
  returned: drain, remove with drain
workers:
  description: What the router lists afterwards, each {url, id, healthy}.
  type: list
  returned: remove, add, wait_healthy, list
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sglang_deploy.http import HttpError
from ansible.module_utils.sglang_deploy.router import Router, RouterError, drain, measure


def act(module: AnsibleModule) -> dict:
    p = module.params
    url = p["worker_url"]
    action = p["action"]
    if action == "measure":
        out = measure(url, p["prompt"], p["requests"], p["max_new_tokens"], api_key=p["api_key"])
        return {"changed": False, "worker_url": url, **out}
    router = Router(p["router_url"], api_key=p["api_key"])
    if action == "list":
        return {"changed": False, "workers": router.membership()}
    if action == "drain":
        if module.check_mode:
            return {"changed": False, "worker_url": url, "drain": {"drained": None, "why": "check mode"}}
        out = drain(url, p["drain_timeout"], api_key=p["api_key"])
        return {"changed": False, "worker_url": url, "drain": out, "seconds": out["seconds"]}
    listed = router.find(url)
    if action == "wait_healthy":
        seconds = router.wait_healthy(url, p["timeout"])
        return {"changed": False, "worker_url": url, "seconds": seconds, "workers": router.membership()}
    if action == "remove":
        if module.check_mode:  # nothing removed, nothing read (as action=drain in check mode)
            out = {"changed": listed is not None, "worker_url": url, "worker_id": (listed or {}).get("id")}
            return {**out, "drain": {"drained": None, "why": "check mode"}} if p["drain"] else out
        out = {"changed": False, "worker_url": url, "worker_id": None}
        if listed is not None:
            wid = router.remove(url)
            out = {"changed": True, "worker_url": url, "worker_id": wid, "seconds": router.wait_gone(url, p["timeout"])}
            out["workers"] = router.membership()
        if p["drain"]:  # the worker's /metrics: api_key is the router's here, not the worker's
            out["drain"] = drain(url, p["drain_timeout"])
        return out
    # add
    if module.check_mode:
        return {"changed": listed is None, "worker_url": url, "worker_id": (listed or {}).get("id")}
    wid = (listed or {}).get("id") or router.add(url)
    seconds = router.wait_healthy(url, p["timeout"])
    listed_now = router.find(url) or {}
    return {
        "changed": listed is None,
        "worker_url": url,
        "worker_id": listed_now.get("id") or wid,
        "seconds": seconds,
        "workers": router.membership(),
    }


def main():
    module = AnsibleModule(
        argument_spec=dict(
            action=dict(
                type="str", choices=["remove", "add", "drain", "wait_healthy", "list", "measure"], required=True
            ),
            router_url=dict(type="str"),
            api_key=dict(type="str", no_log=True),
            worker_url=dict(type="str"),
            timeout=dict(type="float", default=60.0),
            drain_timeout=dict(type="float", default=120.0),
            drain=dict(type="bool", default=False),
            prompt=dict(type="str", default="The capital of France is"),
            requests=dict(type="int", default=4),
            max_new_tokens=dict(type="int", default=64),
        ),
        required_if=[("action", a, ["worker_url"]) for a in ("remove", "add", "drain", "wait_healthy", "measure")]
        + [("action", a, ["router_url"]) for a in ("remove", "add", "wait_healthy", "list")],
        supports_check_mode=True,
    )
    try:
        result = act(module)
    except (RouterError, HttpError) as exc:
        module.fail_json(msg=f"{module.params['action']} {module.params['worker_url'] or ''}: {exc}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
