"""plugins/module_utils/sglang_deploy/rendezvous (the multi-node rendezvous check) and plugins/modules/sglang_rendezvous.

NCCL_SOCKET_IFNAME's patterns as NCCL reads them (src/misc/socket.cc: findInterfaces, parseStringList,
matchIfList), dist_init_addr's forms, every message naming its variable and host, the check on rank 0
and the others with fakes for the host, and the meeting protocol: its handshake for real on 127.0.0.1
(two threads, as two hosts' module calls), the rest with fakes. No torch or lab needed; the all-reduce
runs for real when SGD_TORCH_PYTHON names a python with torch (and in tests/e2e/test_rendezvous.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import meeting, network
from ansible_collections.sglang.deploy.plugins.module_utils.sglang_deploy import rendezvous as rdv
from support.rendezvous import checked

REPO = Path(__file__).resolve().parents[1]

IFACES = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.2", "fe80::1"],
    "eth1": ["10.1.0.2"],
    "ib0": ["192.168.7.2"],
    "ib1": [],  # down: no address
    "docker0": ["172.17.0.1"],
    "enp1s0f0": ["fd00::2"],
}


# --- NCCL_SOCKET_IFNAME ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("eth", (False, False, ["eth"])),
        ("eth0,ib", (False, False, ["eth0", "ib"])),
        ("=eth0", (False, True, ["eth0"])),
        ("^docker,lo", (True, False, ["docker", "lo"])),
        ("^=docker0", (True, True, ["docker0"])),
        ("eth0:1,ib0:2", (False, False, ["eth0", "ib0"])),  # a :port suffix (NCCL_IB_HCA's form) is dropped
        ("eth,,ib", (False, False, ["eth", "ib"])),
        ("^", (True, False, [])),
        ("=^eth", (False, True, ["^eth"])),  # ^ only counts first
        ("eth,^ib", (False, False, ["eth", "^ib"])),  # ...elsewhere it is part of a name
    ],
)
def test_nccl_ifname_is_parsed_as_nccl_parses_it(value, parsed):
    assert network.parse_nccl_ifname(value) == parsed


@pytest.mark.parametrize(
    ("value", "selected"),
    [
        ("eth", ["eth0", "eth1"]),  # prefixes
        ("eth0", ["eth0"]),
        ("e", ["enp1s0f0", "eth0", "eth1"]),  # (nccl_selects alone; check() refuses a 1-character value)
        ("=eth", []),  # exact: no interface is called eth
        ("=eth0,eth1", ["eth0", "eth1"]),  # = applies to every item
        ("=eth0,ib", ["eth0"]),  # ...so ib is an exact name too, and there is no "ib"
        ("ib", ["ib0"]),  # ib1 has no address: NCCL skips it
        ("=ib1", []),
        ("^docker,lo", ["enp1s0f0", "eth0", "eth1", "ib0"]),  # NCCL's own default after ib
        ("^=docker0", ["enp1s0f0", "eth0", "eth1", "ib0", "lo"]),
        ("^eth,ib,lo,docker,enp", []),
        ("^", []),  # an empty list matches everything, excluded
        ("lo", ["lo"]),
        ("eth0:3", ["eth0"]),
        ("bond", []),
        ("Eth", []),  # case matters
        ("eth,^ib", ["eth0", "eth1"]),
    ],
)
def test_nccl_selects_interfaces_by_nccls_rules(value, selected):
    assert network.nccl_selects(value, IFACES) == selected


def test_nccl_socket_family_restricts_the_addresses():
    assert network.nccl_selects("e", IFACES, "AF_INET6") == ["enp1s0f0", "eth0"]
    assert network.nccl_selects("e", IFACES, "AF_INET") == ["eth0", "eth1"]
    assert network.nccl_selects("lo", {"lo": ["::1"]}) == []  # IPv6 loopback never counts


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


def test_nccl_messages_name_the_variable_the_host_and_the_syntax():
    problems, chosen = rdv.check_nccl(inst(env={"NCCL_SOCKET_IFNAME": "bond"}), "node2", IFACES)
    assert chosen == [] and len(problems) == 1
    msg = problems[0]
    assert msg.startswith(
        "NCCL_SOCKET_IFNAME (set by sglang_instances[0].env.NCCL_SOCKET_IFNAME)=bond selects no interface with an "
        "address on node2 (NCCL fails: no socket interface found)"
    )
    assert "=name for exact names" in msg and "a leading ^ to exclude" in msg and "eth0 (10.0.0.2, fe80::1)" in msg
    assert "ib1 (no address)" in msg
    problems, _ = rdv.check_nccl(inst(env={"NCCL_SOCKET_IFNAME": "e"}), "node2", IFACES)
    assert "NCCL ignores a value shorter than 2 characters" in problems[0]
    problems, chosen = rdv.check_nccl(inst(env={"NCCL_SOCKET_IFNAME": "lo"}), "node2", IFACES)
    assert chosen == ["lo"] and "selects only loopback on node2" in problems[0]
    problems, chosen = rdv.check_nccl(inst(env={"NCCL_SOCKET_IFNAME": "^lo,docker"}), "node2", IFACES)
    assert problems == [] and chosen == ["enp1s0f0", "eth0", "eth1", "ib0"]
    assert rdv.check_nccl(inst(), "node2", IFACES) == ([], None)
    fam = inst(env={"NCCL_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_FAMILY": "AF_INET6"})
    assert "with an AF_INET6 address (NCCL_SOCKET_FAMILY)" in rdv.check_nccl(fam, "node2", IFACES)[0][0]


# --- GLOO_SOCKET_IFNAME ---------------------------------------------------------------------------------------------


def test_gloo_ifname_must_name_an_existing_interface_with_an_address():
    assert rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "eth0"}), "node2", IFACES, ["10.0.0.2"]) == []
    assert rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "eth0,ib0"}), "node2", IFACES, None) == []  # torch splits
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "nosuch0"}), "node2", IFACES, ["10.0.0.2"])
    assert msg.startswith(
        "GLOO_SOCKET_IFNAME (set by sglang_instances[0].env.GLOO_SOCKET_IFNAME) names 'nosuch0', an interface node2 "
        "does not have (gloo takes exact names, not prefixes;"
    )
    assert "SGLang would hang at start" in msg and "(enp1s0f0, eth0, eth1, ib0, docker0)" not in msg
    assert msg.endswith(
        "set it to the interface the other ranks reach this host on (docker0, enp1s0f0, eth0, eth1, ib0)"
    )
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "eth"}), "node2", IFACES, None)
    assert "names 'eth', an interface node2 does not have" in msg  # no prefixes for gloo
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "ib1"}), "node2", IFACES, None)
    assert "names 'ib1', which has no address on node2" in msg
    [msg] = rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "lo"}), "node2", IFACES, None)
    assert "names 'lo', loopback on node2" in msg
    assert len(rdv.check_gloo(inst(env={"GLOO_SOCKET_IFNAME": "eth0,nosuch0,"}), "node2", IFACES, None)) == 2


def test_gloo_unset_falls_back_to_the_hostnames_address_which_must_not_be_loopback():
    assert rdv.check_gloo(inst(), "node2", IFACES, ["10.0.0.2"]) == []
    [msg] = rdv.check_gloo(inst(), "node2", IFACES, ["127.0.1.1"])
    assert msg.startswith(
        "GLOO_SOCKET_IFNAME is not set and this host's name resolves on node2 to 127.0.1.1 (loopback)"
    )
    [msg] = rdv.check_gloo(inst(), "node2", IFACES, None)
    assert "does not resolve on node2: gloo would fall back to the loopback address" in msg


# --- dist_init_addr -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("node1:5757", ("node1", 5757)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("[fd00::2]:65535", ("fd00::2", 65535)),
        ("[fe80::1%eth0]:5000", ("fe80::1%eth0", 5000)),
        (" gpu-node-03.example.internal:5757 ", ("gpu-node-03.example.internal", 5757)),
    ],
)
def test_dist_init_addr_forms(value, parsed):
    assert rdv.parse_dist_init_addr(value) == parsed


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (None, "is not set"),
        ("", "is not set"),
        ("node1", "has no port: write host:port"),
        (":5757", "has no host"),
        ("node1:0", "not a number from 1 to 65535"),
        ("node1:65536", "not a number from 1 to 65535"),
        ("node1:http", "not a number from 1 to 65535"),
        ("fd00::2:5757", "write an IPv6 address in brackets"),
        ("[fd00::2]5757", "an IPv6 address is written [address]:port"),
        ("[fd00::2", "an IPv6 address is written [address]:port"),
        ("[node1]:5757", "in brackets is not an IPv6 address"),
    ],
)
def test_dist_init_addr_refusals_say_what_is_wrong(value, error):
    with pytest.raises(ValueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        rdv.parse_dist_init_addr(value)


# --- the check on one rank, with fakes --------------------------------------------------------------------------------


def resolver(table):
    def resolve(host, port):
        if host not in table:
            raise socket.gaierror(-2, "Name or service not known")
        return table[host]

    return resolve


HOSTS = {"node1": ["10.0.0.1"], "node2": ["10.0.0.2"]}


def run_check(rank, env=None, addr="node1:5757", state="free", hosts=HOSTS, local=("10.0.0.1",), hostname="node1"):
    def probe(port, unit, family):
        assert unit == "sglang-mn.service" and family == socket.AF_INET
        holders = {
            "own": [{"pid": 7, "unit": "sglang-mn.service", "cmdline": "python -m sglang.launch_server"}],
            "taken": [{"pid": 9, "unit": "session-3.scope", "cmdline": "python3 -m http.server 5757"}],
        }
        return {"state": state, "holders": holders.get(state, []), "error": None}

    return rdv.check(
        inst(rank, env, addr),
        hostname,
        ifaces=IFACES,
        resolver=resolver(hosts),
        local=lambda a: a in local,
        port_probe=probe,
        pick_port=lambda family: 41234,
        hostname=hostname,
    )


def test_rank0_with_a_free_port_listens_on_it_and_the_all_reduce_meets_there():
    got = run_check(0, {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth"})
    assert got["ok"] and got["problems"] == []
    assert (got["port"], got["store_port"], got["listener"]) == (5757, 5757, True)
    assert got["resolved"] == ["10.0.0.1"] and got["nccl_selected"] == ["eth0", "eth1"]
    assert got["port_state"]["state"] == "free" and got["gloo_ifname"] == "eth0"


def test_rank0_port_held_by_its_own_running_server_is_fine_and_the_all_reduce_goes_elsewhere():
    got = run_check(0, state="own")
    assert got["ok"] and (got["store_port"], got["listener"]) == (41234, False)


def test_rank0_port_taken_by_another_process_fails_naming_dist_init_addr_the_host_and_the_holder():
    got = run_check(0, state="taken")
    assert not got["ok"]
    [msg] = got["problems"]
    assert msg.startswith(
        "dist_init_addr (set by sglang_instances[0].dist_init_addr): port 5757 is already in use on node1 (rank 0) by "
        "pid 9 (session-3.scope: python3 -m http.server 5757)"
    )
    assert "choose another port in dist_init_addr (the same on every rank) or stop that process" in msg


def test_rank0_must_be_the_host_dist_init_addr_names():
    got = run_check(0, local=())
    assert (
        not got["ok"]
        and "node1 resolves on node1 (rank 0) to 10.0.0.1, not an address of this host" in got["problems"][0]
    )


def test_other_rank_resolving_rank0s_name_to_itself_is_refused():
    got = run_check(1, hosts={**HOSTS, "node1": ["127.0.1.1"]}, local=("127.0.1.1", "10.0.0.2"), hostname="node2")
    assert not got["ok"]
    assert (
        "node1 resolves on node2 (rank 1) to 127.0.1.1, an address of this host, not of rank 0's node"
        in got["problems"][0]
    )
    assert got["port_state"] is None and got["store_port"] is None


def test_unresolvable_and_malformed_dist_init_addr_name_the_setting():
    got = run_check(1, addr="nowhere:5757", hostname="node2", local=("10.0.0.2",))
    assert got["problems"][0].startswith(
        "dist_init_addr (set by sglang_instances[0].dist_init_addr): nowhere does not resolve on node2"
    )
    got = run_check(1, addr="node1", hostname="node2", local=("10.0.0.2",))
    assert got["problems"] == [
        "dist_init_addr (set by sglang_instances[0].dist_init_addr) 'node1' has no port: write host:port (on node2)"
    ]


def test_every_problem_of_a_rank_is_reported_not_only_the_first():
    got = run_check(0, {"GLOO_SOCKET_IFNAME": "nosuch0", "NCCL_SOCKET_IFNAME": "bond"}, state="taken")
    assert [p.split(" ", 1)[0] for p in got["problems"]] == [
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "dist_init_addr",
    ]


def test_port_state_tells_the_units_own_listener_from_anothers():
    def holders(pids):
        return lambda inodes: pids

    own = {7: ("sglang-mn.service", "python launch"), 8: ("sglang-mn.service", "python rank1")}
    got = network.port_state(5757, "sglang-mn.service", inodes=lambda p: {"123"}, holders=holders(own))
    assert got["state"] == "own" and [h["pid"] for h in got["holders"]] == [7, 8]
    mixed = {**own, 9: ("session-3.scope", "nc -l 5757")}
    got = network.port_state(5757, "sglang-mn.service", inodes=lambda p: {"123"}, holders=holders(mixed))
    assert got["state"] == "taken" and [h["pid"] for h in got["holders"]] == [9]
    got = network.port_state(5757, "sglang-mn.service", inodes=lambda p: {"123"}, holders=holders({}))
    assert got["state"] == "taken" and got["holders"] == []  # a listener whose holder is not visible
    got = network.port_state(5757, "u", inodes=lambda p: set(), bind=lambda p, f: None)
    assert got == {"state": "free", "holders": [], "error": None}
    got = network.port_state(5757, "u", inodes=lambda p: set(), bind=lambda p, f: "Address already in use")
    assert got["state"] == "taken" and got["error"] == "Address already in use"


def test_port_state_for_real_sees_a_listener_of_this_process():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert network.port_state(port, "no-such.service")["state"] == "taken"
    assert network.port_state(port, "no-such.service")["state"] == "free"


def test_this_hosts_interfaces_and_local_addresses():
    ifaces = network.list_interfaces()
    assert "127.0.0.1" in ifaces["lo"]
    assert network.is_local("127.0.0.1") and not network.is_local("192.0.2.254")
    assert network.resolve("localhost", 1)


# --- meeting: who is there ------------------------------------------------------------------------------------------


def test_peers_each_rank_once_all_passed_same_address():
    problems, rank0 = rdv.peers_problems(inst(), "node1", [checked(0, "node1"), checked(1, "node2")])
    assert problems == [] and rank0["host"] == "node1"
    problems, _ = rdv.peers_problems(inst(), "node1", [checked(0, "node1"), checked(1, "node2", ok=False)])
    assert problems == [
        "not meeting: rank 1 (node2) failed its check: GLOO_SOCKET_IFNAME names 'nosuch0', an interface node2 does not have"
    ]
    problems, _ = rdv.peers_problems(inst(), "node1", [checked(0, "node1")])
    assert problems[0].startswith("mn: rank(s) 1 of 2 are not in this run")
    problems, _ = rdv.peers_problems(inst(), "node1", [checked(0, "node1"), checked(0, "node2")])
    assert problems[0] == "hosts node1, node2 all have node_rank 0 of mn: give each node its own"
    problems, _ = rdv.peers_problems(
        inst(), "node1", [checked(0, "node1"), checked(1, "node2", dist_init_addr="node1:5758")]
    )
    assert problems[-1].startswith(
        "dist_init_addr (set by sglang_instances[0].dist_init_addr) differs between the ranks"
    )
    other = {**checked(1, "node3"), "instance": "other"}
    assert rdv.peers_problems(inst(), "node1", [checked(0, "node1"), checked(1, "node2"), other])[0] == []


# --- meeting: the handshake, for real on 127.0.0.1 --------------------------------------------------------------------


def _port():
    return network.free_port()


def test_handshake_for_real_even_when_the_other_rank_comes_first():
    port = _port()
    hello = {}
    t = threading.Thread(
        target=lambda: hello.update(meeting.say_hello(["127.0.0.1"], port, "mn", 1, "node2", 10)), daemon=True
    )
    t.start()  # rank 1 first: refused, retried until rank 0 listens
    threading.Event().wait(0.6)
    served = meeting.serve_hello(port, socket.AF_INET, "mn", {1}, 10)
    t.join(10)
    assert served == {"joined": {1: "node2"}, "missing": [], "error": None}
    assert hello["ok"] and hello["address"] == "127.0.0.1" and hello["attempts"] > 1
    assert network.port_state(port, None)["state"] == "free"  # the listener is gone, the port free for torch's store


def test_handshake_nobody_comes_and_nobody_listens():
    port = _port()
    served = meeting.serve_hello(port, socket.AF_INET, "mn", {1, 2}, 0.5)
    assert served == {"joined": {}, "missing": [1, 2], "error": None}
    got = meeting.say_hello(["127.0.0.1"], port, "mn", 1, "node2", 0.6)
    assert not got["ok"] and got["error"] == "Connection refused"


def test_handshake_refuses_another_instances_listener_and_a_foreign_one():
    port = _port()
    t = threading.Thread(target=meeting.serve_hello, args=(port, socket.AF_INET, "other", {1}, 2), daemon=True)
    t.start()
    got = meeting.say_hello(["127.0.0.1"], port, "mn", 1, "node2", 1.0)
    t.join(5)
    assert not got["ok"] and "for instance other, not mn: two instances share dist_init_addr?" in got["error"]
    with socket.socket() as srv:  # a server that speaks first, but not our protocol
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]

        def speak():
            conn, _ = srv.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.2\n")

        threading.Thread(target=speak, daemon=True).start()
        got = meeting.say_hello(["127.0.0.1"], port, "mn", 1, "node2", 0.5)
        assert not got["ok"] and got["error"].startswith("something else answers there (it said 'SSH-2.0-OpenSSH_9.2'")


def test_without_a_banner_a_connect_is_the_proof_and_nothing_is_sent():
    """Rank 0's own running server holds the port (a check before a restart): connect and close, send nothing."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        got = meeting.say_hello(["127.0.0.1"], srv.getsockname()[1], "mn", 1, "node2", 2, banner=False)
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(2)
            assert conn.recv(10) == b""
    assert got["ok"] and got["attempts"] == 1


