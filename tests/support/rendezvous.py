"""A rank's check result as rendezvous.check reports it, for the tests of meet and peers_problems (shared by
tests/test_rendezvous.py and tests/test_rendezvous_behaviour.py: test modules do not import one another)."""


def checked(rank, host, ok=True, **kw):
    return {
        "instance": "mn",
        "node_rank": rank,
        "host": host,
        "ok": ok,
        "dist_init_addr": "node1:5757",
        "problems": [] if ok else ["GLOO_SOCKET_IFNAME names 'nosuch0', an interface node2 does not have"],
        "store_port": 5757 if rank == 0 else None,
        "listener": rank == 0,
        "resolved": ["10.0.0.1"],
        **kw,
    }
