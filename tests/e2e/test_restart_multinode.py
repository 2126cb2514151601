"""One model over two lab nodes (nnodes 2): restart.yml stops every rank before any starts,
rank 0 waits until ready, generates and verifies, rank 1 is confirmed and recorded; a
failing rank stops the instance there and says there is no rollback across nodes."""

from __future__ import annotations

import json

import pytest

from support.e2e import ansible, podman_exec

pytestmark = pytest.mark.lab

PORT = 30002


def inventory_with_multinode(the_lab, tmp_path, rank1_env: dict | None = None):
    """The lab's inventory, each node given its rank of the instance `mn` (host variables)."""
    text = the_lab.inventory.read_text()
    for rank, host in enumerate(("lab-node1", "lab-node2")):
        inst = {
            "name": "mn",
            "port": PORT,
            "gpus": [0, 1, 2, 3],
            "nnodes": 2,
            "node_rank": rank,
            "dist_init_addr": "lab-node1:5757",
            "env": (rank1_env or {}) if rank == 1 else {},
        }
        text = text.replace(
            f"        {host}:\n", f"        {host}:\n          sglang_instances: {json.dumps([inst])}\n", 1
        )
    inv = tmp_path / "hosts.yml"
    inv.write_text(text)
    return inv


def results(proc_stdout: str) -> dict:
    start = proc_stdout.find("\n{\n")
    doc, _ = json.JSONDecoder().raw_decode(proc_stdout, start + 1)
    out: dict = {}
    for play in doc["plays"]:
        for task in play["tasks"]:
            for host, r in task["hosts"].items():
                for item in r.get("results") or []:
                    if item.get("instance") == "mn" and item.get("outcome") and "phases" in item:  # sglang_server's
                        out.setdefault(host, []).append(item)
    return out


@pytest.fixture(scope="module")
def nodes(deployed):
    the_lab, hosts = deployed
    yield the_lab, {h["name"]: h["container"] for h in hosts}
    for h in hosts:
        podman_exec(
            h["container"],
            "sh",
            "-c",
            "systemctl disable --now sglang-mn.service; rm -rf /etc/systemd/system/sglang-mn.service "
            "/etc/sglang/mn.env /var/lib/sglang/known-good/mn /etc/sglang/pending/*mn*; systemctl daemon-reload",
        )


def restart(the_lab, inv):
    return ansible(
        "ansible-playbook",
        "playbooks/restart.yml",
        inventory=inv,
        check=False,
        env={"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"},
    )


def test_every_rank_stops_before_any_starts_and_both_are_recorded(nodes, tmp_path):
    the_lab, containers = nodes
    proc = restart(the_lab, inventory_with_multinode(the_lab, tmp_path))
    res = results(proc.stdout)
    assert proc.returncode == 0, {h: [(r["outcome"], r.get("msg")) for r in rs] for h, rs in res.items()}
    assert [r["outcome"] for r in res["lab-node1"]] == ["stopped", "restarted", "restarted"]
    assert [r["outcome"] for r in res["lab-node2"]] == ["stopped", "started", "restarted"]
    rank0 = res["lab-node1"][1]
    assert rank0["verify"]["ok"] and rank0["verify"]["accept_length"] > 1.5
    assert rank0["verify"]["running_profile"] == "eagle3_topk1"
    rank1 = res["lab-node2"][2]
    assert {c["name"] for c in rank1["verify"]["checks"]} == {"unit", "drift", "gpu_processes", "patches"}
    # Every rank's stop ended before any rank's start began: Ansible ran the phases as tasks over both hosts.
    for host, container in containers.items():
        argv = podman_exec(
            container, "sh", "-c", "tr '\\0' ' ' < /proc/$(systemctl show -p MainPID --value sglang-mn.service)/cmdline"
        )
        assert f"--node-rank {0 if host == 'lab-node1' else 1}" in argv and "--nnodes 2" in argv
        newest = "cat $(ls -1 /var/lib/sglang/known-good/mn/generations/*.json | tail -n 1)"
        assert json.loads(podman_exec(container, "sh", "-c", newest))["profile"] == "eagle3_topk1"


def test_a_failing_rank_is_reported_and_not_rolled_back_across_nodes(nodes, tmp_path):
    the_lab, containers = nodes
    proc = restart(the_lab, inventory_with_multinode(the_lab, tmp_path, {"LAB_STANDIN_FAULT": "crash-startup"}))
    assert proc.returncode != 0
    res = results(proc.stdout)
    failed = res["lab-node2"][-1]
    # Rank 1 dies about 3 s after its start: within its start phase, or found by the confirm phase.
    assert failed["outcome"] == "not_recovered" and failed["failure"]["phase"] in ("start", "verify"), failed["failure"]
    assert "no automatic rollback across nodes" in failed["rollback"]["why"]
    state = podman_exec(
        containers["lab-node2"], "systemctl", "show", "-p", "ActiveState", "--value", "sglang-mn.service"
    ).strip()
    assert state != "active"
