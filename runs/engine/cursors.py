"""The cursor the statements of every step go through, and the one private Django API it needs.

On PostgreSQL a step's statement binds its parameters on the server, so psycopg prepares it
after a few uses and the server plans it once per connection (Django's own cursors bind on the
client and are never prepared). Django makes such a cursor only for a whole connection
(OPTIONS server_side_binding); the engine makes one per write and wraps it as Django wraps
its own (query logging, execute wrappers, Django's error classes) through
`BaseDatabaseWrapper._prepare_cursor`, a private method: `django_cursor` is the only call of
it, and tests/test_statements.py fails loudly if an upgrade of Django removes or changes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import connection


def django_cursor(raw: Any) -> Any:
    """Django's wrapper (a CursorWrapper, or CursorDebugWrapper while queries are logged)
    around `raw`, a cursor of the default connection's driver connection."""
    return connection._prepare_cursor(raw)  # type: ignore[attr-defined]


def server_binding_cursor() -> Any:
    """A psycopg cursor of the default connection that binds parameters on the server."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    connection.close_if_health_check_failed()
    connection.ensure_connection()
    return ServerBindingCursor(connection.connection)  # type: ignore[call-arg]


@contextmanager
def hot_cursor() -> Iterator[Any]:
    """A cursor for the statements every step sends: bound on the server (see the module's
    doc). With prepared statements switched off (`DB_PREPARED_STATEMENTS=0`, for a pooler that
    cannot keep them), and while Django logs queries (DEBUG, tests capturing them: psycopg
    keeps no text of a prepared statement to log), it is Django's own cursor."""
    if (
        connection.vendor != "postgresql"
        or not settings.STEPGUARD_PREPARED_STATEMENTS
        or connection.queries_logged
        or getattr(connection, "stepguard_pooled", False)  # behind a pooler: runs/engine/pooling.py
    ):
        with connection.cursor() as cursor:
            yield cursor
        return
    with django_cursor(server_binding_cursor()) as cursor:
        yield cursor


def in_list(name: str, values: list) -> tuple[str, dict[str, Any]]:
    """The placeholders (`%(name_0)s, %(name_1)s, ...`) and named parameters of an
    `IN (...)` of `values`: SQLite takes no array, and positional marks filled from a list
    shift when a condition is added before them."""
    params = {f"{name}_{i}": value for i, value in enumerate(values)}
    return ", ".join(f"%({key})s" for key in params), params


def transaction_lock(key: str) -> None:
    """Wait for, then hold until this transaction ends, PostgreSQL's advisory lock named
    `key` (nothing elsewhere: SQLite's writers are serialised already)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0))", {"key": key}
            )
