"""The multi-node rendezvous check as its callers read it (issue #31: the behaviours behind the mutants the unit suite
let survive in sglang_deploy/rendezvous.py).

What the module returns to Ansible (each record whole: check's, meet's, the handshake's, the all-reduce rank's), every
message as the operator reads it (the variable, its origin, the host, every address and holder listed), and the
protocol on the wire (rank 0's banner, OK and NO; what a rank sends). The timing of rank 1's retries runs on a fake
network whose clock moves only as it waits: a dropped SYN costs the connect's whole time limit, a silent listener
the read's, a blocking socket (no limit) forever. Rank 0's listener runs for real on loopback; so does the all-reduce
rank's worker (the real nccl_worker.py under this venv's python, given a torch that reports what the worker asked
of it instead of measuring: no torch is needed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import meeting, network
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import rendezvous as rdv
from support.rendezvous import checked

IFACES = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.2", "fe80::1"],
    "eth1": ["10.1.0.2"],
    "ib1": [],
}
DVAR = "dist_init_addr (set by sglang_instances[0].dist_init_addr)"
GVAR = "GLOO_SOCKET_IFNAME (set by sglang_instances[0].env.GLOO_SOCKET_IFNAME)"
NVAR = "NCCL_SOCKET_IFNAME (set by sglang_instances[0].env.NCCL_SOCKET_IFNAME)"


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


ipv6 = pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback on this host")


def inst(rank=0, env=None, addr="node1:5757", **kw):
    env = env or {}
    return {
        "name": "mn",
        "unit": "sglang-mn.service",
        "nnodes": 2,
        "node_rank": rank,
        "dist_init_addr": addr,
        "env": env,
        "env_origins": {k: f"sglang_instances[0].env.{k}" for k in env},
        "origins": {"--dist-init-addr": "sglang_instances[0].dist_init_addr"},
        "python": "/opt/ml-env/bin/python",
        **kw,
    }


# --- a fake host for check: names, local addresses, ports by family -------------------------------------------------


class Host:
    """What check asks of a host: names it resolves, addresses it has, who holds a port (per family), a free port."""

    def __init__(self, names, local=(), ports=None, free=None):
        self.names, self.local, self.ports = names, set(local), ports or {}
        self.free = free or {socket.AF_INET: 41234, socket.AF_INET6: 41236}

    def resolve(self, host, port):
        if host not in self.names:
            raise socket.gaierror(-2, "Name or service not known")
        return list(self.names[host])

    def is_local(self, addr):
        return addr in self.local

    def probe(self, port, unit, family):
        if not isinstance(port, int) or not 0 < port < 65536:  # as bind and /proc/net/tcp would
            raise TypeError(f"a port is a number, not {port!r}")
        st = self.ports.get((port, family))
        if st is None:
            return {"state": "free", "holders": [], "error": None}
        return st

    def pick(self, family):
        return self.free[family]  # a KeyError for anything but a family, as socket.socket would refuse it


def run_check(i, host="node1", h=None, hostname="node1", ifaces=IFACES):
    h = h or Host({"node1": ["10.0.0.1"], "node2": ["10.0.0.2"]}, local={"10.0.0.1"})
    return rdv.check(
        i,
        host,
        ifaces=ifaces,
        resolver=h.resolve,
        local=h.is_local,
        port_probe=h.probe,
        pick_port=h.pick,
        hostname=hostname,
    )


# --- check: its record, whole, on each path ------------------------------------------------------------------------


def test_check_on_rank0_with_a_free_port_returns_its_whole_record():
    got = run_check(inst(0, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth"}))
    assert got == {
        "instance": "mn",
        "node_rank": 0,
        "nnodes": 2,
        "host": "node1",
        "dist_init_addr": "node1:5757",
        "interfaces": IFACES,
        "gloo_ifname": "eth0",
        "nccl_selected": ["eth0", "eth1"],
        "resolved": ["10.0.0.1"],
        "port": 5757,
        "store_port": 5757,
        "listener": True,
        "port_state": {"state": "free", "holders": [], "error": None},
        "ok": True,
        "problems": [],
    }


def test_check_with_a_malformed_dist_init_addr_stops_there_and_says_so_with_the_rest_of_its_record():
    got = run_check(inst(1, addr="node1"), host="node2", hostname="node2")
    assert got == {
        "instance": "mn",
        "node_rank": 1,
        "nnodes": 2,
        "host": "node2",
        "dist_init_addr": "node1",
        "interfaces": IFACES,
        "gloo_ifname": None,
        "nccl_selected": None,
        "resolved": None,
        "port": None,
        "store_port": None,
        "listener": False,
        "port_state": None,
        "ok": False,
        "problems": [f"{DVAR} 'node1' has no port: write host:port (on node2)"],
    }


def test_check_with_an_unresolvable_dist_init_addr_names_the_resolvers_own_words():
    got = run_check(inst(1, addr="nowhere:5757"), host="node2", hostname="node2")
    assert got == {
        "instance": "mn",
        "node_rank": 1,
        "nnodes": 2,
        "host": "node2",
        "dist_init_addr": "nowhere:5757",
        "interfaces": IFACES,
        "gloo_ifname": None,
        "nccl_selected": None,
        "resolved": None,
        "port": 5757,
        "store_port": None,
        "listener": False,
        "port_state": None,
        "ok": False,
        "problems": [
            f"{DVAR}: nowhere does not resolve on node2 (Name or service not known): name rank 0's node by a name "
            "every node resolves (DNS or /etc/hosts), or by its address"
        ],
    }


def test_an_instance_without_nnodes_is_one_node_and_every_problem_is_kept():
    i = inst(0, {"GLOO_SOCKET_IFNAME": "nosuch0"})
    del i["nnodes"]
    got = run_check(i)
    assert got["nnodes"] == 1 and not got["ok"]
    assert got["problems"][0] == "mn: nnodes is 1; the rendezvous check is for instances over several nodes"
    assert got["problems"][1].startswith(f"{GVAR} names 'nosuch0', an interface node1 does not have")
    assert len(got["problems"]) == 2


def test_gloo_unset_and_this_hosts_name_unresolvable_is_a_problem_of_check():
    h = Host({"node1": ["10.0.0.1"]}, local={"10.0.0.1"})
    got = run_check(inst(0), h=h, hostname="node9")
    assert got["problems"] == [
        "GLOO_SOCKET_IFNAME is not set and this host's name does not resolve on node1: gloo would fall back to the "
        "loopback address, which the other ranks cannot reach; set it to the interface the other ranks reach this "
        "host on (eth0, eth1)"
    ]


def test_check_names_its_own_host_in_the_interface_messages():
    got = run_check(inst(1, {"GLOO_SOCKET_IFNAME": "nosuch0", "NCCL_SOCKET_IFNAME": "bond"}), host="node2")
    gloo, nccl = got["problems"][:2]
    assert gloo.startswith(f"{GVAR} names 'nosuch0', an interface node2 does not have")
    assert nccl.startswith(f"{NVAR}=bond selects no interface with an address on node2 (NCCL fails")


def test_check_without_interfaces_reads_this_hosts_own():
    h = Host({"node1": ["10.0.0.1"]}, local={"10.0.0.1"})
    got = rdv.check(
        inst(0, {"GLOO_SOCKET_IFNAME": "lo"}),
        "node1",
        resolver=h.resolve,
        local=h.is_local,
        port_probe=h.probe,
        pick_port=h.pick,
        hostname="node1",
    )
    assert got["interfaces"] == network.list_interfaces() and "127.0.0.1" in got["interfaces"]["lo"]
    assert got["problems"][0].startswith(f"{GVAR} names 'lo', loopback on node1: the other ranks cannot reach it")


def test_rank0_on_ipv6_asks_about_its_port_on_ipv6_and_picks_an_ipv6_port_when_its_server_holds_it():
    own = {"state": "own", "holders": [{"pid": 7, "unit": "sglang-mn.service", "cmdline": "python"}], "error": None}
    h = Host({"fd00::1": ["fd00::1"], "node1": ["fd00::1"]}, local={"fd00::1"}, ports={(5757, socket.AF_INET6): own})
    got = run_check(inst(0, addr="[fd00::1]:5757"), h=h)
    assert got["ok"] and got["port_state"] == own
    assert (got["port"], got["store_port"], got["listener"]) == (5757, 41236, False)


def test_rank0_asks_about_the_port_dist_init_addr_names():
    taken = {"state": "taken", "holders": [], "error": "Permission denied"}
    h = Host({"node1": ["10.0.0.1"]}, local={"10.0.0.1"}, ports={(5757, socket.AF_INET): taken})
    got = run_check(inst(0), h=h)
    assert got["problems"] == [
        f"{DVAR}: port 5757 is already in use on node1 (rank 0) by a process not visible here (Permission denied): "
        "rank 0's torch.distributed store could not listen there and every rank would hang; choose another port in "
        "dist_init_addr (the same on every rank) or stop that process"
    ]
    assert (got["store_port"], got["listener"]) == (None, False)


def test_rank0s_port_held_by_several_processes_names_each():
    holders = [
        {"pid": 9, "unit": "session-3.scope", "cmdline": "python3 -m http.server 5757"},
        {"pid": 12, "unit": "user@1000.service", "cmdline": "nc -l 5757"},
    ]
    taken = {"state": "taken", "holders": holders, "error": None}
    h = Host({"node1": ["10.0.0.1"]}, local={"10.0.0.1"}, ports={(5757, socket.AF_INET): taken})
    [msg] = run_check(inst(0), h=h)["problems"]
    assert msg.startswith(
        f"{DVAR}: port 5757 is already in use on node1 (rank 0) by pid 9 (session-3.scope: python3 -m http.server "
        "5757); pid 12 (user@1000.service: nc -l 5757): rank 0's"
    )


def test_rank0_not_named_by_dist_init_addr_lists_every_address_it_resolves_to():
    h = Host({"node1": ["10.0.0.1", "10.0.0.11"]})
    [msg] = run_check(inst(0), h=h)["problems"]
    assert msg == (
        f"{DVAR}: node1 resolves on node1 (rank 0) to 10.0.0.1, 10.0.0.11, not an address of this host: "
        "dist_init_addr must name rank 0's node, the one with node_rank 0"
    )


def test_another_rank_resolving_rank0s_name_to_itself_lists_each_of_its_own_addresses():
    h = Host({"node1": ["127.0.1.1", "10.0.0.2", "10.0.0.1"]}, local={"127.0.1.1", "10.0.0.2"})
    got = run_check(inst(1), host="node2", h=h, hostname="node1")
    assert got["problems"] == [
        f"{DVAR}: node1 resolves on node2 (rank 1) to 127.0.1.1, 10.0.0.2, an address of this host, not of rank 0's "
        "node: fix its entry in /etc/hosts or DNS on this host (a hostname mapped to 127.0.1.1 does this)"
    ]


def test_settings_without_an_origin_are_named_bare():
    i = inst(1, {"GLOO_SOCKET_IFNAME": "nosuch0"}, addr="node1")
    i["env_origins"], i["origins"] = {}, {}
    got = run_check(i, host="node2")
    assert got["problems"][0].startswith("GLOO_SOCKET_IFNAME names 'nosuch0', an interface node2 does not have")
    assert got["problems"][1] == "dist_init_addr 'node1' has no port: write host:port (on node2)"


# --- the interface variables' messages -------------------------------------------------------------------------------


def test_gloo_messages_list_every_interface_or_none():
    ifaces = {"eth0": ["10.0.0.2"], "lo": ["127.0.0.1", "::1"], "ib1": []}
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "nosuch0"}), "node2", ifaces, None)
    assert "it has eth0 (10.0.0.2), ib1 (no address), lo (127.0.0.1, ::1)): SGLang would hang at start" in msg
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "nosuch0"}), "node2", {}, None)
    assert "an interface node2 does not have (gloo takes exact names, not prefixes; it has none): SGLang" in msg


def test_gloo_empty_name_and_a_loopback_hostname_are_said_whole():
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "eth0,"}), "node2", IFACES, None)
    assert msg == (
        f"{GVAR} is 'eth0,': an empty interface name on node2; set it to the interface the other ranks reach this "
        "host on (eth0, eth1)"
    )
    [msg] = rdv.check_gloo(inst(), "node2", IFACES, ["127.0.1.1", "::1"])
    assert msg.startswith(
        "GLOO_SOCKET_IFNAME is not set and this host's name resolves on node2 to 127.0.1.1, ::1 (loopback): gloo "
        "would tell the other ranks to connect there"
    )


def test_nccl_selecting_only_loopback_lists_each_interface_it_selects():
    ifaces = {"lo": ["127.0.0.1"], "lo2": ["127.0.0.2"], "eth0": ["10.0.0.2"]}
    problems, chosen = rdv.check_nccl(inst(env={"NCCL_SOCKET_IFNAME": "lo"}), "node2", ifaces)
    assert chosen == ["lo", "lo2"]
    assert problems[0].startswith(f"{NVAR}=lo selects only loopback on node2 (lo, lo2): other nodes cannot reach it; ")


def test_nccl_ifname_items_end_at_their_first_colon():
    assert network.parse_nccl_ifname("eth0:1:2,ib0") == (False, False, ["eth0", "ib0"])


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("[fd00::2]:5757]", "'[fd00::2]:5757]': the port '5757]' is not a number from 1 to 65535"),
        ("fe80::5757", "'fe80::5757': write an IPv6 address in brackets, [address]:port"),
        ("[fd00::2 eth0]:5757", "'[fd00::2 eth0]:5757': 'fd00::2 eth0' in brackets is not an IPv6 address"),
        ("[%eth0]:5757", "'[%eth0]:5757': '%eth0' in brackets is not an IPv6 address"),
    ],
)
def test_dist_init_addr_refusals_word_for_word(value, error):
    with pytest.raises(ValueError) as exc:
        rdv.parse_dist_init_addr(value)
    assert str(exc.value) == error


def test_a_zone_is_left_whole_to_each_nodes_resolver():
    """What follows the address's first '%' (its zone) is an interface of the node that reads it: the parser judges
    the address before it and passes the zone on as written; the resolver judges the zone on each node, and its
    own words name one this node cannot use (here one no interface could have)."""
    assert rdv.parse_dist_init_addr("[fe80::1%%x]:5757") == ("fe80::1%%x", 5757)
    got = run_check(inst(1, addr="[fe80::1%%x]:5757"), host="node2", hostname="node2")
    assert (got["ok"], got["port"], got["resolved"]) == (False, 5757, None)
    assert got["problems"] == [
        f"{DVAR}: fe80::1%%x does not resolve on node2 (Name or service not known): name rank 0's node by a name "
        "every node resolves (DNS or /etc/hosts), or by its address"
    ]


# --- this host's interfaces, addresses and ports ----------------------------------------------------------------------


def test_interfaces_read_from_sys_and_if_inet6(tmp_path):
    net = tmp_path / "net"
    for name in ("lo", "ib9"):  # ib9: not on this host, so it has no IPv4 address
        (net / name).mkdir(parents=True)
    inet6 = tmp_path / "if_inet6"
    inet6.write_text(
        "00000000000000000000000000000001 01 80 10 80       lo\n"
        "fd000000000000000000000000000007 04 40 00 80     eth7\n"  # gone since /sys was read
        "\n"
        "fe800000000000000000000000000001 05 40 20 80      ib9\n"
    )
    assert network.list_interfaces(str(net), str(inet6)) == {"ib9": ["fe80::1"], "lo": ["127.0.0.1", "::1"]}


def test_interfaces_without_sys_are_the_kernels_index(tmp_path):
    got = network.list_interfaces(str(tmp_path / "none"), str(tmp_path / "none6"))
    assert sorted(got) == sorted(name for _, name in socket.if_nameindex())
    assert got["lo"] == ["127.0.0.1"]


@ipv6
def test_this_hosts_interfaces_carry_their_ipv6_addresses():
    if " lo\n" not in Path("/proc/net/if_inet6").read_text():
        pytest.skip("lo has no IPv6 address here")
    assert "::1" in network.list_interfaces()["lo"]


def test_an_address_resolves_to_itself():
    assert network.resolve("192.0.2.7", 5757) == ["192.0.2.7"]


def test_a_name_listed_twice_resolves_to_each_address_once_in_order(monkeypatch):
    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        if host != "node1":
            raise socket.gaierror(-2, "Name or service not known")
        rows = [(socket.AF_INET6, ("fd00::1", port, 0, 0)), (socket.AF_INET, ("10.0.0.1", port))]
        rows.append((socket.AF_INET, ("10.0.0.1", port)))  # /etc/hosts and DNS both name it
        types_ = [type] if type else [socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW]
        return [(fam, t, 6, "", sa) for fam, sa in rows for t in types_]

    monkeypatch.setattr(network.socket, "getaddrinfo", getaddrinfo)
    assert network.resolve("node1", 5757) == ["fd00::1", "10.0.0.1"]


@ipv6
def test_an_ipv6_address_of_this_host_is_local():
    assert network.is_local("::1") and not network.is_local("fd00::dead:beef")


def test_an_address_of_this_host_is_local_whatever_holds_a_low_port():
    with socket.socket() as low:
        try:
            low.bind(("127.0.0.1", 1))  # as root: port 1 taken; as anyone else it cannot be bound at all
        except OSError:
            pass
        assert network.is_local("127.0.0.1")


def test_a_free_port_is_one_the_kernel_hands_out():
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    port = network.free_port()
    assert lo <= port <= hi
    with socket.socket() as s:
        s.bind(("0.0.0.0", port))


@ipv6
def test_an_ipv6_port_is_free_on_ipv6():
    port = network.free_port(socket.AF_INET6)
    assert network.port_state(port, "sglang-mn.service", socket.AF_INET6) == {
        "state": "free",
        "holders": [],
        "error": None,
    }


def test_a_port_bound_but_not_listening_is_taken_with_the_kernels_reason():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
        got = network.port_state(port, "sglang-mn.service")
    assert got == {"state": "taken", "holders": [], "error": "Address already in use"}


def test_port_state_lists_holders_masked_and_cut_and_asks_about_its_own_port():
    long = "python -m sglang.launch_server --api-key sk-abcdef1234567890 " + "--model-path /models/x " * 10
    own = {7: ("sglang-mn.service", long)}
    mixed = {**own, 9: ("session-3.scope", "nc -l 5757")}

    def state(port, held):
        return network.port_state(
            port,
            "sglang-mn.service",
            inodes=lambda p: {"4242"} if p == 5757 else set(),
            holders=lambda found: held if found == {"4242"} else {},
            bind=lambda p, f: None,
        )

    cut = ("python -m sglang.launch_server --api-key <secret> " + "--model-path /models/x " * 10)[:160]
    assert state(5757, own) == {
        "state": "own",
        "holders": [{"pid": 7, "unit": "sglang-mn.service", "cmdline": cut}],
        "error": None,
    }
    assert state(5757, mixed) == {
        "state": "taken",
        "holders": [{"pid": 9, "unit": "session-3.scope", "cmdline": "nc -l 5757"}],
        "error": None,
    }
    assert state(5758, mixed) == {"state": "free", "holders": [], "error": None}


# --- peers: who is there ---------------------------------------------------------------------------------------------


def test_peers_of_an_instance_without_nnodes_are_rank0_alone():
    i = inst(0)
    del i["nnodes"]
    assert rdv.peers_problems(i, "node1", [checked(0, "node1")]) == ([], checked(0, "node1"))


def test_a_result_without_a_rank_is_no_rank_and_its_failure_is_named_by_its_message():
    rankless = {"instance": "mn", "host": "node3", "ok": False, "problems": [], "msg": "timeout_s is 0.0"}
    rankless["dist_init_addr"] = "node1:5757"
    problems, _ = rdv.peers_problems(inst(), "node1", [checked(0, "node1"), rankless])
    assert problems == [
        "mn: rank(s) 1 of 2 are not in this run (or their hosts were unreachable): run the check on every node of "
        "the instance (--limit)",
        "not meeting: rank -1 (node3) failed its check: timeout_s is 0.0",
    ]


def test_two_results_for_one_rank_name_both_hosts_even_one_without_a_name():
    hostless = {k: v for k, v in checked(1, "x").items() if k != "host"}
    problems, _ = rdv.peers_problems(inst(), "node1", [checked(0, "node1"), hostless, checked(1, "node2")])
    assert problems == ["hosts ?, node2 all have node_rank 1 of mn: give each node its own"]


def test_missing_ranks_failed_checks_and_differing_addresses_are_said_whole():
    problems, _ = rdv.peers_problems(inst(nnodes=3), "node1", [checked(0, "node1")])
    assert problems[0].startswith("mn: rank(s) 1, 2 of 3 are not in this run")
    two = checked(1, "node2", ok=False, problems=["GLOO_SOCKET_IFNAME names 'nosuch0'", "NCCL_SOCKET_IFNAME=bond"])
    problems, _ = rdv.peers_problems(inst(), "node1", [checked(0, "node1"), two])
    assert problems == [
        "not meeting: rank 1 (node2) failed its check: GLOO_SOCKET_IFNAME names 'nosuch0'; NCCL_SOCKET_IFNAME=bond"
    ]
    problems, _ = rdv.peers_problems(
        inst(), "node1", [checked(0, "node1"), checked(1, "node2", dist_init_addr="node1:5758")]
    )
    assert problems == [
        f"{DVAR} differs between the ranks (node1: node1:5757, node2: node1:5758): every rank must name the same "
        "rank 0 host:port"
    ]


# --- meet, with fakes for the handshake and the all-reduce ------------------------------------------------------------


RANKS = [checked(0, "node1"), checked(1, "node2")]
OK_ALLREDUCE = {"ok": True, "error": None, "timed_out": False, "sizes": [], "sum_ok": True, "seconds": 0.4}


class Meeting:
    """The other ranks and the all-reduce as meet sees them: serve and hello answer as given; the all-reduce
    answers for the world it is given (a world other than the instance's never meets)."""

    def __init__(self, served=None, hello=None, allreduce=None, names=None):
        self.served, self.hello_answer, self.allreduce_answer = served, hello, allreduce
        self.names = names if names is not None else {"node1": ["10.0.0.1"]}
        self.calls = {}

    def resolve(self, host, port):
        if host not in self.names:
            raise socket.gaierror(-2, "Name or service not known")
        return self.names[host]

    def serve(self, port, family, name, want, timeout_s):
        self.calls["serve"] = (port, family, name, want, timeout_s)
        return self.served or {"joined": dict.fromkeys(want, "x"), "missing": [], "error": None}

    def hello(self, addrs, port, name, rank, host, timeout_s, banner=True):
        self.calls["hello"] = (addrs, port, name, rank, host, timeout_s, banner)
        return self.hello_answer or {"ok": True, "address": addrs[0], "error": None, "attempts": 1}

    def allreduce(self, python, env, rank, world, addr, port, timeout_s):
        self.calls["allreduce"] = (python, env, rank, world, addr, port, timeout_s)
        return self.allreduce_answer or {**OK_ALLREDUCE, "command": [python, "--world", str(world)]}

    def meet(self, i, host, ranks=RANKS, **kw):
        return rdv.meet(
            i, host, ranks, resolver=self.resolve, serve=self.serve, hello=self.hello, allreduce=self.allreduce, **kw
        )


def test_meet_on_rank0_returns_its_whole_record():
    m = Meeting()
    got = m.meet(inst(0), "node1", timeout_s=20)
    assert got == {
        "instance": "mn",
        "node_rank": 0,
        "nnodes": 2,
        "host": "node1",
        "handshake": {"joined": {1: "x"}, "missing": [], "error": None},
        "allreduce": {**OK_ALLREDUCE, "command": ["/opt/ml-env/bin/python", "--world", "2"]},
        "store_port": 5757,
        "ok": True,
        "problems": [],
    }


def test_meet_on_another_rank_returns_its_whole_record_and_passes_the_instance_environment():
    m = Meeting()
    got = m.meet(inst(1, {"GLOO_SOCKET_IFNAME": "eth0"}), "node2", timeout_s=20)
    assert got == {
        "instance": "mn",
        "node_rank": 1,
        "nnodes": 2,
        "host": "node2",
        "handshake": {"ok": True, "address": "10.0.0.1", "error": None, "attempts": 1},
        "allreduce": {**OK_ALLREDUCE, "command": ["/opt/ml-env/bin/python", "--world", "2"]},
        "store_port": 5757,
        "ok": True,
        "problems": [],
    }
    assert m.calls["allreduce"][1] == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_meet_without_a_python_runs_python3_from_path():
    i = inst(1)
    del i["python"]
    m = Meeting()
    assert m.meet(i, "node2")["allreduce"]["command"][0] == "python3"


def test_meet_refused_before_anyone_waits_returns_its_whole_record():
    m = Meeting()
    got = m.meet(inst(0), "node1", ranks=[checked(0, "node1"), checked(1, "node2", ok=False)])
    assert got == {
        "instance": "mn",
        "node_rank": 0,
        "nnodes": 2,
        "host": "node1",
        "handshake": None,
        "allreduce": None,
        "store_port": None,
        "ok": False,
        "problems": [
            "not meeting: rank 1 (node2) failed its check: GLOO_SOCKET_IFNAME names 'nosuch0', an interface node2 "
            "does not have"
        ],
    }
    assert m.calls == {}


def test_meet_names_the_other_ranks_failed_checks_not_its_own():
    """Its own failure is its check task's (Ansible failed that host already); the others' are why it won't wait."""
    ranks = [checked(0, "node1", ok=False, problems=["own"]), checked(1, "node2", ok=False, problems=["theirs"])]
    got = Meeting().meet(inst(0), "node1", ranks=ranks)
    assert got["problems"] == ["not meeting: rank 1 (node2) failed its check: theirs"]


def test_meet_of_an_instance_without_nnodes_is_a_world_of_one():
    i = inst(0)
    del i["nnodes"]
    m = Meeting()
    got = m.meet(i, "node1", ranks=[checked(0, "node1")])
    assert got["ok"] and got["nnodes"] == 1
    assert m.calls["serve"][3] == set() and m.calls["allreduce"][3] == 1


def test_meet_waits_30_s_unless_told_and_says_so():
    m = Meeting(served={"joined": {}, "missing": [1], "error": None})
    got = m.meet(inst(0), "node1")
    assert m.calls["serve"][4] == 30.0
    assert "never connected to node1:5757 on node1 (rank 0) within 30 s:" in got["problems"][0]


def test_meet_rank0_that_cannot_listen_or_is_left_waiting_says_so_whole():
    m = Meeting(served={"joined": {}, "missing": [1, 2], "error": "cannot listen on port 5757: Address in use"})
    got = m.meet(inst(0, nnodes=3), "node1", ranks=[*RANKS, checked(2, "node3")], timeout_s=20)
    assert got["problems"] == [
        f"{DVAR}: rank 0 on node1 cannot listen on port 5757: Address in use: choose another port in dist_init_addr "
        "or free it"
    ]
    assert got["handshake"] == m.served and got["allreduce"] is None
    m = Meeting(served={"joined": {}, "missing": [1, 2], "error": None})
    got = m.meet(inst(0, nnodes=3), "node1", ranks=[*RANKS, checked(2, "node3")], timeout_s=20)
    assert got["problems"] == [
        f"{DVAR}: rank(s) 1, 2 never connected to node1:5757 on node1 (rank 0) within 20 s: on those nodes node1 "
        "must resolve to this host and port 5757 must not be blocked on the way (their own messages say what they "
        "saw)"
    ]


@pytest.mark.parametrize(
    ("names", "why"),
    [
        ({"node1": []}, "no address"),
        ({}, "Name or service not known"),
    ],
)
def test_meet_on_another_rank_that_cannot_resolve_rank0_says_why(names, why):
    m = Meeting(names=names)
    got = m.meet(inst(1), "node2")
    assert got["problems"] == [f"{DVAR}: node1 does not resolve on node2 (rank 1): {why}"]
    assert got["handshake"] is None and got["allreduce"] is None and not got["ok"]


def test_meet_resolver_failing_without_a_reason_code_is_quoted():
    def resolver(host, port):
        raise OSError("the resolver is down")

    got = rdv.meet(inst(1), "node2", RANKS, resolver=resolver, hello=None, allreduce=None)
    assert got["problems"] == [f"{DVAR}: node1 does not resolve on node2 (rank 1): the resolver is down"]


def test_meet_unreachable_rank0_lists_every_address_tried():
    m = Meeting(
        names={"node1": ["10.0.0.1", "fd00::1"]},
        hello={"ok": False, "address": None, "error": "timed out", "attempts": 9},
    )
    got = m.meet(inst(1), "node2", timeout_s=20)
    assert got["problems"][0].startswith(
        f"{DVAR}: node1:5757 (10.0.0.1, fd00::1) is not reachable from node2 (rank 1) within 20 s: timed out."
    )
    assert got["handshake"] == m.hello_answer


@ipv6
def test_rank0_whose_address_is_ipv6_listens_on_ipv6_and_the_other_rank_reaches_it():
    port = network.free_port(socket.AF_INET6)
    ranks = [checked(0, "node1", resolved=["::1"], store_port=port), checked(1, "node2")]
    i = inst(0, addr=f"node1:{port}")
    with Client(["::1"], port, "mn", 1, "node2", 3) as rank1:
        got = rdv.meet(i, "node1", ranks, timeout_s=3, resolver=Meeting().resolve, allreduce=Meeting().allreduce)
    assert got["handshake"] == {"joined": {1: "node2"}, "missing": [], "error": None}, got["problems"]
    assert rank1.result["ok"] and got["ok"]


# --- rank 1's hello on a fake network (a clock that moves only as it waits) ------------------------------------------


BANNER = b"SGLANG-RDV 1 mn\n"


class Conn:
    """A connected socket: the peer's bytes in the pieces TCP delivers them, then silence (a read waits out its
    time limit; without one, it would block forever) or, with `eof`, the peer's close."""

    def __init__(self, net, timeout, pieces, answer=None, eof=False):
        self.net, self.timeout, self.pending, self.answer, self.eof = net, timeout, list(pieces), answer, eof
        self.sent = b""

    def settimeout(self, t):
        self.timeout = t

    def recv(self, n):
        if self.pending:
            piece = self.pending.pop(0)
            if len(piece) > n:
                self.pending.insert(0, piece[n:])
                piece = piece[:n]
            return piece
        if self.eof:
            return b""
        if self.timeout is None:
            raise AssertionError("a read without a time limit on a silent peer blocks forever")
        self.net.now += self.timeout
        raise TimeoutError("timed out")

    def sendall(self, data):
        self.sent += data
        if self.answer is not None and data.endswith(b"\n"):
            self.pending += self.answer
            self.answer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.net.closed += 1


class Net:
    """Peers by address: 'refused', 'dropped' (the SYN dropped: a connect waits out its limit; without one, the
    kernel's retries, 127 s), 'reset' (reset without a word), or a function of the time giving a Conn's arguments
    (or 'refused' before it listens)."""

    SYN_RETRIES_S = 127.0

    def __init__(self, peers):
        self.peers, self.now, self.conns, self.closed = peers, 0.0, [], 0

    def clock(self):
        return self.now

    def sleep(self, s):
        self.now += s

    def connect(self, address, timeout=None):
        peer = self.peers[address[0]]
        peer = peer(self.now) if callable(peer) else peer
        if peer == "refused":
            raise ConnectionRefusedError(111, "Connection refused")
        if peer == "reset":
            raise ConnectionResetError()
        if peer == "dropped":
            self.now += self.SYN_RETRIES_S if timeout is None else timeout
            raise TimeoutError("timed out")
        conn = Conn(self, timeout, **peer)
        self.conns.append(conn)
        return conn

    def hello(self, addrs, timeout_s, banner=True):
        return meeting.say_hello(
            addrs,
            5757,
            "mn",
            1,
            "node2",
            timeout_s,
            banner=banner,
            connect=self.connect,
            clock=self.clock,
            sleep=self.sleep,
        )


RANK0 = {"pieces": [BANNER], "answer": [b"OK\n"]}
SILENT = {"pieces": []}


def test_a_dropping_rank0_costs_each_attempt_at_most_3_s_and_the_wait_ends_near_its_deadline():
    net = Net({"10.0.0.1": "dropped"})
    got = net.hello(["10.0.0.1"], 10)
    assert got == {"ok": False, "address": None, "error": "timed out", "attempts": 4}
    assert net.now == 10.25  # 3 + 0.25 + 3 + 0.25 + 3 + 0.25, then the last 0.5 s


@pytest.mark.parametrize(("timeout_s", "attempts", "ends"), [(10, 2, 10.0), (5.6, 2, 6.25)])
def test_a_silent_listener_costs_each_attempt_1_to_5_s_and_the_wait_ends_by_its_deadline(timeout_s, attempts, ends):
    net = Net({"10.0.0.1": SILENT})
    got = net.hello(["10.0.0.1"], timeout_s)
    assert got == {
        "ok": False,
        "address": None,
        "error": "a process answers there without a word: not rank 0's check",
        "attempts": attempts,
    }
    assert net.now == ends


def test_rank1_reaches_rank0_within_a_quarter_second_of_it_listening():
    net = Net({"10.0.0.1": lambda now: RANK0 if now >= 1.0 else "refused"})
    got = net.hello(["10.0.0.1"], 10)
    assert got == {"ok": True, "address": "10.0.0.1", "error": None, "attempts": 5}
    assert net.now == 1.0 and net.conns[0].sent == b"HELLO mn 1 node2\n"


@pytest.mark.parametrize(
    "first",
    [
        SILENT,
        {"pieces": [b"SSH-2.0-OpenSSH_9.2\n"]},
        {"pieces": [b"SGLANG-RDV 1 other\n"], "answer": [b"OK\n"]},
    ],
)
def test_rank1_tries_every_address_of_rank0_in_one_round(first):
    net = Net({"10.0.0.9": first, "10.0.0.1": RANK0})
    got = net.hello(["10.0.0.9", "10.0.0.1"], 30)
    assert got == {"ok": True, "address": "10.0.0.1", "error": None, "attempts": 2}


def test_rank0s_banner_and_answer_are_read_whatever_pieces_they_come_in():
    net = Net({"10.0.0.1": {"pieces": [b"SGLANG-RD", b"V 1 m", b"n\n"], "answer": [b"O", b"K\n"]}})
    assert net.hello(["10.0.0.1"], 10) == {"ok": True, "address": "10.0.0.1", "error": None, "attempts": 1}


def test_a_foreign_listener_is_quoted_cut_at_60_characters_and_undecodable_bytes_replaced():
    greeting = b"220 mail.example.internal ESMTP Postfix (Debian/GNU) ready, at your service\r\n"
    net = Net({"10.0.0.1": {"pieces": [greeting]}})
    got = net.hello(["10.0.0.1"], 0.1)
    assert got["error"] == (
        "something else answers there (it said '220 mail.example.internal ESMTP Postfix (Debian/GNU) ready, ', "
        "not rank 0's check)"
    )
    net = Net({"10.0.0.1": {"pieces": [b"\xff\xfe hello\n"]}})
    got = net.hello(["10.0.0.1"], 0.1)
    assert got["error"] == "something else answers there (it said '\ufffd\ufffd hello', not rank 0's check)"


def test_rank0s_check_refusing_this_rank_is_said():
    net = Net({"10.0.0.1": {"pieces": [BANNER], "answer": [b"NO\n"]}})
    got = net.hello(["10.0.0.1"], 1)
    assert got == {"ok": False, "address": None, "error": "rank 0's check refused this rank", "attempts": 5}


def test_a_reset_without_a_word_is_named_by_its_kind():
    got = Net({"10.0.0.1": "reset"}).hello(["10.0.0.1"], 0.1)
    assert got == {"ok": False, "address": None, "error": "ConnectionResetError", "attempts": 2}


def test_without_a_banner_a_connect_is_the_whole_proof():
    net = Net({"10.0.0.1": SILENT})
    got = net.hello(["10.0.0.1"], 10, banner=False)
    assert got == {"ok": True, "address": "10.0.0.1", "error": None, "attempts": 1}
    assert net.conns[0].sent == b"" and net.closed == 1 and net.now == 0.0


# --- rank 0's listener, for real on loopback -----------------------------------------------------------------------


class Client:
    """Rank 1's say_hello in a thread, stopped (its clock run out) when the block ends."""

    def __init__(self, addrs, port, instance, rank, host, timeout_s):
        self.args, self.timeout_s, self.done, self.result = (addrs, port, instance, rank, host), timeout_s, None, None
        self.stop = threading.Event()

    def clock(self):
        return float("inf") if self.stop.is_set() else time.monotonic()

    def run(self):
        self.result = meeting.say_hello(*self.args, self.timeout_s, clock=self.clock)

    def __enter__(self):
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()  # a rank that joined is done; one still knocking gives up at its next round
        self.thread.join(self.timeout_s + 5)


class Serving:
    """serve_hello in a thread."""

    def __init__(self, port, family=socket.AF_INET, want=frozenset({1}), timeout_s=10, clock=time.monotonic):
        self.args, self.result = (port, family, "mn", set(want), timeout_s), None
        self.clock = clock
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        self.result = meeting.serve_hello(*self.args, clock=self.clock)


def connect_when_listening(port, family=socket.AF_INET, host="127.0.0.1"):
    deadline = time.monotonic() + 5
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            threading.Event().wait(0.02)


def read_all(conn) -> bytes:
    data = b""
    while chunk := conn.recv(100):
        data += chunk
    return data


@ipv6
def test_rank0_on_ipv6_listens_on_ipv6_and_stops_as_soon_as_every_rank_said_hello():
    port = network.free_port(socket.AF_INET6)
    start = time.monotonic()
    with Client(["::1"], port, "mn", 1, "node2", 10) as rank1:
        got = meeting.serve_hello(port, socket.AF_INET6, "mn", {1}, 10)
    assert got == {"joined": {1: "node2"}, "missing": [], "error": None}
    assert rank1.result["ok"] and time.monotonic() - start < 5


def test_rank0_answers_strangers_no_and_goes_on_waiting_for_its_ranks():
    port = network.free_port()
    serving = Serving(port)
    with connect_when_listening(port) as other:  # another instance's rank 1, sharing dist_init_addr
        other.sendall(b"HELLO other 1 node3\n")
        assert read_all(other) == BANNER + b"NO\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as web:
        web.sendall(b"GET / HTTP/1.1\n")
        assert read_all(web) == BANNER + b"NO\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as badrank:
        badrank.sendall(b"HELLO mn one node2\n")
        assert read_all(badrank) == BANNER + b"NO\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as mute:  # done sending before a word
        mute.shutdown(socket.SHUT_WR)
        assert read_all(mute) == BANNER + b"NO\n"
    reset = socket.create_connection(("127.0.0.1", port), timeout=5)
    reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    reset.close()  # a reset, not a close
    got = meeting.say_hello(["127.0.0.1"], port, "mn", 1, "node2", 5)
    serving.thread.join(10)
    assert got["ok"] and serving.result == {"joined": {1: "node2"}, "missing": [], "error": None}


def test_rank0_gives_up_on_a_silent_peer_after_3_s_and_serves_the_next():
    port = network.free_port()
    serving = Serving(port)
    silent = connect_when_listening(port)
    try:
        with Client(["127.0.0.1"], port, "mn", 1, "node2", 10) as rank1:
            serving.thread.join(6)
            assert not serving.thread.is_alive(), "rank 0 still waits on a peer that never speaks"
    finally:
        silent.close()
    assert serving.result == {"joined": {1: "node2"}, "missing": [], "error": None} and rank1.result["ok"]


def test_rank0_goes_on_after_a_connection_aborted_before_it_was_accepted(monkeypatch):
    class Aborting(socket.socket):
        aborted = 0

        def accept(self):
            if Aborting.aborted == 0:
                Aborting.aborted += 1
                raise ConnectionAbortedError(103, "Software caused connection abort")
            return super().accept()

    proxy = types.SimpleNamespace(**{k: getattr(socket, k) for k in dir(socket) if not k.startswith("__")})
    proxy.socket = Aborting
    monkeypatch.setattr(meeting, "socket", proxy)
    port = network.free_port()
    with Client(["127.0.0.1"], port, "mn", 1, "node2", 5) as rank1:
        got = meeting.serve_hello(port, socket.AF_INET, "mn", {1}, 5)
    assert Aborting.aborted == 1 and got == {"joined": {1: "node2"}, "missing": [], "error": None}
    assert rank1.result["ok"]


def test_rank0_that_cannot_listen_says_the_kernels_reason_and_misses_everyone():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        got = meeting.serve_hello(port, socket.AF_INET, "mn", {1, 2}, 1)
    assert got == {"joined": {}, "missing": [1, 2], "error": f"cannot listen on port {port}: Address already in use"}


def test_rank0_stops_within_its_poll_of_the_deadline_when_nobody_comes():
    start = time.monotonic()
    got = meeting.serve_hello(network.free_port(), socket.AF_INET, "mn", {1}, 0.05)
    assert got == {"joined": {}, "missing": [1], "error": None}
    assert time.monotonic() - start < 0.8


def test_rank0_at_its_deadline_stops_even_with_a_rank_knocking():
    times = iter([100.0])

    def clock():
        return next(times, 110.0)  # the deadline (100 + 10), and there it stays

    port = network.free_port()
    with Client(["127.0.0.1"], port, "mn", 1, "node2", 3):
        got = meeting.serve_hello(port, socket.AF_INET, "mn", {1}, 10, clock=clock)
    assert got == {"joined": {}, "missing": [1], "error": None}


# --- one rank of the all-reduce: the real worker, a torch that reports --------------------------------------------------

# The worker imports torch only in its rank's function, after parsing its arguments with its own parser: this torch
# (first on PYTHONPATH, from the instance's environment) writes down what it was asked and where, then reports as a
# rank does (its result file) and exits, or crashes as a rank can (a message on stderr, an exit code, no result).
FAKE_TORCH = """\
import json, os, sys
import __main__ as worker
args = worker.parse_args(sys.argv[1:])
seen = {"args": {k: v for k, v in vars(args).items() if k != "passthrough"}, "cwd": os.getcwd(),
        "worker": os.path.abspath(worker.__file__), "env": dict(os.environ)}
with open(os.environ["FAKE_TORCH_SEEN"], "w") as f:
    json.dump(seen, f)
if os.environ.get("FAKE_TORCH") == "crash":
    sys.stderr.write("Fatal Python error: Segmentation fault\\n")
    sys.stderr.flush()
    os._exit(139)
rows = [{"bytes": b, "iters": args.max_iters, "seconds": 0.004} for b in worker.sizes(args.min_bytes, args.max_bytes)]
with open(args.result, "w") as f:
    json.dump({"rank": args.rank, "results": rows, "sum_ok": True}, f)
os._exit(0)
"""


@pytest.fixture
def torch_env(tmp_path, monkeypatch):
    (tmp_path / "fake" / "torch").mkdir(parents=True)
    (tmp_path / "fake" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", "/home/operator")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("SGD_NOT_FOR_THE_WORKER", "a secret of the controller")
    return {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_TORCH_SEEN": str(tmp_path / "seen.json")}


KEYS = {"ok", "error", "timed_out", "sizes", "sum_ok", "seconds", "command"}


def test_the_rank_runs_the_worker_in_a_private_directory_with_only_its_environment(torch_env, tmp_path, monkeypatch):
    now = [500.0]
    monkeypatch.setattr(meeting, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    def run(*args, **kw):
        now[0] += 1.23456  # the worker's time, as the clock says
        return subprocess.run(*args, **kw)

    env = {**torch_env, "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_TIMEOUT": 22}
    got = meeting.run_allreduce(sys.executable, env, 1, 2, "node1", 5757, 30, run=run)
    seen = json.loads(Path(torch_env["FAKE_TORCH_SEEN"]).read_text())
    assert set(got) == KEYS and got["ok"] and got["error"] is None and got["sum_ok"] is True
    assert got["timed_out"] is False and got["seconds"] == 1.23
    assert [r["bytes"] for r in got["sizes"]] == [1 << 20] and got["sizes"][0]["iters"] == 10
    assert got["command"][:2] == [sys.executable, seen["worker"]]
    assert seen["env"] == {
        "PATH": os.environ["PATH"],
        "HOME": "/home/operator",
        "LANG": "C.UTF-8",
        **torch_env,
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_IB_TIMEOUT": "22",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "5757",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
    }
    assert seen["args"] == {
        "backend": "gloo",
        "nprocs": 0,
        "min_bytes": 1 << 20,
        "max_bytes": 1 << 20,
        "dtype": "float32",
        "warmup": 1,
        "min_iters": 2,
        "max_iters": 10,
        "per_size_s": 0.05,
        "budget_s": 30.0,
        "grace_s": 5.0,
        "keep_log": 0,
        "rank": 1,
        "world": 2,
        "result": seen["args"]["result"],
    }
    work = Path(seen["cwd"])
    assert work.name.startswith("sglang-rdv-") and str(work.parent) == tempfile.gettempdir()
    assert Path(seen["worker"]).parent == work and Path(seen["args"]["result"]).parent == work
    assert not work.exists() and list(Path.cwd().iterdir()) == []


def test_a_rank_whose_worker_dies_reports_its_exit_and_last_words(torch_env):
    got = meeting.run_allreduce(sys.executable, {**torch_env, "FAKE_TORCH": "crash"}, 0, 2, "node1", 5757, 30)
    assert set(got) == KEYS and not got["ok"] and not got["timed_out"]
    assert got["error"] == "exit 139: Fatal Python error: Segmentation fault"
    assert got["sizes"] == [] and got["sum_ok"] is None
