"""Webhook requests that cannot reach inside the network.

An operator writes a webhook's URL, but the request leaves from a worker inside the network, and
a viewer reads back how it went ("Connection refused", "answered 418"): left unchecked, a
webhook reaches the cloud metadata service (169.254.169.254), databases and admin ports on
private addresses, and this very host, and reports on them.

So a webhook connects only to public addresses, unless STEPGUARD_WEBHOOK_ALLOW lists the
address (or a network holding it) or the URL's host name. The check is made as the connection
is opened: the host is resolved once, refused if any address it resolves to is loopback,
link-local, private, multicast, reserved, unspecified or otherwise not public (IPv4, IPv6, and
IPv4 inside IPv6), and the socket connects to an address that was checked. Nothing resolves the
name a second time, so a name cannot answer a public address to the check and an inside one to
the connection (DNS rebinding). The URL's host still goes in the Host header, and in TLS's SNI
and certificate check. Environment proxies (HTTPS_PROXY) are not used: through a proxy, the
address connected would be the proxy's, not the receiver's. Redirects are not followed.

This is the way Sentry (`sentry.net.socket.safe_create_connection`) and healthchecks
(`hc/lib/curl.py`, through curl's open-socket callback) guard their outgoing hooks.
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import logging
import re
import socket
import urllib.request
from urllib.parse import urlsplit

from django.conf import settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

log = logging.getLogger("stepguard.notifications")

SETTING = "STEPGUARD_WEBHOOK_ALLOW"
#: One label of a host name (letters, digits, hyphens; underscores, which some internal DNS
#: names carry); a name is labels joined by dots, the last one not all digits.
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)\Z")
#: IPv6 addresses carrying an IPv4 one that a gateway reaches for them (RFC 6052 NAT64).
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class Refused(OSError):
    """The target is inside the network, and STEPGUARD_WEBHOOK_ALLOW does not let it through."""


def host_name(text: str) -> bool:
    """Whether `text` is a DNS host name (not an address in any spelling)."""
    name = text.lower().removesuffix(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        return False
    return not labels[-1].isdigit() and _ipv4_spelling(name) is None


def _ipv4_spelling(text: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address `text` spells the way the C resolver reads it (`2130706433`,
    `0x7f000001`, `0177.0.0.1`, `127.1`), or None."""
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except (OSError, ValueError):
        return None


def literal(host: str) -> Address | None:
    """The address `host` is written as, in any spelling, or None for a name."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return _ipv4_spelling(host)


def parse_allow(items: list[str] | tuple[str, ...], name: str = SETTING):
    """STEPGUARD_WEBHOOK_ALLOW's entries as (networks, host names); ValueError naming the first
    entry that is neither an address or network (`10.0.0.0/8`, `::1`) nor a host name."""
    networks: list[Network] = []
    hosts: set[str] = set()
    for item in items:
        try:
            network = ipaddress.ip_network(item, strict=False)
        except ValueError:
            pass
        else:
            if network.prefixlen == 0:
                raise ValueError(
                    f"{name}: {item!r} allows every address, which turns the guard off: list"
                    " the addresses or networks your receivers are in"
                )
            networks.append(network)
            continue
        if not host_name(item):
            raise ValueError(
                f"{name}: {item!r} is not an address, a network (10.0.0.0/8) or a host name"
            )
        hosts.add(item.lower().removesuffix("."))
    return tuple(networks), frozenset(hosts)


@functools.lru_cache(maxsize=8)
def _allowed(items: tuple[str, ...]):
    return parse_allow(items)


def allowlist():
    return _allowed(tuple(getattr(settings, SETTING, ()) or ()))


def _embedded(ip: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, NAT64), or None."""
    if ip.version != 6:
        return None
    assert isinstance(ip, ipaddress.IPv6Address)
    if ip.ipv4_mapped or ip.sixtofour:
        return ip.ipv4_mapped or ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def inside(ip: Address) -> str | None:
    """What kind of address inside the network `ip` is ("a loopback address"...), or None for
    a public one."""
    ip = _embedded(ip) or ip
    kinds = ("unspecified", "loopback", "link_local", "site_local", "multicast", "reserved")
    for kind in (*kinds, "private"):
        if getattr(ip, f"is_{kind}", False):  # site-local (fec0::/10) is IPv6's alone
            article = "an" if kind == "unspecified" else "a"
            return f"{article} {kind.replace('_', '-')} address"
    if not ip.is_global:  # shared (100.64.0.0/10), documentation, benchmarking...
        return "not a public address"
    return None


