"""The multi-node rendezvous check: can the ranks of an instance spanning nodes meet, before anything stops?

SGLang over several nodes hangs at start when a rank's GLOO_SOCKET_IFNAME names a missing interface or
rank 0's address is unreachable (sgl-project/sglang#3226, #3514). This checks it all, with the instance's
own settings, on every rank, and stops nothing:

- ``check`` (each rank alone): GLOO_SOCKET_IFNAME names interfaces that exist here and have an address
  (torch splits it on commas; gloo wants exact names); NCCL_SOCKET_IFNAME selects at least one interface
  by NCCL's rules (``nccl_selects``); dist_init_addr parses (host:port, IPv6 in brackets) and resolves;
  on rank 0 its host is an address of this host and its port is free, or held by this instance's own
  unit (before a restart the server holds it: fine); on other ranks it is not an address of theirs.
- ``meet`` (every rank at once: Ansible runs one task on all hosts of the batch in parallel): given every
  rank's ``check`` result, rank 0 opens a short-lived listener on dist_init_addr's port and each other rank
  connects to it (retrying until rank 0 listens) and exchanges one line each way; then all ranks run a real
  gloo all-reduce on CPU (the NCCL preflight's worker, one process per node) with
  MASTER_ADDR:MASTER_PORT = dist_init_addr, under the instance's environment.

The two steps are two tasks, so that a rank whose ``check`` failed is known to the others before anyone
waits for it, and so that rank 0 tells the others which port the all-reduce uses: dist_init_addr's own port
when it is free; when the instance's running server holds it (a check before a restart), a free port rank 0
picked, and the other ranks only connect to the server's listener (a TCP connect and close, nothing sent).

Every failure names the variable (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, dist_init_addr), the host, and
what to do. This host's interfaces, addresses and ports are read in ``network``; the handshake's wire format and
the all-reduce's run are ``meeting``'s. No Ansible imports: ``plugins/modules/sglang_rendezvous.py`` is a thin
adapter over ``check`` and ``meet``.
"""

from __future__ import annotations

import ipaddress
import socket

from .meeting import run_allreduce, say_hello, serve_hello
from .network import _is_loopback, _listing, free_port, is_local, list_interfaces, nccl_selects, port_state, resolve
from .render import placement

# A value NCCL reads as a list of interfaces only from 2 characters on (ncclFindInterfaces: strlen(env) > 1).
NCCL_MIN_LEN = 2


# ---------------------------------------------------------------- dist_init_addr
def parse_dist_init_addr(value: str | None) -> tuple[str, int]:
    """(host, port) of ``host:port``, ``1.2.3.4:port`` or ``[v6]:port``; ValueError saying what is wrong."""
    text = (value or "").strip()
    if not text:
        raise ValueError("is not set")
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1 :].startswith(":"):
            raise ValueError(f"{text!r}: an IPv6 address is written [address]:port")
        host, port_text = text[1:end], text[end + 2 :]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} in brackets is not an IPv6 address") from None
    else:
        if text.count(":") > 1:
            raise ValueError(f"{text!r}: write an IPv6 address in brackets, [address]:port")
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"{text!r} has no port: write host:port")
    if not host:
        raise ValueError(f"{text!r} has no host: write host:port")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text!r}: the port {port_text!r} is not a number from 1 to 65535")
    return host, int(port_text)


# ---------------------------------------------------------------- step 1: check (each rank alone)
def _var(inst: dict, name: str) -> str:
    """GLOO_SOCKET_IFNAME (set by sglang_instances[0].env.GLOO_SOCKET_IFNAME): a variable and where it came from."""
    origin = (inst.get("env_origins") or {}).get(name)
    return f"{name} (set by {origin})" if origin else name


def _dist_var(inst: dict) -> str:
    origin = (inst.get("origins") or {}).get("--dist-init-addr")
    return f"dist_init_addr (set by {origin})" if origin else "dist_init_addr"


