"""The live run page: a websocket that sends every event after the client's last seq.

The event table is the source of truth: the client says the last `seq` it has, the consumer
sends everything after it, in order, as htmx out-of-band fragments rendered by the same
partials the page uses (so ids match). A reconnect backfills what was missed, without
duplicates. It polls the table twice a second, and sooner when the doorbell rings (a worker wrote
events for this run: channels-redis, or PostgreSQL NOTIFY relayed by EventsListener).
"""

import asyncio
import contextlib
import json
import logging
import os
from collections import Counter
from importlib import import_module
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.layers import InMemoryChannelLayer, channel_layers
from django.conf import settings
from django.contrib.auth import HASH_SESSION_KEY, SESSION_KEY, get_user_model
from django.db import connection
from django.db.models import Q
from django.template.loader import render_to_string
from django.utils.crypto import constant_time_compare
from django.utils.html import escape

from runs.engine.streaming import shown_text
from runs.engine.wakeup import LIVE_GROUP, EventsListener
from runs.models import (
    GLOBAL,
    TERMINAL_STATUSES,
    Event,
    Policy,
    Run,
    Step,
    StepKind,
    StepStatus,
    Worker,
)
from runs.queries import step_filter, step_matches
from runs.security import session_expired, sessions_end
from runs.views import timeline_rows

log = logging.getLogger("stepguard.live")

# Polling is the source of truth; the doorbell only makes it prompt.
POLL_SECONDS = float(os.environ.get("STEPGUARD_LIVE_POLL", "0.5"))
#: How often an open feed asks again whether its session and permission still stand.
RECHECK_SECONDS = float(os.environ.get("STEPGUARD_LIVE_RECHECK", "3"))
BATCH = 200
MAX_ROWS = 5000  # rows a filtered page may name (it shows 200 per chunk)


def _number(raw: str | None, default: int) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


def still_allowed(session_key: str | None, user_id) -> bool:
    """The session is still there and still this user's, active and allowed to view runs.

    Read afresh from the session store and the user table: a logout deletes the session, an
    expiry or a password change invalidates it, a deactivation or a lost permission shows in
    the user row. The live feed asks again every few seconds while it is open. Where pages
    end sessions on their idle and absolute timeouts (SessionTimeouts), so does the feed:
    else one left open outlived the session it was opened with. A feed is no request, so it
    never keeps a session alive."""
    if not session_key:
        return False
    data = import_module(settings.SESSION_ENGINE).SessionStore(session_key=session_key).load()
    if str(data.get(SESSION_KEY)) != str(user_id):
        return False
    if sessions_end() and session_expired(data):
        return False
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first()
    if user is None:
        return False
    stored = data.get(HASH_SESSION_KEY)
    if not stored or not constant_time_compare(stored, user.get_session_auth_hash()):
        return False
    return user.has_perm("runs.view_run")


def live_status(status: str | None) -> str:
    """The page's feed indicator: "live" only while the run can still change."""
    if status in TERMINAL_STATUSES:
        return (
            '<span id="ws-status" data-state="open" class="muted ended" hx-swap-oob="true">'
            "ended: nothing more will change</span>"
        )
    return '<span id="ws-status" data-state="open" hx-swap-oob="true">live</span>'


#: The live feeds' layer in a project that configures no CHANNEL_LAYERS (one embedding Stepguard
#: may have none): in-process only, it carries what this very process relays (the PostgreSQL
#: NOTIFY doorbell, EventsListener), never a message between processes; on SQLite, feeds poll.
LOCAL_LAYER = "stepguard-local"


def layer_alias() -> str:
    """The project's default channel layer if it has one, else this process's own."""
    if "default" in channel_layers:
        return "default"
    if LOCAL_LAYER not in channel_layers.backends:  # also after a CHANNEL_LAYERS change
        channel_layers.set(LOCAL_LAYER, InMemoryChannelLayer())
    return LOCAL_LAYER


#: Open live feeds per user, in this process (a page keeps one; a user rarely needs many).
_open: Counter = Counter()


class Feed(AsyncWebsocketConsumer):
    """A live feed's guard: a logged-in session allowed to view runs, a bounded number of open
    feeds per user, and the same questions asked again every few seconds while it is open."""

    counted = False
    group = ""

    @property  # read once per connection, when Channels builds the consumer's layer
    def channel_layer_alias(self) -> str:  # type: ignore[override]
        return layer_alias()

    async def admit(self) -> bool:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()
            return False
        self.session_key = self.scope["session"].session_key
        if not await database_sync_to_async(still_allowed)(self.session_key, user.pk):
            await self.close()
            return False
        if _open[user.pk] >= settings.STEPGUARD_LIVE_MAX_SOCKETS:
            log.warning("user %s has %d live feeds open: refusing another", user, _open[user.pk])
            await self.close()
            return False
        _open[user.pk] += 1
        self.counted = True
        return True

    async def still_open(self, check_at: float) -> float | None:
        """The next time to check, or None once the session or permission is gone (closed)."""
        loop = asyncio.get_running_loop()
        if loop.time() < check_at:
            return check_at
        allowed = await database_sync_to_async(still_allowed)(
            self.session_key, self.scope["user"].pk
        )
        if not allowed:
            # 4401: not a server error, so the page does not keep reconnecting.
            await self.close(code=4401)
            return None
        return loop.time() + RECHECK_SECONDS

    async def disconnect(self, code):
        if self.counted:
            self.counted = False
            user_id = self.scope["user"].pk
            _open[user_id] -= 1
            if _open[user_id] <= 0:
                del _open[user_id]
        pump = getattr(self, "pump", None)
        if pump is not None:
            pump.cancel()
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def run_doorbell(self, event):
        """A worker wrote events: look now rather than at the next poll."""
        self.bell.set()


