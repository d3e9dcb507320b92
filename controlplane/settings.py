"""Settings, all read from the environment (see docs/deploy.md for the full list)."""

import os
import re
import secrets
import socket
import urllib.parse
from datetime import timedelta
from pathlib import Path

import dj_database_url
import django
from django.core.exceptions import ImproperlyConfigured

from runs.env import env_bool, env_float, env_int, env_list, env_networks

BASE_DIR = Path(__file__).resolve().parent.parent
# The embedded database, the development key and logs: under the directory Stepguard is run
# from (never inside site-packages, where an installed Stepguard's code lives).
VAR_DIR = Path(os.environ.get("STEPGUARD_VAR_DIR") or Path.cwd() / "var").resolve()

DEBUG = env_bool("DEBUG", False)


def _secret_key() -> str:
    key = os.environ.get("SECRET_KEY", "")
    if key:
        return key
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")
    # Development only: a key kept under var/ so sessions survive a restart of `make run`.
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    path = VAR_DIR / "dev-secret-key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS")

# No "daphne" app: it only swaps `runserver` for an ASGI one, and its import (Twisted's
# reactor) costs every process, workers included, about half a second. Serve with daphne.
INSTALLED_APPS = [
    # Before channels: our `runworker` (workflow runs) shadows channels' (channel-layer consumers).
    "runs",
    "runs.approvals",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "ninja",
    "django_htmx",
    "axes",
]
if DJANGO_6 := django.VERSION >= (6, 0):
    from django.utils.csp import CSP
else:
    # Django 6 has both built in: template partials and a Content-Security-Policy.
    INSTALLED_APPS += ["template_partials", "csp"]

MIDDLEWARE = [
    # Django's, less the HTTPS redirect for someone at this host on 127.0.0.1 or localhost.
    # (check --deploy's security.W001 looks for Django's by name: silenced below.)
    "controlplane.security.SecurityMiddleware",
    # Outside all that read the database: a request that fails on a lost or timed-out
    # connection, wherever inside, answers 503 rather than 500 (runs/dbdown.py).
    "runs.dbdown.DatabaseUnavailable",
    "controlplane.api.BodyLimitMiddleware",
    "runs.security.RefuseNul",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "runs.security.SessionTimeouts",
    "controlplane.security.PermissionsPolicy",
    "django.middleware.csp.ContentSecurityPolicyMiddleware"
    if DJANGO_6
    else "csp.middleware.CSPMiddleware",
    # Last, as django-axes asks: it turns a locked-out login into AXES_LOCKOUT_CALLABLE's answer.
    "axes.middleware.AxesMiddleware",
]

# A Content-Security-Policy with no inline script or style anywhere (templates have none;
# htmx is told not to inject its indicator styles) and no framing.
_CSP = {
    "default-src": ["'self'"],
    "script-src": ["'self'"],
    "style-src": ["'self'"],
    "img-src": ["'self'", "data:"],
    "connect-src": ["'self'"],
    "object-src": ["'none'"],
    "base-uri": ["'self'"],
    "form-action": ["'self'"],
    "frame-ancestors": ["'none'"],
}
if DJANGO_6:
    SECURE_CSP = {k: [CSP.SELF if v == "'self'" else CSP.NONE if v == "'none'" else v for v in vs]
                  for k, vs in _CSP.items()}  # fmt: skip
else:
    CONTENT_SECURITY_POLICY = {"DIRECTIVES": _CSP}

