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
what to do. No Ansible imports: ``plugins/modules/sglang_rendezvous.py`` is a thin adapter over ``check`` and ``meet``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import subprocess
import tempfile
import time

from . import nccl_worker
from .nccl import worker_source
from .secret_rule import clip
from .validate import listening_inodes, socket_holders

MIB = nccl_worker.MIB
BANNER = "SGLANG-RDV 1"
# A value NCCL reads as a list of interfaces only from 2 characters on (ncclFindInterfaces: strlen(env) > 1).
NCCL_MIN_LEN = 2
SIOCGIFADDR = 0x8915


# ---------------------------------------------------------------- interfaces
def list_interfaces(sys_net: str = "/sys/class/net", inet6: str = "/proc/net/if_inet6") -> dict[str, list[str]]:
    """{interface: [its addresses]} of this host: names from /sys/class/net (else socket.if_nameindex),
    IPv4 from SIOCGIFADDR, IPv6 from /proc/net/if_inet6. An interface without an address maps to []."""
    try:
        names = sorted(os.listdir(sys_net))
    except OSError:
        names = sorted(name for _, name in socket.if_nameindex())
    out: dict[str, list[str]] = {n: [] for n in names}
    import fcntl  # Unix only; imported here so that the pure functions import anywhere

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for n in names:
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", n[:15].encode()))
                out[n].append(socket.inet_ntoa(raw[20:24]))
            except OSError:
                continue
    try:
        with open(inet6, encoding="ascii") as fh:
            for line in fh:
                f = line.split()
                if len(f) >= 6 and f[5] in out:
                    out[f[5]].append(str(ipaddress.IPv6Address(bytes.fromhex(f[0]))))
    except (OSError, ValueError):
        pass
    return out


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _listing(ifaces: dict[str, list[str]]) -> str:
    """lo (127.0.0.1), eth0 (10.89.0.2, fd00::2), ib0 (no address): for messages."""
    return ", ".join(f"{n} ({', '.join(a) if a else 'no address'})" for n, a in sorted(ifaces.items())) or "none"


def parse_nccl_ifname(value: str) -> tuple[bool, bool, list[str]]:
    """NCCL_SOCKET_IFNAME as NCCL reads it (src/misc/socket.cc findInterfaces, parseStringList):
    (exclude, exact, prefixes). A leading ``^`` excludes, then a leading ``=`` makes every item an exact
    name; items are comma-separated, ``:port`` suffixes dropped, empty items skipped. ``^`` or ``=``
    anywhere else is part of a name."""
    exclude = value.startswith("^")
    rest = value[1:] if exclude else value
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    items = [item.split(":", 1)[0] for item in rest.split(",")]
    return exclude, exact, [i for i in items if i]


def _family_ok(addr: str, family: str | None) -> bool:
    if family == "AF_INET":
        return ":" not in addr
    if family == "AF_INET6":
        return ":" in addr
    return True


def nccl_selects(value: str, ifaces: dict[str, list[str]], family: str | None = None) -> list[str]:
    """The interfaces NCCL would use for NCCL_SOCKET_IFNAME=value: those with an address (of NCCL_SOCKET_FAMILY
    when set; IPv6 loopback never), matching a prefix (or exact name), or none of them with ``^``. An empty
    list of prefixes matches every interface (so ``^`` alone selects none), as NCCL's matchIfList does."""
    exclude, exact, prefixes = parse_nccl_ifname(value)
    out = []
    for name, addrs in sorted(ifaces.items()):
        usable = [a for a in addrs if not (":" in a and _is_loopback(a)) and _family_ok(a, family)]
        if not usable:
            continue
        hit = not prefixes or any(name == p if exact else name.startswith(p) for p in prefixes)
        if hit != exclude:
            out.append(name)
    return out


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


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to here (TCP), in getaddrinfo's order; OSError when it does not resolve."""
    seen: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if sockaddr[0] not in seen:
            seen.append(sockaddr[0])
    return seen


