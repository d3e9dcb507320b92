"""One wake-up path, two mechanisms: PostgreSQL LISTEN/NOTIFY, or polling alone.

Notifications are only a doorbell. Workers always poll too, so a lost NOTIFY (a dropped
listener connection, a database restart) delays work by at most one poll interval.
"""

import asyncio
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.db import connection, connections

from runs.engine.pooling import listen_connection

log = logging.getLogger("stepguard.wakeup")

CHANNEL = "stepguard_runs"


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def notify_runnable() -> None:
    """Ring the workers' doorbell: a run became runnable now. Call it after commit."""
    if is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%(channel)s, '')", {"channel": CHANNEL})


class Listener(threading.Thread):
    """Sets `bell` on every NOTIFY; reconnects after any error until `stop` is set."""

    #: Seconds between the questions that tell a silent server from a quiet channel.
    PING = 5.0

    def __init__(self, bell: threading.Event, stop: threading.Event):
        super().__init__(name="stepguard-listener", daemon=True)
        self.bell, self.stop = bell, stop
        self.params = connection.get_connection_params()

    def run(self) -> None:
        lost = False  # one line when the connection goes, one when it is back
        while not self.stop.is_set():
            try:
                # Read again: a multi-host DATABASE_URL may have a new first host.
                conn = listen_connection(connection.get_connection_params())
                if conn is None:
                    return  # behind a pooler with no direct URL: the worker polls
                with conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if lost:
                        log.info("listener reconnected")
                        lost = False
                    self.bell.set()  # a NOTIFY sent while we were away is lost: look now
                    asked = time.monotonic()
                    while not self.stop.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self.bell.set()
                        if time.monotonic() - asked > self.PING:
                            # A silent server sends no notification and no error: ask it
                            # something, under the statement deadline (runs/engine/deadline.py).
                            conn.execute("SELECT 1")
                            asked = time.monotonic()
            except Exception as exc:
                if not lost:
                    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else exc
                    log.warning("listener connection lost (%s); polling until it reconnects", cause)
                lost = True
                self.stop.wait(0.5)


EVENTS_CHANNEL = "stepguard_events"
DELTAS_CHANNEL = "stepguard_deltas"
#: The most text one delta message carries (NOTIFY payloads stay under 8 kB).
DELTA_CHARS = 2000


class Doorbell:
    """Tells live pages that a run has new events: a hint, coalesced, off the hot path.

    `ring(run_id)` only adds the id to a set and wakes a daemon thread, which publishes the set
    at once, then rests 0.1 s so the rings of that interval share the next flush: an idle system
    answers in milliseconds, a busy one publishes ten times a second at most. It publishes to
    the Channels layer (channels-redis) when REDIS_URL is set, else by PostgreSQL NOTIFY (one
    notification per flush, not per event). With neither, pages simply poll.
    """

    REST = 0.1

    def __init__(self):
        self._ids: set[str] = set()
        #: Streamed pieces by (run, step seq): [attempt, offset, kind, text], to store and send.
        self._deltas: dict[tuple[str, int], list[list]] = {}
        self._stored: list[dict] = []  # stored already (settle), still to send
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()  # pieces are stored in the order they came
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._aloop = None  # the doorbell thread's own event loop: one Redis connection, kept

    def enabled(self) -> bool:

        return bool(settings.REDIS_URL) or is_postgres()

    def ring(self, run_id) -> None:
        if not self.enabled():
            return
        with self._lock:
            self._ids.add(str(run_id))
            self._start()
        self._wake.set()

    def stream(self, run_id, seq: int, attempt: int, offset: int, kind: str, text: str) -> None:
        """A piece of a model's streamed answer, `text` written at `offset` of step `seq`'s
        stream (runs/engine/streaming.py): stored for the run's readers and sent to its live
        page, off the hot path, coalesced the same way (contiguous pieces become one)."""
        with self._lock:
            pieces = self._deltas.setdefault((str(run_id), seq), [])
            last = pieces[-1] if pieces else None
            if (
                last is not None
                and last[0] == attempt
                and last[2] == kind
                and last[1] + len(last[3]) == offset
            ):
                last[3] += text
            else:
                pieces.append([attempt, offset, kind, text])
            self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="stepguard-doorbell", daemon=True
            )
            self._thread.start()

    def _loop(self) -> None:
        import time

        while True:
            self._wake.wait()
            self._wake.clear()
            with self._store_lock:
                with self._lock:
                    ids, self._ids = self._ids, set()
                    deltas, self._deltas = self._deltas, {}
                    stored, self._stored = self._stored, []
                self._store(deltas)
            if not ids and not deltas and not stored:
                continue
            if self.enabled():
                pieces = [*stored, *published(deltas)]
                try:
                    self.publish(ids, pieces)
                except Exception as exc:
                    log.warning("doorbell not published (%s); pages fall back to polling", exc)
                    connections.close_all()
            time.sleep(self.REST)

    def settle(self, run_id, seq: int) -> None:
        """Store step `seq`'s pieces now, in order after those stored before (the live page
        still gets them from the doorbell thread): called as its stream ends, before the step
        completes, so a reader that sees the run end has every piece of it."""
        with self._store_lock:
            with self._lock:
                parts = self._deltas.pop((str(run_id), seq), None)
            if parts:
                deltas = {(str(run_id), seq): parts}
                self._store(deltas)
                with self._lock:
                    self._stored += published(deltas)
                    self._start()
                self._wake.set()

    @staticmethod
    def _store(deltas: dict) -> None:
        if not deltas:
            return
        try:
            store_pieces(deltas)
        except Exception as exc:
            log.warning("streamed pieces not stored (%s)", exc)
            connections.close_all()

    def publish(self, ids: set[str], deltas: Sequence[dict[str, Any]] = ()) -> None:
        if settings.REDIS_URL:
            from channels.layers import get_channel_layer

            layer = get_channel_layer()
            messages: list[tuple[str, dict[str, Any]]] = [
                (f"run-{i}", {"type": "run.doorbell"}) for i in ids
            ]
            if ids:  # every other page's feed: something changed somewhere
                messages.append((LIVE_GROUP, {"type": "run.doorbell"}))
            messages += [(f"run-{d['run']}", delta_message(d)) for d in deltas]

            async def send():
                sends = (layer.group_send(group, message) for group, message in messages)
                for failed in await asyncio.gather(*sends, return_exceptions=True):
                    if isinstance(failed, Exception):
                        raise failed

            # async_to_sync would start a new loop, hence a new Redis connection, per flush.
            if self._aloop is None:
                self._aloop = asyncio.new_event_loop()
            self._aloop.run_until_complete(send())
            return
        batch: list[str] = []
        for run_id in sorted(ids):
            batch.append(run_id)
            if len(batch) == 150:  # NOTIFY payloads stay under 8 kB
                self._notify(batch)
                batch = []
        if batch:
            self._notify(batch)
        for delta in deltas:
            payload = json.dumps(delta)
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_notify(%(channel)s, %(payload)s)",
                    {"channel": DELTAS_CHANNEL, "payload": payload},
                )

    @staticmethod
    def _notify(ids: list[str]) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_notify(%(channel)s, %(ids)s)",
                {"channel": EVENTS_CHANNEL, "ids": ",".join(ids)},
            )


