"""The web process's database connections under ASGI: closed after each request, and bounded.

Under ASGI, Django runs each request's synchronous part (middleware, the view, the ORM) in a
thread made for that request, and a connection belongs to the thread that opened it. With
persistent connections (CONN_MAX_AGE > 0) no later request ever reuses one, and none is closed
when its thread ends: measured here, 200 concurrent requests to `/api/health` opened 92
connections, until PostgreSQL's max_connections (100) refused the rest and 106 requests failed,
and all 92 were still open, idle, 5 s later. Django's docs say it: no persistent connections
under ASGI.

So the web process closes its connection at the end of every request (CONN_MAX_AGE 0 for every
database, whatever DB_CONN_MAX_AGE says: workers keep theirs; set as the process serves its
first request, so that merely importing the application, as tests do, changes nothing), and
lets at most
DB_WEB_CONNECTIONS requests into Django at once (each holds at most one connection per
database while it runs), half of them at most from one client; the others wait their turn on
the event loop, which costs nothing
but their wait. The live feeds' database work runs on one thread of its own (Channels'
`database_sync_to_async` outside a request), and the wake-up listener holds one connection:
a web process holds at most DB_WEB_CONNECTIONS + 2 connections to a database. To reuse
connections across requests, put PgBouncer in front (docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import hashlib

from django.conf import settings


def close_after_each_request(databases: dict) -> None:
    """No persistent connections: each connection opened from now on is closed at the end of
    the request that opened it."""
    for database in databases.values():
        database["CONN_MAX_AGE"] = 0


def client_of(scope) -> bytes | None:
    """Who a request is from, as far as the bound can tell before Django reads it: its
    credential (the session cookie or the Authorization header, hashed: never kept whole), or
    None for a request with neither. Not its address: behind a proxy every request has the
    proxy's, and the anonymous ones (health checks, the login page) are cheap; a load
    balancer's twenty health checks at once during an outage must not queue behind each
    other."""
    headers = dict(scope.get("headers") or [])
    cookies = headers.get(b"cookie", b"")
    name = settings.SESSION_COOKIE_NAME.encode() + b"="
    session = next((part for part in cookies.split(b";") if part.strip().startswith(name)), b"")
    credential = headers.get(b"authorization", b"") or session.strip()
    return hashlib.blake2b(credential, digest_size=16).digest() if credential else None


class ConnectionBound:
    """ASGI middleware: at most `limit` HTTP requests inside the application at once (from the
    first one on, with no persistent connections), and at most `share` of them (half, by
    default) with one credential (`client_of`): ten heavy list requests of one viewer held all ten
    of a web process's database slots for 20 s, and another user's one-row list waited 19 s.
    A client's requests past its share wait without holding a slot."""

    def __init__(self, app, limit: int, databases: dict | None = None, *, share: int | None = None):
        self.app = app
        self.slots = asyncio.Semaphore(limit)
        self.share = share or max(1, limit // 2)
        self.clients: dict[bytes, list] = {}  # client -> [its semaphore, requests holding it]
        self.databases = databases  # settings.DATABASES unless told
        self.serving = False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.serving:
            close_after_each_request(self.databases or settings.DATABASES)
            self.serving = True
        client = client_of(scope)
        if client is None:
            async with self.slots:
                return await self.app(scope, receive, send)
        entry = self.clients.setdefault(client, [asyncio.Semaphore(self.share), 0])
        entry[1] += 1
        try:
            async with entry[0], self.slots:
                return await self.app(scope, receive, send)
        finally:
            entry[1] -= 1
            if not entry[1]:  # nobody of this client waits or runs: forget it
                del self.clients[client]
