"""The history partitioned by month on PostgreSQL (runs/partitions.py): every writer gives an
event its run's creation month, retention drops a month whole once no run of it is left, the
append-only rule holds on each partition, and the migration carries an existing history over."""

import logging
import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from datetime import timedelta
from unittest import mock

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.utils import timezone

from runs import notifications, partitions, retention
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.management.commands.runworker import chores
from runs.models import NO_RUN, Event, NotificationDelivery, Run, RunStatus
from runs.operations import cancel_run, halt
from runs.sdk import send_signal, start_run
from tests import workflows  # noqa: F401  (registers "ledger", "waiter", "approver")
from tests.conftest import ROOT

pytestmark = pytest.mark.django_db

MISFILED = """
SELECT count(*) FROM runs_event e LEFT JOIN runs_run r ON r.id = e.run_id
WHERE e.run_created_at <> coalesce(r.created_at, %s)
"""


def misfiled() -> int:
    """Events whose partition key is not their run's creation time (NO_RUN without a run)."""
    with connection.cursor() as cursor:
        cursor.execute(MISFILED, [connection.ops.adapt_datetimefield_value(NO_RUN)])
        return cursor.fetchone()[0]


def months_ago(n: int):
    month = partitions.month_of(timezone.now())
    for _ in range(n):
        month = (month - timedelta(days=1)).replace(day=1)
    return month


@contextmanager
def created_in(month):
    """Runs started inside are created on the 15th of `month` (the clock auto_now_add reads)."""
    when = partitions._start(month) + timedelta(days=14)
    with mock.patch("django.utils.timezone.now", return_value=when):
        yield


def test_every_writer_gives_an_event_its_runs_creation_month(drive, alice, cast):
    """The claim, the step writes and the completions riding on them, signals, decisions,
    operator actions and workflow-wide audit events, on both engines."""
    ledger = start_run("ledger", {"steps": 3})
    waiter = start_run("waiter", {})
    approver = start_run("approver", {"amount": 5})
    doomed = start_run("waiter", {})
    drive()
    send_signal(waiter.pk, "go", {"x": 1})
    decide(ApprovalRequest.objects.get(run=approver).pk, "approve", alice)
    cancel_run(doomed.pk, cast["otto"], "not needed")
    halt("workflow:ledger", cast["otto"], "maintenance")
    drive()
    assert Run.objects.get(pk=ledger.pk).status == RunStatus.COMPLETED
    assert Event.objects.filter(run=None, type="scope.halted").exists()
    assert Event.objects.count() > 20 and misfiled() == 0
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT DISTINCT tableoid::regclass::text FROM runs_event")
            where = {row[0] for row in cursor.fetchall()}
        assert where == {partitions.NO_RUN, partitions.name_of(partitions.month_of(timezone.now()))}


@pytest.mark.postgres
def test_a_prune_drops_a_month_no_run_is_left_in_and_keeps_the_month_a_live_run_pins(drive, caplog):
    old, pinned = months_ago(2), months_ago(1)
    partitions.ensure(since=partitions._start(old))
    with created_in(old):
        gone = start_run("ledger", {"steps": 2})
    with created_in(pinned):
        finished = start_run("ledger", {"steps": 2})
        live = start_run("waiter", {})
    drive()
    Run.objects.filter(pk__in=[gone.pk, finished.pk]).update(
        finished_at=timezone.now() - timedelta(days=10)
    )
    assert misfiled() == 0
    live_events = list(Event.objects.filter(run=live).values_list("seq", "type"))
    finished_events = Event.objects.filter(run=finished).count()

    result = retention.prune(finished_before=timezone.now() - timedelta(days=1))

    assert result.runs == 2 and result.counts["events"] == finished_events * 2
    assert partitions.name_of(old) in result.partitions_dropped
    assert old not in partitions.months() and pinned in partitions.months()
    assert list(Event.objects.filter(run=live).values_list("seq", "type")) == live_events
    # The pruned run's events stay in the pinned month, off every page, until it goes.
    assert Event.objects.filter(run_id=finished.pk).count() == finished_events
    assert retention.prune(finished_before=timezone.now()).partitions_dropped == []
    [audit] = Event.objects.filter(type="runs.pruned", payload__runs=2)
    assert audit.payload["partitions_dropped"] == result.partitions_dropped

    # A month that ended more than PINNED_GRACE before the limit and is still pinned has its
    # pruned runs' events deleted row by row instead, once; the live run's stay.
    later = retention.prune(finished_before=timezone.now() + timedelta(days=45))
    assert later.orphaned_events == finished_events and later.partitions_dropped == []
    assert not Event.objects.filter(run_id=finished.pk).exists()
    assert list(Event.objects.filter(run=live).values_list("seq", "type")) == live_events