def check_gloo(inst: dict, host: str, ifaces: dict[str, list[str]], hostname_addrs: list[str] | None) -> list[str]:
    """Problems of GLOO_SOCKET_IFNAME on this host (or, unset, of the address gloo falls back to)."""
    env = inst.get("env") or {}
    value = env.get("GLOO_SOCKET_IFNAME")
    var = _var(inst, "GLOO_SOCKET_IFNAME")
    carriers = [n for n, a in sorted(ifaces.items()) if any(not _is_loopback(x) for x in a)]
    hint = (
        f"set it to the interface the other ranks reach this host on ({', '.join(carriers) or 'none has an address'})"
    )
    if value is None:
        if hostname_addrs is None:
            return [
                f"GLOO_SOCKET_IFNAME is not set and this host's name does not resolve on {host}: gloo would fall back "
                f"to the loopback address, which the other ranks cannot reach; {hint}"
            ]
        if hostname_addrs and all(_is_loopback(a) for a in hostname_addrs):
            return [
                f"GLOO_SOCKET_IFNAME is not set and this host's name resolves on {host} to {', '.join(hostname_addrs)} "
                f"(loopback): gloo would tell the other ranks to connect there; {hint}"
            ]
        return []
    names = [n.strip() for n in str(value).split(",")]
    problems = []
    for n in names:
        if not n:
            problems.append(f"{var} is {value!r}: an empty interface name on {host}; {hint}")
        elif n not in ifaces:
            problems.append(
                f"{var} names {n!r}, an interface {host} does not have (gloo takes exact names, not prefixes; "
                f"it has {_listing(ifaces)}): SGLang would hang at start; {hint}"
            )
        elif not ifaces[n]:
            problems.append(f"{var} names {n!r}, which has no address on {host}: gloo cannot bind it; {hint}")
        elif all(_is_loopback(a) for a in ifaces[n]):
            problems.append(f"{var} names {n!r}, loopback on {host}: the other ranks cannot reach it; {hint}")
    return problems


def check_nccl(inst: dict, host: str, ifaces: dict[str, list[str]]) -> tuple[list[str], list[str] | None]:
    """(problems, the interfaces NCCL_SOCKET_IFNAME selects here, None when unset)."""
    env = inst.get("env") or {}
    value = env.get("NCCL_SOCKET_IFNAME")
    if value is None:
        return [], None
    value = str(value)
    var = _var(inst, "NCCL_SOCKET_IFNAME")
    fix = (
        "write comma-separated prefixes (eth matches eth0, eth1), =name for exact names (=eth0,eth1), "
        f"a leading ^ to exclude (^docker,lo); this host has {_listing(ifaces)}"
    )
    if len(value) < NCCL_MIN_LEN:
        return [
            f"{var} is {value!r}: NCCL ignores a value shorter than {NCCL_MIN_LEN} characters and picks an "
            f"interface itself on {host}; {fix}"
        ], None
    family = env.get("NCCL_SOCKET_FAMILY")
    chosen = nccl_selects(value, ifaces, family)
    fam = f" with an {family} address (NCCL_SOCKET_FAMILY)" if family else " with an address"
    if not chosen:
        return [f"{var}={value} selects no interface{fam} on {host} (NCCL fails: no socket interface found); {fix}"], []
    if all(all(_is_loopback(a) for a in ifaces[n]) for n in chosen):
        return [
            f"{var}={value} selects only loopback on {host} ({', '.join(chosen)}): other nodes cannot reach it; {fix}"
        ], chosen
    return [], chosen


