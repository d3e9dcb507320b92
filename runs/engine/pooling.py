"""Behind a connection pooler (PgBouncer in transaction mode): what the engine must not do.

A transaction pooler hands each transaction to any of its server connections. A statement
prepared on one is unknown on the next, or, worse, another client's statement prepared under
the same name (psycopg names them `_pg3_0`, `_pg3_1`... on every connection) runs in its
place; a LISTEN is dropped with the connection it was made on. So every new connection is
probed: a pooler answers the client's startup itself, with a backend process id of its own
making (PgBouncer's is random), unlike PostgreSQL's `pg_backend_pid()` seen through it. A
pooled connection prepares nothing (DB_PREPARED_STATEMENTS applies to direct connections) and
the wake-up listener uses DATABASE_DIRECT_URL, or polling alone. Advisory locks and settings
are transaction-scoped everywhere in the engine, so nothing else outlives a transaction.

The same probe turns JIT compilation off for the session (`set_config('jit', 'off', false)`,
no round trip of its own): at a million runs the claim's estimated cost crosses PostgreSQL's
`jit_above_cost`, and every claim and idle poll compiled code for 125 ms to save nothing
(7 ms without). A libpq `options=-c jit=off` would do it at startup, but PgBouncer refuses
an `options` startup parameter unless told to ignore it (and then drops it). Through a
pooler a session setting lands on one server connection of many, so the claim also sets it
for its own transaction there (`jit_off`); DB_JIT=1 leaves the server's setting alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from django.conf import settings
from django.db import transaction

from runs.engine.deadline import prefer_answering_host, watchdog

log = logging.getLogger("stepguard.database")
_said = False


def is_pooled(conn, jit_off: bool = False) -> bool:
    """Whether the psycopg connection `conn` goes through a pooler (see the module's doc);
    `jit_off` turns JIT off for the session in the same statement."""
    reported = conn.info.backend_pid
    sql = "SELECT pg_backend_pid()" + (", set_config('jit', 'off', false)" if jit_off else "")
    row = conn.execute(sql, prepare=False).fetchone()
    if not conn.autocommit and conn.info.transaction_status:
        conn.commit() if jit_off else conn.rollback()  # the probe's own transaction
    return row is None or row[0] != reported


def jit_wanted() -> bool:
    return getattr(settings, "STEPGUARD_DB_JIT", False)


def on_connect(sender, connection, **kwargs) -> None:
    """Django's `connection_created`: probe a new PostgreSQL connection, once, and turn its
    JIT off (see the module's doc)."""
    if connection.vendor != "postgresql":
        return
    watchdog.watch(connection.connection)
    prefer_answering_host(connection)
    jit_off = not jit_wanted()
    if not settings.STEPGUARD_DETECT_POOLER:
        if jit_off:
            conn = connection.connection
            conn.execute("SELECT set_config('jit', 'off', false)", prepare=False)
            if not conn.autocommit and conn.info.transaction_status:
                conn.commit()
        return
    pooled = is_pooled(connection.connection, jit_off)
    connection.stepguard_pooled = pooled
    if pooled:
        connection.connection.prepare_threshold = None
        _say_once()


@contextmanager
def jit_off(connection) -> Iterator[None]:
    """A transaction whose statements never compile JIT code, on a pooled connection too,
    where the session's setting may be another server connection's: `SET LOCAL` in it. On a
    direct connection the session's setting (on_connect) holds, and this adds nothing."""
    if connection.vendor != "postgresql" or jit_wanted():
        yield
        return
    if not getattr(connection, "stepguard_pooled", False):
        yield
        return
    with transaction.atomic(using=connection.alias):
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
        yield


def _say_once() -> None:
    global _said
    if not _said:
        _said = True
        log.info(
            "connected through a connection pooler: no server-side prepared statements on "
            "pooled connections; the wake-up listener uses DATABASE_DIRECT_URL%s",
            "" if settings.STEPGUARD_DATABASE_DIRECT_URL else " (not set: workers poll instead)",
        )


def listen_connection(params: dict):
    """An autocommit psycopg connection to LISTEN on: DATABASE_DIRECT_URL's when set, else one
    made with `params` (DATABASE_URL's) unless that goes through a pooler, which would drop
    the LISTEN with the transaction: then None, and the caller polls."""
    import psycopg

    if settings.STEPGUARD_DATABASE_DIRECT_URL:
        conn = psycopg.connect(settings.STEPGUARD_DATABASE_DIRECT_URL, autocommit=True)
        watchdog.watch(conn)
        return conn
    conn = psycopg.connect(**params, autocommit=True)
    watchdog.watch(conn)
    try:
        pooled = settings.STEPGUARD_DETECT_POOLER and is_pooled(conn)
    except Exception:
        conn.close()
        raise
    if pooled:
        conn.close()
        log.warning(
            "DATABASE_URL goes through a connection pooler, which drops LISTEN: set "
            "DATABASE_DIRECT_URL to a connection straight to PostgreSQL for instant wake-ups "
            "(polling every STEPGUARD_POLL_INTERVAL meanwhile)"
        )
        return None
    return conn
