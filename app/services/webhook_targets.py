"""Where a webhook may be sent: http(s) URLs whose host is public (app/services/addresses.py),
judged when the endpoint is saved and again before every attempt, since a name may resolve
elsewhere later (DNS rebinding). The attempt then connects to the address that was judged,
not to a second lookup: the URL's host is replaced by that address, and the name travels
in the `Host` header and, for https, as the TLS server name (certificates are still checked
against the name). Redirects are never followed (the deliverer treats a 3xx as a failure).

`LLMQ_WEBHOOK_ALLOW_PRIVATE=true` lets an operator send to private and loopback addresses
(receivers inside the same network); the scheme check still applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

from app.services.addresses import Resolver, UnresolvableHost, parse_ip, url_refusal


class Refused(Exception):
    """The URL may not be sent to; the message says why."""


def refusal(url: str, resolve: Resolver, *, allow_private: bool) -> str | None:
    """Why `url` may not receive webhooks, or None."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        _ = parts.port  # a port that is not a number raises here
    except ValueError as exc:
        return f"the URL cannot be parsed ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"scheme `{parts.scheme or '(none)'}` is not allowed (only http and https)"
    if not host:
        return "the URL has no host"
    if allow_private:
        return None
    return url_refusal(url, resolve)


@dataclass(frozen=True)
class Target:
    """What an attempt sends to: the URL (host pinned to a checked address), extra headers
    and httpx request extensions."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, str] = field(default_factory=dict)


def pin(url: str, resolve: Resolver, *, allow_private: bool) -> Target:
    """The target of one attempt. Raises Refused when the URL, or what its name resolves
    to now, is not allowed."""
    why = refusal(url, resolve, allow_private=allow_private)
    if why is not None:
        raise Refused(why)
    parts = urlsplit(url)
    host = parts.hostname or ""
    if allow_private or parse_ip(host) is not None:
        return Target(url)
    try:
        # The same resolver answered the check a moment ago (it caches): same addresses.
        address = resolve(host.removesuffix("."))[0]
    except (UnresolvableHost, IndexError) as exc:
        raise Refused(f"host `{host}` does not resolve") from exc
    literal = f"[{address}]" if address.version == 6 else str(address)
    netloc = literal if parts.port is None else f"{literal}:{parts.port}"
    host_header = host if parts.port is None else f"{host}:{parts.port}"
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    pinned = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    return Target(pinned, {"host": host_header}, extensions)
