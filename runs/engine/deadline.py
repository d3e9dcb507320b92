"""Every statement a worker sends has a deadline: one that outlives it is abandoned.

A primary that hangs instead of dying (a frozen host, a proxy that stops forwarding, a
partition the kernel has not noticed) leaves a statement in flight waiting for an answer that
never comes: TCP keepalives are answered by whatever still holds the socket's other end, and a
server-side `statement_timeout` cannot fire in a server that does nothing. Measured before: 375
s and 0 steps run on a standby promoted 1.3 s after the old primary hung, and not a line in the
workers' logs. So in a worker process every blocking wait of a watched psycopg connection (a
statement, a commit) is registered while it lasts, and a watchdog thread shuts the socket of
one older than STEPGUARD_STATEMENT_DEADLINE: the wait ends at once with a lost connection,
which the engine handles as a restart (reconnect, to the next host of a multi-host
DATABASE_URL when the first does not answer, and carry the run on under its lease).

Not watched: waits given a timeout of their own (a LISTEN waiting for notifications), and
threads marked `exempt()` (the chores that may legitimately run a long statement, such as a
prune; a partition those run into is left to TCP keepalives).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress

log = logging.getLogger("stepguard.database")

_local = threading.local()


class Watchdog:
    """The waits in flight on watched connections, and the thread that abandons late ones."""

    def __init__(self) -> None:
        self.seconds: float | None = None  # None: not enabled in this process
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[float, weakref.ref, str]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.abandoned = 0

    def enable(self, seconds: float) -> None:
        """Watch from now on, with `seconds` as the deadline (0: never)."""
        self.seconds = seconds or None
        if self.seconds is None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="stepguard-deadline", daemon=True
                )
                self._thread.start()

    def watch(self, conn) -> None:
        """Give the psycopg connection `conn` a deadline on each wait (an attribute of its own
        over `Connection.wait`, through which psycopg runs every statement and commit)."""
        if self.seconds is None or "wait" in vars(conn):
            return
        original = conn.wait
        ref = weakref.ref(conn)

        def wait(gen, *args, **kwargs):
            if kwargs.get("timeout") is not None or getattr(_local, "exempt", False):
                return original(gen, *args, **kwargs)
            token = next(self._ids)
            with self._lock:
                self._inflight[token] = (time.monotonic(), ref, threading.current_thread().name)
            try:
                return original(gen, *args, **kwargs)
            finally:
                with self._lock:
                    self._inflight.pop(token, None)

        conn.wait = wait

    def _loop(self) -> None:
        while True:
            seconds = self.seconds
            time.sleep(min(0.5, (seconds or 1.0) / 10))
            if seconds is None:
                continue
            now = time.monotonic()
            with self._lock:
                late = [(t, v) for t, v in self._inflight.items() if now - v[0] > seconds]
                for token, _ in late:
                    del self._inflight[token]  # abandoned once
            for _, (started, ref, thread) in late:
                conn = ref()
                if conn is not None and abandon(conn):
                    self.abandoned += 1
                    log.warning(
                        "no answer from the database for %.1f s (%s): connection abandoned, "
                        "reconnecting (STEPGUARD_STATEMENT_DEADLINE)",
                        now - started,
                        thread,
                    )


def abandon(conn) -> bool:
    """Shut the socket under a psycopg connection: a wait on it ends at once, as after a
    server that closed it (a cancel request would go to the silent server too)."""
    try:
        fd = conn.pgconn.socket
    except Exception:
        return False  # already closed
    with suppress(OSError), socket.socket(fileno=_dup(fd)) as sock:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    return False


def _dup(fd: int) -> int:
    import os

    return os.dup(fd)


@contextmanager
def exempt() -> Iterator[None]:
    """This thread's statements have no deadline while inside (a chore's long statement)."""
    before = getattr(_local, "exempt", False)
    _local.exempt = True
    try:
        yield
    finally:
        _local.exempt = before


watchdog = Watchdog()


_hosts_lock = threading.Lock()


def _pairs(settings_dict) -> list[tuple[str, str]] | None:
    """The (host, port) pairs of a multi-host DATABASE_URL, in the order they are tried."""
    hosts, ports = str(settings_dict.get("HOST") or ""), str(settings_dict.get("PORT") or "")
    if "," not in hosts:
        return None
    names = hosts.split(",")
    numbers = ports.split(",") if "," in ports else [ports] * len(names)
    if len(numbers) != len(names):
        return None  # not DATABASE_URL's form: left as given
    return list(zip(names, numbers, strict=True))


def _put_first(settings_dict, pairs: list[tuple[str, str]], first: int) -> bool:
    """Try the hosts from `pairs[first]` on, the ones before it last, for every connection of
    the process made from now on. The hosts' settings are shared by all of the process's
    threads; HOST and PORT change in one `update` (a thread reading them between the two may
    pair a host with another's port once: that attempt fails, and the next pair is tried)."""
    with _hosts_lock:
        if _pairs(settings_dict) != pairs:
            return False  # another thread just did it
        pairs = pairs[first:] + pairs[:first]
        settings_dict.update(HOST=",".join(h for h, _ in pairs), PORT=",".join(p for _, p in pairs))
    return True


def _host_of(connection) -> tuple[str, str] | None:
    try:
        info = connection.connection.info
        return info.host, str(info.port)
    except Exception:  # no connection, or one already closed
        return None


def prefer_answering_host(connection) -> None:
    """A new connection of a multi-host DATABASE_URL that answered on a host other than the
    first: put that host first. Each new connection tries the hosts in order, and a host that
    hangs costs a full connect timeout (DB_CONNECT_TIMEOUT) before the next is tried: without
    this, every connection a worker replaces (each run thread's, every CONN_MAX_AGE) paid it
    for as long as the old primary stayed silent."""
    pairs = _pairs(connection.settings_dict)
    answered = _host_of(connection)
    if pairs is None or answered not in pairs or pairs[0] == answered:
        return
    if _put_first(connection.settings_dict, pairs, pairs.index(answered)):
        log.warning("database host %s:%s answered; trying it first from now on", *answered)


def demote_host(connection) -> None:
    """A connection to the first host of a multi-host DATABASE_URL was lost: try the next
    host first from now on (the one that answers writes goes first again as it answers,
    `prefer_answering_host`). A pooler in front of a dead primary (PgBouncer per database
    host) accepts each login and fails its first statement (`server login has been failing`,
    after a `query_wait_timeout` of 120 s for the first): libpq sees a connection made, and
    without this every reconnect went back to it; 0 steps in 85 s in the issue. Only with
    `target_session_attrs=read-write` (or `primary`), which refuses a host that is not the
    primary: a standby tried first costs a refused login, never a write to it."""
    settings_dict = connection.settings_dict
    attrs = (settings_dict.get("OPTIONS") or {}).get("target_session_attrs")
    pairs = _pairs(settings_dict)
    lost = _host_of(connection)
    if pairs is None or attrs not in ("read-write", "primary") or lost != pairs[0]:
        return
    if _put_first(settings_dict, pairs, 1):
        log.warning(
            "database host %s:%s lost the connection; trying %s:%s first from now on",
            *lost,
            *pairs[1],
        )
