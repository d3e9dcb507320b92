"""Issue 31 item 8, the leftovers: bad API keys throttled by what they claim, not by address
alone; live feeds that end with the session's timeouts; the API's JSON 404 for any path under
its mount."""

import time

import pytest
from channels.db import database_sync_to_async
from django.db import connections
from django.test import Client

from runs import consumers
from runs.apikeys import create_key
from runs.sdk import start_run
from runs.security import LOGIN_AT, SEEN_AT
from tests.conftest import run_coroutine
from tests.test_api import Api, error
from tests.test_live import communicator
from tests.test_security import closed_within

pytestmark = pytest.mark.django_db

GUESS = "sg_abcd1234_wrong"  # matches no key's prefix


@pytest.fixture
def root(django_user_model):
    return django_user_model.objects.create_superuser("root", "root@example.com", "pw")


def tries(key: str, n: int, address: str = "127.0.0.1") -> list[int]:
    return [Api(Client(REMOTE_ADDR=address), key)("get", "/runs").status_code for _ in range(n)]


# -- bad API keys count against the key they claim ---------------------------------------------


def test_guessed_keys_from_an_address_do_not_lock_out_a_valid_key_or_prometheus(root):
    good = create_key(root)[1]
    assert tries(GUESS, 6) == [401] * 4 + [429] * 2  # the 5th failure locks (AXES_FAILURE_LIMIT)
    assert tries("sg_ffff0000_other", 1) == [429]  # any key matching no prefix: per address
    assert tries(good, 1) == [200]  # the same address (a NAT, a proxy, a CI runner)
    scrape = Client().get("/metrics", headers={"Authorization": f"Bearer {good}"})
    assert scrape.status_code == 200
    assert tries(GUESS, 1, "10.0.0.2") == [401]  # another address is not locked either


def test_wrong_secrets_for_a_real_key_lock_out_the_guesses_but_never_the_key(root):
    """Before, anyone at the key holder's address (a NAT, an office) who saw its prefix in a
    list or an event locked the key out for its holder with five wrong secrets. Now the wrong
    secrets are throttled and the right one (256 random bits) always works."""
    victim, other = create_key(root), create_key(root)
    prefix, good = victim[0].prefix, victim[1]
    wrong = f"sg_{prefix}_not-the-secret"
    assert tries(wrong, 6) == [401] * 4 + [429] * 2
    locked = Api(Client(), wrong)("get", "/runs")
    assert locked.status_code == 429 and error(locked)["code"] == "locked_out"
    assert tries(good, 1) == [200]  # the holder, at the same address
    scrape = Client().get("/metrics", headers={"Authorization": f"Bearer {good}"})
    assert scrape.status_code == 200
    assert tries(other[1], 1) == [200]  # another key from the same address
    assert tries(GUESS, 1) == [401]  # keys matching no prefix keep their own count
    assert tries(good, 1, "10.0.0.2") == [200]  # the key itself from elsewhere


# -- live feeds end with the session's timeouts ------------------------------------------------


def age(session, field: str, settings) -> None:
    """Make the session `field`'s timeout (plus a second) old, the other field recent."""
    idle, most = settings.STEPGUARD_SESSION_IDLE_SECONDS, settings.STEPGUARD_SESSION_MAX_SECONDS
    now = time.time()
    session[SEEN_AT] = now - (idle + 1 if field == SEEN_AT else 10)
    session[LOGIN_AT] = now - (most + 1 if field == LOGIN_AT else 10)
    session.save()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("field", [SEEN_AT, LOGIN_AT], ids=["idle", "absolute"])
def test_an_open_feed_closes_when_the_session_times_out(field, cast, monkeypatch, settings):
    monkeypatch.setattr(consumers, "RECHECK_SECONDS", 0.2)
    run = start_run("ledger", {"steps": 1})

    async def go():
        try:
            comm = communicator(run, cast["vera"], after=0)
            connected, _ = await comm.connect(timeout=10)
            assert connected
            assert "live" in await comm.receive_from(timeout=5)  # open while the session is
            await database_sync_to_async(age)(comm.scope["session"], field, settings)
            code = await closed_within(comm, 5)
            if code is None:
                await comm.disconnect()
            return code
        finally:  # the consumer's database thread must not keep the test database open
            await database_sync_to_async(connections.close_all)()

    assert run_coroutine(go()) == 4401  # as after a logout: the page does not reconnect


TIMEOUTS = "runs.security.SessionTimeouts"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "timeouts, refused",
    [(TIMEOUTS, True), ("controlplane.security.SessionTimeouts", True), (None, False)],
    ids=["app", "old path", "left out"],
)
def test_a_feed_is_refused_on_a_timed_out_session(timeouts, refused, cast, settings):
    """Where pages end sessions, under the path the settings name the middleware by (the app's,
    or the project's it moved from), so does the feed; a host that leaves it out ends neither."""
    settings.MIDDLEWARE = [
        timeouts if m == TIMEOUTS else m for m in settings.MIDDLEWARE if timeouts or m != TIMEOUTS
    ]
    run = start_run("ledger", {"steps": 1})

    async def go():
        try:
            comm = communicator(run, cast["vera"], after=0)
            await database_sync_to_async(age)(comm.scope["session"], SEEN_AT, settings)
            connected, _ = await comm.connect(timeout=10)
            if connected:
                await comm.disconnect()
            return connected
        finally:
            await database_sync_to_async(connections.close_all)()

    assert run_coroutine(go()) is not refused


# -- every path under the API's mount answers the API's JSON -----------------------------------

UNMATCHED = [
    ("get", "nothing"),
    ("get", ""),
    ("get", "runs/"),
    ("put", "flow/rate-limits/%0Ax"),
    ("post", "nothing"),  # no CSRF token either: still the 404, not the pages' 403
    ("delete", "approvals/nothing/at/all"),
]


@pytest.mark.parametrize("mount", ["/api/", "/agents/api/"], ids=["root", "embedded"])
@pytest.mark.parametrize("method, path", UNMATCHED)
def test_an_unknown_path_under_the_api_answers_its_json_404(mount, method, path, root, settings):
    settings.DEBUG = False
    if mount == "/agents/api/":  # as a host project mounts it (tests/test_embedding.py)
        settings.ROOT_URLCONF = "tests.embedded_urls"
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(root)
    for client in (browser, Client()):  # logged in, and anonymous
        response = getattr(client, method)(f"{mount}{path}", content_type="application/json")
        assert response.status_code == 404, (method, path)
        assert response["Content-Type"] == "application/json", (method, path)
        assert error(response)["code"] == "not_found"
    assert Client().get("/nothing").status_code == 404  # pages keep their own 404


@pytest.mark.parametrize("mount", ["/api/", "/agents/api/"], ids=["root", "embedded"])
def test_a_nul_character_is_refused_in_json_under_the_api_wherever_mounted(mount, root, settings):
    if mount == "/agents/api/":
        settings.ROOT_URLCONF = "tests.embedded_urls"
    key = create_key(root)[1]
    response = Client().get(
        f"{mount}runs", {"workflow": "\x00"}, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code == 400 and error(response)["code"] == "bad_request"
    page = Client().get(mount.removesuffix("api/") + "audit", {"actor": "\x00"})
    assert page.status_code == 400 and page["Content-Type"].startswith("text/plain")