@pytest.mark.postgres
def test_each_partition_is_append_only_and_a_run_with_events_in_a_month_keeps_it(drive, caplog):
    old = months_ago(2)
    partitions.ensure(since=partitions._start(old))
    run = start_run("waiter", {})
    drive()
    name = partitions.name_of(partitions.month_of(run.created_at))
    for sql in (f"DELETE FROM {name}", f"UPDATE {name} SET actor = 'forged'"):
        with (
            pytest.raises(DatabaseError, match="append-only"),
            transaction.atomic(),
            connection.cursor() as cursor,
        ):
            cursor.execute(sql)
    # An event filed under another month than its run's (a created_at edited by hand) keeps
    # that month from being dropped: the check reads the partition before it goes.
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO runs_event (run_id, run_created_at, seq, type, step_key, actor,"
            " payload, created_at) VALUES (%s, %s, 99, 'step.completed', '', 'system', '{}',"
            " now())",
            [run.pk, partitions._start(old) + timedelta(days=1)],
        )
    with caplog.at_level(logging.ERROR, logger="stepguard.retention"):
        dropped = partitions.drop_empty()
    assert partitions.name_of(old) not in dropped and old in partitions.months()
    assert f"holds events of run {run.pk}" in caplog.text


@pytest.mark.postgres
def test_workers_keep_the_coming_months_partitions_made():
    ahead = partitions.month_of(timezone.now())
    for _ in range(partitions.AHEAD):
        ahead = partitions.next_month(ahead)
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {partitions.name_of(ahead)}")
    assert ahead not in partitions.months()
    [chore] = [c for c in chores() if c.name == "making history partitions"]
    chore.run(None)
    assert ahead in partitions.months()


def test_the_audit_page_leaves_out_the_actions_on_a_pruned_run(drive, cast):
    run = start_run("waiter", {})
    drive()
    cancel_run(run.pk, cast["otto"], "not needed")
    drive()
    Run.objects.filter(pk=run.pk).update(finished_at=timezone.now() - timedelta(days=10))
    client = Client()
    client.force_login(cast["otto"])
    page = client.get("/audit")
    assert str(run.pk)[:8] in page.content.decode()
    assert retention.prune(finished_before=timezone.now() - timedelta(days=1)).runs == 1
    page = client.get("/audit")
    assert page.status_code == 200 and str(run.pk)[:8] not in page.content.decode()


