"""Stepguard's own settings, `STEPGUARD_*`, each read from the environment with a typed default.

controlplane.settings takes them all (`from runs.conf import *`). A Django project that embeds
Stepguard need not: the runs app's ready() sets every one its settings leave out, so a host
sets only what it wants to change (docs/install.md). The two settings Stepguard reads under
names of their own, LOG_FORMAT and REDIS_URL, get host defaults too (`host_defaults`).
"""

import os

from runs.env import (
    env_allow,
    env_bool,
    env_float,
    env_int,
    env_json,
    env_list,
    env_networks,
)

STEPGUARD_WORKFLOW_MODULES = env_list("STEPGUARD_WORKFLOW_MODULES", [])
STEPGUARD_LEASE_SECONDS = env_float("STEPGUARD_LEASE_SECONDS", 30.0, minimum=1.0)
STEPGUARD_POLL_INTERVAL = env_float("STEPGUARD_POLL_INTERVAL", 1.0, minimum=0.01)
STEPGUARD_SHUTDOWN_GRACE = env_float("STEPGUARD_SHUTDOWN_GRACE", 30.0)
STEPGUARD_RUN_MAX_ATTEMPTS = env_int("STEPGUARD_RUN_MAX_ATTEMPTS", 3, minimum=1)
STEPGUARD_RUN_RETRY_BASE_SECONDS = env_float("STEPGUARD_RUN_RETRY_BASE_SECONDS", 2.0)
STEPGUARD_MAX_RECOVERIES = env_int("STEPGUARD_MAX_RECOVERIES", 5, minimum=1)
STEPGUARD_MAX_OUTPUT_BYTES = env_int("STEPGUARD_MAX_OUTPUT_BYTES", 1_048_576, minimum=1024)
STEPGUARD_DURABLE_START = env_bool("STEPGUARD_DURABLE_START", True)
# /api/health answers 503 when its queries have not answered within this many seconds (a
# database that hangs: a stopped server, a partition, a lock), whatever its connection does.
STEPGUARD_HEALTH_TIMEOUT = env_float("STEPGUARD_HEALTH_TIMEOUT", 3.0, minimum=0.1)
# With a replica (DATABASE_REPLICA_URL, runs/replica.py): a client that acted reads the primary
# for this many seconds; a replica that did not answer is tried again after this many.
STEPGUARD_REPLICA_STICKY = env_int("STEPGUARD_REPLICA_STICKY", 10, minimum=1)
STEPGUARD_REPLICA_RETRY = env_float("STEPGUARD_REPLICA_RETRY", 10.0, minimum=1.0)
# Probe each new PostgreSQL connection for a pooler in between (runs/engine/pooling.py).
STEPGUARD_DETECT_POOLER = env_bool("STEPGUARD_DETECT_POOLER", True)
# Leave PostgreSQL's JIT as the server sets it (runs/engine/pooling.py): off by default on
# Stepguard's connections, where it cost each claim 125 ms at a million runs and saved nothing.
STEPGUARD_DB_JIT = env_bool("DB_JIT", False)
# In a worker, a statement with no answer after this many seconds is abandoned: its socket shut,
# the connection replaced (runs/engine/deadline.py); 0 never. Keep it well under the lease.
STEPGUARD_STATEMENT_DEADLINE = env_float("STEPGUARD_STATEMENT_DEADLINE", 10.0, minimum=0.0)
# The same in a web process (ASGI): a request whose statement has no answer after this many
# seconds answers 503 (a page or API call that takes longer is abandoned too); 0 never.
STEPGUARD_WEB_STATEMENT_DEADLINE = env_float("STEPGUARD_WEB_STATEMENT_DEADLINE", 30.0, minimum=0.0)
# A connection straight to PostgreSQL, for LISTEN, when DATABASE_URL goes through a pooler.
STEPGUARD_DATABASE_DIRECT_URL = os.environ.get("DATABASE_DIRECT_URL", "")
# Write each step's completion at once, instead of with the run's next write (docs/sdk.md).
STEPGUARD_EAGER_COMPLETIONS = env_bool("STEPGUARD_EAGER_COMPLETIONS", False)
# A completion that no next write carried is written by itself this many seconds after its
# step returned (plus up to a tenth of it: the writer looks ten times per window).
STEPGUARD_COMPLETION_WINDOW = env_float("STEPGUARD_COMPLETION_WINDOW", 0.1, minimum=0.01)
# A step's retry delay (its backoff, or a provider's Retry-After) of at least this many seconds
# is a durable timer that gives the worker thread back; shorter ones are slept in the thread.
STEPGUARD_DURABLE_RETRY_SECONDS = env_float("STEPGUARD_DURABLE_RETRY_SECONDS", 5.0)
# Flow control (docs/flow-control.md): a run due for this long is claimed before fresher runs
# whatever their priority; a schedule's tick later than this is missed (its catch-up decides).
STEPGUARD_PRIORITY_AGING_SECONDS = env_float("STEPGUARD_PRIORITY_AGING_SECONDS", 300.0)
STEPGUARD_SCHEDULE_GRACE_SECONDS = env_float("STEPGUARD_SCHEDULE_GRACE_SECONDS", 60.0)
# A rate-limit grant whose call never returned (its worker died) counts this long at most.
STEPGUARD_RATE_GRANT_STALE_SECONDS = env_float("STEPGUARD_RATE_GRANT_STALE_SECONDS", 600.0)
STEPGUARD_BUDGET_WARN_AT = env_float("STEPGUARD_BUDGET_WARN_AT", 0.8)
STEPGUARD_MODEL_PRICES = env_json("STEPGUARD_MODEL_PRICES", {})
# Refuse a call to a model without a price in a run under a USD budget (else: a warning event).
STEPGUARD_REFUSE_UNPRICED_MODELS = env_bool("STEPGUARD_REFUSE_UNPRICED_MODELS", False)
STEPGUARD_API_MAX_BODY = env_int("STEPGUARD_API_MAX_BODY", 1_048_576, minimum=1024)
# About how much JSON one API page (steps, runs, events, approvals) may carry, one value the
# dashboard shows inline, and all the values of one list page (the approvals inbox) together.
STEPGUARD_API_MAX_RESPONSE = env_int("STEPGUARD_API_MAX_RESPONSE", 8_388_608, minimum=65_536)
STEPGUARD_UI_MAX_JSON = env_int("STEPGUARD_UI_MAX_JSON", 65_536, minimum=1024)
STEPGUARD_UI_MAX_PAGE = env_int("STEPGUARD_UI_MAX_PAGE", 1_048_576, minimum=1024)
STEPGUARD_LIVE_MAX_SOCKETS = env_int("STEPGUARD_LIVE_MAX_SOCKETS", 20, minimum=1)
# Approvals: the person who started a run may not decide its requests; API keys may decide.
STEPGUARD_FOUR_EYES = env_bool("STEPGUARD_FOUR_EYES", True)
STEPGUARD_API_KEYS_DECIDE = env_bool("STEPGUARD_API_KEYS_DECIDE", True)
# Retention: workers delete runs that ended more than this many days ago, daily (0: never).
STEPGUARD_RETENTION_DAYS = env_int("STEPGUARD_RETENTION_DAYS", 0)
# Notifications (runs/notifications.py): how often one worker looks for events to deliver, and
# the dashboard's address for links in messages (e.g. https://stepguard.example.com).
STEPGUARD_NOTIFY_SWEEP_SECONDS = env_float("STEPGUARD_NOTIFY_SWEEP_SECONDS", 1.0, minimum=0.05)
# How often one worker resumes `halted` runs no hold covers (runs/engine/unheld.py; 0: never).
STEPGUARD_HOLD_SWEEP_SECONDS = env_float("STEPGUARD_HOLD_SWEEP_SECONDS", 5.0)
STEPGUARD_NOTIFY_RETRY_SECONDS = env_float("STEPGUARD_NOTIFY_RETRY_SECONDS", 2.0)
STEPGUARD_PUBLIC_URL = os.environ.get("STEPGUARD_PUBLIC_URL", "")
# Approval notifications carry decision links for each approver (runs/approvals/links.py): on
# or off, and how long a link works (at most until its approval expires).
STEPGUARD_APPROVAL_LINKS = env_bool("STEPGUARD_APPROVAL_LINKS", True)
STEPGUARD_APPROVAL_LINK_SECONDS = env_int("STEPGUARD_APPROVAL_LINK_SECONDS", 86_400, minimum=60)
# Webhooks reach only public addresses, and these: addresses, networks, host names of internal
# receivers (runs/egress.py); none by default, an entry that is none of these stops the process.
STEPGUARD_WEBHOOK_ALLOW = env_allow("STEPGUARD_WEBHOOK_ALLOW")
# GET /metrics without an API key or a session, from these addresses or networks (Prometheus).
STEPGUARD_METRICS_ALLOW = env_networks("STEPGUARD_METRICS_ALLOW")
# /metrics' totals over everything stored (finished runs, steps, spend, deliveries) read whole
# tables: computed at most once this often and shared through Django's cache (0: every scrape).
STEPGUARD_METRICS_SUMMARY_SECONDS = env_float("STEPGUARD_METRICS_SUMMARY_SECONDS", 60.0)
# The reverse proxies whose X-Forwarded-For is believed (controlplane/proxy.py, `serve`).
STEPGUARD_TRUSTED_PROXIES = env_networks("STEPGUARD_TRUSTED_PROXIES")
# Sessions end after this long without a request, or this long after login (in stand-alone
# Stepguard: its middleware runs.security.SessionTimeouts).
STEPGUARD_SESSION_IDLE_SECONDS = env_int("STEPGUARD_SESSION_IDLE_SECONDS", 8 * 3600, minimum=60)
STEPGUARD_SESSION_MAX_SECONDS = env_int("STEPGUARD_SESSION_MAX_SECONDS", 14 * 86400, minimum=60)


