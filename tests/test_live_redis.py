"""Live feeds on the Redis channel layer, as production runs them: a quiet feed stays open past
the layer's 5 s blocking pop, and a closed or refused feed leaves no task polling Redis."""

import asyncio
import os
import uuid

import pytest
from django.db import transaction

from controlplane.settings import redis_channel_layer
from runs.engine.store import run_event
from runs.sdk import start_run
from tests.conftest import daphne, database_url, run_coroutine
from tests.test_live import communicator, run_async, session_of

pytestmark = pytest.mark.django_db(transaction=True)

#: Longer than channels-redis's blocking pop (5 s) and redis-py 8's default read timeout (5 s),
#: which together closed every quiet feed with 1011 after 5.4-6.0 s (issue 50 §1).
QUIET_SECONDS = 8


@pytest.fixture
def redis_layer(settings):
    layer = redis_channel_layer(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    layer["CONFIG"]["prefix"] = f"test-{uuid.uuid4().hex[:8]}"
    settings.CHANNEL_LAYERS = {"default": layer}
    return layer


def test_a_quiet_feed_on_redis_stays_open_and_still_delivers(redis_layer, drive, cast):
    run = start_run("ledger", {"steps": 1})
    drive()
    comm = communicator(run, cast["vera"], after=run.events.last().seq)

    async def go():
        connected, _ = await comm.connect(timeout=10)
        assert connected
        while not await comm.receive_nothing(timeout=1):  # what the page missed since it rendered
            await comm.receive_from(timeout=10)
        # Nothing happens for longer than the pop: no frame, above all no close (1011).
        quiet = await comm.receive_nothing(timeout=QUIET_SECONDS, interval=0.5)
        await asyncio.get_running_loop().run_in_executor(None, note, run.pk)
        frame = await comm.receive_from(timeout=10)
        await comm.disconnect()
        return quiet, frame

    quiet, frame = run_async(go)
    assert quiet, "the quiet feed sent something (a close?) before anything happened"
    assert "after the quiet" in frame


def note(run_id) -> None:
    from django.db import connections

    try:
        with transaction.atomic():
            run_event(run_id, "note.added", actor="otto", text="after the quiet")
    finally:
        connections.close_all()


def test_a_receive_cancelled_at_any_point_of_its_connection_ends(redis_layer):
    """A feed that closes cancels its layer receive, often while the receive's new connection is
    still in its handshake. On Python 3.11, redis-py's `asyncio.wait_for` around each send (used
    when a socket timeout is set) swallows a cancellation that lands as the send completes
    (fixed in 3.12): the task lived on, polling Redis until the read timed out (5 s by default)
    or, with a read timeout longer than the 5 s pop, for good (34 of 150 here with 15 s). The
    cancellation is swept across the handshake, one new connection (a new layer) each time."""
    from channels_redis.core import RedisChannelLayer

    async def go():
        lived_on = 0
        for attempt in range(150):
            layer = RedisChannelLayer(**redis_layer["CONFIG"])
            receive = asyncio.ensure_future(layer.receive(await layer.new_channel()))
            for _ in range(attempt % 15):
                await asyncio.sleep(0)
            receive.cancel()
            done, _ = await asyncio.wait([receive], timeout=2)
            lived_on += not done
        return lived_on

    assert run_coroutine(go()) == 0  # a thread of its own: Playwright may hold this one


def test_six_quiet_feeds_of_a_real_server_stay_open_past_the_pop(tmp_path, cast):
    """The issue's measurement through daphne and Redis: before, 6 of 6 quiet feeds (the
    site-wide one and a run's) closed with 1011 after 5.4-6.0 s and the pages reconnected."""
    import websockets
    from django.conf import settings

    run = start_run("ledger", {"steps": 1})
    cookie = f"{settings.SESSION_COOKIE_NAME}={session_of(cast['vera']).session_key}"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    with daphne(tmp_path, DATABASE_URL=database_url(), REDIS_URL=redis_url) as url:
        base = url.replace("http", "ws", 1)
        paths = ["/ws/live/"] * 3 + [f"/ws/runs/{run.pk}/?after=0&last=-1"] * 3

        async def quiet(path: str) -> object:
            headers = {"Cookie": cookie, "Origin": url}
            async with websockets.connect(base + path, additional_headers=headers) as socket:
                try:
                    while True:  # what the page missed first, then nothing for QUIET_SECONDS
                        await asyncio.wait_for(socket.recv(), QUIET_SECONDS + 4)
                except TimeoutError:
                    return "open"
                except websockets.ConnectionClosed as closed:
                    return closed.rcvd.code if closed.rcvd else "closed"

        async def all_quiet():
            return await asyncio.gather(*(quiet(p) for p in paths))

        assert run_coroutine(all_quiet()) == ["open"] * 6