def test_handshake_serve_on_a_port_in_use_says_so():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        got = meeting.serve_hello(s.getsockname()[1], socket.AF_INET, "mn", {1}, 1)
    assert got["error"].startswith("cannot listen on port") and got["missing"] == [1]


# --- meeting: the whole step, with fakes ------------------------------------------------------------------------------


RANKS = [checked(0, "node1"), checked(1, "node2")]
OK_ALLREDUCE = {"ok": True, "error": None, "timed_out": False, "sizes": [{"bytes": 1 << 20}], "sum_ok": True}


def fake_meet(rank, host, ranks=RANKS, served=None, hello=None, allreduce=None, env=None):
    calls = {}

    def serve(port, family, name, want, timeout_s):
        calls["serve"] = (port, family, name, want, timeout_s)
        return served or {"joined": dict.fromkeys(want, "x"), "missing": [], "error": None}

    def say(addrs, port, name, rank_, host_, timeout_s, banner=True):
        calls["hello"] = (addrs, port, name, rank_, host_, timeout_s, banner)
        return hello or {"ok": True, "address": addrs[0], "error": None, "attempts": 1}

    def run(python, env_, rank_, world, addr, port, timeout_s):
        calls["allreduce"] = (python, env_, rank_, world, addr, port, timeout_s)
        return allreduce or OK_ALLREDUCE

    got = rdv.meet(
        inst(rank, env), host, ranks, timeout_s=20, resolver=resolver(HOSTS), serve=serve, hello=say, allreduce=run
    )
    return got, calls


