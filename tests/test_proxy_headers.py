"""Behind a reverse proxy, the client's address: X-Forwarded-For believed only from the proxies
in STEPGUARD_TRUSTED_PROXIES, the right-most untrusted hop (issue 31, item 6). Checked against
`stepguard serve --proxy-headers` itself, with the lockout and /metrics that go by the address."""

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

from controlplane.proxy import ForwardedFor, client_address, networks
from tests.conftest import ROOT, database_url, run_coroutine, wait_until
from tests.test_settings import PRODUCTION, manage

#: Documentation addresses (RFC 5737): a Prometheus server, an attacker, a victim.
PROMETHEUS, ATTACKER, VICTIM = "203.0.113.7", "198.51.100.9", "198.51.100.10"


@contextmanager
def serve(tmp_path, *args: str, **env: str):
    """`manage.py serve` on a port the OS picks, on the test database; yields its URL."""
    log = tmp_path / "serve.log"
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
        "ALLOWED_HOSTS": "127.0.0.1",
        "AXES_FAILURE_LIMIT": "5",
        **env,
    }
    environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", "0", *args],
            cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        match = wait_until(
            lambda: (
                re.search(r"Listening on TCP address 127\.0\.0\.1:(\d+)", log.read_text())
                or proc.poll() is not None
            ),
            what="the server to listen",
        )
        assert proc.poll() is None, log.read_text()
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def get(url: str, path: str, forwarded: str | None = None, key: str | None = None) -> int:
    headers = {"X-Forwarded-For": forwarded} if forwarded else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url + path, headers=headers), timeout=30
        ) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def bad_key(url: str, forwarded: str | None) -> int:
    return get(url, "/api/runs", forwarded, key="sg_00000000_not-a-key")


