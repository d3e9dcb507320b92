"""The history's partitions on PostgreSQL: one table of events per month of their runs' creation.

All of a run's events are in its creation month's partition, so once no run created in a month
is left, retention detaches and drops that month whole: next to no WAL, where deleting the
rows logged each of them (and, past a checkpoint, each page whole). Events without a run (halts
and budgets on a whole workflow or on everything) are in `runs_event_no_run`, never dropped;
the DEFAULT partition takes a run created in a month that has no partition (one seeded or
imported with an old date, or a month no worker made in time), and retention deletes such rows
one by one as before. SQLite keeps one plain table: everything here does nothing there.

Partitions are made by the migration (from the first run's month to AHEAD months on), then by
every worker's chore and every prune, AHEAD months ahead. Their DDL waits at most LOCK_TIMEOUT
for its lock: a statement queued behind a long reader would hold up every event write queued
behind it in turn, so it gives up instead and the next round tries again.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, date, datetime, timedelta

from django.db import DatabaseError, close_old_connections, connection, transaction
from django.utils import timezone

from runs.engine.chores import Chore, ChoreContext
from runs.models import Event, Run

log = logging.getLogger("stepguard.retention")

TABLE = Event._meta.db_table
NO_RUN = f"{TABLE}_no_run"
DEFAULT = f"{TABLE}_default"
AHEAD = 2
LOCK_TIMEOUT = "500ms"
#: A month older than this before the prune's cutoff, that a run still pins, has the events of
#: its pruned runs deleted row by row: a run that lives for months must not keep a month of
#: other runs' history with it.
PINNED_GRACE = timedelta(days=31)
CHECK_SECONDS = 6 * 3600.0
#: The most pruned runs whose events one prune deletes from pinned months (the rest: the next).
ORPHANS_PER_PRUNE = 100_000
_NAME = re.compile(rf"^{TABLE}_(\d{{4}})_(\d{{2}})$")


def partitioned() -> bool:
    return connection.vendor == "postgresql"


def month_of(when: datetime) -> date:
    return when.astimezone(UTC).date().replace(day=1)


def next_month(month: date) -> date:
    return date(month.year + month.month // 12, month.month % 12 + 1, 1)


def _start(month: date) -> datetime:
    return datetime(month.year, month.month, 1, tzinfo=UTC)


def name_of(month: date) -> str:
    return f"{TABLE}_{month:%Y_%m}"


def months() -> list[date]:
    """The months that have a partition, oldest first."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = %s::regclass",
            [TABLE],
        )
        names = [row[0] for row in cursor.fetchall()]
    found = (_NAME.match(name) for name in names)
    return sorted(date(int(m[1]), int(m[2]), 1) for m in found if m)


def _ddl(*statements: str) -> None:
    """Statements in a transaction of their own that waits at most LOCK_TIMEOUT for locks."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        for sql in statements:
            cursor.execute(sql)


def ensure(since: datetime | None = None, now: datetime | None = None) -> list[str]:
    """Make the missing partitions from `since`'s month (the current one if not given) to AHEAD
    months after `now`'s; return their names. A month the DEFAULT partition already holds
    events of is left to it (PostgreSQL refuses the partition): logged, not raised."""
    if not partitioned():
        return []
    now = now or timezone.now()
    month, last = month_of(since or now), month_of(now)
    for _ in range(AHEAD):
        last = next_month(last)
    have, made = set(months()), []
    while month <= last:
        start, end = _start(month), _start(next_month(month))
        if month not in have and _in_default(start, end):
            log.warning(
                "history partition %s not made: %s holds its events", name_of(month), DEFAULT
            )
        elif month not in have:
            try:
                _ddl(
                    f"CREATE TABLE IF NOT EXISTS {name_of(month)} PARTITION OF {TABLE}"
                    f" FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
                )
                made.append(name_of(month))
            except DatabaseError as error:
                log.warning("history partition %s not made: %s", name_of(month), error)
        month = next_month(month)
    return made


def _in_default(start: datetime, end: datetime) -> bool:
    """Whether the DEFAULT partition holds events of a month: PostgreSQL would refuse that
    month's partition, after reading DEFAULT whole under a lock every event write waits for.
    Read here under no such lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT 1 FROM {DEFAULT} WHERE run_created_at >= %s AND run_created_at < %s LIMIT 1",
            [start, end],
        )
        return cursor.fetchone() is not None