def test_meet_rank0_serves_then_all_reduces_on_dist_init_addr():
    got, calls = fake_meet(0, "node1")
    assert got["ok"] and got["store_port"] == 5757
    assert calls["serve"] == (5757, socket.AF_INET, "mn", {1}, 20)
    assert calls["allreduce"] == ("/opt/ml-env/bin/python", {}, 0, 2, "node1", 5757, 20)


def test_meet_other_rank_says_hello_then_all_reduces():
    got, calls = fake_meet(1, "node2")
    assert got["ok"] and "serve" not in calls
    assert calls["hello"] == (["10.0.0.1"], 5757, "mn", 1, "node2", 20, True)
    assert calls["allreduce"][2:6] == (1, 2, "node1", 5757)


def test_meet_when_rank0s_server_holds_the_port_connects_only_and_meets_on_rank0s_port():
    ranks = [checked(0, "node1", store_port=41234, listener=False), checked(1, "node2")]
    got, calls = fake_meet(1, "node2", ranks)
    assert got["ok"] and calls["hello"][-1] is False and calls["allreduce"][5] == 41234
    got, calls = fake_meet(0, "node1", ranks)
    assert got["ok"] and "serve" not in calls and calls["allreduce"][5] == 41234


def test_meet_a_failed_peer_is_named_at_once_and_nobody_waits():
    got, calls = fake_meet(0, "node1", [checked(0, "node1"), checked(1, "node2", ok=False)])
    assert not got["ok"] and calls == {}
    assert got["problems"][0].startswith("not meeting: rank 1 (node2) failed its check: GLOO_SOCKET_IFNAME")