# Login throttling (django-axes): a username from one address is locked out after
# AXES_FAILURE_LIMIT failures for AXES_COOLOFF_TIME; a bad API key counts per address and
# the key it claims (runs.security._key_credentials).
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("AXES_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "runs.security.locked_out"
AXES_VERBOSE = False
# The client's address is REMOTE_ADDR, always. Behind reverse proxies, the ASGI application
# sets it from X-Forwarded-For, believed only from the proxies in STEPGUARD_TRUSTED_PROXIES
# (controlplane/proxy.py): any other header is the client's to write.
STEPGUARD_TRUSTED_PROXIES = env_networks("STEPGUARD_TRUSTED_PROXIES")
AXES_IPWARE_META_PRECEDENCE_ORDER = ["REMOTE_ADDR"]
if env_list("AXES_IP_HEADERS", ["REMOTE_ADDR"]) != ["REMOTE_ADDR"]:
    raise ImproperlyConfigured(
        "AXES_IP_HEADERS is no longer read: a client writes any header it likes. Set "
        "STEPGUARD_TRUSTED_PROXIES to your proxies' addresses instead (docs/deploy.md)"
    )

# Sessions end after STEPGUARD_SESSION_IDLE_SECONDS without a request (8 hours) or
# STEPGUARD_SESSION_MAX_SECONDS after login (14 days), whichever comes first.
STEPGUARD_SESSION_IDLE_SECONDS = env_int("STEPGUARD_SESSION_IDLE_SECONDS", 8 * 3600, minimum=60)
STEPGUARD_SESSION_MAX_SECONDS = env_int("STEPGUARD_SESSION_MAX_SECONDS", 14 * 86400, minimum=60)
SESSION_COOKIE_AGE = STEPGUARD_SESSION_MAX_SECONDS

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        # The layout, login pages and assets the whole project shares (the top-level
        # templates/ and static/); an installed wheel has them in the runs app (setup.py).
        "DIRS": [d for d in [BASE_DIR / "templates"] if d.is_dir()],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "runs.context_processors.nav",
            ],
        },
    },
]

# One DATABASE_URL; the embedded default is an SQLite file under var/.
_default_sqlite = f"sqlite:///{VAR_DIR / 'stepguard.sqlite3'}"


def parse_database_url(url: str) -> dict:
    """dj_database_url's parse, and libpq's multi-host form that it refuses:
    `postgres://user@db1:5432,db2:5432/name?target_session_attrs=read-write` (HOST and PORT
    become libpq's comma-separated lists; a host without a port gets 5432), for a standby that
    takes over: docs/deploy.md."""
    parts = urllib.parse.urlsplit(url)
    auth, at, hosts = parts.netloc.rpartition("@")
    if not parts.scheme.startswith("postgres") or "," not in hosts:
        return dj_database_url.parse(url)
    names, ports = [], []
    for entry in hosts.split(","):
        match = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]/]+)(?::(\d{1,5}))?", entry)
        if match is None:
            raise ImproperlyConfigured(
                f"DATABASE_URL: cannot read host {entry!r} in {hosts!r}: write"
                " host:port,host:port (an IPv6 address in brackets, [::1]:5432)"
            )
        names.append(match[1].strip("[]"))
        ports.append(match[2] or "5432")
    parsed = dj_database_url.parse(urllib.parse.urlunsplit(parts._replace(netloc=f"{auth}{at}h")))
    parsed.update(HOST=",".join(names), PORT=",".join(ports))
    return parsed


DATABASES = {"default": parse_database_url(os.environ.get("DATABASE_URL") or _default_sqlite)}
_db = DATABASES["default"]
if _db["ENGINE"] == "django.db.backends.sqlite3":
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    # WAL lets readers and one writer overlap; IMMEDIATE takes the write lock at BEGIN so two
    # processes never deadlock upgrading a read lock; the timeout waits out short writes.
    # synchronous=FULL: a completed step is on disk when its commit returns, as the docs
    # promise (NORMAL in WAL mode can lose the last commits to a power cut or an OS crash).
    _db["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;",
    }
    # Tests share the database with worker subprocesses, so it must be a file, not :memory:.
    _db["TEST"] = {"NAME": str(VAR_DIR / "test-stepguard.sqlite3")}