@pytest.mark.postgres
def test_the_migration_carries_every_event_into_its_runs_month():
    """A database at 0024 with a history spread over three months and an audit event
    migrates: every event is kept, filed under its run's month, ids carry on after it."""
    settings = connection.settings_dict
    name = f"migrate_{uuid.uuid4().hex[:8]}"
    dsn = {
        "host": settings["HOST"] or "127.0.0.1",
        "port": settings["PORT"] or 5432,
        "user": settings["USER"],
        "password": settings["PASSWORD"],
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **dsn) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{dsn['user']}:{dsn['password'] or ''}@{dsn['host']}:"
        f"{dsn['port']}/{name}",
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }

    def manage(*argv: str) -> None:
        done = subprocess.run(
            [sys.executable, "manage.py", *argv], cwd=ROOT, env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr

    try:
        manage("migrate", "--no-input", "runs", "0024")
        with psycopg.connect(dbname=name, **dsn) as db:
            db.execute(SEED_0024)
        manage("migrate", "--no-input")
        with psycopg.connect(dbname=name, **dsn) as db:
            rows = db.execute(
                "SELECT e.tableoid::regclass::text, count(*), count(*) FILTER (WHERE"
                " e.run_created_at = coalesce(r.created_at, '1970-01-01+00'))"
                " FROM runs_event e LEFT JOIN runs_run r ON r.id = e.run_id GROUP BY 1"
            ).fetchall()
            placed = {where: (n, right) for where, n, right in rows}
            assert sum(n for n, _ in placed.values()) == 3 * 4 + 1
            assert all(n == right for n, right in placed.values())
            assert placed[partitions.NO_RUN] == (1, 1)
            assert len(placed) == 4  # three months and the audit partition
            next_id = db.execute(
                "INSERT INTO runs_event (run_id, run_created_at, seq, type, step_key, actor,"
                " payload, created_at) VALUES (NULL, '1970-01-01+00', 0, 'scope.halted', '',"
                " 'a', '{}', now()) RETURNING id"
            ).fetchone()[0]
            assert next_id > db.execute("SELECT max(id) FROM runs_event WHERE actor <> 'a'"
                                        ).fetchone()[0]  # fmt: skip
    finally:
        with psycopg.connect(dbname="postgres", autocommit=True, **dsn) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


SEED_0024 = """
INSERT INTO runs_run (id, workflow, version, input, status, key, lease_epoch, attempt,
    max_attempts, recoveries, event_seq, tokens_in, tokens_out, cost_micros, reserved_micros,
    reserved_tokens, budget_warned, halted_by, halt_reason, cancel_requested_by, cancel_reason,
    concurrency_key, priority, possibly_spent_micros, possibly_spent_tokens, created_at, wake_at,
    labels)
SELECT gen_random_uuid(), 'w', '1', '{}'::jsonb, 'completed', 'k-' || g, 1, 1, 3, 0, 4,
    0, 0, 0, 0, 0, false, '', '', '', '', '', 0, 0, 0,
    date_trunc('month', now()) - (g || ' months')::interval + interval '3 days', now(), '{}'
FROM generate_series(0, 2) g;
INSERT INTO runs_event (run_id, seq, type, step_key, actor, payload, created_at)
SELECT r.id, s, 'step.completed', '', 'system', '{}'::jsonb, r.created_at
FROM runs_run r, generate_series(1, 4) s;
INSERT INTO runs_event (run_id, seq, type, step_key, actor, payload, created_at)
VALUES (NULL, 0, 'scope.halted', '', 'alice', '{}', now());
"""


@pytest.mark.postgres
def test_a_runs_events_are_read_from_its_months_table_alone(drive):
    """Event.objects.of(run) names the partition: one month's table is planned and read."""
    run = start_run("waiter", {})
    drive()
    plan = Event.objects.of(run).filter(seq__gt=0).order_by("seq").explain()
    month = partitions.name_of(partitions.month_of(run.created_at))
    assert month in plan
    assert partitions.DEFAULT not in plan and partitions.NO_RUN not in plan


@pytest.mark.postgres
def test_a_pruned_runs_events_are_neither_swept_nor_sent(drive):
    """Left in their month after the prune, they are no one's news: the sweep skips them and
    a delivery started before the prune says the event is gone."""
    channel = notifications.add_channel(None, "webhook", "http://127.0.0.1:9/h", ["run.completed"])
    run = start_run("ledger", {"steps": 1})
    drive()
    event = Event.objects.get(run_id=run.pk, type="run.completed")
    assert not NotificationDelivery.objects.exists()
    Run.objects.filter(pk=run.pk).update(finished_at=timezone.now() - timedelta(days=10))
    assert retention.prune(finished_before=timezone.now() - timedelta(days=1)).runs == 1
    assert Event.objects.filter(pk=event.pk).exists()  # left in its month's partition
    assert notifications.sweep() == 0 and not NotificationDelivery.objects.exists()
    assert notifications.send(channel.pk, event.pk, "k") == {
        "skipped": "the event is gone (its run was pruned)"
    }