def test_meet_unreachable_rank0_fails_naming_dist_init_addr_on_both_sides():
    got, calls = fake_meet(
        1, "node2", hello={"ok": False, "address": None, "error": "No route to host", "attempts": 80}
    )
    assert not got["ok"] and "allreduce" not in calls
    [msg] = got["problems"]
    assert msg.startswith(
        "dist_init_addr (set by sglang_instances[0].dist_init_addr): node1:5757 (10.0.0.1) is not reachable from node2 "
        "(rank 1) within 20 s: No route to host. Check that node1 resolves here to rank 0's address"
    )
    got, _ = fake_meet(0, "node1", served={"joined": {}, "missing": [1], "error": None})
    assert got["problems"][0].startswith(
        "dist_init_addr (set by sglang_instances[0].dist_init_addr): rank(s) 1 never connected to node1:5757 on node1 "
        "(rank 0) within 20 s"
    )


def test_meet_all_reduce_that_times_out_names_dist_init_addr_and_the_interface_variables():
    hung = {"ok": False, "error": None, "timed_out": True, "sizes": [], "sum_ok": None}
    got, _ = fake_meet(1, "node2", allreduce=hung, env={"GLOO_SOCKET_IFNAME": "eth0"})
    [msg] = got["problems"]
    assert "did not complete within 20 s on node2 (rank 1): a rank never joined the group at MASTER_ADDR=node1 " in msg
    assert "MASTER_PORT=5757 (from dist_init_addr (set by sglang_instances[0].dist_init_addr))" in msg
    assert msg.endswith(
        "check GLOO_SOCKET_IFNAME (set by sglang_instances[0].env.GLOO_SOCKET_IFNAME)=eth0 and NCCL_SOCKET_IFNAME "
        "(unset) on every rank"
    )
    failed = {**hung, "timed_out": False, "error": "RuntimeError: Unable to find address for: eth9"}
    got, _ = fake_meet(0, "node1", allreduce=failed)
    assert "failed on node1 (rank 0) with MASTER_ADDR=node1" in got["problems"][0]
    assert "RuntimeError: Unable to find address for: eth9" in got["problems"][0]


