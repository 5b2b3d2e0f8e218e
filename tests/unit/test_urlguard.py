"""The SSRF guard for callback URLs: form, literal addresses, resolved names, allow-lists.

Every resolver here is a fake: a dict of answers, or one that fails the test if
it is called at all (literal addresses must never be resolved).
"""

from __future__ import annotations

import ipaddress

import pytest

from core.ops.urlguard import (
    ResolutionError,
    Resolver,
    Target,
    UrlPolicy,
    UrlRefused,
    check_url,
    parse_url,
    refusal,
)

HTTPS_ONLY = UrlPolicy()
ALLOW_HTTP = UrlPolicy(allow_http=True)

PUBLIC_V4 = "93.184.216.34"
PUBLIC_V6 = "2606:2800:220:1:248:1893:25c8:1946"


class FakeResolver:
    """Answers from a dict; a name not in it does not exist (NXDOMAIN)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.calls.append((host, port))
        if host not in self.answers:
            raise ResolutionError(f"{host} does not resolve", temporary=False)
        return list(self.answers[host])


def never_resolve(host: str, port: int) -> list[str]:
    pytest.fail(f"resolved {host}:{port}, but a literal address must never be resolved")


def failing(error: ResolutionError) -> Resolver:
    def resolve(host: str, port: int) -> list[str]:
        raise error

    return resolve


def refused(url: str, policy: UrlPolicy, resolve: Resolver = never_resolve) -> UrlRefused:
    with pytest.raises(UrlRefused) as info:
        check_url(url, policy, resolve)
    return info.value


# --- literal addresses ---------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        # IPv4
        ("https://127.0.0.1/", ("127.0.0.1", "loopback")),
        ("https://127.255.255.254/", ("loopback",)),
        ("https://169.254.169.254/latest/meta-data", ("169.254.169.254", "metadata")),
        ("https://169.254.170.2/v2/credentials", ("metadata",)),  # ECS task metadata
        ("https://100.100.100.200/", ("metadata",)),  # Alibaba Cloud metadata
        ("https://169.254.1.1/", ("link-local",)),
        ("https://10.0.0.1", ("10.0.0.1", "private")),
        ("https://192.168.1.5", ("192.168.1.5", "private")),
        ("https://172.16.0.1", ("172.16.0.1", "private")),
        ("https://172.31.255.254", ("private",)),
        ("https://100.64.0.1", ("100.64.0.1", "not a public address")),  # shared, RFC 6598
        ("https://224.0.0.1", ("multicast",)),
        ("https://0.0.0.0", ("unspecified",)),
        # 240/4 is "reserved for future use"; Python's ipaddress also counts it
        # private, and the guard tests is_private first, so that is the word.
        ("https://240.0.0.1", ("240.0.0.1", "reserved")),  # 240.0.0.0/4: reserved for future use
        # IPv6
        ("https://[::1]", ("::1", "loopback")),
        ("https://[::]", ("unspecified",)),
        ("https://[fe80::1]", ("fe80::1", "link-local")),
        ("https://[fe80::1%25eth0]/", ("link-local",)),  # with a zone id
        ("https://[fc00::1]", ("fc00::1", "private")),
        ("https://[fd12:3456::1]", ("private",)),
        ("https://[fd00:ec2::254]", ("fd00:ec2::254", "metadata")),  # AWS IMDS over IPv6
        ("https://[ff02::1]", ("multicast",)),
        ("https://[64:ff9b:1::a00:1]", ("reserved",)),  # local-use NAT64, RFC 8215
        ("https://[::127.0.0.1]", ("reserved",)),  # deprecated IPv4-compatible form
        # IPv4 carried inside IPv6: judged by the IPv4 address
        ("https://[::ffff:10.0.0.1]", ("carries 10.0.0.1", "private")),
        ("https://[::ffff:127.0.0.1]", ("carries 127.0.0.1", "loopback")),
        ("https://[::ffff:169.254.169.254]", ("carries 169.254.169.254", "metadata")),
        ("https://[2002:a00:1::1]", ("carries 10.0.0.1", "private")),  # 6to4
        ("https://[2002:7f00:1::1]", ("carries 127.0.0.1", "loopback")),  # 6to4
        ("https://[64:ff9b::a00:1]", ("carries 10.0.0.1", "private")),  # NAT64
        ("https://[64:ff9b::a9fe:a9fe]", ("carries 169.254.169.254", "metadata")),  # NAT64
        # Teredo: the client address is stored inverted (~10.0.0.1 = f5ff:fffe)
        ("https://[2001:0:4136:e378:8000:63bf:f5ff:fffe]", ("carries 10.0.0.1", "private")),
    ],
)
def test_literal_address_is_refused_without_resolving(url: str, words: tuple[str, ...]) -> None:
    exc = refused(url, HTTPS_ONLY)
    assert exc.permanent is True
    for word in words:
        assert word in exc.reason, (word, exc.reason)
    # A literal is not reported as a name that resolves to something.
    assert "resolves to" not in exc.reason


def test_ipv6_site_local_is_refused() -> None:
    # fec0::/10: deprecated site-local (RFC 3879), the private range ULA replaced;
    # not routable on the internet, and still used inside some networks.
    exc = refused("https://[fec0::1]/", HTTPS_ONLY)
    assert exc.permanent is True


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("https://8.8.8.8/", "8.8.8.8"),
        (f"https://{PUBLIC_V4}/", PUBLIC_V4),
        (f"https://[{PUBLIC_V6}]/", PUBLIC_V6),
        ("https://[::ffff:8.8.8.8]/", "::ffff:808:808"),  # mapped public IPv4
        ("https://[64:ff9b::808:808]/", "64:ff9b::808:808"),  # NAT64 of a public IPv4
    ],
)
def test_public_literal_is_admitted_without_resolving(url: str, address: str) -> None:
    target = check_url(url, HTTPS_ONLY, never_resolve)
    assert target.addresses == (address,)
    assert target.port == 443


def test_http_loopback_needs_allow_http_and_an_allow_list() -> None:
    url = "http://127.0.0.1/"

    https_only = refused(url, HTTPS_ONLY)
    assert "https" in https_only.reason
    assert https_only.permanent is True

    no_allow_list = refused(url, UrlPolicy.of(True, []))
    assert "loopback" in no_allow_list.reason
    assert "127.0.0.1" in no_allow_list.reason
    assert no_allow_list.permanent is True

    target = check_url(url, UrlPolicy.of(True, ["127.0.0.1/32"]), never_resolve)
    assert target == Target(
        url=url, scheme="http", host="127.0.0.1", port=80, path="/", addresses=("127.0.0.1",)
    )
    assert target.host_header == "127.0.0.1"


def test_allow_list_for_one_loopback_address_admits_no_other() -> None:
    policy = UrlPolicy.of(True, ["127.0.0.1/32"])
    exc = refused("http://127.0.0.2:8080/", policy)
    assert "loopback" in exc.reason


@pytest.mark.parametrize("url", ["http://169.254.169.254/", "http://169.254.169.254/latest/"])
def test_metadata_over_http(url: str) -> None:
    assert "https" in refused(url, HTTPS_ONLY).reason
    assert "metadata" in refused(url, ALLOW_HTTP).reason


# --- names and what they resolve to -------------------------------------------


def test_name_resolving_to_a_private_address_is_refused() -> None:
    resolve = FakeResolver({"hooks.internal.example": ["10.1.2.3"]})
    exc = refused("https://hooks.internal.example/x", HTTPS_ONLY, resolve)
    assert exc.reason == "hooks.internal.example resolves to 10.1.2.3, a private address"
    assert exc.permanent is True
    assert resolve.calls == [("hooks.internal.example", 443)]


@pytest.mark.parametrize(
    ("addresses", "bad", "word"),
    [
        ([PUBLIC_V4, "10.1.2.3"], "10.1.2.3", "private"),
        (["10.1.2.3", PUBLIC_V4], "10.1.2.3", "private"),
        ([PUBLIC_V4, PUBLIC_V6, "127.0.0.1"], "127.0.0.1", "loopback"),
        ([PUBLIC_V6, "fd00::5"], "fd00::5", "private"),
        ([PUBLIC_V4, "::ffff:169.254.169.254"], "::ffff:169.254.169.254", "metadata"),
        ([PUBLIC_V4, "fe80::1%eth0"], "fe80::1%eth0", "link-local"),
    ],
)
def test_every_resolved_address_is_checked(addresses: list[str], bad: str, word: str) -> None:
    resolve = FakeResolver({"mixed.example.com": addresses})
    exc = refused("https://mixed.example.com/hook", HTTPS_ONLY, resolve)
    assert f"mixed.example.com resolves to {bad}," in exc.reason
    assert word in exc.reason
    assert exc.permanent is True


@pytest.mark.parametrize(
    "addresses", [[PUBLIC_V4, PUBLIC_V6], [PUBLIC_V6, PUBLIC_V4], [PUBLIC_V4], [PUBLIC_V6]]
)
def test_name_resolving_only_to_public_addresses_is_admitted(addresses: list[str]) -> None:
    resolve = FakeResolver({"example.com": addresses})
    url = "https://example.com:8443/hooks/ferry?token=abc&x=1"
    target = check_url(url, HTTPS_ONLY, resolve)
    assert target == Target(
        url=url,
        scheme="https",
        host="example.com",
        port=8443,
        path="/hooks/ferry?token=abc&x=1",
        addresses=tuple(addresses),  # in the resolver's order
    )
    assert resolve.calls == [("example.com", 8443)]


def test_numeric_host_that_is_not_a_literal_is_resolved_and_checked() -> None:
    # 2130706433 is 127.0.0.1 to inet_aton; ipaddress does not read it as a
    # literal, so it goes to the resolver, and what comes back is checked.
    resolve = FakeResolver({"2130706433": ["127.0.0.1"]})
    exc = refused("https://2130706433/", HTTPS_ONLY, resolve)
    assert "loopback" in exc.reason
    assert resolve.calls == [("2130706433", 443)]


def test_temporary_resolution_failure_is_not_permanent() -> None:
    resolve = failing(ResolutionError("example.com does not resolve (try again)", temporary=True))
    exc = refused("https://example.com/", HTTPS_ONLY, resolve)
    assert exc.permanent is False
    assert exc.reason == "example.com does not resolve (try again)"


def test_nxdomain_is_permanent() -> None:
    exc = refused("https://nowhere.invalid/", HTTPS_ONLY, FakeResolver({}))
    assert exc.permanent is True
    assert exc.reason == "nowhere.invalid does not resolve"


def test_empty_answer_is_not_permanent() -> None:
    exc = refused("https://empty.example.com/", HTTPS_ONLY, FakeResolver({"empty.example.com": []}))
    assert exc.permanent is False
    assert "empty.example.com" in exc.reason
    assert "no address" in exc.reason


# --- the form of the URL ----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://example.com/file", ("scheme", "'ftp'")),
        ("file:///etc/passwd", ("scheme", "'file'")),
        ("gopher://example.com/_x", ("scheme", "'gopher'")),
        ("javascript:alert(1)", ("scheme", "'javascript'")),
        ("example.com/hook", ("scheme", "(none)")),
        ("//example.com/hook", ("scheme", "(none)")),
        ("http://example.com/hook", ("only https",)),
        ("https:///hook", ("no host",)),
        ("https://:443/hook", ("no host",)),
        ("https://user:pw@example.com/", ("credentials",)),
        ("https://user@example.com/", ("credentials",)),
        ("https://:pw@example.com/", ("credentials",)),
        ("https://evil.example\\@10.0.0.1/", ("credentials",)),
        ("https://example.com/hook#frag", ("fragment",)),
        ("https://example.com:99999/", ("not a valid URL",)),
        ("https://example.com:abc/", ("not a valid URL",)),
        ("https://[::1/", ("not a valid URL",)),
        ("https://example.com/a b", ("spaces",)),
    ],
)
def test_malformed_url_is_refused_permanently(url: str, words: tuple[str, ...]) -> None:
    with pytest.raises(UrlRefused) as info:
        parse_url(url, HTTPS_ONLY)
    assert info.value.permanent is True
    for word in words:
        assert word in info.value.reason, (word, info.value.reason)
    # check_url refuses it the same way, before resolving anything.
    assert refused(url, HTTPS_ONLY).reason == info.value.reason


def test_port_zero_is_refused() -> None:
    # Port 0 cannot be connected to; the URL must not be rewritten to port 443.
    with pytest.raises(UrlRefused) as info:
        parse_url("https://example.com:0/hook", HTTPS_ONLY)
    assert info.value.permanent is True


@pytest.mark.parametrize(
    ("url", "policy", "scheme", "host", "port", "path"),
    [
        ("https://example.com", HTTPS_ONLY, "https", "example.com", 443, "/"),
        ("HTTPS://Example.COM/a?b=c", HTTPS_ONLY, "https", "example.com", 443, "/a?b=c"),
        ("https://example.com:65535/x/y?", HTTPS_ONLY, "https", "example.com", 65535, "/x/y"),
        ("http://example.com:8080/x", ALLOW_HTTP, "http", "example.com", 8080, "/x"),
        (f"https://[{PUBLIC_V6}]:8443/", HTTPS_ONLY, "https", PUBLIC_V6, 8443, "/"),
    ],
)
def test_parse_url_reads_the_target(
    url: str, policy: UrlPolicy, scheme: str, host: str, port: int, path: str
) -> None:
    target = parse_url(url, policy)
    assert target == Target(url, scheme, host, port, path)
    assert target.addresses == ()


# --- the allow-list -------------------------------------------------------------


def test_policy_of_parses_networks() -> None:
    policy = UrlPolicy.of(True, ["10.20.0.0/16", "fd00:1234::/32"])
    assert policy.allow_http is True
    assert policy.allowed_networks == (
        ipaddress.ip_network("10.20.0.0/16"),
        ipaddress.ip_network("fd00:1234::/32"),
    )
    with pytest.raises(ValueError):
        UrlPolicy.of(False, ["10.0.0.1/8"])  # host bits set


@pytest.mark.parametrize(
    ("address", "admitted"),
    [
        ("10.20.3.4", True),
        ("10.20.0.0", True),
        ("10.20.255.255", True),
        ("10.21.0.1", False),
        ("10.19.255.255", False),
        ("192.168.1.1", False),
        ("::ffff:10.20.3.4", True),  # the same address, mapped
        ("::ffff:10.21.0.1", False),
        ("fd00:1234::9", True),
        ("fd00:1235::9", False),
    ],
)
def test_allow_list_admits_only_inside_its_networks(address: str, admitted: bool) -> None:
    policy = UrlPolicy.of(False, ["10.20.0.0/16", "fd00:1234::/32"])
    host = f"[{address}]" if ":" in address else address
    if admitted:
        assert check_url(f"https://{host}/", policy, never_resolve).addresses == (
            str(ipaddress.ip_address(address)),
        )
    else:
        assert "private" in refused(f"https://{host}/", policy).reason


def test_allow_list_applies_to_resolved_names() -> None:
    policy = UrlPolicy.of(False, ["10.20.0.0/16"])
    resolve = FakeResolver({"in.example": ["10.20.3.4"], "out.example": ["10.20.3.4", "10.21.0.1"]})
    assert check_url("https://in.example/", policy, resolve).addresses == ("10.20.3.4",)
    exc = refused("https://out.example/", policy, resolve)
    assert "out.example resolves to 10.21.0.1" in exc.reason


def test_allow_list_is_the_operators_word_even_for_metadata() -> None:
    # As documented: everything is refused *unless an operator allow-list admits it*.
    policy = UrlPolicy.of(False, ["169.254.0.0/16"])
    target = check_url("https://169.254.169.254/", policy, never_resolve)
    assert target.addresses == ("169.254.169.254",)


# --- refusal() directly ------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        (PUBLIC_V4, None),
        (PUBLIC_V6, None),
        ("10.0.0.1", "a private address"),
        ("127.0.0.1", "a loopback address"),
        ("169.254.169.254", "a cloud metadata address"),
        ("169.254.0.1", "a link-local address"),
        ("224.0.0.251", "a multicast address"),
        ("0.0.0.0", "an unspecified address"),
        ("100.64.0.1", "not a public address"),
        ("::ffff:10.0.0.1", "which carries 10.0.0.1, a private address"),
        ("2002:a00:1::1", "which carries 10.0.0.1, a private address"),
        ("64:ff9b::a00:1", "which carries 10.0.0.1, a private address"),
        ("::ffff:8.8.8.8", None),
    ],
)
def test_refusal(address: str, expected: str | None) -> None:
    assert refusal(ipaddress.ip_address(address), HTTPS_ONLY) == expected


def test_refusal_respects_allow_list() -> None:
    policy = UrlPolicy.of(False, ["10.0.0.0/8"])
    assert refusal(ipaddress.ip_address("10.0.0.1"), policy) is None
    assert refusal(ipaddress.ip_address("::ffff:10.0.0.1"), policy) is None
    assert refusal(ipaddress.ip_address("192.168.0.1"), policy) == "a private address"


# --- the Host header -------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "host", "port", "expected"),
    [
        ("https", "example.com", 443, "example.com"),
        ("https", "example.com", 8443, "example.com:8443"),
        ("https", "example.com", 80, "example.com:80"),
        ("http", "example.com", 80, "example.com"),
        ("http", "example.com", 443, "example.com:443"),
        ("https", PUBLIC_V4, 443, PUBLIC_V4),
        ("https", PUBLIC_V6, 443, f"[{PUBLIC_V6}]"),
        ("https", PUBLIC_V6, 8443, f"[{PUBLIC_V6}]:8443"),
        ("http", "::1", 80, "[::1]"),
    ],
)
def test_host_header(scheme: str, host: str, port: int, expected: str) -> None:
    target = Target(url="ignored", scheme=scheme, host=host, port=port, path="/")
    assert target.host_header == expected


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://Example.com:443/", "example.com"),
        ("https://example.com:8443/", "example.com:8443"),
        (f"https://[{PUBLIC_V6}]/", f"[{PUBLIC_V6}]"),
        (f"https://[{PUBLIC_V6}]:8443/", f"[{PUBLIC_V6}]:8443"),
    ],
)
def test_host_header_from_url(url: str, expected: str) -> None:
    assert parse_url(url, HTTPS_ONLY).host_header == expected


# (Tabs and line breaks never get here: urlsplit drops them, as browsers do.)
@pytest.mark.parametrize("path", ["/a\x7fb", "/a\x00b", "/a b"])
def test_control_characters_in_the_path_are_refused(path: str) -> None:
    with pytest.raises(UrlRefused) as info:
        parse_url(f"https://example.com{path}", HTTPS_ONLY)
    assert "control characters" in info.value.reason
    assert info.value.permanent is True
