"""The client's address behind reverse proxies: X-Forwarded-For, believed only from them.

Everything that goes by a client's address reads REMOTE_ADDR, which comes from the ASGI
scope's `client`: the login and API key lockouts (django-axes), `STEPGUARD_METRICS_ALLOW`,
logs. Behind a proxy, that is the proxy. daphne's own `--proxy-headers` replaces it with the
*first* entry of X-Forwarded-For, from any peer: but a proxy appends the address it saw to
whatever the client sent, so the first entry is the client's to write, and a forged one opened
`/metrics`, rotated past the login lockout, or locked a victim out.

So `ForwardedFor` believes the headers only from a peer in STEPGUARD_TRUSTED_PROXIES, and then
walks X-Forwarded-For from the right, past the proxies it trusts, to the first hop it does not:
the client as the last trusted proxy saw it (the right-most untrusted hop; the way uvicorn's
`--forwarded-allow-ips` and Werkzeug's ProxyFix read the header). Entries to the left of that
are whatever the client wrote, and are ignored. X-Forwarded-Proto is taken from a trusted peer
too. `stepguard serve --proxy-headers` needs the setting, and no longer hands daphne its own flag.
"""

from __future__ import annotations

import ipaddress

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(items: list[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(item, strict=False) for item in items)


def _address(text: str) -> Address | None:
    """A hop of X-Forwarded-For: `1.2.3.4`, `1.2.3.4:5678`, `::1`, `[::1]:5678`; else None."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def _trusted(address: Address | None, trusted: tuple[Network, ...]) -> bool:
    return address is not None and any(address in net for net in trusted)


def client_address(peer: str, forwarded: list[str], trusted: tuple[Network, ...]) -> str:
    """The client's address: `peer` unless it is a trusted proxy; then the right-most hop of
    the X-Forwarded-For values `forwarded` (in the order received) that is not a trusted
    proxy. A hop that is not an address ends the walk at the last address known (a trusted
    proxy's), and when every hop is trusted the left-most one is the client."""
    known = peer
    if not _trusted(_address(peer), trusted):
        return peer
    hops = [hop for value in forwarded for hop in value.split(",") if hop.strip()]
    for hop in reversed(hops):
        address = _address(hop)
        if address is None:
            return known
        known = str(address)
        if not _trusted(address, trusted):
            return known
    return known


class ForwardedFor:
    """ASGI middleware (HTTP and websockets): the scope's client from X-Forwarded-For, and its
    scheme from X-Forwarded-Proto, when the peer is one of `trusted` (addresses, networks)."""

    def __init__(self, app, trusted: list[str]):
        self.app = app
        self.trusted = networks(trusted)

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope.get("client"):
            peer = scope["client"][0]
            if _trusted(_address(peer), self.trusted):
                headers = scope.get("headers", [])
                forwarded = [v.decode("latin1") for k, v in headers if k == b"x-forwarded-for"]
                protos = [v.decode("latin1") for k, v in headers if k == b"x-forwarded-proto"]
                scope = dict(scope, client=[client_address(peer, forwarded, self.trusted), 0])
                proto = protos[-1].split(",")[-1].strip().lower() if protos else ""
                if proto in ("http", "https"):
                    if scope["type"] == "websocket":
                        proto = "wss" if proto == "https" else "ws"
                    scope["scheme"] = proto
        return await self.app(scope, receive, send)