class RunConsumer(Feed):
    async def connect(self):
        if not await self.admit():
            return
        self.run_id = self.scope["url_route"]["kwargs"]["run_id"]
        query = {
            k: v[-1] for k, v in parse_qs(self.scope.get("query_string", b"").decode()).items()
        }
        self.after = max(0, _number(query.get("after"), 0))
        # The page shows steps from `from` to `last` (its latest chunk, maybe filtered): those
        # get updated in place, later ones appended; earlier ones belong to unloaded chunks.
        self.shown_from = _number(query.get("from"), 0)
        # A page from before `last` existed shows every step it had: treat them all as shown.
        self.last = _number(query.get("last"), 2**62 if "last" not in query else -1)
        chosen, self.match = step_filter(query)
        self.filters = {k: v for k, v in chosen.items() if v}
        # A filtered page names its rows: which steps matched when it rendered is history.
        rows = query.get("rows")
        if rows is not None:
            self.shown = {int(r) for r in rows.split(",")[:MAX_ROWS] if r.isascii() and r.isdigit()}
            if not await database_sync_to_async(Run.objects.filter(pk=self.run_id).exists)():
                self.shown = None
        else:
            self.shown = await database_sync_to_async(self._shown_steps)()
        if self.shown is None:
            await self.close()
            return
        self.bell = asyncio.Event()
        #: What each streaming step's row shows, and the rows the last fragments redrew.
        self.streams: dict[int, str] = {}
        self.redrawn: list[int] = []
        self.redrawn_streaming: list[int] = []  # of those, model calls still streaming
        self.drawing = asyncio.Lock()  # a row's stream and its redraw go out in order
        self.group = f"run-{self.run_id}"
        await self.channel_layer.group_add(self.group, self.channel_name)
        if not settings.REDIS_URL and connection.vendor == "postgresql":
            EventsListener.ensure(asyncio.get_running_loop(), self.channel_layer)
        await self.accept()
        # Its creation time too, once: the events' partition key (Event.objects.of).
        status, self.created = await database_sync_to_async(
            lambda: (
                Run.objects.filter(pk=self.run_id).values_list("status", "created_at").first()
                or (None, None)
            )
        )()
        await self.send(text_data=live_status(status))
        self.pump = asyncio.create_task(self._pump())

    async def step_delta(self, event):
        """A piece of a model's streamed answer, written at its offset of the step's stream
        (runs/engine/streaming.py): appended to the step's row when it follows what the row
        shows, else the row's stream is drawn again whole (a re-send that differs cuts back;
        a page that missed pieces reads them from the table). The row is redrawn with the
        recorded response when the step completes."""
        seq, offset, text = event.get("seq"), event.get("offset"), event.get("text")
        if not isinstance(seq, int) or not isinstance(text, str):
            return
        async with self.drawing:
            shown = self.streams.get(seq)
            if shown is not None and offset == len(shown):
                self.streams[seq] = shown + text
                if text:
                    await self._draw_stream(seq, text, "beforeend")
            elif shown is not None and isinstance(offset, int) and offset < len(shown):
                self.streams[seq] = shown[:offset] + text
                await self._draw_stream(seq, self.streams[seq])
            else:  # the first piece this page sees, or one after a gap
                await self._draw_stored_stream(seq)

    async def _draw_stream(self, seq: int, text: str, swap: str = "innerHTML") -> None:
        await self.send(
            text_data=f'<output id="stream-{seq}" hx-swap-oob="{swap}">{escape(text)}</output>'
        )

    async def _draw_stored_stream(self, seq: int) -> None:
        """The step's stream whole, as stored (its pieces are stored before they are sent)."""
        self.streams[seq] = (await database_sync_to_async(shown_text)(self.run_id, seq))[0]
        await self._draw_stream(seq, self.streams[seq])

    async def _pump(self):
        check_at: float | None = asyncio.get_running_loop().time() + RECHECK_SECONDS
        try:
            while True:
                if (check_at := await self.still_open(check_at)) is None:
                    return
                messages = await database_sync_to_async(self._fragments)()
                async with self.drawing:
                    for message in messages:
                        await self.send(text_data=message)
                    for seq in self.redrawn:  # a redrawn row's stream starts empty again
                        self.streams.pop(seq, None)
                    for seq in self.redrawn_streaming:
                        await self._draw_stored_stream(seq)
                if not messages:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.bell.wait(), POLL_SECONDS)
                    self.bell.clear()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("live feed of run %s stopped", self.run_id)
            await self.close(code=1011)  # an error: the page's ws extension reconnects

    def _shown_steps(self) -> set[int] | None:
        if not Run.objects.filter(pk=self.run_id).exists():
            return None
        steps = Step.objects.filter(
            Q(run_id=self.run_id, seq__gte=self.shown_from, seq__lte=self.last) & self.match
        )
        return set(steps.values_list("seq", flat=True))

    def _fragments(self) -> list[str]:
        """Everything after the last seq sent, as out-of-band fragments; advances the cursor.

        One message per table row: the HTML parser cannot mix rows with other elements."""
        events = list(
            Event.objects.filter(
                run_id=self.run_id, run_created_at=self.created, seq__gt=self.after
            ).order_by("seq")[:BATCH]
        )
        self.redrawn, self.redrawn_streaming = [], []
        if not events:
            return []
        run = Run.objects.get(pk=self.run_id)
        touched = {e.step_key for e in events if e.step_key}
        parts = []
        steps = timeline_rows(run.steps.filter(key__in=touched, seq__gte=self.shown_from))
        for step in steps.order_by("seq"):
            if step.seq not in self.shown and not step_matches(step, self.filters):
                continue  # filtered out, and not on the page
            row = render_to_string("runs/detail.html#step-row", {"s": step})
            self.redrawn.append(step.seq)
            if step.kind == StepKind.LLM and step.status == StepStatus.STARTED:
                self.redrawn_streaming.append(step.seq)
            if step.seq in self.shown:
                parts.append(row.replace("<tr ", '<tr hx-swap-oob="outerHTML" ', 1))
            else:
                # New, or newly matching the page's filter (a step that just failed): in place.
                later = [seq for seq in self.shown if seq > step.seq]
                where = f"beforebegin:#step-{min(later)}" if later else "beforeend:#timeline"
                if not self.shown:
                    parts.append('<tr id="no-steps" hx-swap-oob="delete"></tr>')
                self.shown.add(step.seq)
                parts.append(f'<tbody hx-swap-oob="{where}">{row}</tbody>')
        items = "".join(render_to_string("runs/detail.html#event-item", {"e": e}) for e in events)
        status = render_to_string("runs/detail.html#run-status", {"run": run})
        status = status.replace("<span ", '<span hx-swap-oob="true" ', 1)
        parts.append(
            f'<ol id="history" hx-swap-oob="beforeend">{items}</ol>{status}'
            + live_status(run.status)
        )
        self.after = events[-1].seq
        return parts


