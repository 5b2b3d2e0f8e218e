"""Which callback URLs Ferry may call: a guard against server-side request forgery.

A callback URL comes from a client, and Ferry's processes sit inside a
network that clients cannot reach. :func:`check_url` resolves the host and
checks every address it resolves to; the caller then connects to one of those
checked addresses (never resolving again, so a DNS answer that changes between
the check and the connection cannot redirect the request).

Refused unless an operator allow-list admits them: loopback, private
(RFC 1918, unique local), shared (100.64/10), link-local (including the cloud
metadata address 169.254.169.254), multicast, reserved, unspecified and
documentation addresses, in IPv4 and IPv6, including IPv4 addresses carried
inside IPv6 (mapped ``::ffff:a.b.c.d``, 6to4, Teredo, NAT64).

The resolver is passed in, so tests never query DNS.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port -> the addresses the name resolves to. Raises ResolutionError.
Resolver = Callable[[str, int], list[str]]

# Named so the refusal says what the address is; each is also not global.
METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)
NAT64 = ipaddress.ip_network("64:ff9b::/96")


class UrlRefused(ValueError):
    """The URL may not be called; ``reason`` says why, in words for the client."""

    def __init__(self, reason: str, *, permanent: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        # False: the name did not resolve now (DNS trouble), it may later.
        self.permanent = permanent


class ResolutionError(Exception):
    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


@dataclass(frozen=True)
class UrlPolicy:
    allow_http: bool = False
    allowed_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def of(cls, allow_http: bool, allowed_networks: Sequence[str]) -> UrlPolicy:
        return cls(allow_http, tuple(ipaddress.ip_network(n) for n in allowed_networks))


@dataclass(frozen=True)
class Target:
    """A checked URL: connect to one of ``addresses``, send ``host`` as the Host."""

    url: str
    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent in the request line
    addresses: tuple[str, ...] = field(default=())

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


def system_resolver(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        temporary = exc.errno in (socket.EAI_AGAIN, getattr(socket, "EAI_SYSTEM", None))
        raise ResolutionError(
            f"{host} does not resolve ({exc.strerror})", temporary=temporary
        ) from None
    # Keep getaddrinfo's order (it prefers what the host can reach), once each.
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def parse_url(url: str, policy: UrlPolicy) -> Target:
    """Check the URL's form (scheme, host, port, no credentials) without resolving it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefused(f"not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UrlRefused(f"scheme {scheme or '(none)'!r} is not allowed; use https")
    if scheme == "http" and not policy.allow_http:
        raise UrlRefused("only https URLs are allowed")
    if not parts.hostname:
        raise UrlRefused("the URL has no host")
    if parts.username is not None or parts.password is not None:
        raise UrlRefused("credentials in the URL are not allowed")
    if port == 0:
        raise UrlRefused("port 0 is not a port one can call")
    if parts.fragment:
        raise UrlRefused("a fragment (#...) is not allowed")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if any(c == " " or ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise UrlRefused("the path must not contain spaces or control characters")
    return Target(
        url=url,
        scheme=scheme,
        host=parts.hostname,
        port=port if port is not None else (443 if scheme == "https" else 80),
        path=path,
    )


def check_url(url: str, policy: UrlPolicy, resolve: Resolver) -> Target:
    """The checked target, or :class:`UrlRefused` saying why it may not be called."""
    target = parse_url(url, policy)
    literal = _literal(target.host)
    if literal is not None:
        addresses = [str(literal)]
    else:
        try:
            addresses = resolve(target.host, target.port)
        except ResolutionError as exc:
            raise UrlRefused(str(exc), permanent=not exc.temporary) from None
        if not addresses:
            raise UrlRefused(f"{target.host} resolves to no address", permanent=False)
    for address in addresses:
        why = refusal(ipaddress.ip_address(address.split("%", 1)[0]), policy)
        if why is not None:
            shown = "" if literal is not None else f"{target.host} resolves to "
            raise UrlRefused(f"{shown}{address}, {why}")
    return replace(target, addresses=tuple(addresses))


def refusal(address: IPAddress, policy: UrlPolicy) -> str | None:
    """Why this address may not be called (None: it may)."""
    if any(address in network for network in policy.allowed_networks):
        return None
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            why = refusal(embedded, policy)
            return None if why is None else f"which carries {embedded}, {why}"
    for test, why in (
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_multicast", "a multicast address"),
        ("is_unspecified", "an unspecified address"),
        # Reserved before private: Python's table of private networks has changed between
        # patch releases (64:ff9b:1::/48 was private in 3.11.2, not in 3.11.7), its
        # reserved ones have not, and the reason given must not depend on the interpreter.
        ("is_reserved", "a reserved address"),
        ("is_private", "a private address"),
        # fec0::/10, deprecated but still routed inside some networks.
        ("is_site_local", "a site-local address"),
    ):
        if getattr(address, test, False):  # is_site_local: IPv6 only
            return why
    if not address.is_global:
        return "not a public address"
    return None


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]  # the client's address
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