def check(
    inst: dict,
    host: str,
    ifaces: dict[str, list[str]] | None = None,
    resolver=resolve,
    local=is_local,
    port_probe=port_state,
    pick_port=free_port,
    hostname: str | None = None,
) -> dict:
    """Step 1 on one rank: {ok, problems, instance, node_rank, nnodes, host, dist_init_addr, interfaces,
    gloo_ifname, nccl_selected, resolved, port, store_port, listener, port_state}.

    On rank 0 ``store_port`` is the port the all-reduce will use and ``listener`` whether rank 0 will listen
    on dist_init_addr's port in ``meet`` (False when the instance's own server holds it)."""
    ifaces = list_interfaces() if ifaces is None else ifaces
    out = _check_result(inst, host, ifaces)
    rank = out["node_rank"]
    dvar = _dist_var(inst)
    problems, out["nccl_selected"] = _interface_problems(inst, host, ifaces, out["nnodes"], resolver, hostname)
    try:
        dhost, port = parse_dist_init_addr(inst.get("dist_init_addr"))
    except ValueError as exc:
        problems.append(f"{dvar} {exc} (on {host})")
        return {**out, "ok": False, "problems": problems}
    out["port"] = port
    try:
        addrs = resolver(dhost, port)
    except OSError as exc:
        problems.append(
            f"{dvar}: {dhost} does not resolve on {host} ({exc.strerror or exc}): name rank 0's node by a name "
            "every node resolves (DNS or /etc/hosts), or by its address"
        )
        return {**out, "ok": False, "problems": problems}
    out["resolved"] = addrs
    mine = [a for a in addrs if local(a)]
    if rank == 0:
        found, fields = _rank0_port(inst, host, dhost, port, addrs, mine, port_probe, pick_port)
        problems += found
        out.update(fields)
    elif mine:
        problems.append(
            f"{dvar}: {dhost} resolves on {host} (rank {rank}) to {', '.join(mine)}, an address of this host, not of "
            "rank 0's node: fix its entry in /etc/hosts or DNS on this host (a hostname mapped to 127.0.1.1 does this)"
        )
    return {**out, "ok": not problems, "problems": problems}


def _about(inst: dict, host: str) -> dict:
    """Which rank of which instance a result is from: what every step's result opens with."""
    rank, nnodes = placement(inst)
    return {"instance": inst.get("name"), "node_rank": rank, "nnodes": nnodes, "host": host}


def _check_result(inst: dict, host: str, ifaces: dict[str, list[str]]) -> dict:
    """check's result before anything is checked: every field the module returns, unknown ones None."""
    env = inst.get("env") or {}
    return {
        **_about(inst, host),
        "dist_init_addr": inst.get("dist_init_addr"),
        "interfaces": ifaces,
        "gloo_ifname": env.get("GLOO_SOCKET_IFNAME"),
        "nccl_selected": None,
        "resolved": None,
        "port": None,
        "store_port": None,
        "listener": False,
        "port_state": None,
    }


def _interface_problems(
    inst: dict, host: str, ifaces: dict[str, list[str]], nnodes: int, resolver, hostname: str | None
) -> tuple[list[str], list[str] | None]:
    """What this rank alone can tell before dist_init_addr: nnodes, GLOO_SOCKET_IFNAME (unset: the address gloo
    falls back to, this host's name resolved) and NCCL_SOCKET_IFNAME. (problems, the interfaces NCCL selects)."""
    problems: list[str] = []
    if nnodes < 2:
        problems.append(
            f"{inst.get('name')}: nnodes is {nnodes}; the rendezvous check is for instances over several nodes"
        )
    hostname = hostname or socket.gethostname()
    try:
        own = resolver(hostname, 0)
    except OSError:
        own = None
    problems += check_gloo(inst, host, ifaces, own)
    nccl_problems, selected = check_nccl(inst, host, ifaces)
    return problems + nccl_problems, selected


