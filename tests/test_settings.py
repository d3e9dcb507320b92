"""Settings come from the environment, fail loudly, and are production-safe by default."""

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": "k" * 20 + "-production-like-secret-with-enough-entropy-9f8e7d6c5b4a",
    "ALLOWED_HOSTS": "stepguard.example.com",
    "DATABASE_URL": "",
}


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    drop = ("SECRET_KEY", "DEBUG", "DJANGO_ALLOW_ASYNC_UNSAFE")
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update(DJANGO_SETTINGS_MODULE="controlplane.settings", **env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=environ, capture_output=True, text=True
    )


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    result = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        STEPGUARD_VAR_DIR=str(tmp_path),
        **PRODUCTION,
    )
    assert result.returncode == 0, result.stderr


def test_a_missing_secret_key_stops_the_process_with_its_name(tmp_path):
    result = manage("check", DEBUG="0", STEPGUARD_VAR_DIR=str(tmp_path))
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is off" in result.stderr


def test_a_malformed_setting_names_the_variable(tmp_path):
    result = manage(
        "check", STEPGUARD_LEASE_SECONDS="soon", STEPGUARD_VAR_DIR=str(tmp_path), **PRODUCTION
    )
    assert result.returncode != 0
    assert "STEPGUARD_LEASE_SECONDS='soon' is not a number" in result.stderr


def test_the_health_check_is_the_only_anonymous_route(client, db):
    assert client.get("/health").json()["database"] == "ok"
    response = client.get("/admin/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_a_webhook_allowlist_entry_that_is_no_address_network_or_host_stops_the_process(tmp_path):
    result = manage(
        "check",
        STEPGUARD_WEBHOOK_ALLOW="10.0.0.0/8, http://hooks.internal",
        STEPGUARD_VAR_DIR=str(tmp_path),
        **PRODUCTION,
    )
    assert result.returncode != 0
    assert (
        "STEPGUARD_WEBHOOK_ALLOW: 'http://hooks.internal' is not an address, a network "
        "(10.0.0.0/8) or a host name"
    ) in result.stderr


@pytest.mark.parametrize("everything", ["0.0.0.0/0", "::/0"])
def test_a_webhook_allowlist_that_allows_every_address_stops_the_process(tmp_path, everything):
    """It was taken without a word, and turned the guard off for every delivery."""
    result = manage(
        "check",
        STEPGUARD_WEBHOOK_ALLOW=f"10.0.0.0/8,{everything}",
        STEPGUARD_VAR_DIR=str(tmp_path),
        **PRODUCTION,
    )
    assert result.returncode != 0
    assert f"STEPGUARD_WEBHOOK_ALLOW: '{everything}' allows every address" in result.stderr


def test_the_webhook_allowlist_is_read_by_runs_conf_for_embedding_hosts_too():
    """Before, only controlplane.settings read it: a host project had no way but its own
    settings, and runs.conf (which gives a host every default) did not know it."""

    def conf(value: str) -> subprocess.CompletedProcess:
        code = "from runs import conf; print(conf.STEPGUARD_WEBHOOK_ALLOW)"
        environ = {**os.environ, "STEPGUARD_WEBHOOK_ALLOW": value}
        environ.pop("DJANGO_SETTINGS_MODULE", None)
        return subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True
        )

    assert conf("").stdout.strip() == "[]"
    assert conf(" 10.0.0.0/8, hooks.internal ").stdout.strip() == "['10.0.0.0/8', 'hooks.internal']"
    bad = conf("10.0.0.0/8, http://hooks.internal")
    assert bad.returncode != 0 and "'http://hooks.internal' is not an address" in bad.stderr


def test_a_web_process_bound_of_no_connection_stops_the_process(tmp_path):
    result = manage("check", DB_WEB_CONNECTIONS="0", STEPGUARD_VAR_DIR=str(tmp_path), **PRODUCTION)
    assert result.returncode != 0
    assert "DB_WEB_CONNECTIONS='0' must be at least 1" in result.stderr


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("peer", "host", "redirected"),
    [
        ("127.0.0.1", "127.0.0.1:8000", False),  # someone at the machine: plain HTTP works
        ("::1", "localhost:8000", False),
        ("::1", "[::1]:8000", False),
        ("10.0.0.5", "127.0.0.1:8000", True),  # anyone else naming loopback
        ("127.0.0.1", "agents.example.com", True),  # a proxy on this host passing the Host
    ],
)
def test_plain_http_on_loopback_is_not_sent_to_https(client, settings, peer, host, redirected):
    """`stepguard serve` with production settings, opened on 127.0.0.1, redirected to an
    https:// that nobody serves there."""
    from controlplane import settings as production

    assert production.MIDDLEWARE[0] == "controlplane.security.SecurityMiddleware"
    settings.MIDDLEWARE = production.MIDDLEWARE
    settings.SECURE_SSL_REDIRECT = True
    settings.ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", "agents.example.com"]
    answer = client.get("/login/", REMOTE_ADDR=peer, HTTP_HOST=host)
    assert (answer.status_code == 301) is redirected, answer.status_code
    if redirected:
        assert answer["Location"] == f"https://{host}/login/"


def test_with_redis_the_cache_is_one_for_every_process(tmp_path):
    """The settings defined no cache: Django's per-process LocMemCache, so N web processes
    computed /metrics' summary N times a period. With REDIS_URL it is Redis, shared."""
    import uuid

    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    key, value = f"test-shared-{uuid.uuid4().hex}", uuid.uuid4().hex
    code = (
        "import sys; from django.conf import settings; from django.core.cache import cache;"
        " print(settings.CACHES['default']['BACKEND']);"
        " print(cache.get(sys.argv[1]) if sys.argv[2] == 'get' else cache.set(sys.argv[1],"
        " sys.argv[3], 30))"
    )

    def django(*argv: str) -> list[str]:
        environ = {**os.environ, **PRODUCTION, "REDIS_URL": url, "STEPGUARD_VAR_DIR": str(tmp_path)}
        environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
        done = subprocess.run(
            [sys.executable, "-c", f"import django; django.setup(); {code}", *argv],
            cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    backend, _ = django(key, "set", value)
    assert backend == "django.core.cache.backends.redis.RedisCache"
    assert django(key, "get") == [backend, value]  # another process reads what one wrote
