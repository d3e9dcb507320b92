"""One wake-up path, two mechanisms: PostgreSQL LISTEN/NOTIFY, or polling alone.

Notifications are only a doorbell. Workers always poll too, so a lost NOTIFY (a dropped
listener connection, a database restart) delays work by at most one poll interval.
"""

import logging
import threading

import psycopg
from django.db import connection

log = logging.getLogger("stepguard.wakeup")

CHANNEL = "stepguard_runs"


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def notify_runnable() -> None:
    """Ring the workers' doorbell: a run became runnable now. Call it after commit."""
    if is_postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, '')", [CHANNEL])


class Listener(threading.Thread):
    """Sets `bell` on every NOTIFY; reconnects after any error until `stop` is set."""

    def __init__(self, bell: threading.Event, stop: threading.Event):
        super().__init__(name="stepguard-listener", daemon=True)
        self.bell, self.stop = bell, stop
        self.params = connection.get_connection_params()
        self.connected = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with psycopg.connect(**self.params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.connected.set()
                    while not self.stop.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self.bell.set()
            except Exception as exc:
                self.connected.clear()
                log.warning("listener connection lost (%s); polling until it reconnects", exc)
                self.stop.wait(1.0)
