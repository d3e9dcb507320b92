"""The live run feed: a websocket that sends every event after the client's last seq."""

import asyncio
import html
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from channels.testing import WebsocketCommunicator
from django.db import transaction

from controlplane.asgi import application
from controlplane.settings import redis_channel_layer
from runs.consumers import RunConsumer
from runs.engine.store import run_event
from runs.sdk import start_run
from tests import agent_workflows  # registers the streaming workflow before workers start

pytestmark = pytest.mark.django_db(transaction=True)


def run_async(coro_fn):
    """Run a coroutine on a loop of its own thread: Playwright's sync API may hold this one's."""
    from channels.db import database_sync_to_async
    from django.db import connections

    async def main():
        try:
            return await coro_fn()
        finally:  # the consumer's database thread must not keep the test database open
            await database_sync_to_async(connections.close_all)()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(main())).result()


def communicator(run, user, after: int, query: str = "") -> WebsocketCommunicator:
    """A page's socket; by default one rendered now, showing every step the run has."""
    if "last=" not in query:
        last = run.steps.order_by("-seq").values_list("seq", flat=True).first()
        query += f"&last={-1 if last is None else last}"
    comm = WebsocketCommunicator(RunConsumer.as_asgi(), f"/ws/runs/{run.pk}/?after={after}{query}")
    comm.scope["user"] = user
    comm.scope["session"] = session_of(user)
    comm.scope["url_route"] = {"kwargs": {"run_id": run.pk}}
    return comm


def session_of(user):
    """A stored login session for `user`, as the session middleware would find it."""
    from importlib import import_module

    from django.conf import settings
    from django.test import Client

    store = import_module(settings.SESSION_ENGINE).SessionStore
    if not user.is_authenticated:
        return store()
    client = Client()
    client.force_login(user)
    return store(session_key=client.session.session_key)


def collect(comm, count: int) -> list[str]:
    async def go():
        connected, _ = await comm.connect(timeout=10)
        assert connected
        frames = [await comm.receive_from(timeout=5) for _ in range(count)]
        await comm.disconnect()
        return frames

    return run_async(go)


def test_the_feed_sends_everything_after_the_last_seq_in_order_once(drive, cast):
    run = start_run("ledger", {"steps": 2})
    drive()
    # after seq 3: steps s0 (started at 3) and s1 changed: a row each, then history + status.
    status, row0, row1, fragment = collect(communicator(run, cast["vera"], after=3), 4)
    assert 'data-state="open"' in status
    assert 'id="step-0"' in row0 and 'id="step-1"' in row1
    assert all(r.count("<tr ") == 1 for r in (row0, row1))
    seqs = [int(s) for s in re.findall(r'id="event-(\d+)"', fragment)]
    assert seqs == list(range(4, 4 + len(seqs))) and seqs[-1] == run.events.last().seq
    assert 'hx-swap-oob="outerHTML"' in row0 + row1
    assert 'id="run-status"' in fragment and "completed" in fragment


def test_new_steps_are_appended_and_a_filtered_page_gets_only_matches_and_failures(drive, cast):
    run = start_run("saga", {"fail": True})
    drive()
    statuses = dict(run.steps.values_list("seq", "status"))
    assert "failed" in statuses.values() and "completed" in statuses.values()
    # An empty page: every step is new, so each is appended after the "no steps" row goes.
    frames = collect(communicator(run, cast["vera"], 0, "&last=-1"), len(statuses) + 3)
    appended = [int(s) for f in frames for s in re.findall(r'<tr id="step-(\d+)"', f)]
    assert appended == sorted(statuses) and 'id="no-steps" hx-swap-oob="delete"' in frames[1]
    # A page filtered to model calls (this run has none): its failures still show, only them.
    failed = sorted(s for s, v in statuses.items() if v == "failed")
    frames = collect(communicator(run, cast["vera"], 0, "&last=-1&kind=llm"), len(failed) + 3)
    appended = [int(s) for f in frames for s in re.findall(r'<tr id="step-(\d+)"', f)]
    assert appended == failed


def test_a_step_that_fails_on_a_filtered_page_appears_in_place(cast):
    from django.utils import timezone

    from runs.models import Step

    run = start_run("ledger", {"steps": 4})
    now = timezone.now()
    for seq, status in enumerate(["completed", "started", "completed", "completed"]):
        Step.objects.create(run=run, seq=seq, key=f"s{seq}", status=status, started_at=now,
                            finished_at=now, idempotency_key=f"k{seq}")  # fmt: skip
    after = run.events.order_by("-seq").first().seq
    # The page shows completed steps 0, 2 and 3. Then step 1 fails: it must show, before 2.
    Step.objects.filter(run=run, seq=1).update(status="failed", error={"message": "boom"})
    with transaction.atomic():
        run_event(run.pk, "step.failed", step_key="s1")
    page = "&from=0&last=3&status=completed&rows=0,2,3"
    frames = collect(communicator(run, cast["vera"], after, page), 3)
    assert '<tbody hx-swap-oob="beforebegin:#step-2">' in frames[1]
    assert '<tr id="step-1" data-status="failed">' in frames[1]