def test_serve_with_proxy_headers_refuses_to_start_without_trusted_proxies(db):
    environ = {k: v for k, v in os.environ.items() if k != "DJANGO_ALLOW_ASYNC_UNSAFE"}
    environ.update(DJANGO_SETTINGS_MODULE="tests.settings", DATABASE_URL=database_url())
    result = subprocess.run(
        [sys.executable, "manage.py", "serve", "--port", "0", "--proxy-headers"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--proxy-headers needs STEPGUARD_TRUSTED_PROXIES" in result.stderr


@pytest.mark.django_db(transaction=True)
def test_a_client_s_own_x_forwarded_for_opens_nothing_and_rotates_past_no_lockout(tmp_path):
    """Nobody in front is trusted: what a client writes in X-Forwarded-For is ignored."""
    with serve(
        tmp_path, "--proxy-headers",
        STEPGUARD_TRUSTED_PROXIES="10.9.9.9", STEPGUARD_METRICS_ALLOW=PROMETHEUS,
    ) as url:  # fmt: skip
        assert get(url, "/metrics", PROMETHEUS) == 401
        # Twelve guesses, each claiming another address: the fifth locks this one out (its
        # answer is the lockout).
        answers = [bad_key(url, f"192.0.2.{n}") for n in range(12)]
        assert answers == [401] * 4 + [429] * 8


@pytest.mark.django_db(transaction=True)
def test_behind_a_trusted_proxy_the_client_is_the_right_most_untrusted_hop(tmp_path):
    """The test is the proxy (127.0.0.1): it appends the address it saw to what the client
    sent. The client's own entries, to the left, change nothing."""
    with serve(
        tmp_path, "--proxy-headers",
        STEPGUARD_TRUSTED_PROXIES="127.0.0.1,10.0.0.0/8", STEPGUARD_METRICS_ALLOW=PROMETHEUS,
    ) as url:  # fmt: skip
        assert get(url, "/metrics", PROMETHEUS) == 200  # the proxy saw Prometheus
        assert get(url, "/metrics", f"{PROMETHEUS}, 10.1.1.1") == 200  # through two proxies
        assert get(url, "/metrics", f"{PROMETHEUS}, {ATTACKER}") == 401  # forged, then real
        assert get(url, "/metrics", f"{PROMETHEUS}, {ATTACKER}, 10.1.1.1") == 401

        # The attacker writes the victim's address (then rotating ones) in front of their own:
        # the lockout falls on the attacker, not on the victim.
        answers = [bad_key(url, f"{VICTIM}, 192.0.2.{n}, {ATTACKER}") for n in range(12)]
        assert answers == [401] * 4 + [429] * 8
        assert bad_key(url, VICTIM) == 401  # the victim's own guess is still heard
        assert bad_key(url, ATTACKER) == 429


def test_client_address_reads_x_forwarded_for_from_the_right():
    trusted = networks(["127.0.0.1", "10.0.0.0/8", "fd00::/8"])
    cases = [
        ("203.0.113.9", ["192.0.2.1"], "203.0.113.9"),  # an untrusted peer: its own address
        ("127.0.0.1", [], "127.0.0.1"),
        ("127.0.0.1", ["192.0.2.1"], "192.0.2.1"),
        ("127.0.0.1", ["192.0.2.66, 192.0.2.1"], "192.0.2.1"),
        ("127.0.0.1", ["192.0.2.1, 10.0.0.2"], "192.0.2.1"),
        ("127.0.0.1", ["192.0.2.66", "192.0.2.1, 10.0.0.2"], "192.0.2.1"),  # two header lines
        ("127.0.0.1", ["10.0.0.3, 10.0.0.2"], "10.0.0.3"),  # all trusted: the left-most
        ("127.0.0.1", ["unknown, 10.0.0.2"], "10.0.0.2"),  # not an address: stop there
        ("127.0.0.1", ["192.0.2.1:4711"], "192.0.2.1"),
        ("127.0.0.1", ["[2001:db8::1]:4711"], "2001:db8::1"),
        ("::ffff:127.0.0.1", ["192.0.2.1"], "192.0.2.1"),
        ("fd00::1", ["2001:db8::1, fd00::2"], "2001:db8::1"),
    ]
    for peer, forwarded, client in cases:
        assert client_address(peer, forwarded, trusted) == client, (peer, forwarded)


def test_the_middleware_sets_client_and_scheme_for_http_and_websockets_from_proxies_only():
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["client"], scope["scheme"]))

    middleware = ForwardedFor(app, ["127.0.0.1"])
    headers = [(b"x-forwarded-for", b"192.0.2.66, 192.0.2.1"), (b"x-forwarded-proto", b"https")]
    for kind, scheme, peer in [
        ("http", "http", "127.0.0.1"),
        ("websocket", "ws", "127.0.0.1"),
        ("http", "http", "192.0.2.200"),
    ]:
        scope = {"type": kind, "scheme": scheme, "client": [peer, 5555], "headers": headers}
        run_coroutine(middleware(scope, None, None))
    assert seen == [
        (["192.0.2.1", 0], "https"),
        (["192.0.2.1", 0], "wss"),
        (["192.0.2.200", 5555], "http"),  # not a proxy: nothing it says is believed
    ]


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"AXES_IP_HEADERS": "HTTP_X_FORWARDED_FOR"}, "AXES_IP_HEADERS is no longer read"),
        ({"STEPGUARD_TRUSTED_PROXIES": "proxy.internal"}, "STEPGUARD_TRUSTED_PROXIES: 'proxy"),
    ],
)
def test_a_client_address_setting_that_would_trust_clients_stops_the_process(tmp_path, env, says):
    result = manage("check", STEPGUARD_VAR_DIR=str(tmp_path), **PRODUCTION, **env)
    assert result.returncode != 0
    assert says in result.stderr


@pytest.mark.django_db
def test_x_forwarded_proto_from_a_peer_that_is_no_proxy_is_not_believed(client, settings):
    """Django's SECURE_PROXY_SSL_HEADER believed the header from anyone: a client on plain
    HTTP could say it came over TLS (request.is_secure(), the HTTPS redirect, secure-only
    logic). The scheme now comes from ForwardedFor, and from trusted proxies only."""
    from controlplane import settings as production

    assert production.SECURE_PROXY_SSL_HEADER is None
    settings.SECURE_PROXY_SSL_HEADER = production.SECURE_PROXY_SSL_HEADER
    settings.SECURE_SSL_REDIRECT = True
    answer = client.get("/api/health", HTTP_X_FORWARDED_PROTO="https")
    assert answer.status_code == 301 and answer["Location"].startswith("https://")
