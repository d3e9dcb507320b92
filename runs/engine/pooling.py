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
"""

from __future__ import annotations

import logging

from django.conf import settings

log = logging.getLogger("stepguard.database")
_said = False


def is_pooled(conn) -> bool:
    """Whether the psycopg connection `conn` goes through a pooler (see the module's doc)."""
    reported = conn.info.backend_pid
    row = conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
    if not conn.autocommit and conn.info.transaction_status:
        conn.rollback()  # the probe's transaction: nothing else was in it
    return row is None or row[0] != reported


def on_connect(sender, connection, **kwargs) -> None:
    """Django's `connection_created`: probe a new PostgreSQL connection, once."""
    if connection.vendor != "postgresql" or not settings.STEPGUARD_DETECT_POOLER:
        return
    pooled = is_pooled(connection.connection)
    connection.stepguard_pooled = pooled
    if pooled:
        connection.connection.prepare_threshold = None
        _say_once()


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
        return psycopg.connect(settings.STEPGUARD_DATABASE_DIRECT_URL, autocommit=True)
    conn = psycopg.connect(**params, autocommit=True)
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