def drop_empty(now: datetime | None = None) -> list[str]:
    """Detach and drop each past month's partition that no run created in it is left for;
    return their names. The run check is made under the table's lock, so a run committed
    while the lock was awaited is seen, and its month kept."""
    if not partitioned():
        return []
    current, dropped = month_of(now or timezone.now()), []
    for month in months():
        name = name_of(month)
        try:
            if month >= current or _pinned(month):  # an index look-up on runs(created_at)
                continue
            if stray := _live_run_in(name):
                log.error(
                    "history partition %s not dropped: it holds events of run %s, created in"
                    " another month (was the run's created_at changed?)",
                    name,
                    stray,
                )
                continue
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                cursor.execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
                if _pinned(month):
                    continue
                cursor.execute(f"ALTER TABLE {TABLE} DETACH PARTITION {name}")
                cursor.execute(f"DROP TABLE {name}")
        except DatabaseError as error:
            log.warning("history partition %s not dropped, next prune tries again: %s", name, error)
            continue
        dropped.append(name)
    return dropped


def _live_run_in(name: str):
    """A run that still exists and has events in partition `name`, or None. Every writer
    takes the key from the run row, so this finds none unless a run's created_at was edited;
    it reads the whole partition, once, before it is dropped."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT r.id FROM {name} e JOIN {Run._meta.db_table} r ON r.id = e.run_id LIMIT 1"
        )
        row = cursor.fetchone()
    return row[0] if row else None


def _pinned(month: date) -> bool:
    start, end = _start(month), _start(next_month(month))
    return Run.objects.filter(created_at__gte=start, created_at__lt=end).exists()


def orphans(before: datetime, now: datetime | None = None) -> list:
    """The ids of pruned runs (at most ORPHANS_PER_PRUNE) whose events are still in a month
    that ended PINNED_GRACE before `before` and was not dropped (a live run pins it, or it
    could not be): retention deletes those rows one by one. Reads each such month whole."""
    if not partitioned():
        return []
    current, found = month_of(now or timezone.now()), []
    for month in months():
        if month >= current or _start(next_month(month)) > before - PINNED_GRACE:
            continue
        try:
            with connection.cursor() as cursor:
                cursor.execute(
                    f"SELECT DISTINCT e.run_id FROM {name_of(month)} e WHERE NOT EXISTS"
                    f" (SELECT 1 FROM {Run._meta.db_table} r WHERE r.id = e.run_id) LIMIT %s",
                    [ORPHANS_PER_PRUNE - len(found)],
                )
                found += [row[0] for row in cursor.fetchall()]
        except DatabaseError as error:  # dropped meanwhile by another prune
            log.warning("history partition %s not read: %s", name_of(month), error)
        if len(found) >= ORPHANS_PER_PRUNE:
            break
    return found


def keep_ahead(context: ChoreContext) -> None:
    """One look of a worker's partition chore."""
    try:
        made = ensure()
        if made:
            log.info("made history partitions %s", ", ".join(made))
    except Exception:
        log.exception("history partitions: not made; next look in %ss", CHECK_SECONDS)
        close_old_connections()  # a connection lost to a restart is opened again next time


def chore() -> Chore | None:
    """On PostgreSQL, every worker makes the coming months' partitions at start and every
    CHECK_SECONDS (idempotent: a look at pg_inherits when they are there)."""
    if not partitioned():
        return None
    return Chore("making history partitions", CHECK_SECONDS, keep_ahead)
