"""Whether a URL points at a public address: the one place that judges hosts for anything
llmq might fetch (SSRF).

A host is judged the way a fetcher would reach it, never as written: IPv4 literals are
read with `inet_aton` rules (`127.1`, `0x7f000001`, `2130706433`, `0177.0.0.1`,
`0x7f.1` are all 127.0.0.1), IPv6 literals that carry an IPv4 address (mapped
`::ffff:a.b.c.d`, compatible `::a.b.c.d`, 6to4 `2002::/16`, NAT64 `64:ff9b::/96`) are judged
by that address too, and names are resolved (with a time limit) and refused when ANY address
they resolve to is not public — a name that does not resolve is refused as well.

llmq fetches no URL today (the served models are text-only, and image parts are refused
after this check), so there is no redirect to follow here. Whatever fetches later (image
inputs, webhooks) must call `url_refusal` on the first URL and on every redirect target,
and connect to the addresses it was given, not re-resolve the name.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Names that are local by definition or by every cloud's convention; refused without asking DNS.
_LOCAL_NAMES = frozenset(
    {
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
        "metadata",
        "metadata.google.internal",
        "instance-data",
        "instance-data.ec2.internal",
    }
)

# Cloud instance-metadata endpoints that are not caught as private/link-local by their range
# (Alibaba's sits in shared address space, Azure's WireServer in a public block).
_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "168.63.129.16", "fd00:ec2::254")
)

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_IPV4ISH = re.compile(r"^[0-9][0-9a-fx.]*$")
_AMBIGUOUS_AUTHORITY = re.compile(r"[\\\s\x00-\x1f\x7f]")


class UnresolvableHost(Exception):
    """The name has no address, or the resolver did not answer in time."""


Resolver = Callable[[str], Sequence[IPAddress]]


def parse_ipv4(host: str) -> ipaddress.IPv4Address | None:
    """`host` as the C library's `inet_aton` reads it (what curl, requests and most fetchers
    end up connecting to), or None when it is not an IPv4 literal: one to four parts, each
    decimal, octal (leading 0) or hex (0x); the last part fills the remaining bytes."""
    host = host.lower().removesuffix(".")
    if not _IPV4ISH.match(host) or len(host) > 64:
        return None
    parts = host.split(".")
    if len(parts) > 4 or "" in parts:
        return None
    values: list[int] = []
    for part in parts:
        try:
            if part.startswith("0x"):
                values.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                values.append(int(part[1:], 8))
            else:
                values.append(int(part, 10))
        except ValueError:
            return None
    *leading, last = values
    if any(v > 255 for v in leading) or last >= 256 ** (5 - len(values)):
        return None
    number = last
    for i, v in enumerate(leading):
        number += v << (8 * (3 - i))
    return ipaddress.IPv4Address(number)


def parse_ip(host: str) -> IPAddress | None:
    """An IP literal in any form a fetcher accepts (brackets and IPv6 zone ids allowed)."""
    bare = host.strip("[]")
    try:
        address = ipaddress.ip_address(bare.split("%", 1)[0])
    except ValueError:
        return parse_ipv4(bare)
    return address


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, compatible, 6to4, NAT64), if any."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_refusal(address: IPAddress) -> str | None:
    """Why connecting to `address` is not allowed (what kind of address it is), or None
    when it is a public unicast address."""
    inner = embedded_ipv4(address)
    if inner is not None:
        why = address_refusal(inner)
        if why is not None:
            return f"{why}, carried in an IPv6 address"
        if isinstance(address, ipaddress.IPv6Address) and (address in _NAT64 or address.sixtofour):
            return None  # a translation prefix in front of a public IPv4 address
    if address in _METADATA:
        return "a cloud metadata address"
    for kind, flag in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
    ):
        if flag:
            return kind
    if not address.is_global:
        return "not globally routable"
    return None


def is_public_address(address: IPAddress) -> bool:
    """True when a fetch may connect to `address`: not loopback, private, link-local,
    reserved, unspecified, multicast, shared or a cloud metadata address, in any of its
    IPv4-in-IPv6 forms."""
    return address_refusal(address) is None


def url_refusal(url: str, resolve: Resolver) -> str | None:
    """Why fetching `url` is not allowed, or None. `data:` URLs carry their bytes and are
    allowed; other schemes but http(s) are refused; the host is parsed as a fetcher would,
    and a name is resolved with `resolve` and refused if any of its addresses is not public
    or it does not resolve."""
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
    except ValueError as exc:
        return f"the URL cannot be parsed ({exc}), which is not allowed"
    if parts.scheme == "data":
        return None
    if parts.scheme not in ("http", "https"):
        return f"scheme `{parts.scheme or '(none)'}` is not allowed (only http, https and data)"
    if not host:
        return "the URL has no host, which is not allowed"
    if _AMBIGUOUS_AUTHORITY.search(parts.netloc):
        # `http://127.0.0.1\@example.com`: Python reads host example.com, browsers and
        # WHATWG-style fetchers read 127.0.0.1. Refuse rather than guess which one fetches.
        return "the URL's host part holds a backslash, space or control character: not allowed"
    name = host.removesuffix(".")
    if name in _LOCAL_NAMES or name.endswith((".localhost", ".internal", ".local")):
        return f"host `{host}` is local: the address is not allowed"
    literal = parse_ip(host)
    if literal is not None:
        why = address_refusal(literal)
        if why is None:
            return None
        written = "" if str(literal) == host.strip("[]") else f" (written `{host}`)"
        return f"the address {literal}{written} is not allowed: {why}"
    try:
        addresses = resolve(name)
    except UnresolvableHost as exc:
        return f"host `{host}` {exc}, so its address cannot be checked: not allowed"
    for address in addresses:
        why = address_refusal(address)
        if why is not None:
            return f"host `{host}` resolves to {address}, an address that is not allowed: {why}"
    return None


class SystemResolver:
    """The operating system's resolver (getaddrinfo), bounded in time, with a short cache.

    getaddrinfo has no timeout of its own, so lookups run on a few threads and a caller
    waits at most `timeout_seconds` (queueing included); a lookup that hangs occupies one
    thread until the OS gives up, never the request. Answers, failures included, are kept
    for `cache_seconds` so a file of lines naming one slow host waits once.
    """

    def __init__(self, timeout_seconds: float, *, cache_seconds: float = 60.0, threads: int = 4) -> None:
        self._timeout = timeout_seconds
        self._ttl = cache_seconds
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._cache: dict[str, tuple[float, tuple[IPAddress, ...] | str]] = {}
        self._lock = threading.Lock()

    def __call__(self, host: str) -> Sequence[IPAddress]:
        """Every address `host` resolves to. Raises UnresolvableHost."""
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(host)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="llmq-resolve")
            pool = self._pool
        if hit is not None and hit[0] > now:
            answer = hit[1]
        else:
            try:
                answer = pool.submit(_lookup, host).result(timeout=self._timeout)
            except FutureTimeout:
                answer = f"did not resolve within {self._timeout:g} s"
            with self._lock:
                if len(self._cache) >= 4096:
                    self._cache.clear()
                self._cache[host] = (now + self._ttl, answer)
        if isinstance(answer, str):
            raise UnresolvableHost(answer)
        return answer


def _lookup(host: str) -> tuple[IPAddress, ...] | str:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return "does not resolve"
    found = {parse_ip(str(info[4][0])) for info in infos}
    addresses = tuple(a for a in found if a is not None)
    return addresses or "does not resolve"


@functools.cache
def system_resolver(timeout_seconds: float) -> SystemResolver:
    """One resolver (threads and cache) per process and time limit, made on first use."""
    return SystemResolver(timeout_seconds)
