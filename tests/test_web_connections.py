"""The web process's database connections under ASGI: closed after each request, and bounded
(issue 31, item 5). Against the real server (daphne) on PostgreSQL, whose database refuses
connections past a small limit, as a production server's max_connections does."""

import asyncio
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection, connections

from controlplane.webdb import ConnectionBound
from tests.conftest import daphne, database_url, run_coroutine, wait_until

#: The server's connections carry this name, so they can be told from the test's own.
APP = "stepguard-web-connections-test"
BOUND = 8
REQUESTS = 200


def server_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND application_name = %s",
            [APP],
        )
        return cursor.fetchone()[0]


def connection_limit(limit: int) -> None:
    name = connection.ops.quote_name(connection.settings_dict["NAME"])
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER DATABASE {name} CONNECTION LIMIT {limit}")


def fetch(url: str, start: threading.Barrier) -> int:
    start.wait()
    try:
        with urllib.request.urlopen(f"{url}/api/health", timeout=60) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_200_concurrent_requests_share_a_bounded_set_of_connections_that_close(tmp_path):
    """DB_CONN_MAX_AGE=60 as before: 200 concurrent requests opened a connection each (the
    database refused most: 503s) and left them open for a minute. Now at most DB_WEB_CONNECTIONS
    are open at once, every request is answered, and none is left when the burst is over."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        ours = cursor.fetchone()[0]
    # This test's connections (and the sampler's), the server's bound, its live feed's one
    # thread and its listener, and a little room: everything past that is refused.
    connection_limit(ours + 1 + BOUND + 2 + 2)
    try:
        url_db = database_url() + f"?application_name={APP}"
        env = {"DATABASE_URL": url_db, "DB_CONN_MAX_AGE": "60", "DB_WEB_CONNECTIONS": str(BOUND)}
        with daphne(tmp_path, **env) as url:
            samples: list[int] = []
            done = threading.Event()

            def sample():
                while not done.is_set():
                    samples.append(server_connections())
                    time.sleep(0.005)
                connections.close_all()

            sampler = threading.Thread(target=sample)
            sampler.start()
            start = threading.Barrier(REQUESTS)
            try:
                with ThreadPoolExecutor(REQUESTS) as pool:
                    answers = list(pool.map(lambda _: fetch(url, start), range(REQUESTS)))
            finally:
                done.set()
                sampler.join()
            assert answers.count(200) == REQUESTS, sorted(set(answers))
            assert max(samples) <= BOUND + 2, max(samples)
            # Closed at the end of each request, not kept for DB_CONN_MAX_AGE: what stays is
            # at most the live feed's listener.
            wait_until(lambda: server_connections() <= 1, timeout=5, what="connections to close")
    finally:
        connection_limit(-1)


def test_the_bound_lets_so_many_requests_in_at_once_and_ends_persistent_connections():
    databases = {"default": {"CONN_MAX_AGE": 60}, "replica": {"CONN_MAX_AGE": None}}
    inside, most = 0, 0

    async def app(scope, receive, send):
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        await asyncio.sleep(0.01)
        inside -= 1

    bound = ConnectionBound(app, 3, databases)

    async def burst(kind: str, n: int):
        await asyncio.gather(*(bound({"type": kind}, None, None) for _ in range(n)))

    run = run_coroutine
    run(burst("websocket", 1))  # a live feed is not a request: nothing changes
    assert databases["default"]["CONN_MAX_AGE"] == 60
    most = 0
    run(burst("http", 20))
    assert most == 3
    assert [d["CONN_MAX_AGE"] for d in databases.values()] == [0, 0]


def test_one_client_takes_at_most_half_the_slots_and_another_gets_in_at_once():
    """Ten heavy lists of one viewer held all ten database slots of a web process for 20 s;
    another user's one-row list waited 19 s. Now one client (its session or API key) holds
    at most half of them, and another client's request goes in while the first one's wait."""
    inside: dict[bytes, int] = {}
    most: dict[bytes, int] = {}
    release = asyncio.Event()

    async def app(scope, receive, send):
        who = dict(scope["headers"])[b"authorization"]
        inside[who] = inside.get(who, 0) + 1
        most[who] = max(most.get(who, 0), inside[who])
        if who == b"Bearer heavy":
            await release.wait()
        inside[who] -= 1

    bound = ConnectionBound(app, 4, {})

    def request(who: bytes):
        return bound({"type": "http", "headers": [(b"authorization", who)]}, None, None)

    async def scene():
        heavy = [asyncio.ensure_future(request(b"Bearer heavy")) for _ in range(10)]
        await asyncio.sleep(0)  # the heavy ones take what they can
        await asyncio.wait_for(request(b"Bearer light"), timeout=10)  # not behind them
        release.set()
        await asyncio.gather(*heavy)

    run_coroutine(scene())
    assert most == {b"Bearer heavy": 2, b"Bearer light": 1}
    assert bound.clients == {}  # nothing kept per client once its requests are done