def _rank0_port(
    inst: dict, host: str, dhost: str, port: int, addrs: list[str], mine: list[str], port_probe, pick_port
) -> tuple[list[str], dict]:
    """Rank 0: dist_init_addr is an address of this host and its port free, or held by the instance's own server.
    (problems, check's port_state, store_port and listener as far as they are known)."""
    dvar = _dist_var(inst)
    problems = []
    if not mine:
        problems.append(
            f"{dvar}: {dhost} resolves on {host} (rank 0) to {', '.join(addrs)}, not an address of this host: "
            "dist_init_addr must name rank 0's node, the one with node_rank 0"
        )
    family = socket.AF_INET6 if ":" in (mine or addrs)[0] else socket.AF_INET
    st = port_probe(port, inst.get("unit"), family)
    fields = {"port_state": st}
    if st["state"] == "taken":
        who = "; ".join(f"pid {h['pid']} ({h['unit']}: {h['cmdline']})" for h in st["holders"])
        who = who or f"a process not visible here ({st['error'] or 'the port cannot be bound'})"
        problems.append(
            f"{dvar}: port {port} is already in use on {host} (rank 0) by {who}: rank 0's torch.distributed "
            "store could not listen there and every rank would hang; choose another port in dist_init_addr "
            "(the same on every rank) or stop that process"
        )
    elif st["state"] == "own":
        fields["store_port"] = pick_port(family)
    else:
        fields["store_port"], fields["listener"] = port, True
    return problems, fields


# ---------------------------------------------------------------- step 2: meet (every rank at once)
def peers_problems(inst: dict, host: str, ranks: list[dict]) -> tuple[list[str], dict | None]:
    """Before waiting for anyone: every rank 0..nnodes-1 ran ``check`` once, passed, and agrees on
    dist_init_addr. (problems, rank 0's check result)."""
    nnodes, name = int(inst.get("nnodes") or 1), inst.get("name")
    dvar = _dist_var(inst)
    mine = [r for r in ranks if r.get("instance") == name]
    by_rank: dict[int, list[dict]] = {}
    for r in mine:
        by_rank.setdefault(int(r.get("node_rank", -1)), []).append(r)
    problems = []
    for rank, rs in sorted(by_rank.items()):
        if len(rs) > 1:
            problems.append(
                f"hosts {', '.join(r.get('host', '?') for r in rs)} all have node_rank {rank} of {name}: give each node its own"
            )
    missing = [r for r in range(nnodes) if r not in by_rank]
    if missing:
        problems.append(
            f"{name}: rank(s) {', '.join(map(str, missing))} of {nnodes} are not in this run (or their hosts were "
            "unreachable): run the check on every node of the instance (--limit)"
        )
    for rank, rs in sorted(by_rank.items()):
        for r in rs:
            if r.get("host") != host and not r.get("ok"):
                why = "; ".join(r.get("problems") or []) or r.get("msg") or "it failed"
                problems.append(f"not meeting: rank {rank} ({r.get('host')}) failed its check: {why}")
    addrs = {r.get("dist_init_addr") for r in mine}
    if len(addrs) > 1:
        seen = ", ".join(f"{r.get('host')}: {r.get('dist_init_addr')}" for r in mine)
        problems.append(f"{dvar} differs between the ranks ({seen}): every rank must name the same rank 0 host:port")
    rank0 = (by_rank.get(0) or [None])[0]
    return problems, rank0


def _iface_advice(inst: dict) -> str:
    env = inst.get("env") or {}
    parts = []
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(name)
        parts.append(f"{_var(inst, name)}={value}" if value is not None else f"{name} (unset)")
    return " and ".join(parts)


def meet(
    inst: dict,
    host: str,
    ranks: list[dict],
    timeout_s: float = 30.0,
    python: str | None = None,
    resolver=resolve,
    serve=serve_hello,
    hello=say_hello,
    allreduce=run_allreduce,
) -> dict:
    """Step 2 on one rank, at the same time as every other: the reachability handshake on dist_init_addr, then a
    real gloo all-reduce over the nodes. {ok, problems, instance, node_rank, host, handshake, allreduce, store_port}."""
    out = {**_about(inst, host), "handshake": None, "allreduce": None}
    rank, nnodes = out["node_rank"], out["nnodes"]
    problems, rank0 = peers_problems(inst, host, ranks)
    if problems or rank0 is None:
        return {**out, "ok": False, "problems": problems, "store_port": None}
    dhost, port = parse_dist_init_addr(inst.get("dist_init_addr"))
    store_port, listener = rank0.get("store_port"), bool(rank0.get("listener"))
    out["store_port"] = store_port
    if rank == 0:
        if listener:
            out["handshake"], problems = _listen(inst, host, rank0, dhost, port, timeout_s, serve)
    else:
        out["handshake"], problems = _connect(inst, host, dhost, port, timeout_s, listener, resolver, hello)
    if problems:
        return {**out, "ok": False, "problems": problems}
    res = allreduce(
        python or inst.get("python") or "python3", inst.get("env") or {}, rank, nnodes, dhost, store_port, timeout_s
    )
    out["allreduce"] = res
    if not res["ok"]:
        problems.append(_allreduce_problem(inst, host, dhost, store_port, timeout_s, res))
    return {**out, "ok": not problems, "problems": problems}


