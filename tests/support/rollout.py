"""Helpers of the rollout's end-to-end tests (tests/e2e/test_rollout*.py): the lab's inventory with the rollout's
groups and the router, the router's view of its workers, and bench/loadgen.py through the router."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import yaml

from support.e2e import REPO, ansible, labmod, podman_exec

ROUTER = "lab-node1"
ROUTER_PORT = 30100
KEY = "lab-router-key"
MODEL = labmod.LAB_HOST_VARS["sglang_model_path"]  # the lab's served model: what smg routes a request by
ROUTER_VARS = labmod.router_vars(ROUTER_PORT, 29100, KEY)


def write_inventory(
    the_lab, name: str, instances: dict[str, list[dict]], groups: dict[str, list[str]], routers: dict | None = None
) -> str:
    """The lab's inventory, with `groups` (sglang_replicas, sglang_multinode...), sglang_routers (`routers`, each
    host's own variables over ROUTER_VARS; default the one router on ROUTER) and each node's instances (host
    variables, which rank above the project's group_vars); written next to it (lab/lab.py's own is untouched)."""
    routers = {ROUTER: {}} if routers is None else routers
    doc = yaml.safe_load(the_lab.inventory.read_text(encoding="utf-8"))
    hosts = doc["all"]["children"]["sglang_nodes"]["hosts"]
    for host, inst in instances.items():
        hosts[host]["sglang_instances"] = inst
    for host, own in routers.items():
        hosts[host].update({**ROUTER_VARS, **own})
    for group, members in groups.items():
        doc["all"]["children"][group] = {"hosts": {h: None for h in members}}
    doc["all"]["children"]["sglang_routers"] = {"hosts": {h: None for h in routers}}
    path = the_lab.inventory.parent / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return str(path)


def serve_behind_router(run, inventory: str, *routers: str) -> None:
    """The inventory's instances started through the driver's safe restart (a known-good generation each), the
    routers deployed in front of them (playbooks/router.yml), the load generator copied to each router's node."""
    code, _, proc = run("restart", inventory=inventory)
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ansible("ansible-playbook", "playbooks/router.yml", inventory=inventory)
    for router in routers:
        subprocess.run(["podman", "cp", str(REPO / "bench" / "loadgen.py"), f"{router}:/tmp/loadgen.py"], check=True)


class Watched:
    """A driver run in the background whose output is read as it comes (what it has said so far, at any time)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=lambda s=s, into=into: into.extend(iter(s.readline, "")), daemon=True)
            for s, into in ((proc.stdout, self.out), (proc.stderr, self.err))
        ]
        for r in self.readers:
            r.start()

    def said(self, text: str):
        return lambda: text in "".join(self.err)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        for r in self.readers:
            r.join(10)
        return code, "".join(self.out), "".join(self.err)


def remove_router(router: str) -> None:
    """The gateway and its sentinel gone from the node (their units, the sentinel's state)."""
    units = ("sglang-router-sentinel.service", "sglang-router.service")
    podman_exec(router, "sh", "-c", f"systemctl disable --now {' '.join(units)} || true")
    podman_exec(
        router, "rm", "-rf", *(f"/etc/systemd/system/{u}" for u in units), "/var/lib/sglang-router-sentinel",
        "/tmp/loadgen.py",
    )  # fmt: skip


def in_node(container: str, code: str) -> str:
    return podman_exec(container, "python3", "-c", code)


def router_workers(container: str) -> dict[str, bool]:
    """What the router lists, asked on its node: {url: healthy}."""
    code = (
        "import json, urllib.request as u; r = u.urlopen(u.Request("
        f"'http://127.0.0.1:{ROUTER_PORT}/workers', headers={{'Authorization': 'Bearer {KEY}'}}), timeout=10); "
        "print(json.dumps({w['url']: w['is_healthy'] for w in json.load(r)['workers']}))"
    )
    return json.loads(in_node(container, code))


def main_pid(container: str, unit: str) -> int:
    return int(podman_exec(container, "systemctl", "show", "-p", "MainPID", "--value", unit))


class Load:
    """bench/loadgen.py on the router's node, through the router, until stopped; its completions name `model` (smg
    routes by it: the served name, MODEL)."""

    def __init__(self, container: str, model: str = "default"):
        self.container = container
        podman_exec(container, "rm", "-f", "/tmp/loadgen.stop", "/tmp/loadgen.ready")
        self.proc = subprocess.Popen(
            [
                *("podman", "exec", container, "python3", "/tmp/loadgen.py"),
                *("--url", f"http://127.0.0.1:{ROUTER_PORT}", "--api-key", KEY, "--concurrency", "3", "--model", model),
                *("--stop-file", "/tmp/loadgen.stop", "--ready-file", "/tmp/loadgen.ready", "--duration", "900"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while podman_exec(container, "sh", "-c", "test -f /tmp/loadgen.ready && echo y || true").strip() != "y":
            assert time.monotonic() < deadline and self.proc.poll() is None, "the load generator did not start"
            time.sleep(0.2)

    def stop(self) -> dict:
        podman_exec(self.container, "touch", "/tmp/loadgen.stop")
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return json.loads(out)
