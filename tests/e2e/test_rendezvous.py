"""The multi-node rendezvous check (playbooks/preflight.yml) on two lab nodes, for real: the instance `rdv`
over lab-node1 (rank 0) and lab-node2 (rank 1) is started first; the check passes (a handshake on
dist_init_addr and a gloo all-reduce between the two nodes, torch on CPU from the lab's venv), then fails
naming the setting for a missing GLOO interface, an unreachable rank-0 address and a rank-0 port another
process holds; each time before anything is stopped: both ranks' units keep their MainPID."""

from __future__ import annotations

import json
import subprocess

import pytest

from support.e2e import ansible, podman_exec

pytestmark = pytest.mark.lab

NAME, PORT, DIST_PORT = "rdv", 30004, 5858
HOSTS = ("lab-node1", "lab-node2")
UNIT = f"sglang-{NAME}.service"


def inventory_with_rdv(the_lab, tmp_path, env: dict | None = None):
    """The lab's inventory, each node given its rank of the instance `rdv` (host variables); env for rank 1."""
    text = the_lab.inventory.read_text()
    for rank, host in enumerate(HOSTS):
        inst = {
            "name": NAME,
            "port": PORT,
            "gpus": [4, 5, 6, 7],
            "nnodes": 2,
            "node_rank": rank,
            "dist_init_addr": f"lab-node1:{DIST_PORT}",
            "env": (env or {}) if rank == 1 else {},
        }
        text = text.replace(
            f"        {host}:\n", f"        {host}:\n          sglang_instances: {json.dumps([inst])}\n", 1
        )
    inv = tmp_path / "hosts.yml"
    inv.write_text(text)
    return inv


def playbook(name: str, inv, *extra: str):
    return ansible(
        "ansible-playbook",
        f"playbooks/{name}",
        *extra,
        inventory=inv,
        check=False,
        env={"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"},
    )


def rdv_results(stdout: str) -> dict[str, dict[str, dict]]:
    """{host: {check|meet: the module's result}} for the instance `rdv`."""
    doc, _ = json.JSONDecoder().raw_decode(stdout, stdout.find("\n{\n") + 1)
    out: dict = {}
    for play in doc["plays"]:
        for task in play["tasks"]:
            for host, r in task["hosts"].items():
                for item in r.get("results") or []:
                    if item.get("instance") == NAME and "node_rank" in item:
                        step = "check" if "interfaces" in item else "meet"
                        out.setdefault(host, {})[step] = item
    return out


def main_pids(containers) -> dict[str, str]:
    return {
        h: podman_exec(c, "systemctl", "show", "-p", "MainPID", "--value", UNIT).strip() for h, c in containers.items()
    }


@pytest.fixture(scope="module")
def rdv_nodes(deployed, tmp_path_factory):
    """Both ranks of `rdv` started (restart.yml), serving; removed at the end."""
    the_lab, hosts = deployed
    containers = {h["name"]: h["container"] for h in hosts}
    inv = inventory_with_rdv(the_lab, tmp_path_factory.mktemp("rdv"))
    proc = playbook("restart.yml", inv)
    assert proc.returncode == 0, proc.stdout[-4000:]
    pids = main_pids(containers)
    assert all(p not in ("", "0") for p in pids.values()), pids
    yield the_lab, containers, pids
    for c in containers.values():
        podman_exec(
            c,
            "sh",
            "-c",
            f"systemctl disable --now {UNIT}; rm -rf /etc/systemd/system/{UNIT} /etc/sglang/{NAME}.env "
            f"/var/lib/sglang/known-good/{NAME} /etc/sglang/pending/*{NAME}*; systemctl daemon-reload",
        )


def assert_nothing_stopped(containers, pids):
    assert main_pids(containers) == pids
    for c in containers.values():
        assert podman_exec(c, "systemctl", "show", "-p", "ActiveState", "--value", UNIT).strip() == "active"


def test_the_ranks_meet_and_all_reduce_across_the_two_nodes(rdv_nodes, tmp_path):
    the_lab, containers, pids = rdv_nodes
    proc = playbook("preflight.yml", inventory_with_rdv(the_lab, tmp_path))
    res = rdv_results(proc.stdout)
    assert proc.returncode == 0, {h: {s: r.get("msg") for s, r in rs.items()} for h, rs in res.items()}
    rank0, rank1 = res["lab-node1"], res["lab-node2"]
    # The stand-in does not hold dist_init_addr's port: rank 0 listened on it, rank 1 said hello there.
    assert rank0["check"]["listener"] and rank0["check"]["port_state"]["state"] == "free"
    assert rank0["meet"]["handshake"] == {"joined": {"1": "lab-node2"}, "missing": [], "error": None}
    assert rank1["meet"]["handshake"]["ok"] and rank1["meet"]["store_port"] == DIST_PORT
    for r in (rank0, rank1):
        assert r["meet"]["allreduce"]["ok"] and r["meet"]["allreduce"]["sum_ok"], r["meet"]["allreduce"]
        assert r["meet"]["allreduce"]["sizes"][0]["bytes"] == 1 << 20
    assert_nothing_stopped(containers, pids)
    for host, r in res.items():  # shown with -rP
        a = r["meet"]["allreduce"]
        print(
            f"{host}: rank {r['meet']['node_rank']} all-reduce {a['sizes']} in {a['seconds']} s (torch import included)"
        )


