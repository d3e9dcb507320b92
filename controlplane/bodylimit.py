"""Refuse an oversized request body while it streams in, before anything buffers it.

Django's ASGI handler spools the whole body to a temporary file before any middleware or view
runs, so a limit checked there comes after the disk has taken a 300 MB upload from anyone, logged
in or not. This ASGI layer answers 413 as soon as the declared length, or the bytes actually
received, pass STEPGUARD_API_MAX_BODY. A proxy in front should cap bodies too (docs/deploy.md).
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings


class BodyLimit:
    def __init__(self, app: Any, limit: int | None = None):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit or settings.STEPGUARD_API_MAX_BODY
        declared = dict(scope.get("headers", [])).get(b"content-length")
        try:
            too_long = declared is not None and int(declared) > limit
        except ValueError:
            too_long = False  # Django answers a malformed length itself
        if too_long:
            return await refuse(scope, send, limit)
        received, over, started = 0, False, False

        async def counting_receive():
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    # Django stops reading at a disconnect and sends nothing; we answer.
                    return {"type": "http.disconnect"}
            return message

        async def watching_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, watching_send)
        if over and not started:
            await refuse(scope, send, limit)


async def refuse(scope, send, limit: int) -> None:
    message = f"request body over the {limit}-byte limit"
    if scope.get("path", "").startswith("/api/"):
        body = json.dumps({"error": {"code": "payload_too_large", "message": message}}).encode()
        content_type = b"application/json"
    else:
        body, content_type = message.encode(), b"text/plain; charset=utf-8"
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def limit_daphne() -> None:
    """Daphne (Twisted) reads a whole request body, into a temporary file past 100 KB, before the
    ASGI application sees the request, so the layer above comes too late there. This counts
    the bytes as Twisted receives them and answers 413 at the limit, closing the connection."""
    from daphne.http_protocol import WebRequest

    if getattr(WebRequest, "stepguard_limited", False):
        return
    got_length, got_chunk = WebRequest.gotLength, WebRequest.handleContentChunk

    def gotLength(self, length):
        self.stepguard_received = 0
        got_length(self, length)
        if length is not None and length > settings.STEPGUARD_API_MAX_BODY:
            _refuse(self)

    def handleContentChunk(self, data):
        if getattr(self, "stepguard_refused", False):
            return
        self.stepguard_received = getattr(self, "stepguard_received", 0) + len(data)
        if self.stepguard_received > settings.STEPGUARD_API_MAX_BODY:
            _refuse(self)
            return
        got_chunk(self, data)

    WebRequest.gotLength, WebRequest.handleContentChunk = gotLength, handleContentChunk
    WebRequest.stepguard_limited = True


def _refuse(request) -> None:
    request.stepguard_refused = True
    limit = settings.STEPGUARD_API_MAX_BODY
    path = getattr(request.channel, "_path", b"") or b""
    message = f"request body over the {limit}-byte limit"
    if path.startswith(b"/api/"):
        body = json.dumps({"error": {"code": "payload_too_large", "message": message}}).encode()
        content_type = b"application/json"
    else:
        body, content_type = message.encode(), b"text/plain; charset=utf-8"
    request.channel.transport.write(
        b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + body
    )  # fmt: skip
    request.channel.loseConnection()