def host_defaults(settings) -> dict[str, object]:
    """What a host project that leaves them out gets for the settings Stepguard reads without
    the STEPGUARD_ prefix. Not read from the environment, as controlplane.settings does: the
    host's logging and channel layers are its own (a REDIS_URL in the environment may be for
    its cache).

    - LOG_FORMAT "plain": `runworker` prints its lines, as with the host's own commands.
    - REDIS_URL: the host's Redis channel layer, if CHANNEL_LAYERS has one (workers then ring
      the live pages' doorbell through it), else "": PostgreSQL NOTIFY, or polling on SQLite.
    """
    layer = getattr(settings, "CHANNEL_LAYERS", {}).get("default", {})
    hosts = layer.get("CONFIG", {}).get("hosts") or [""]
    host = hosts[0].get("address", "") if isinstance(hosts[0], dict) else hosts[0]
    redis = "channels_redis" in layer.get("BACKEND", "") and isinstance(host, str)
    return {"LOG_FORMAT": "plain", "REDIS_URL": host if redis else ""}


def apply_defaults(settings) -> None:
    """Give `settings` every STEPGUARD_* value it lacks, LOG_FORMAT and REDIS_URL if it lacks
    them (`host_defaults`), and whether prepared statements are on, from its database's
    options."""
    for name, value in globals().items():
        if name.startswith("STEPGUARD_") and not hasattr(settings, name):
            setattr(settings, name, value)
    for name, value in host_defaults(settings).items():
        if not hasattr(settings, name):
            setattr(settings, name, value)
    if not hasattr(settings, "STEPGUARD_PREPARED_STATEMENTS"):
        options = settings.DATABASES["default"].get("OPTIONS", {})
        settings.STEPGUARD_PREPARED_STATEMENTS = options.get("prepare_threshold") is not None
