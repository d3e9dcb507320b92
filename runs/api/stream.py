"""`GET /api/runs/{id}/stream`: a run's streamed model output as server-sent events.

Every piece the run's steps streamed (runs/engine/streaming.py) is stored, so a client gets
them all, in order, whenever it connects, and resumes after the last one it has: the event id is
the piece's, and a reconnecting `EventSource` sends it back as `Last-Event-ID` (or `?after=`).
Each `delta` event says where its text goes, `text = text[:offset] + piece` for its step: a step
re-sent after a crash repeats nothing its earlier attempt showed, and where the re-sent answer
differs the first piece cuts back to that offset. A `end` event closes a run that has ended.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from uuid import UUID

from channels.db import database_sync_to_async
from django.http import HttpRequest, StreamingHttpResponse
from ninja import Query

from runs.api.common import ERRORS_422, Router, run_or_404, viewer
from runs.errors import InvalidInput
from runs.models import TERMINAL_STATUSES, ApiKey, Run, StreamPiece

router = Router(tags=["runs"], ids="runs_stream_api")  # its ids from runs/stream_api.py

#: Seconds between looks at the table while the run is live (its pieces are stored 10 times a
#: second at most, runs/engine/wakeup.py), and between the questions whether the client may
#: still read it; a comment keeps proxies from closing a quiet stream.
POLL_SECONDS = float(os.environ.get("STEPGUARD_LIVE_POLL", "0.5"))
RECHECK_SECONDS = float(os.environ.get("STEPGUARD_LIVE_RECHECK", "3"))
KEEPALIVE_SECONDS = 15.0
BATCH = 500


def cursor(last_event_id: str | None, after: int | None) -> int:
    """The id of the last piece the client has: `Last-Event-ID`, else `?after=`, else 0."""
    if last_event_id is None or not last_event_id.strip():
        return after or 0
    value = last_event_id.strip()
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        raise InvalidInput(f"Last-Event-ID must be the id of a stream event, not {value[:40]!r}")
    return int(value)


def allowed(request: HttpRequest) -> Callable[[], bool]:
    """The question asked again while the stream is open: is its user still active, allowed to
    view runs and, for an API key, is the key still live; for a session, is it still there."""
    user_id, key = request.user.pk, getattr(request, "api_key", None)
    if key is None:
        from runs.consumers import still_allowed

        session_key = request.session.session_key
        return lambda: still_allowed(session_key, user_id)

    def key_live() -> bool:
        found = ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).select_related("user")
        live = found.first()
        if live is None or live.expired() or not live.user.is_active:
            return False
        return live.user.has_perm("runs.view_run")

    return key_live


def pieces_after(run_id: UUID, after: int) -> tuple[list[tuple], bool]:
    """The run's next pieces after `after`, and whether the run has ended (read first: a run
    seen ended has stored every piece, so an empty batch after it is the end)."""
    ended = Run.objects.filter(pk=run_id, status__in=TERMINAL_STATUSES).exists()
    rows = StreamPiece.objects.filter(run_id=run_id, id__gt=after).order_by("id")[:BATCH]
    fields = ("id", "seq", "attempt", "offset", "kind", "text")
    return list(rows.values_list(*fields)), ended


def sse(event: str, data: dict, id: int | None = None) -> bytes:
    head = f"id: {id}\n" if id is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def events(run_id: UUID, after: int, may_read: Callable[[], bool]) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    check_at = loop.time() + RECHECK_SECONDS
    quiet_since = loop.time()
    yield b"retry: 1000\n\n"
    while True:
        if loop.time() >= check_at:
            if not await database_sync_to_async(may_read)():
                yield sse("error", {"code": "forbidden", "message": "no longer allowed"})
                return
            check_at = loop.time() + RECHECK_SECONDS
        rows, ended = await database_sync_to_async(pieces_after)(run_id, after)
        for pk, seq, attempt, offset, kind, text in rows:
            data = {"step": seq, "attempt": attempt, "offset": offset, "kind": kind}
            yield sse("delta", data | {"text": text}, id=pk)
            after, quiet_since = pk, loop.time()
        if len(rows) == BATCH:
            continue
        if ended:
            yield sse("end", {"run": str(run_id)})
            return
        if loop.time() - quiet_since > KEEPALIVE_SECONDS:
            yield b": keep-alive\n\n"
            quiet_since = loop.time()
        await asyncio.sleep(POLL_SECONDS)


@router.get("/runs/{run_id}/stream", response={200: None, **ERRORS_422})
def stream_run(request, run_id: UUID, after: Query[int | None] = None):
    """The run's streamed model output as server-sent events (`text/event-stream`): every
    piece after the client's last event id (`Last-Event-ID`, or `after`), then new ones as they
    are streamed, then `end` once the run has ended. Each `delta` event's data is `{"step",
    "attempt", "offset", "kind", "text"}`: write `text` at `offset` of that step's text."""
    viewer(request)
    run = run_or_404(run_id)
    start = cursor(request.headers.get("Last-Event-ID"), after)
    response = StreamingHttpResponse(
        events(run.pk, start, allowed(request)), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on as it comes
    return response