def check(host: str, ip: Address) -> None:
    """Raise Refused unless `ip` (what `host` resolved to) is public or allowed."""
    kind = inside(ip)
    if kind is None:
        return
    networks, hosts = allowlist()
    if host.lower().strip("[]").removesuffix(".") in hosts:
        return
    if any(candidate in net for net in networks for candidate in {ip, _embedded(ip) or ip}):
        return
    stands_for = _embedded(ip) or ip
    how = f"unless {SETTING} lists the address, its network or the host"
    if literal(host) is None:
        # A name: what it resolves to inside is not said to whoever reads the refusal (a
        # viewer reads deliveries' errors): that would map the inside's DNS. The log says.
        log.warning("webhook to %s refused: it resolves to %s, %s", host, stands_for, kind)
        raise Refused(
            f"refused: {host} resolves to an address inside the network; webhooks reach only"
            f" public addresses {how}"
        )
    shown = f"{host} is" if host.strip("[]") == str(stands_for) else f"{host} is {stands_for},"
    raise Refused(f"refused: {shown} {kind}; webhooks reach only public addresses {how}")


def connect(address, timeout=None, source_address=None) -> socket.socket:
    """`socket.create_connection`, checked: resolve once, refuse the whole name if any of its
    addresses is inside and not allowed, then connect to the addresses checked, in order."""
    host, port = address
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    for *_, sockaddr in infos:
        check(host, ipaddress.ip_address(str(sockaddr[0]).split("%")[0]))
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            if isinstance(timeout, int | float):  # else http.client's "the default" marker
                sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error or OSError(f"{host} resolves to no address")


class _Checked:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # http.client opens its socket through this attribute (its own hook for replacing
        # create_connection); TLS is then wrapped around our socket, with the URL's host
        # name as SNI and for the certificate check.
        self._create_connection = connect


class _HTTPConnection(_Checked, http.client.HTTPConnection):
    pass


class _HTTPSConnection(_Checked, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req):
        return self.do_open(_HTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req):
        # The default TLS context: certificates verified against the URL's host name.
        return self.do_open(_HTTPSConnection, req)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a POST is not followed elsewhere: the 3xx is the answer


#: An opener whose every connection is checked; no proxies, no redirects.
opener = urllib.request.build_opener(
    urllib.request.ProxyHandler({}), _HTTPHandler, _HTTPSHandler, _NoRedirects
)

#: Characters a webhook URL may hold: printable ASCII but the space (no CR, LF, tab, NUL...).
_URL_CHARS = re.compile(r"[\x21-\x7e]+\Z")


def check_url(url: str) -> str:
    """`url` if it is a webhook URL Stepguard sends to, else ValueError naming the problem:
    http or https, a host, no credentials, no whitespace or control characters (a CR or LF
    would write headers of its own), ASCII only, and, when the host is written as an address
    (in any spelling) or is `localhost`, an address outside the network or allowed. Host
    names are checked when a delivery connects, against what they resolve to then."""
    if not url:
        raise ValueError("a webhook needs a URL")
    if not _URL_CHARS.match(url):
        bad = next(c for c in url if not _URL_CHARS.match(c))
        what = "non-ASCII characters" if ord(bad) > 0x7E else f"the character {bad!r}"
        raise ValueError(
            f"a webhook URL may not hold {what} (encode it: %-escapes, punycode for a host)"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"a webhook needs an http:// or https:// URL, not {url!r}")
    if "@" in parts.netloc:
        raise ValueError("put a webhook's credentials in its secret, not in its URL")
    host = parts.hostname or ""
    if not host:
        raise ValueError(f"a webhook URL needs a host: {url!r}")
    address = literal(host)
    if address is None and not host_name(host):
        raise ValueError(f"{host!r} is not a host name or an address")
    if address is not None or host == "localhost" or host.endswith(".localhost"):
        try:
            infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
            for *_, sockaddr in infos:
                check(host, ipaddress.ip_address(str(sockaddr[0]).split("%")[0]))
        except Refused as exc:
            raise ValueError(str(exc)) from None
        except OSError:
            pass  # unresolvable here: the delivery will say so
    return url


def redact(url: str) -> str:
    """The scheme and host (and port) of `url`, for people who may not read the rest: a Slack
    webhook's path is its secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(not a URL)"
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
