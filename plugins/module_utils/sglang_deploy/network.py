"""This host's network as the ranks of an instance over several nodes use it: its interfaces and their addresses,
the interfaces NCCL_SOCKET_IFNAME selects (NCCL's own rules), what a name resolves to, whether an address is this
host's, and whether a port is free, held by the instance's own unit, or taken (and by whom).

Read by the rendezvous check (rendezvous.check) on every rank; no Ansible here.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

from .procinfo import listening_inodes, socket_holders
from .secret_rule import clip

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


# ---------------------------------------------------------------- addresses and ports
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
    host_checks.check_port tells it apart; anyone else's is ``taken``; no listener and a bind that works is ``free``.
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