def _listen(
    inst: dict, host: str, rank0: dict, dhost: str, port: int, timeout_s: float, serve
) -> tuple[dict, list[str]]:
    """Rank 0's side of the handshake: listen on dist_init_addr's port until every other rank said hello.
    (the handshake, problems)."""
    _, nnodes = placement(inst)
    dvar = _dist_var(inst)
    addr = ((rank0.get("resolved") or [dhost]) + [dhost])[0]
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    hs = serve(port, family, inst.get("name"), set(range(1, nnodes)), timeout_s)
    if hs["error"]:
        return hs, [f"{dvar}: rank 0 on {host} {hs['error']}: choose another port in dist_init_addr or free it"]
    if hs["missing"]:
        return hs, [
            f"{dvar}: rank(s) {', '.join(map(str, hs['missing']))} never connected to {dhost}:{port} on {host} "
            f"(rank 0) within {timeout_s:g} s: on those nodes {dhost} must resolve to this host and port {port} "
            "must not be blocked on the way (their own messages say what they saw)"
        ]
    return hs, []


def _connect(
    inst: dict, host: str, dhost: str, port: int, timeout_s: float, listener: bool, resolver, hello
) -> tuple[dict | None, list[str]]:
    """A rank > 0's side: say hello to rank 0 at dist_init_addr as it resolves here (without rank 0's `listener`,
    the instance's own server holds the port: a connect is the proof). (the handshake, None unresolved; problems)."""
    rank, _ = placement(inst)
    dvar = _dist_var(inst)
    why = "no address"
    try:
        addrs = resolver(dhost, port)
    except OSError as exc:
        addrs, why = [], exc.strerror or str(exc)
    if not addrs:
        return None, [f"{dvar}: {dhost} does not resolve on {host} (rank {rank}): {why}"]
    hs = hello(addrs, port, inst.get("name"), rank, host, timeout_s, banner=listener)
    if hs["ok"]:
        return hs, []
    return hs, [
        f"{dvar}: {dhost}:{port} ({', '.join(addrs)}) is not reachable from {host} (rank {rank}) within "
        f"{timeout_s:g} s: {hs['error']}. Check that {dhost} resolves here to rank 0's address, that rank 0 "
        f"runs this check at the same time, and that no firewall drops port {port} between the nodes"
    ]


def _allreduce_problem(inst: dict, host: str, dhost: str, store_port: int, timeout_s: float, res: dict) -> str:
    """What a failed all-reduce says: its MASTER_ADDR:MASTER_PORT and the interface variables every rank must check."""
    rank, nnodes = placement(inst)
    via = f"MASTER_ADDR={dhost} MASTER_PORT={store_port} (from {_dist_var(inst)})"
    if res.get("timed_out"):
        what = (
            f"did not complete within {timeout_s:g} s on {host} (rank {rank}): a rank never joined the group at {via}"
        )
    else:
        what = f"failed on {host} (rank {rank}) with {via}: {res['error']}"
    return (
        f"the gloo all-reduce over {nnodes} nodes {what}. The ranks connect to each other directly on the address of "
        f"the interface gloo uses: check {_iface_advice(inst)} on every rank"
    )