#: What each part of `site_state` is called in the feed's messages.
TOPICS = ("events", "approvals", "killswitch", "holds", "workers")


def site_state(workers: bool) -> tuple:
    """What the site-wide pages show that can change: the newest event anywhere, the pending
    approvals, the kill switch, the workflow holds and (for the workers page) the heartbeats."""
    from runs.context_processors import pending_badge

    last = Event.objects.order_by("-pk").values_list("pk", flat=True).first()
    pending = pending_badge()  # as the badge says it: past its cap, a decision is a new event
    held = dict(Policy.objects.filter(halted_at__isnull=False).values_list("scope", "halted_at"))
    beat = None
    if workers:
        beats = Worker.objects.order_by("-heartbeat_at").values_list("pk", "heartbeat_at")
        beat = list(beats[:200])
    return last, pending, held.get(GLOBAL), held, beat


class LiveConsumer(Feed):
    """The site-wide feed every page keeps open: it says *that* something changed (an event
    anywhere, an approval, the kill switch, a worker's heartbeat with `?workers=1`), and each
    page's live regions fetch themselves again through the ordinary, permission-checked views.
    A change is seen within the poll interval, or at once when a worker's doorbell rings."""

    group = LIVE_GROUP

    async def connect(self):
        if not await self.admit():
            return
        query = parse_qs(self.scope.get("query_string", b"").decode())
        self.workers = query.get("workers", [""])[-1] == "1"
        self.bell = asyncio.Event()
        await self.channel_layer.group_add(LIVE_GROUP, self.channel_name)
        if not settings.REDIS_URL and connection.vendor == "postgresql":
            EventsListener.ensure(asyncio.get_running_loop(), self.channel_layer)
        await self.accept()
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self):
        check_at: float | None = asyncio.get_running_loop().time() + RECHECK_SECONDS
        seen, rang = None, False
        try:
            while True:
                if (check_at := await self.still_open(check_at)) is None:
                    return
                state = await database_sync_to_async(site_state)(self.workers)
                if seen is None:  # the page catches up with what changed since it rendered
                    await self.send(text_data=json.dumps({"live": True, "changed": TOPICS}))
                else:
                    changed = [n for n, a, b in zip(TOPICS, seen, state, strict=True) if a != b]
                    if rang and "events" not in changed:
                        # An event committed after a newer id was seen: ids are not commit order.
                        changed.append("events")
                    if changed:
                        await self.send(text_data=json.dumps({"changed": changed}))
                seen = state
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.bell.wait(), POLL_SECONDS * 2)
                rang = self.bell.is_set()
                self.bell.clear()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("site-wide live feed stopped")
            await self.close(code=1011)
