"""A worker's URL: the one spelling the router role registers and the rollout names (``worker_url``), the spellings a
gateway lists or is posted (``normalize``, ``posted``), and whether two spellings name one worker (``same_worker``).

A worker is one worker whatever the spelling of its URL: the router may list it under an address where the inventory
names a host, an explicit default port, an upper-case scheme. Names are resolved where this runs (the router's host:
the addresses the router connects to), through an injected ``getaddrinfo`` (tests pass fakes).
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from collections.abc import Callable

DEFAULT_PORTS = {"http": 80, "https": 443}


def worker_url(host: str, port: int, scheme: str = "http") -> str:
    """A worker's URL as the router role registers it and the rollout names it: scheme://host:port, an IPv6
    address in brackets (the one place this is written; roles reach it through the sglang_worker_url filter)."""
    host = str(host).strip().strip("[]")
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{int(port)}"


def normalize(url: str) -> str:
    """A worker URL as the router lists it: no trailing slash."""
    return str(url).strip().rstrip("/")


def canonical(url: str) -> str:
    """A worker URL in one spelling: scheme and host lower-cased, the port explicit (http 80, https 443), an IPv6
    address in brackets and compressed (an IPv4-mapped one as IPv4), no trailing dot, slash or path.
    ValueError when it is not a URL with a host (a port that is not a number, no scheme)."""
    text = str(url).strip()
    parts = urllib.parse.urlsplit(text)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")  # urlsplit lower-cases it and takes the brackets off
    if not scheme or "://" not in text or not host:
        raise ValueError(f"not a worker URL (scheme://host:port): {url!r}")
    port = parts.port  # ValueError for a port that is not a number or out of range
    if port is None:
        if scheme not in DEFAULT_PORTS:
            raise ValueError(f"no port, and no default port for {scheme}: {url!r}")
        port = DEFAULT_PORTS[scheme]
    host = _address(host) or host
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def posted(url: str) -> str:
    """The spelling ``add`` posts: the scheme lower-cased, no trailing slash or path, the host and port as written
    (the router role's spelling). sglang-router 0.3.2 takes an upper-case scheme for none (it asked
    ``http://http//LOCALHOST:P//health`` of ``HTTP://LOCALHOST:P/`` and never listed it) and lists a trailing
    slash as one more worker (docs/router.md)."""
    parts = urllib.parse.urlsplit(str(url).strip())
    if not parts.scheme or not parts.netloc:
        return normalize(url)
    return f"{parts.scheme.lower()}://{parts.netloc}"


def _address(text: str) -> str | None:
    """An IP address in one spelling (IPv6 compressed, an IPv4-mapped one as IPv4), or None for a name."""
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


class Resolver:
    """Whether two worker URLs name one worker (``same``): the same canonical URL, or the same scheme and port
    on hosts that resolve to a common address (socket.getaddrinfo where this runs, the router's host: the
    addresses the router connects to). Each host is resolved once per Resolver (make one per decision); a host
    that does not resolve is compared by its canonical name only."""

    def __init__(self, getaddrinfo: Callable = socket.getaddrinfo):
        self.getaddrinfo = getaddrinfo
        self.cache: dict[str, frozenset[str] | None] = {}

    def addresses(self, host: str) -> frozenset[str] | None:
        """The host's addresses (an address: itself), None when it does not resolve."""
        literal = _address(host)
        if literal:
            return frozenset([literal])
        if host not in self.cache:
            try:
                infos = self.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
                found = frozenset(a for a in (_address(str(i[4][0]).split("%", 1)[0]) for i in infos) if a)
            except (OSError, UnicodeError, ValueError):  # socket.gaierror is an OSError
                found = None
            self.cache[host] = found or None
        return self.cache[host]

    def same(self, a: str, b: str) -> bool:
        try:
            ca, cb = canonical(a), canonical(b)
        except ValueError:
            return normalize(a) == normalize(b)
        if ca == cb:
            return True
        pa, pb = urllib.parse.urlsplit(ca), urllib.parse.urlsplit(cb)
        if pa.scheme != pb.scheme or pa.port != pb.port:
            return False
        ra, rb = self.addresses(pa.hostname or ""), self.addresses(pb.hostname or "")
        return bool(ra and rb and ra & rb)


def same_worker(a: str, b: str, resolver: Resolver | None = None) -> bool:
    """Whether the URLs a and b name one worker (Resolver.same)."""
    return (resolver or Resolver()).same(a, b)
