"""The live run page: a websocket that sends every event after the client's last seq.

The event table is the source of truth: the client says the last `seq` it has, the consumer
sends everything after it, in order, as htmx out-of-band fragments rendered by the same
partials the page uses (so ids match). A reconnect backfills what was missed, without
duplicates. It polls the table twice a second, and sooner when the doorbell rings (a worker wrote
events for this run: channels-redis, or PostgreSQL NOTIFY relayed by EventsListener).
"""

import asyncio
import contextlib
import logging
import os
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import connection
from django.db.models import Q
from django.template.loader import render_to_string

from runs.engine.wakeup import EventsListener
from runs.models import Event, Run, Step, StepStatus
from runs.views import timeline_rows

log = logging.getLogger("stepguard.live")

# Polling is the source of truth; the doorbell only makes it prompt.
POLL_SECONDS = float(os.environ.get("STEPGUARD_LIVE_POLL", "0.5"))
BATCH = 200
MAX_ROWS = 5000  # rows a filtered page may name (it shows 200 per chunk)


def _number(raw: str | None, default: int) -> int:
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


class RunConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()
            return
        if not await database_sync_to_async(user.has_perm)("runs.view_run"):
            await self.close()
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
        self.filters = {k: query[k] for k in ("status", "kind") if query.get(k)}
        # A filtered page names its rows: which steps matched when it rendered is history.
        rows = query.get("rows")
        if rows is not None:
            self.shown = {int(r) for r in rows.split(",")[:MAX_ROWS] if r.isdigit()}
            if not await database_sync_to_async(Run.objects.filter(pk=self.run_id).exists)():
                self.shown = None
        else:
            self.shown = await database_sync_to_async(self._shown_steps)()
        if self.shown is None:
            await self.close()
            return
        self.bell = asyncio.Event()
        self.group = f"run-{self.run_id}"
        await self.channel_layer.group_add(self.group, self.channel_name)
        if not settings.REDIS_URL and connection.vendor == "postgresql":
            EventsListener.ensure(asyncio.get_running_loop(), self.channel_layer)
        await self.accept()
        await self.send(
            text_data='<span id="ws-status" data-state="open" hx-swap-oob="true">live</span>'
        )
        self.pump = asyncio.create_task(self._pump())

    async def disconnect(self, code):
        pump = getattr(self, "pump", None)
        if pump is not None:
            pump.cancel()
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def run_doorbell(self, event):
        """A worker wrote events for this run: look now rather than at the next poll."""
        self.bell.set()

    async def _pump(self):
        try:
            while True:
                messages = await database_sync_to_async(self._fragments)()
                for message in messages:
                    await self.send(text_data=message)
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
        match = Q(**self.filters) | Q(status=StepStatus.FAILED) if self.filters else Q()
        steps = Step.objects.filter(
            Q(run_id=self.run_id, seq__gte=self.shown_from, seq__lte=self.last) & match
        )
        return set(steps.values_list("seq", flat=True))

    def _matches(self, step: Step) -> bool:
        """The page's step filter; a filter never hides a failure."""
        wanted = all(getattr(step, k) == v for k, v in self.filters.items())
        return wanted or step.status == StepStatus.FAILED

    def _fragments(self) -> list[str]:
        """Everything after the last seq sent, as out-of-band fragments; advances the cursor.

        One message per table row: the HTML parser cannot mix rows with other elements."""
        events = list(
            Event.objects.filter(run_id=self.run_id, seq__gt=self.after).order_by("seq")[:BATCH]
        )
        if not events:
            return []
        run = Run.objects.get(pk=self.run_id)
        touched = {e.step_key for e in events if e.step_key}
        parts = []
        steps = timeline_rows(run.steps.filter(key__in=touched, seq__gte=self.shown_from))
        for step in steps.order_by("seq"):
            if step.seq not in self.shown and not self._matches(step):
                continue  # filtered out, and not on the page
            row = render_to_string("runs/detail.html#step-row", {"s": step})
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
        parts.append(f'<ol id="history" hx-swap-oob="beforeend">{items}</ol>{status}')
        self.after = events[-1].seq
        return parts
