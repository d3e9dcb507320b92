"""A websocket's Origin must be the site itself: scheme, host and port, not just the host.

Channels' AllowedHostsOriginValidator compares host names only, so a page served from another
port of the same host (`http://127.0.0.1:9999`) or the other scheme could open the live feed
with the operator's cookies. Browsers always send Origin on a websocket handshake.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings

DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int] | None:
    try:
        parts = urlsplit(url)
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or port is None:
        return None
    return parts.scheme, parts.hostname.lower(), port


def own_origin(scope) -> tuple[str, str, int] | None:
    """The origin the browser sees this server at: the Host header, and the scheme the proxy
    says (X-Forwarded-Proto, which Django trusts too: SECURE_PROXY_SSL_HEADER) or the socket's."""
    headers = dict(scope.get("headers", []))
    host = headers.get(b"host", b"").decode("latin1")
    proto = headers.get(b"x-forwarded-proto", b"").decode("latin1").split(",")[0].strip()
    if proto not in DEFAULT_PORTS:
        proto = "https" if scope.get("scheme") == "wss" else "http"
    return _origin(f"{proto}://{host}") if host else None


class SameOrigin:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            origin = dict(scope.get("headers", [])).get(b"origin", b"").decode("latin1")
            trusted = {_origin(o) for o in settings.CSRF_TRUSTED_ORIGINS} - {None}
            seen = _origin(origin)
            if seen is None or (seen != own_origin(scope) and seen not in trusted):
                return await WebsocketDenier()(scope, receive, send)
        return await self.app(scope, receive, send)