elif _db["ENGINE"] in ("django.db.backends.postgresql",):
    _db.setdefault("OPTIONS", {})
    # Workers' connections; the web process (ASGI) closes each at the end of its request.
    _db["CONN_MAX_AGE"] = env_int("DB_CONN_MAX_AGE", 60)
    _db["CONN_HEALTH_CHECKS"] = True
    # A server that stops answering (stopped, partitioned) fails a new connection after this
    # long instead of hanging it: the web process connects per request, so its requests and
    # /api/health fail in seconds; a worker's reconnect says "database unreachable" once.
    _db["OPTIONS"].setdefault("connect_timeout", env_int("DB_CONNECT_TIMEOUT", 5, minimum=1))
    # A peer that stops acknowledging (a partition, a dead host) drops the connection after
    # DB_TCP_TIMEOUT seconds, whether a statement is in flight (tcp_user_timeout) or it is idle
    # (keepalives), instead of Linux's 2 h 11 min. A peer that acknowledges and says nothing (a
    # frozen server, a proxy that stops forwarding) is the statement deadline's (deploy.md).
    _tcp = env_int("DB_TCP_TIMEOUT", 10, minimum=2)
    _every = max(1, _tcp // 5)
    for _option, _value in {
        "keepalives": 1,
        "keepalives_idle": max(1, _tcp - 3 * _every),
        "keepalives_interval": _every,
        "keepalives_count": 3,
        "tcp_user_timeout": _tcp * 1000,
    }.items():
        _db["OPTIONS"].setdefault(_option, _value)
    # The engine's checkpoint statements are prepared (planned once per connection); Django's
    # own queries bind on the client and never are. Off for a pooler that cannot keep prepared
    # statements across transactions (PgBouncer before 1.21 in transaction mode).
    if env_bool("DB_PREPARED_STATEMENTS", True):
        _db["OPTIONS"].setdefault("prepare_threshold", 5)
STEPGUARD_PREPARED_STATEMENTS = _db.get("OPTIONS", {}).get("prepare_threshold") is not None
# A streaming standby for the pages' and the API's reads (runs/replica.py, docs/deploy.md).
if _replica_url := os.environ.get("DATABASE_REPLICA_URL", ""):
    if _db["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured(
            "DATABASE_REPLICA_URL needs a PostgreSQL DATABASE_URL: a replica is a streaming "
            "standby of the primary"
        )
    _replica = parse_database_url(_replica_url)
    _replica["OPTIONS"] = {**_replica.get("OPTIONS", {}), **_db["OPTIONS"]}
    _replica.update(CONN_MAX_AGE=_db["CONN_MAX_AGE"], CONN_HEALTH_CHECKS=True)
    _replica["TEST"] = {"MIRROR": "default"}  # tests: the same database, no second one made
    DATABASES["replica"] = _replica
    DATABASE_ROUTERS = ["runs.replica.ReplicaRouter"]
    MIDDLEWARE.insert(
        MIDDLEWARE.index("django.contrib.auth.middleware.AuthenticationMiddleware") + 1,
        "runs.replica.ReadsOnReplica",
    )
# Requests a web process lets into Django at once, each holding at most one connection per
# database; the rest wait their turn (controlplane/webdb.py).
DB_WEB_CONNECTIONS = env_int("DB_WEB_CONNECTIONS", 10, minimum=1)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"


#: Seconds a read from the Redis cache may wait.
REDIS_SOCKET_TIMEOUT = 15
REDIS_KEEPALIVE = {socket.TCP_KEEPIDLE: 10, socket.TCP_KEEPINTVL: 5, socket.TCP_KEEPCNT: 3}


def redis_channel_layer(url: str) -> dict:
    """The Channels layer on Redis at `url`, with no read timeout and TCP keepalives instead.

    redis-py 8 reads with a 5 s timeout by default, and channels-redis blocks 5 s on its pop: a
    quiet live feed's pop timed out and the feed closed with 1011 every 5-6 s (issue 50 §1).
    A longer read timeout is no cure on Python 3.11: any socket timeout wraps each send in
    `asyncio.wait_for`, which swallows a cancellation landing as the send completes (fixed in
    3.12), so a closing feed's receive lived on and polled Redis for good. With none, the pop
    returns every 5 s by itself, and a dead peer is found by keepalive (about 25 s)."""
    host = {
        "address": url,
        "socket_timeout": None,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "socket_keepalive_options": REDIS_KEEPALIVE,
    }
    return {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [host]}}


REDIS_URL = os.environ.get("REDIS_URL", "")
if REDIS_URL:
    CHANNEL_LAYERS = {"default": redis_channel_layer(REDIS_URL)}
    # One cache for every web process: /metrics' summary is computed once a period for all
    # of them, not once per process (Django's default, a per-process LocMemCache).
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "stepguard",
            "OPTIONS": {"socket_timeout": REDIS_SOCKET_TIMEOUT, "socket_connect_timeout": 5},
        }
    }