def test_the_feed_refuses_anonymous_users_and_foreign_origins(drive):
    from django.contrib.auth.models import AnonymousUser

    run = start_run("ledger", {"steps": 1})

    async def anonymous():
        comm = communicator(run, AnonymousUser(), after=0)
        connected, _ = await comm.connect(timeout=10)
        return connected

    async def foreign_origin():
        comm = WebsocketCommunicator(
            application, f"/ws/runs/{run.pk}/", headers=[(b"origin", b"https://evil.example")]
        )
        connected, _ = await comm.connect(timeout=10)
        return connected

    assert run_async(anonymous) is False
    assert run_async(foreign_origin) is False


def test_a_reconnect_resumes_after_the_last_seq_it_saw_without_duplicates(drive, cast):
    run = start_run("ledger", {"steps": 2})
    drive()
    first = collect(communicator(run, cast["vera"], after=0), 4)
    seen = [int(s) for s in re.findall(r'id="event-(\d+)"', "".join(first))]
    assert seen == list(range(1, run.events.last().seq + 1))
    # More history while the client is away.
    with transaction.atomic():
        run_event(run.pk, "note.added", actor="otto", text="while you were away")
    _, backfill = collect(communicator(run, cast["vera"], after=seen[-1]), 2)
    again = [int(s) for s in re.findall(r'id="event-(\d+)"', backfill)]
    assert again == [seen[-1] + 1]  # only what was missed, once


def test_a_streamed_answer_reaches_the_live_page_piece_by_piece(drive, demo_model, cast, settings):
    """The deltas travel by the Channels layer (Redis) to the run page's socket, escaped, as
    appends to the step's row; the page's feed of events carries on beside them."""
    import uuid

    from django.db import connections

    settings.REDIS_URL = "redis://127.0.0.1:6379/0"
    layer = redis_channel_layer(settings.REDIS_URL)  # as production configures it
    layer["CONFIG"]["prefix"] = f"test-{uuid.uuid4().hex[:8]}"
    settings.CHANNEL_LAYERS = {"default": layer}
    agent_workflows.deltas.clear()
    shape = {"protocol": "chat", "async_client": False, "helper": False}
    run = start_run("llm-stream", shape)
    comm = communicator(run, cast["vera"], after=0, query="&last=-1")
    # The answer pauses after its first pieces until the page has shown them: piece by piece
    # however slow this machine is, not one frame with everything.
    demo_model.stall_streams(3)

    def worker():
        try:
            return drive()
        finally:
            connections.close_all()

    async def go():
        connected, _ = await comm.connect(timeout=10)
        assert connected
        await asyncio.sleep(0)
        outcome = asyncio.get_running_loop().run_in_executor(None, worker)
        pieces: list[str] = []
        shown = [""]  # the row's stream: appended to, or drawn whole (a page's first piece)

        def all_arrived() -> bool:
            sent = "".join(agent_workflows.deltas)
            return outcome.done() and bool(sent) and shown[0] == html.escape(sent)

        deadline = asyncio.get_running_loop().time() + 30
        while not all_arrived():
            # receive_nothing looks without cancelling the consumer, as a timed-out
            # receive_from would; the last piece may arrive before the run has ended.
            if await comm.receive_nothing(timeout=0.1):
                assert asyncio.get_running_loop().time() < deadline, (pieces, outcome)
                continue
            frame = await comm.receive_from(timeout=10)
            found = re.fullmatch(
                r'<output id="stream-0" hx-swap-oob="(beforeend|innerHTML)">(.*)</output>',
                frame,
                re.S,
            )
            if found:
                pieces.append(found.group(2))
                drawn = found.group(1) == "innerHTML"
                shown[0] = found.group(2) if drawn else shown[0] + found.group(2)
                demo_model.release()
        await comm.disconnect()
        return await outcome, pieces, shown[0]

    outcome, pieces, shown = run_async(go)
    assert outcome == ["completed"]
    assert len(pieces) > 1  # piece by piece, not at the end
    assert shown == html.escape("".join(agent_workflows.deltas))
    assert "".join(agent_workflows.deltas).startswith("[demo model]")


def test_deltas_travel_by_notify_without_redis(settings):
    """Without Redis, a worker sends deltas by PostgreSQL NOTIFY, which the web process's
    listener turns into the same messages."""
    import json as jsonlib

    import psycopg
    from django.db import connection

    from runs.engine.wakeup import (
        DELTAS_CHANNEL,
        Doorbell,
        EventsListener,
        delta_message,
        published,
    )

    if connection.vendor != "postgresql":
        assert not Doorbell().enabled() or settings.REDIS_URL  # SQLite alone: pages poll
        return
    settings.REDIS_URL = ""
    params = connection.get_connection_params()
    with psycopg.connect(**params, autocommit=True) as listener:
        listener.execute(f"LISTEN {DELTAS_CHANNEL}")
        piece = {"run": "r-1", "seq": 3, "attempt": 1, "kind": "text", "offset": 0}
        Doorbell().publish(set(), published({("r-1", 3): [[1, 0, "text", "<b>hi</b>" * 300]]}))
        notes = list(listener.notifies(timeout=5, stop_after=2))
    payloads = [jsonlib.loads(n.payload) for n in notes]
    assert "".join(p["text"] for p in payloads) == "<b>hi</b>" * 300
    assert EventsListener.messages(DELTAS_CHANNEL, notes[0].payload) == [
        ("run-r-1", delta_message(piece | {"text": payloads[0]["text"]}))
    ]
    assert payloads[1]["offset"] == len(payloads[0]["text"])  # each piece says where it goes