def test_a_missing_gloo_interface_is_named_with_its_host(rdv_nodes, tmp_path):
    the_lab, containers, pids = rdv_nodes
    proc = playbook("preflight.yml", inventory_with_rdv(the_lab, tmp_path, {"GLOO_SOCKET_IFNAME": "nosuch0"}))
    assert proc.returncode != 0
    res = rdv_results(proc.stdout)
    msg = res["lab-node2"]["check"]["msg"]
    assert msg.startswith(
        "GLOO_SOCKET_IFNAME (set by sglang_instances[0].env.GLOO_SOCKET_IFNAME) names 'nosuch0', an interface "
        "lab-node2 does not have"
    ), msg
    assert "meet" not in res["lab-node2"]  # a failed rank goes no further
    # Rank 0 passed its own check, and does not wait for rank 1: it names it at once.
    assert res["lab-node1"]["check"]["ok"]
    assert res["lab-node1"]["meet"]["msg"].startswith(
        "not meeting: rank 1 (lab-node2) failed its check: GLOO_SOCKET_IFNAME"
    )
    assert res["lab-node1"]["meet"]["handshake"] is None
    assert_nothing_stopped(containers, pids)


def test_an_unreachable_rank0_address_is_named_by_both_ranks(rdv_nodes, tmp_path):
    """On lab-node2, lab-node1 resolves (/etc/hosts) to an address of the lab's network where no node is."""
    the_lab, containers, pids = rdv_nodes
    c2 = containers["lab-node2"]
    ip = podman_exec(c2, "getent", "ahostsv4", "lab-node2").split()[0]
    nowhere = ".".join([*ip.split(".")[:3], "250"])
    podman_exec(
        c2,
        "sh",
        "-c",
        f"cp /etc/hosts /tmp/hosts.rdv && {{ echo '{nowhere} lab-node1'; cat /tmp/hosts.rdv; }} > /etc/hosts",
    )
    try:
        proc = playbook(
            "preflight.yml", inventory_with_rdv(the_lab, tmp_path), "-e", "sglang_service_rendezvous_timeout_s=8"
        )
    finally:
        podman_exec(c2, "sh", "-c", "cat /tmp/hosts.rdv > /etc/hosts && rm /tmp/hosts.rdv")
    assert proc.returncode != 0
    res = rdv_results(proc.stdout)
    assert res["lab-node2"]["check"]["resolved"] == [nowhere]
    msg1 = res["lab-node2"]["meet"]["msg"]
    assert msg1.startswith(
        f"dist_init_addr (set by sglang_instances[0].dist_init_addr): lab-node1:{DIST_PORT} ({nowhere}) is not "
        "reachable from lab-node2 (rank 1) within 8 s"
    ), msg1
    msg0 = res["lab-node1"]["meet"]["msg"]
    assert msg0.startswith(
        f"dist_init_addr (set by sglang_instances[0].dist_init_addr): rank(s) 1 never connected to lab-node1:{DIST_PORT} "
        "on lab-node1 (rank 0) within 8 s"
    ), msg0
    assert res["lab-node1"]["meet"]["allreduce"] is None and res["lab-node2"]["meet"]["allreduce"] is None
    assert_nothing_stopped(containers, pids)


def test_rank0s_port_held_by_another_process_is_named_with_the_holder(rdv_nodes, tmp_path):
    the_lab, containers, pids = rdv_nodes
    c1 = containers["lab-node1"]
    podman_exec(c1, "systemd-run", "--unit", "rdv-squatter", "python3", "-m", "http.server", str(DIST_PORT))
    try:
        podman_exec(
            c1,
            "sh",
            "-c",
            f"for i in $(seq 50); do grep -qi ':{DIST_PORT:04X} ' /proc/net/tcp && exit; sleep 0.1; done",
        )
        proc = playbook("preflight.yml", inventory_with_rdv(the_lab, tmp_path))
    finally:
        subprocess.run(["podman", "exec", c1, "systemctl", "stop", "rdv-squatter"], check=False, capture_output=True)
    assert proc.returncode != 0
    res = rdv_results(proc.stdout)
    msg = res["lab-node1"]["check"]["msg"]
    assert msg.startswith(
        f"dist_init_addr (set by sglang_instances[0].dist_init_addr): port {DIST_PORT} is already in use on lab-node1 "
        "(rank 0) by pid "
    ), msg
    assert "(rdv-squatter.service: " in msg and f"python3 -m http.server {DIST_PORT}): " in msg
    assert res["lab-node2"]["meet"]["msg"].startswith(
        "not meeting: rank 0 (lab-node1) failed its check: dist_init_addr"
    )
    assert_nothing_stopped(containers, pids)


def test_a_restart_with_its_preflight_refused_stops_nothing(rdv_nodes, tmp_path):
    """restart.yml -e sglang_restart_preflight=true: the rendezvous fails on rank 1 (a missing GLOO interface),
    so neither rank is restarted: the hosts that failed the preflight play leave the run, rank 0 restarts
    nothing alone (restart.yml asserts a multi-node instance's nodes restart together)."""
    the_lab, containers, pids = rdv_nodes
    inv = inventory_with_rdv(the_lab, tmp_path, {"GLOO_SOCKET_IFNAME": "nosuch0"})
    proc = playbook("restart.yml", inv, "-e", "sglang_restart_preflight=true")
    assert proc.returncode != 0
    res = rdv_results(proc.stdout)
    assert res["lab-node2"]["check"]["msg"].startswith("GLOO_SOCKET_IFNAME"), res["lab-node2"]["check"]["msg"]
    assert_nothing_stopped(containers, pids)