else:
    # Per-process only: good enough for the embedded single-process demo, where consumers poll.
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [d for d in [BASE_DIR / "static"] if d.is_dir()]  # as TEMPLATES' DIRS
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", VAR_DIR / "staticfiles"))
# daphne serves no static files; tests and `make run` ask the ASGI app to do it.
SERVE_STATIC = env_bool("SERVE_STATIC", DEBUG)

LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

# Production hardening; all of it is what `manage.py check --deploy` asks for.
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Not SECURE_PROXY_SSL_HEADER: Django would believe X-Forwarded-Proto from any client. The
# ASGI application takes the scheme from it only from STEPGUARD_TRUSTED_PROXIES (proxy.py).
SECURE_PROXY_SSL_HEADER = None
SESSION_COOKIE_SECURE = not DEBUG
CSRF_COOKIE_SECURE = not DEBUG
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", not DEBUG)
# W001 asks for django.middleware.security.SecurityMiddleware by its path; MIDDLEWARE has its
# subclass, controlplane.security.SecurityMiddleware (tests/test_settings.py checks it is there).
SILENCED_SYSTEM_CHECKS = ["security.W001"]

# LOG_FORMAT=json: one JSON object per line, with the run, workflow, step, worker and event a
# line is about (runs/logcontext.py); then every logger's lines go out that way, not just ours.
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain").strip().lower() or "plain"
if LOG_FORMAT not in ("plain", "json"):
    raise ImproperlyConfigured(f"LOG_FORMAT={LOG_FORMAT!r} is not 'plain' or 'json'")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"context": {"()": "runs.logcontext.ContextFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
        "json": {"()": "runs.logcontext.JsonFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["context"],
        }
    },
    "loggers": {
        "stepguard": {
            "handlers": ["console"],
            "level": os.environ.get("LOG_LEVEL", "INFO"),
            "propagate": LOG_FORMAT != "json",
        },
        # LOG_EVENTS=1: every event appended to a run's history is a line too.
        "stepguard.events": {"level": "INFO" if env_bool("LOG_EVENTS", False) else "WARNING"},
    },
}
if LOG_FORMAT == "json":
    LOGGING["root"] = {"handlers": ["console"], "level": "WARNING"}

# Engine tunables, all under STEPGUARD_* (runs/conf.py: a project embedding Stepguard gets the
# same defaults without importing these settings).
from runs.conf import *  # noqa: E402, F403

DATA_UPLOAD_MAX_MEMORY_SIZE = STEPGUARD_API_MAX_BODY  # noqa: F405
# Email notifications go through Django's mail settings, from the environment: MAILERS on
# Django 6.1 and newer (the EMAIL_* settings are deprecated there), EMAIL_* before.
_MAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
_SMTP = {
    "host": os.environ.get("EMAIL_HOST", "localhost"),
    "port": env_int("EMAIL_PORT", 25, minimum=1),
    "username": os.environ.get("EMAIL_HOST_USER", ""),
    "password": os.environ.get("EMAIL_HOST_PASSWORD", ""),
    "use_tls": env_bool("EMAIL_USE_TLS", False),
    "timeout": env_float("EMAIL_TIMEOUT", 10.0, minimum=1.0),
}
if django.VERSION >= (6, 1):
    _options = _SMTP if _MAIL_BACKEND.endswith(".smtp.EmailBackend") else {}
    if os.environ.get("EMAIL_FILE_PATH"):
        _options = {"file_path": os.environ["EMAIL_FILE_PATH"]}
    MAILERS = {"default": {"BACKEND": _MAIL_BACKEND, "OPTIONS": _options}}
else:
    EMAIL_BACKEND = _MAIL_BACKEND
    EMAIL_HOST, EMAIL_PORT, EMAIL_TIMEOUT = _SMTP["host"], _SMTP["port"], _SMTP["timeout"]
    EMAIL_HOST_USER, EMAIL_HOST_PASSWORD = _SMTP["username"], _SMTP["password"]
    EMAIL_USE_TLS = _SMTP["use_tls"]
    if os.environ.get("EMAIL_FILE_PATH"):
        EMAIL_FILE_PATH = os.environ["EMAIL_FILE_PATH"]
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "stepguard@localhost")
