"""The SSRF filter judges the address a fetcher would connect to, never the host as written."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

import pytest

from app.services.addresses import (
    IPAddress,
    SystemResolver,
    UnresolvableHost,
    is_public_address,
    parse_ipv4,
    url_refusal,
)


class FakeDns:
    """A resolver with fixed answers; names it does not know do not resolve."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, host: str) -> Sequence[IPAddress]:
        self.asked.append(host)
        if host not in self.answers:
            raise UnresolvableHost("does not resolve")
        return [ipaddress.ip_address(a) for a in self.answers[host]]


DNS = FakeDns(
    {
        "cdn.example.com": ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"],
        "rebind.example.com": ["93.184.216.34", "10.0.0.7"],  # one private answer is enough
        "v6loop.example.com": ["::1"],
    }
)


@pytest.mark.parametrize(
    ("written", "address"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("0x7f000001", "127.0.0.1"),
        ("2130706433", "127.0.0.1"),
        ("127.1", "127.0.0.1"),
        ("0177.0.0.1", "127.0.0.1"),
        ("0x7f.1", "127.0.0.1"),
        ("0x7F.0.0.1", "127.0.0.1"),
        ("127.0.1", "127.0.0.1"),
        ("017700000001", "127.0.0.1"),
        ("10.1", "10.0.0.1"),
        ("169.254.43518", "169.254.169.254"),
        ("0", "0.0.0.0"),
        ("127.0.0.1.", "127.0.0.1"),
    ],
)
def test_ipv4_shorthand_is_read_like_inet_aton(written: str, address: str) -> None:
    assert parse_ipv4(written) == ipaddress.IPv4Address(address)


@pytest.mark.parametrize(
    "name", ["example.com", "1.2.3.4.5", "256.0.0.1", "08.0.0.1", "0x1.2.3.4g", "4294967296", "1..2"]
)
def test_names_and_impossible_literals_are_not_ipv4(name: str) -> None:
    assert parse_ipv4(name) is None


@pytest.mark.parametrize(
    "host",
    [
        "0x7f000001",
        "2130706433",
        "127.1",
        "0177.0.0.1",
        "0x7f.1",
        "0",
        "0.0.0.0",
        "10.0.0.5",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",  # shared address space (carrier NAT)
        "169.254.169.254",
        "169.254.43518",
        "100.100.100.200",  # Alibaba Cloud metadata
        "168.63.129.16",  # Azure WireServer
        "224.0.0.1",
        "240.0.0.1",
        "[::1]",
        "[::]",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "[::ffff:169.254.169.254]",
        "[::127.0.0.1]",  # IPv4-compatible
        "[2002:7f00:1::]",  # 6to4 of 127.0.0.1
        "[2002:a9fe:a9fe::1]",  # 6to4 of 169.254.169.254
        "[64:ff9b::7f00:1]",  # NAT64 of 127.0.0.1
        "[64:ff9b::a00:1]",  # NAT64 of 10.0.0.1
        "[fe80::1%25eth0]",
        "[fd00:ec2::254]",
        "[fc00::1]",
        "[ff02::1]",
        "localhost",
        "LOCALHOST.",
        "api.localhost",
        "metadata.google.internal",
    ],
)
def test_every_form_of_a_non_public_address_is_refused(host: str) -> None:
    why = url_refusal(f"http://{host}/x.png", DNS)
    assert why is not None and "not allowed" in why
    assert DNS.asked == [] or host not in DNS.asked  # literals never reach DNS


@pytest.mark.parametrize(
    "url",
    [
        "https://93.184.216.34/cat.png",
        "https://[2606:2800:220:1:248:1893:25c8:1946]/cat.png",
        "https://[64:ff9b::5db8:d822]/cat.png",  # NAT64 of a public address
        "https://cdn.example.com/cat.png",
        "data:image/png;base64,AAAA",
    ],
)
def test_public_addresses_and_names_pass(url: str) -> None:
    assert url_refusal(url, DNS) is None


def test_names_are_judged_by_every_address_they_resolve_to() -> None:
    assert "10.0.0.7" in (url_refusal("https://rebind.example.com/a.png", DNS) or "")
    assert "::1" in (url_refusal("https://v6loop.example.com/a.png", DNS) or "")
    why = url_refusal("https://nowhere.example.com/a.png", DNS)
    assert why is not None and "does not resolve" in why


@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "gopher://example.com/",
        "http:///x",
        "http://[::1/x",
        "http://127.0.0.1\\@cdn.example.com/x.png",  # parser differential: who reads which host
        "http://cdn.example.com@127.0.0.1/x.png",
    ],
)
def test_other_schemes_and_broken_urls_are_refused(url: str) -> None:
    assert url_refusal(url, DNS) is not None


def test_is_public_address() -> None:
    assert is_public_address(ipaddress.ip_address("8.8.8.8"))
    assert not is_public_address(ipaddress.ip_address("::ffff:10.0.0.1"))


def test_the_system_resolver_is_bounded_and_refuses_what_does_not_resolve() -> None:
    resolve = SystemResolver(timeout_seconds=2.0)
    assert ipaddress.ip_address("127.0.0.1") in resolve("localhost")
    with pytest.raises(UnresolvableHost):
        resolve("no-such-host.invalid")  # .invalid never resolves (RFC 2606)
