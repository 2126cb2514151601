"""One secret, every way an operator passes it, found nowhere it must not be (issue 30), on lab-node1's `main`.

The value holds each of \\ ' " $ % a newline and regex metacharacters. It goes in as the instance's secret env
(sglang_service_secret_env: the root-only secrets file) by `-e` JSON, by clustered `-ve`, by the inventory's
group_vars and by `-e @file`, and last as the API key of a server that crashes at start: SGLang logs its
server_args, the key in a repr, and the journal tail goes into the failure and the evidence bundle. Then it is
searched for, in every form secret_rule.forms says a log carries it, in: every file under the ledger's directory
(the ledger, each run's events, progress and evidence, each bundle member), every --json and terminal output,
and every process command line on the controller and on the node, read while the runs were in flight (the
driver's own command line is the operator's: left out). The count of places searched is printed.
At the end `main` is back to deployed, never verified."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy.secret_rule import forms
from support.e2e import ALL_GPUS, back_to_deployed, driver_runner, members

pytestmark = pytest.mark.lab

NODE = "lab-node1"
SECRET = "Lab\\sec'ret\"$HOME%i{(.*)+?}[^x]|\nline2-7f3a"
# An API key goes in an HTTP header, where a newline cannot: the crash's key is the value's first line.
KEY = SECRET.split("\n")[0]


def main_env(**env: str) -> dict:
    return {"sglang_instances": [{"name": "main", "port": 30000, "gpus": ALL_GPUS, "env": env}]}


# The node's side of the sampler: one process for the whole test (a podman exec per reading cost a core's third
# on a loaded CI machine), every distinct command line printed once, at once; it ends when its stdin closes.
NODE_SAMPLER = r"""
import os, select, sys
seen = set()
while not select.select([sys.stdin], [], [], 0.1)[0]:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    line = f.read().replace(b"\0", b" ")
            except OSError:
                continue
            if line and line not in seen:
                seen.add(line)
                print(line.hex(), flush=True)  # a line of its own whatever the command line holds
"""


class CmdlineSampler:
    """Every distinct process command line on the controller (read every 0.2 s) and on the node (every 0.1 s, by
    one reader in the node, NODE_SAMPLER; its own command line left out) while it runs."""

    def __init__(self, node: str):
        self.node, self.seen, self.skip = node, set(), set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._reader = subprocess.Popen(
            ["podman", "exec", "-i", node, "python3", "-c", NODE_SAMPLER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or int(pid) in self.skip:
                    continue
                try:
                    self.seen.add(("controller", Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")))
                except OSError:
                    pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(30)
        out, _ = self._reader.communicate(timeout=30)  # its stdin closed: the reader ends
        lines = {bytes.fromhex(h) for h in out.decode().split()}
        self.seen |= {("node", line) for line in lines if b"select.select" not in line}  # not the reader itself


@pytest.fixture(scope="module")
def drive(deployed, tmp_path_factory):
    the_lab, hosts = deployed
    host = next(h for h in hosts if h["name"] == NODE)
    tmp = tmp_path_factory.mktemp("secrets")
    ledger = tmp / "ledger" / "ledger.sqlite3"
    ledger.parent.mkdir()
    yield the_lab, host, tmp, driver_runner(the_lab, ledger, NODE), ledger
    back_to_deployed(the_lab, host["container"], NODE)


def test_a_secret_passed_every_way_and_present_in_a_crash_is_found_nowhere(drive):
    the_lab, host, tmp, run, ledger = drive
    node = host["container"]
    # The inventory's group_vars: a copy of the lab's inventory with the secret beside it.
    inventory = tmp / "inventory" / "hosts.yml"
    (inventory.parent / "group_vars").mkdir(parents=True)
    shutil.copy(the_lab.inventory, inventory)
    (inventory.parent / "group_vars" / "all.yml").write_text(
        json.dumps({"sglang_service_secret_env": {"LAB_TOKEN": SECRET}})
    )
    vars_file = tmp / "vars.json"
    vars_file.write_text(json.dumps({"sglang_service_secret_env": {"LAB_TOKEN": SECRET}}))
    vars_file.chmod(0o600)
    crash = tmp / "crash.json"
    crash.write_text(json.dumps({**main_env(LAB_STANDIN_FAULT="crash-startup"), "sglang_service_api_key": KEY}))
    crash.chmod(0o600)
    secret_env = json.dumps({"sglang_service_secret_env": {"LAB_TOKEN": SECRET}})
    runs = [  # (what, driver arguments, --json, inventory, the exit codes it may end with)
        ("-e JSON", ("restart", "-e", secret_env), True, None, {0}),
        ("-ve, terminal", ("restart", "-ve", secret_env), False, None, {0}),
        ("group_vars", ("restart",), True, inventory, {0}),
        ("-e @file", ("verify", "-e", f"@{vars_file}"), True, None, {0}),
        # The crash: rolled back, or (the known-good server gets the new key too) not recovered.
        ("crash", ("restart", "-e", f"@{crash}"), True, None, {5, 6}),
    ]
    outputs: dict[str, str] = {}
    with CmdlineSampler(node) as sampler:
        for what, args, json_out, inv, codes in runs:
            proc = run(*args, json_out=json_out, inventory=inv, popen=True)
            sampler.skip.add(proc.pid)  # the operator's own command line
            out, err = proc.communicate(timeout=900)
            assert proc.returncode in codes, f"{what}: exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
            outputs[f"{what}: stdout"], outputs[f"{what}: stderr"] = out, err
    crashed = json.loads(outputs["crash: stdout"])
    assert crashed["evidence"], crashed  # the crash left a bundle, searched below
    bundle = members(crashed["evidence"])
    # The key was there to leak: the crashed server's own line with its server_args, the key masked.
    assert any(b"api_key='<secret>'" in data for data in bundle.values()), sorted(bundle)

    places: dict[str, bytes] = {k: v.encode() for k, v in outputs.items()}
    for path in sorted(ledger.parent.rglob("*")):
        if path.is_file():
            places[str(path)] = path.read_bytes()
            if path.name.endswith(".tar.gz"):
                places.update({f"{path}:{name}": data for name, data in members(str(path)).items()})
    places.update({f"{where} cmdline {i}": line for i, (where, line) in enumerate(sorted(sampler.seen))})
    needles = {f.encode() for f in forms(SECRET) | forms(KEY)} | {b"line2-7f3a"}
    leaks = [(place, n) for place, data in places.items() for n in needles if n in data]
    print(
        f"\nsecret searched for in {len(places)} places ({len(needles)} forms): {len(outputs)} outputs, "
        f"{sum(1 for p in places if p.startswith(str(ledger.parent)))} ledger files and bundle members, "
        f"{len(sampler.seen)} process command lines"
    )
    assert not leaks, leaks[:10]
    assert len(sampler.seen) > 50 and any(b"ansible-playbook" in line for _, line in sampler.seen)
    assert any(where == "node" and b"sglang-launch" in line for where, line in sampler.seen)