# --- one rank of the all-reduce: the worker's plumbing, with a fake run -----------------------------------------------


class FakeRun:
    def __init__(self, result=None, rc=0, raises=None, stdout=""):
        self.result, self.rc, self.raises, self.stdout, self.calls = result, rc, raises, stdout, []

    def __call__(self, cmd, **kw):
        self.calls.append((cmd, kw))
        if self.raises:
            raise self.raises
        if self.result is not None:
            Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps(self.result))
        return subprocess.CompletedProcess(cmd, self.rc, self.stdout, "")


def test_allreduce_rank_runs_the_worker_in_rank_mode_on_cpu_with_master_addr():
    fake = FakeRun({"rank": 1, "results": [{"bytes": 1 << 20, "iters": 4, "seconds": 0.002}], "sum_ok": True})
    got = meeting.run_allreduce(
        "/venv/bin/python", {"GLOO_SOCKET_IFNAME": "eth0"}, 1, 2, "node1", 5757, 20, run=fake, base_env={}
    )
    cmd, kw = fake.calls[0]
    assert (
        got["ok"] and got["error"] is None and got["sizes"][0]["bytes"] == 1 << 20 and got["sizes"][0]["busbw_gbps"] > 0
    )
    assert cmd[0] == "/venv/bin/python" and cmd[1].endswith("nccl_worker.py")
    assert cmd[2:10] == ["--backend", "gloo", "--rank", "1", "--world", "2", "--result", cmd[9]]
    assert kw["timeout"] == 20 and kw["env"]["MASTER_ADDR"] == "node1" and kw["env"]["MASTER_PORT"] == "5757"
    assert kw["env"]["GLOO_SOCKET_IFNAME"] == "eth0" and kw["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_allreduce_rank_failures():
    got = meeting.run_allreduce(
        "py", {}, 0, 2, "n", 1, 5, run=FakeRun(raises=subprocess.TimeoutExpired("py", 5)), base_env={}
    )
    assert not got["ok"] and got["timed_out"] and got["error"] is None
    err = {"rank": 0, "error": "RuntimeError: Unable to find address for: nosuch0"}
    got = meeting.run_allreduce("py", {}, 0, 2, "n", 1, 5, run=FakeRun(err, rc=1), base_env={})
    assert not got["ok"] and got["error"] == err["error"]
    got = meeting.run_allreduce(
        "py", {}, 0, 2, "n", 1, 5, run=FakeRun(rc=1, stdout="boom\nModuleNotFoundError: torch"), base_env={}
    )
    assert got["error"] == "exit 1: ModuleNotFoundError: torch"
    got = meeting.run_allreduce("py", {}, 0, 2, "n", 1, 5, run=FakeRun({"results": [], "sum_ok": False}), base_env={})
    assert not got["ok"] and got["error"] == "the all-reduce gave wrong sums"
    got = meeting.run_allreduce(
        "/no/python", {}, 0, 2, "n", 1, 5, run=FakeRun(raises=FileNotFoundError(2, "No such file")), base_env={}
    )
    assert got["error"].startswith("could not run /no/python:")


@pytest.mark.skipif(not os.environ.get("SGD_TORCH_PYTHON"), reason="SGD_TORCH_PYTHON (a python with torch) not set")
def test_two_ranks_meet_and_all_reduce_for_real_on_loopback():
    port = _port()
    ranks = [checked(0, "a", store_port=port), checked(1, "b")]
    out = {}

    def rank(r):
        i = inst(r, addr=f"127.0.0.1:{port}", python=os.environ["SGD_TORCH_PYTHON"])
        out[r] = rdv.meet(i, "ab"[r], ranks, timeout_s=30)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert out[0]["ok"] and out[1]["ok"], (out[0]["problems"], out[1]["problems"])
    assert out[0]["allreduce"]["sum_ok"] and out[0]["handshake"]["joined"] == {1: "b"}


# --- plugins/modules/sglang_rendezvous.py as Ansible runs it ------------------------------------------------------------------

RUNNER = """\
import sys
sys.argv = ['sglang_rendezvous', {argfile!r}]
exec(compile(open({module!r}).read(), {module!r}, 'exec'), {{'__name__': '__main__'}})
"""


def run_module(tmp_path: Path, args: dict) -> tuple[int, dict]:
    argfile = tmp_path / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    runner = tmp_path / "runner.py"
    runner.write_text(
        RUNNER.format(argfile=str(argfile), module=str(REPO / "plugins" / "modules" / "sglang_rendezvous.py"))
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "collections")}
    proc = subprocess.run([sys.executable, str(runner)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_module_check_fails_naming_the_missing_gloo_interface(tmp_path):
    i = inst(1, {"GLOO_SOCKET_IFNAME": "nosuch0"}, addr=f"localhost:{_port()}")
    rc, out = run_module(tmp_path, {"step": "check", "instance": i, "host": "node2"})
    assert rc == 1 and out["failed"] and not out["ok"] and not out["changed"]
    assert out["msg"].startswith(
        "GLOO_SOCKET_IFNAME (set by sglang_instances[0].env.GLOO_SOCKET_IFNAME) names 'nosuch0'"
    )
    assert out["instance"] == "mn" and out["node_rank"] == 1 and "lo" in out["interfaces"]


def test_module_check_on_rank0_with_a_free_port_passes(tmp_path):
    port = _port()
    rc, out = run_module(
        tmp_path,
        {"step": "check", "instance": inst(0, {"GLOO_SOCKET_IFNAME": "lo"}, f"127.0.0.1:{port}"), "host": "node1"},
    )
    # lo is refused for gloo across nodes; everything else about rank 0 passes
    assert rc == 1 and out["problems"] == [p for p in out["problems"] if p.startswith("GLOO_SOCKET_IFNAME")]
    assert out["store_port"] == port and out["listener"] and out["port_state"]["state"] == "free"


def test_module_meet_refuses_without_peers_and_a_bad_timeout(tmp_path):
    rc, out = run_module(tmp_path, {"step": "meet", "instance": inst(0), "host": "node1", "ranks": []})
    assert rc == 1 and "rank(s) 0, 1 of 2 are not in this run" in out["msg"]
    rc, out = run_module(tmp_path, {"step": "meet", "instance": inst(0), "host": "node1", "timeout_s": 0})
    assert rc == 1 and out["msg"] == "timeout_s is 0.0: give 1 to 60 seconds"


def test_handshake_against_a_silent_listener_says_it_is_not_rank0s_check():
    with socket.socket() as srv:  # as the running server's torch store would be, were rank 0 to expect a banner
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        got = meeting.say_hello(["127.0.0.1"], srv.getsockname()[1], "mn", 1, "node2", 1.2)
    assert not got["ok"] and got["error"] == "a process answers there without a word: not rank 0's check"
