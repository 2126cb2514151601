"""Restarting one instance never stops another instance's server on the same host (issue #29).

lab-node1's `main` serves on GPUs 0-7. A restart through the driver whose inventory (here -e) declares only an
instance `bench` on GPUs 4-7 used to stop main's processes there (every instance runs as the service user, and
the stop policy `own` took any of that user's processes for its own) and report success. Now its preflight,
from the host's own processes, refuses: exit 4, naming main's unit and its pids, nothing stopped; main serves on,
the same process. At the end bench's files are removed and main is left as deploy.yml leaves it.
"""

from __future__ import annotations

import json
import re

import pytest

from support.e2e import back_to_deployed, driver_runner, podman_exec

pytestmark = pytest.mark.lab

NODE = "lab-node1"
BENCH = {"name": "bench", "port": 30003, "gpus": [4, 5, 6, 7]}
HEALTH = (
    "import sys, urllib.request as u; print(u.urlopen(f'http://127.0.0.1:{sys.argv[1]}/health', timeout=10).status)"
)


def main_state(node: str) -> dict[str, str]:
    out = podman_exec(node, "systemctl", "show", "sglang-main.service", "-p", "MainPID", "-p", "ActiveState")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def holders(node: str, gpus: list[int]) -> set[int]:
    """The pids nvidia-smi lists on these GPUs."""
    fmt = "--format=csv,noheader,nounits"
    index = dict(
        reversed([f.strip() for f in line.split(",")])
        for line in podman_exec(node, "nvidia-smi", "--query-gpu=index,uuid", fmt).splitlines()
        if line.strip()
    )
    apps = podman_exec(node, "nvidia-smi", "--query-compute-apps=pid,gpu_uuid", fmt).splitlines()
    rows = [[f.strip() for f in line.split(",")] for line in apps if line.strip()]
    return {int(pid) for pid, uuid in rows if int(index[uuid]) in gpus}


@pytest.fixture(scope="module")
def main_serving(deployed, tmp_path_factory):
    """lab-node1's main started and verified through the driver's safe restart."""
    the_lab, hosts = deployed
    node = next(h["container"] for h in hosts if h["name"] == NODE)
    run = driver_runner(the_lab, tmp_path_factory.mktemp("ledger") / "ledger.sqlite3", NODE)
    code, _, proc = run("restart")
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    yield run, node
    # bench was never verified: its restart wrote its files in place (and refused); none of it is left behind
    podman_exec(node, "sh", "-c", "systemctl disable --now sglang-bench.service; systemctl reset-failed || true")
    podman_exec(
        node,
        "rm",
        "-rf",
        "/etc/systemd/system/sglang-bench.service",
        "/etc/sglang/bench.env",
        "/etc/sglang/pending/sglang-bench.service",
        "/etc/sglang/pending/bench.env",
        "/etc/sglang/secrets/bench.env",
        "/var/lib/sglang/known-good/bench",
    )
    podman_exec(node, "systemctl", "daemon-reload")
    back_to_deployed(the_lab, node, NODE)


def test_a_restart_of_an_instance_on_another_instances_gpus_is_refused_and_the_other_serves_on(main_serving):
    run, node = main_serving
    before = main_state(node)
    assert before["ActiveState"] == "active" and int(before["MainPID"]) > 0
    mains = holders(node, BENCH["gpus"])
    assert mains, "main's ranks hold GPUs 4-7"

    code, doc, proc = run("restart", "--instance", "bench", "-e", json.dumps({"sglang_instances": [BENCH]}))

    assert code == 4, proc.stdout[-3000:] + proc.stderr[-2000:]
    res = doc["hosts"][NODE]["instances"]["bench"]
    assert res["outcome"] == "gpus_not_clean" and res["failure"]["phase"] == "preflight"
    cause = res["failure"]["cause"]
    named = re.search(r"sglang-main\.service \(sglang instance main\): pids ([\d, ]+) on GPUs \[4, 5, 6, 7\]", cause)
    assert named, cause
    assert {int(p) for p in named.group(1).split(", ")} == mains
    assert "Nothing was stopped." in cause
    assert [p["phase"] for p in res["phases"]][-1] == "preflight" and res["stopped_processes"] == []
    # main: the same process, serving, its ranks still on the GPUs
    assert main_state(node) == before
    assert podman_exec(node, "python3", "-c", HEALTH, "30000").strip() == "200"
    assert holders(node, BENCH["gpus"]) == mains