def store_pieces(deltas: dict[tuple[str, int], list[list]]) -> None:
    """The pieces of one flush as StreamPiece rows, in their order (one INSERT)."""
    from runs.models import StreamPiece

    rows = [
        StreamPiece(run_id=run_id, seq=seq, attempt=attempt, offset=offset, kind=kind, text=text)
        for (run_id, seq), parts in deltas.items()
        for attempt, offset, kind, text in parts
    ]
    StreamPiece.objects.bulk_create(rows)


def published(deltas: dict[tuple[str, int], list[list]]) -> list[dict]:
    """The pieces as messages, each under DELTA_CHARS (NOTIFY payloads stay under 8 kB)."""
    return [
        {"run": run_id, "seq": seq, "attempt": attempt, "kind": kind,
         "offset": offset + i, "text": text[i : i + DELTA_CHARS]}
        for (run_id, seq), parts in deltas.items()
        for attempt, offset, kind, text in parts
        for i in range(0, max(len(text), 1), DELTA_CHARS)
    ]  # fmt: skip


def delta_message(delta: dict) -> dict:
    """A piece as the live page's consumer gets it (RunConsumer.step_delta)."""
    fields = ("seq", "attempt", "offset", "kind", "text")
    return {"type": "step.delta", **{k: delta.get(k) for k in fields}}


doorbell = Doorbell()
#: The channel-layer group of every page's site-wide feed (runs/consumers.py LiveConsumer).
LIVE_GROUP = "stepguard-live"


class EventsListener(threading.Thread):
    """In a web process without Redis: turns NOTIFY doorbells into in-process group sends."""

    _started: "EventsListener | None" = None
    _guard = threading.Lock()

    def __init__(self, loop, layer):
        super().__init__(name="stepguard-events-listener", daemon=True)
        self.loop, self.layer = loop, layer
        self.params = connection.get_connection_params()

    @classmethod
    def ensure(cls, loop, layer) -> None:
        with cls._guard:
            if cls._started is None:
                cls._started = cls(loop, layer)
                cls._started.start()

    @staticmethod
    def messages(channel: str, payload: str) -> list[tuple[str, dict]]:
        """(group, message) pairs for a notification: the runs' pages and the site-wide feed."""
        if channel == DELTAS_CHANNEL:
            delta = json.loads(payload)
            return [(f"run-{delta['run']}", delta_message(delta))]
        rings = [(f"run-{run_id}", {"type": "run.doorbell"}) for run_id in payload.split(",")]
        return [*rings, (LIVE_GROUP, {"type": "run.doorbell"})]

    def run(self) -> None:
        import asyncio
        import time

        while True:
            try:
                conn = listen_connection(connection.get_connection_params())
                if conn is None:
                    return  # behind a pooler with no direct URL: live pages poll
                with conn:
                    conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                    conn.execute(f"LISTEN {DELTAS_CHANNEL}")
                    while True:
                        for note in conn.notifies(timeout=Listener.PING):
                            for group, message in self.messages(note.channel, note.payload):
                                self.loop.call_soon_threadsafe(
                                    asyncio.ensure_future, self.layer.group_send(group, message)
                                )
                        conn.execute("SELECT 1")  # a silent server: see Listener.PING
            except Exception as exc:
                log.warning("events listener lost (%s); live pages poll meanwhile", exc)
                time.sleep(1.0)