def is_local(addr: str) -> bool:
    """Whether `addr` is an address of this host (it can be bound)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _bind_free(port: int, family: int) -> str | None:
    """None when `port` can be bound on every address of `family` (as torch's store binds it), else why not."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def port_state(
    port: int,
    unit: str | None,
    family: int = socket.AF_INET,
    inodes=listening_inodes,
    holders=socket_holders,
    bind=_bind_free,
) -> dict:
    """{state: free|own|taken, holders: [{pid, unit, cmdline}], error}: whether rank 0 may listen on `port`.

    A listener of the instance's own unit is ``own`` (its running server: fine before a restart), as
    validate.check_port tells it apart; anyone else's is ``taken``; no listener and a bind that works is ``free``.
    """
    found = inodes(port)
    if found:
        held = holders(found)
        listed = [{"pid": pid, "unit": u, "cmdline": clip(cmd, 160)} for pid, (u, cmd) in sorted(held.items())]
        if held and all(h[0] == unit for h in held.values()):
            return {"state": "own", "holders": listed, "error": None}
        return {"state": "taken", "holders": [h for h in listed if h["unit"] != unit], "error": None}
    why = bind(port, family)
    return {"state": "taken" if why else "free", "holders": [], "error": why}


def free_port(family: int = socket.AF_INET) -> int:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
        return s.getsockname()[1]


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
    rank, nnodes = int(inst.get("node_rank") or 0), int(inst.get("nnodes") or 1)
    env = inst.get("env") or {}
    out = {
        "instance": inst.get("name"),
        "node_rank": rank,
        "nnodes": nnodes,
        "host": host,
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
    problems: list[str] = []
    dvar = _dist_var(inst)
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
    nccl_problems, out["nccl_selected"] = check_nccl(inst, host, ifaces)
    problems += nccl_problems
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
        if not mine:
            problems.append(
                f"{dvar}: {dhost} resolves on {host} (rank 0) to {', '.join(addrs)}, not an address of this host: "
                "dist_init_addr must name rank 0's node, the one with node_rank 0"
            )
        family = socket.AF_INET6 if ":" in (mine or addrs)[0] else socket.AF_INET
        st = port_probe(port, inst.get("unit"), family)
        out["port_state"] = st
        if st["state"] == "taken":
            who = "; ".join(f"pid {h['pid']} ({h['unit']}: {h['cmdline']})" for h in st["holders"])
            who = who or f"a process not visible here ({st['error'] or 'the port cannot be bound'})"
            problems.append(
                f"{dvar}: port {port} is already in use on {host} (rank 0) by {who}: rank 0's torch.distributed "
                "store could not listen there and every rank would hang; choose another port in dist_init_addr "
                "(the same on every rank) or stop that process"
            )
        elif st["state"] == "own":
            out["store_port"] = pick_port(family)
        else:
            out["store_port"], out["listener"] = port, True
    elif mine:
        problems.append(
            f"{dvar}: {dhost} resolves on {host} (rank {rank}) to {', '.join(mine)}, an address of this host, not of "
            "rank 0's node: fix its entry in /etc/hosts or DNS on this host (a hostname mapped to 127.0.1.1 does this)"
        )
    return {**out, "ok": not problems, "problems": problems}


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


def serve_hello(port: int, family: int, instance: str, want: set[int], timeout_s: float, clock=time.monotonic) -> dict:
    """Rank 0: listen on `port` (all addresses, as torch's store does) until every rank in `want` said hello,
    or `timeout_s`. Per connection: send the banner, read ``HELLO <instance> <rank> <host>``, answer ``OK``,
    wait for the peer to close (the TIME_WAIT stays on its side). {joined: {rank: host}, missing, error}."""
    joined: dict[int, str] = {}
    try:
        srv = socket.socket(family, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        srv.listen(64)
    except OSError as exc:
        return {
            "joined": joined,
            "missing": sorted(want),
            "error": f"cannot listen on port {port}: {exc.strerror or exc}",
        }
    deadline = clock() + timeout_s
    with srv:
        srv.settimeout(0.2)
        while set(joined) < want and clock() < deadline:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                continue
            with conn:
                conn.settimeout(3)
                try:
                    conn.sendall(f"{BANNER} {instance}\n".encode())
                    words = _readline(conn).split()
                    if len(words) == 4 and words[0] == "HELLO" and words[1] == instance and words[2].isdigit():
                        joined[int(words[2])] = words[3]
                        conn.sendall(b"OK\n")
                        conn.recv(16)  # the peer closes first
                    else:
                        conn.sendall(b"NO\n")
                except OSError:
                    continue
    return {"joined": joined, "missing": sorted(want - set(joined)), "error": None}


def _readline(conn: socket.socket, limit: int = 512) -> str:
    buf = b""
    while not buf.endswith(b"\n") and len(buf) < limit:
        chunk = conn.recv(limit - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


def say_hello(
    addrs: list[str],
    port: int,
    instance: str,
    rank: int,
    host: str,
    timeout_s: float,
    banner: bool = True,
    connect=socket.create_connection,
    clock=time.monotonic,
    sleep=time.sleep,
) -> dict:
    """Rank > 0: connect to rank 0 at `addrs`:`port` until it answers or `timeout_s`, retrying (rank 0's module
    may start later). With `banner`, expect rank 0's listener and exchange one line each way; without (the
    instance's own server holds the port), a connect and close is the proof. {ok, address, error, attempts}."""
    deadline = clock() + timeout_s
    last, answer, attempts = "no attempt", None, 0
    while True:
        for addr in addrs:
            attempts += 1
            try:
                with connect((addr, port), timeout=max(0.5, min(3.0, deadline - clock()))) as conn:
                    if not banner:
                        return {"ok": True, "address": addr, "error": None, "attempts": attempts}
                    conn.settimeout(max(1.0, min(5.0, deadline - clock())))
                    try:
                        first = _readline(conn)
                    except TimeoutError:
                        first = ""
                    if not first:
                        answer = answer or "a process answers there without a word: not rank 0's check"
                        continue
                    if not first.startswith(BANNER):
                        answer = f"something else answers there (it said {clip(first, 60)!r}, not rank 0's check)"
                        continue
                    if first.split()[-1] != instance:
                        answer = f"rank 0's check there is for instance {first.split()[-1]}, not {instance}: two instances share dist_init_addr?"
                        continue
                    conn.sendall(f"HELLO {instance} {rank} {host}\n".encode())
                    if _readline(conn) == "OK":
                        return {"ok": True, "address": addr, "error": None, "attempts": attempts}
                    answer = "rank 0's check refused this rank"
            except OSError as exc:
                last = exc.strerror or str(exc) or type(exc).__name__
        if clock() >= deadline:
            # What a listener said beats a later refusal or timeout: it names the wrong process or instance.
            return {"ok": False, "address": None, "error": answer or last, "attempts": attempts}
        sleep(0.25)


def run_allreduce(
    python: str,
    env: dict,
    rank: int,
    world: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    run=subprocess.run,
    base_env: dict | None = None,
) -> dict:
    """One rank of a gloo all-reduce on CPU (nccl_worker's rank mode, 1 MiB) under the instance's environment
    with MASTER_ADDR/MASTER_PORT, killed after `timeout_s`. {ok, error, timed_out, sizes, sum_ok, seconds, command}."""
    if base_env is None:
        base_env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    wenv = {**base_env, **{k: str(v) for k, v in env.items()}}
    # CPU only: never touch the GPUs a running server holds.
    wenv.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglang-rdv-") as tmp:
        worker, result = os.path.join(tmp, "nccl_worker.py"), os.path.join(tmp, "rank.json")
        with open(worker, "w") as f:
            f.write(worker_source())
        cmd = [python, worker, "--backend", "gloo", "--rank", str(rank), "--world", str(world), "--result", result]
        cmd += ["--min-bytes", str(MIB), "--max-bytes", str(MIB), "--warmup", "1", "--min-iters", "2"]
        cmd += ["--max-iters", "10", "--per-size-s", "0.05"]
        out = {"ok": False, "error": None, "timed_out": False, "sizes": [], "sum_ok": None, "command": cmd}
        try:
            res = run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False, env=wenv, cwd=tmp)
            rc, text = res.returncode, (res.stdout or "") + (res.stderr or "")
        except subprocess.TimeoutExpired:
            rc, text, out["timed_out"] = None, "", True
        except OSError as exc:
            rc, text = None, ""
            out["error"] = f"could not run {python}: {exc}"
        try:
            with open(result) as f:
                got = json.load(f)
        except (OSError, ValueError):
            got = {}
    out["seconds"] = round(time.monotonic() - start, 2)
    out["sizes"] = nccl_worker.table(got.get("results") or [], world)
    out["sum_ok"] = got.get("sum_ok")
    if out["error"] is None and not out["timed_out"]:
        out["error"] = got.get("error") or (f"exit {rc}: {nccl_worker.last_line(text) or 'no output'}" if rc else None)
    out["ok"] = rc == 0 and out["error"] is None and out["sum_ok"] is True
    if rc == 0 and out["sum_ok"] is not True and out["error"] is None:
        out["error"] = "the all-reduce gave wrong sums"
    return out


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
    name, rank, nnodes = inst.get("name"), int(inst.get("node_rank") or 0), int(inst.get("nnodes") or 1)
    dvar = _dist_var(inst)
    out = {"instance": name, "node_rank": rank, "nnodes": nnodes, "host": host, "handshake": None, "allreduce": None}
    problems, rank0 = peers_problems(inst, host, ranks)
    if problems or rank0 is None:
        return {**out, "ok": False, "problems": problems, "store_port": None}
    dhost, port = parse_dist_init_addr(inst.get("dist_init_addr"))
    store_port, listener = rank0.get("store_port"), bool(rank0.get("listener"))
    out["store_port"] = store_port
    advice = _iface_advice(inst)
    if rank == 0:
        if listener:
            addr = ((rank0.get("resolved") or [dhost]) + [dhost])[0]
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            hs = serve(port, family, name, set(range(1, nnodes)), timeout_s)
            out["handshake"] = hs
            if hs["error"]:
                problems.append(
                    f"{dvar}: rank 0 on {host} {hs['error']}: choose another port in dist_init_addr or free it"
                )
            elif hs["missing"]:
                problems.append(
                    f"{dvar}: rank(s) {', '.join(map(str, hs['missing']))} never connected to {dhost}:{port} on {host} "
                    f"(rank 0) within {timeout_s:g} s: on those nodes {dhost} must resolve to this host and port {port} "
                    "must not be blocked on the way (their own messages say what they saw)"
                )
    else:
        why = "no address"
        try:
            addrs = resolver(dhost, port)
        except OSError as exc:
            addrs, why = [], exc.strerror or str(exc)
        if not addrs:
            problems.append(f"{dvar}: {dhost} does not resolve on {host} (rank {rank}): {why}")
        else:
            hs = hello(addrs, port, name, rank, host, timeout_s, banner=listener)
            out["handshake"] = hs
            if not hs["ok"]:
                problems.append(
                    f"{dvar}: {dhost}:{port} ({', '.join(addrs)}) is not reachable from {host} (rank {rank}) within "
                    f"{timeout_s:g} s: {hs['error']}. Check that {dhost} resolves here to rank 0's address, that rank 0 "
                    f"runs this check at the same time, and that no firewall drops port {port} between the nodes"
                )
    if problems:
        return {**out, "ok": False, "problems": problems}
    res = allreduce(
        python or inst.get("python") or "python3", inst.get("env") or {}, rank, nnodes, dhost, store_port, timeout_s
    )
    out["allreduce"] = res
    if not res["ok"]:
        via = f"MASTER_ADDR={dhost} MASTER_PORT={store_port} (from {dvar})"
        if res.get("timed_out"):
            what = f"did not complete within {timeout_s:g} s on {host} (rank {rank}): a rank never joined the group at {via}"
        else:
            what = f"failed on {host} (rank {rank}) with {via}: {res['error']}"
        problems.append(
            f"the gloo all-reduce over {nnodes} nodes {what}. The ranks connect to each other directly on the address of "
            f"the interface gloo uses: check {advice} on every rank"
        )
    return {**out, "ok": not problems, "problems": problems}
