"""A lost database connection: how to recognise one, wait it out, and say so once.

A PostgreSQL restart breaks every connection a worker holds at once: the claim loop, the
heartbeat, the listener and each run thread all fail, and keep failing until the server is
back. One line says the database went away (with the cause), one says it is back and after how
long; the failures in between are logged at DEBUG, not as a traceback a second.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import psycopg
from django.db import InterfaceError, OperationalError, connection

from runs.engine.deadline import demote_host

log = logging.getLogger("stepguard.database")
P = ParamSpec("P")
R = TypeVar("R")


#: SQLSTATEs of a server shutting down or not yet accepting connections (class 57P).
_SHUTDOWN = {"57P01", "57P02", "57P03"}


def is_disconnect(exc: BaseException) -> bool:
    """A connection-level failure on PostgreSQL (server gone, restarting, unreachable,
    connection closed), as opposed to a statement the database refused or cancelled: only
    these are worth waiting out. A SQLite error never is (there is no server to come back)."""
    if not isinstance(exc, OperationalError | InterfaceError):
        return False
    if connection.vendor != "postgresql":
        return False
    if isinstance(exc, InterfaceError):
        return True  # "connection already closed": Django's own, or the driver's
    cause = exc.__cause__
    if not isinstance(cause, psycopg.Error):
        return False
    state = cause.sqlstate
    # A client-side failure (no SQLSTATE: the socket closed, the server is unreachable),
    # a connection exception (class 08) or a shutdown; not a timeout or a cancelled query.
    return state is None or state.startswith("08") or state in _SHUTDOWN


class Outage:
    """Process-wide: the first failure opens an outage, the first success after it closes it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._over_at = float("-inf")  # when the last outage closed

    def failed(self, exc: BaseException, where: str, attempted_at: float) -> None:
        """A failed attempt, begun at `attempted_at` (time.monotonic()). One begun before the
        last outage closed is a straggler of it, not a new one: during a failover a thread
        still connecting to the old side fails just after another found the new primary."""
        with self._lock:
            first = self._since is None and attempted_at >= self._over_at
            if first:
                self._since = time.monotonic()
        if first:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.error("database unreachable (%s: %s); retrying until it answers", where, cause)
        else:
            log.debug("database still unreachable (%s): %s", where, exc)

    def ok(self) -> None:
        if self._since is None:  # the common case: no lock
            return
        with self._lock:
            since, self._since = self._since, None
            if since is not None:
                self._over_at = time.monotonic()
        if since is not None:
            log.warning("database back after %.1f s", time.monotonic() - since)


outage = Outage()


def reconnect(where: str) -> bool:
    """Replace this thread's broken connection; True if the database answers on a new one.

    Only a failed attempt to connect opens an outage: a connection broken by a restart that is
    already over is replaced without a word, so each outage is said once, not once per thread.
    """
    demote_host(connection)
    connection.close()
    attempted_at = time.monotonic()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:
        if not is_disconnect(exc):
            raise
        outage.failed(exc, where, attempted_at)
        return False
    outage.ok()
    return True


def wait_for_database(give_up: Callable[[], bool], *, first: float = 0.05, most: float = 0.5):
    """Block this thread until a new database connection answers, or `give_up()` is true.

    The pause between attempts doubles from `first` to `most`: a restarted server is found
    well within a second of accepting connections, and a long outage costs at most two
    connection attempts a second per thread.
    """
    pause = first
    while not give_up():
        if reconnect("a run thread reconnecting"):
            return True
        time.sleep(pause)
        pause = min(pause * 2, most)
    return False


def once_more(fn: Callable[P, R]) -> Callable[P, R]:
    """An entry point for callers outside the worker (a consumer, a cron daemon, a script):
    called again once, on a new connection, when the connection is lost under it, unless the
    caller's own transaction is open (its earlier statements are gone with the connection:
    the caller must start it again). Before, nothing replaced a connection broken outside a
    request: after a switchover every call of a long-lived process failed with `the
    connection is closed` (125 failures in 25 s). A connection an earlier call left broken is
    replaced before the call. The call again is safe for a read, a signal whose first attempt
    failed, and a start by `key`; a start without one whose commit was lost with the reply
    (the connection broke during COMMIT) may start the run twice: give it a key."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if not connection.in_atomic_block:
            _replace_if_broken()
        try:
            return fn(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if connection.in_atomic_block or not is_disconnect(exc):
                raise
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log.warning("database connection lost (%s); %s again on a new one", cause, fn.__name__)
            demote_host(connection)
            connection.close()
            return fn(*args, **kwargs)

    return call


def _replace_if_broken() -> None:
    """Close this thread's connection if an error broke it (Django does so only between
    requests; its age is left alone: a web process's requests close theirs at the end)."""
    if connection.connection is not None and connection.errors_occurred:
        if connection.is_usable():
            connection.errors_occurred = False
        else:
            connection.close()
