"""Retention: whole finished runs leave the database, in short batches, through one path.

The history is append-only (a trigger on PostgreSQL); this module is the one place that opens
it, for the transaction that deletes a batch of runs, and every prune is an audit event with
its counts. A run leaves only with its whole family: a root run that ended before the limit,
every descendant ended before the limit too, and no run outside the batch forked from any of
them (Run.forked_from is PROTECT: a fork that stays keeps its origin).

On PostgreSQL a pruned run's events are not deleted with it: they stay in their month's
partition, which goes whole once no run created in that month is left (runs/partitions.py).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import close_old_connections, connection, transaction
from django.db.models import Q
from django.utils import timezone

from runs import partitions
from runs.engine.chores import Chore as WorkerChore
from runs.engine.chores import ChoreContext, my_turn
from runs.models import TERMINAL_STATUSES, Event, EventType, Run
from runs.operations import audit

log = logging.getLogger("stepguard.retention")

BATCH_SIZE = 100
#: How often a worker looks whether the daily prune is due (it is claimed once a day).
CHECK_SECONDS = 600.0
CHORE = "prune"


@dataclass
class PruneResult:
    """Rows deleted (or, in a dry run, that would be), by table, and the batches it took."""

    counts: Counter = field(default_factory=Counter)
    batches: int = 0
    #: PostgreSQL: the month partitions of events dropped whole, and the events of runs pruned
    #: earlier deleted from a month a live run still pins (partitions.orphans).
    partitions_dropped: list[str] = field(default_factory=list)
    orphaned_events: int = 0

    @property
    def runs(self) -> int:
        return self.counts["runs"]


def _related():
    """Every table that points at a run (steps, events, signals, approvals, and whatever comes
    later), read from the models so a new one is not forgotten."""
    return [
        rel
        for rel in Run._meta.related_objects
        if rel.related_model is not Run and not rel.many_to_many
    ]


def _ended(before: datetime) -> Q:
    return Q(status__in=TERMINAL_STATUSES, finished_at__lt=before)


def _history_open(on: bool) -> None:
    """Let this transaction delete events, or no longer. Transaction-local (SET LOCAL), and
    closed again after each batch: an outer transaction around prune() must not stay open."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('stepguard.prune', %s, true)", ["on" if on else ""])


def _family(roots: list, before: datetime) -> list:
    """The ids of the families of `roots` that may go now, each root's whole tree or nothing.

    Runs are locked with SKIP LOCKED: a run someone is changing (a retry, a fork) is left for
    the next prune. Its status is checked under the lock, so a retry cannot slip in between.
    """
    owner = {r: r for r in roots}
    blocked: set = set()
    level = list(roots)
    while level:
        kids = list(Run.objects.filter(parent_id__in=level).values_list("id", "parent_id"))
        locked = set(
            Run.objects.select_for_update(skip_locked=True)
            .filter(_ended(before), pk__in=[k for k, _ in kids])
            .values_list("id", flat=True)
        )
        for kid, parent in kids:
            owner[kid] = owner[parent]
            if kid not in locked:
                blocked.add(owner[kid])
        level = [k for k, _ in kids]
    # A fork that stays keeps its origin, and so the origin's family; a family that stays
    # keeps the origins of its own forks in turn (O <- F1 <- F2 with F2 live: F1 stays, so O
    # stays), until nothing more is kept.
    outside = Run.objects.filter(forked_from_id__in=list(owner)).exclude(pk__in=list(owner))
    newly = {owner[origin] for origin in outside.values_list("forked_from_id", flat=True)}
    newly |= blocked
    blocked = set()
    while newly := newly - blocked:
        blocked |= newly
        kept = [run for run, root in owner.items() if root in newly]
        origins = Run.objects.filter(pk__in=kept, forked_from_id__in=list(owner))
        newly = {owner[origin] for origin in origins.values_list("forked_from_id", flat=True)}
    return [run for run, root in owner.items() if root not in blocked]


def _archive(ids: list, directory: Path) -> None:
    """Each run as JSON lines, `<dir>/<run id>.jsonl`: the run, then each row pointing at it.
    Written and synced before the delete, so a crash loses no run that is not archived."""
    directory.mkdir(parents=True, exist_ok=True)
    for run in Run.objects.filter(pk__in=ids).values():
        path = directory / f"{run['id']}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as out:
            out.write(json.dumps({"table": "runs_run", "row": run}, cls=DjangoJSONEncoder) + "\n")
            for rel in _related():
                model = rel.related_model
                rows = model._base_manager.filter(**{rel.field.name: run["id"]}).order_by("pk")
                for row in rows.values().iterator():
                    line = {"table": model._meta.db_table, "row": row}
                    out.write(json.dumps(line, cls=DjangoJSONEncoder) + "\n")
            out.flush()
            os.fsync(out.fileno())
        tmp.replace(path)


def _delete(ids: list, *, dry_run: bool, archive: Path | None) -> Counter:
    if not dry_run:
        if archive is not None:
            _archive(ids, archive)
        _history_open(True)
    counts: Counter = Counter()
    # Raw deletes: one statement per table, no rows loaded. Runs go last (their parent and
    # forked_from references are within the batch, checked at commit).
    for rel in _related():
        rows = rel.related_model._base_manager.filter(**{f"{rel.field.name}__in": ids})
        name = rel.get_accessor_name()
        if dry_run:
            counts[name] = rows.count()
        elif rel.related_model is Event and partitions.partitioned():
            # Left in their month's partition, dropped whole later; only those the DEFAULT
            # partition holds are deleted here.
            counts[name] = rows.count()
            with connection.cursor() as cursor:
                cursor.execute(f"DELETE FROM {partitions.DEFAULT} WHERE run_id = ANY(%s)", [ids])
        else:
            counts[name] = rows._raw_delete(rows.db)
    runs = Run.objects.filter(pk__in=ids)
    counts["runs"] = len(ids) if dry_run else runs._raw_delete(runs.db)
    if not dry_run:
        _history_open(False)
    return counts


def prune(
    *,
    finished_before: datetime,
    dry_run: bool = False,
    archive: Path | None = None,
    batch_size: int = BATCH_SIZE,
    workflows: list[str] | None = None,
    actor: str = "system",
) -> PruneResult:
    """Delete the runs that ended before `finished_before`, with everything that points at
    them, `batch_size` families per transaction; return the counts.

    Never a run that has not ended, nor one that ended later, nor a parent with such a child.
    Safe while workers run: each batch is a short transaction, and rows someone holds a lock on
    are skipped. Unless `dry_run`, writes one audit event `runs.pruned` with the counts (also
    when a batch fails midway: what was deleted stays deleted and is told).
    """
    result = PruneResult()
    after: tuple | None = None  # keyset cursor over roots: (finished_at, id)
    if not dry_run:
        partitions.ensure()  # a prune run by cron, where no worker may make them
    try:
        while True:
            with transaction.atomic():
                roots = Run.objects.select_for_update(skip_locked=True).filter(
                    _ended(finished_before), parent__isnull=True
                )
                if workflows:
                    roots = roots.filter(workflow__in=workflows)
                if after:
                    roots = roots.filter(
                        Q(finished_at__gt=after[0]) | Q(finished_at=after[0], id__gt=after[1])
                    )
                page = list(
                    roots.order_by("finished_at", "id").values_list("finished_at", "id")[
                        :batch_size
                    ]
                )
                if not page:
                    break
                after = page[-1]
                ids = _family([run for _, run in page], finished_before)
                counts = _delete(ids, dry_run=dry_run, archive=archive) if ids else None
            if counts is not None:  # told once committed: a batch that failed deleted nothing
                result.counts.update(counts)
                result.batches += 1
        if not dry_run:
            result.partitions_dropped = partitions.drop_empty()
            result.orphaned_events = _delete_orphans(partitions.orphans(finished_before))
    finally:
        if not dry_run:
            dropped = {
                "partitions_dropped": result.partitions_dropped,
                "orphaned_events": result.orphaned_events,
            }
            audit(
                actor,
                EventType.RUNS_PRUNED,
                finished_before=finished_before.isoformat(),
                archive=str(archive) if archive else None,
                batches=result.batches,
                **{"runs": 0, **result.counts},
                **(dropped if partitions.partitioned() else {}),
            )
    return result


def _delete_orphans(runs: list) -> int:
    """Delete the events of runs pruned earlier, `BATCH_SIZE` runs per transaction."""
    deleted = 0
    for start in range(0, len(runs), BATCH_SIZE):
        with transaction.atomic():
            _history_open(True)
            rows = Event.objects.filter(run_id__in=runs[start : start + BATCH_SIZE])
            deleted += rows._raw_delete(rows.db)
            _history_open(False)
    return deleted


def claim_daily_prune(worker: str) -> bool:
    """True for the one worker that takes today's prune: a conditional UPDATE moves the due
    time a day on, so of many workers on many hosts exactly one sees a row count of 1."""
    return my_turn(CHORE, worker, timedelta(days=1).total_seconds()) is not None


def prune_if_due(worker: str) -> PruneResult | None:
    """The daily prune of STEPGUARD_RETENTION_DAYS, if it is on, due, and ours to do."""
    days = settings.STEPGUARD_RETENTION_DAYS
    if not days or not claim_daily_prune(worker):
        return None
    result = prune(finished_before=timezone.now() - timedelta(days=days))
    log.info("pruned %s runs that ended over %s days ago: %s", result.runs, days, result.counts)
    return result


def daily_round(context: ChoreContext) -> None:
    """One look of a worker's retention chore: prune if due and ours to do."""
    try:
        prune_if_due(context.worker)
    except Exception:
        log.exception("retention: the daily prune failed; next look in %ss", CHECK_SECONDS)
        close_old_connections()


def chore() -> WorkerChore | None:
    """The daily prune when STEPGUARD_RETENTION_DAYS is set: a worker looks at start, then
    every CHECK_SECONDS, on a thread of its own (one worker of all prunes each day)."""
    if not settings.STEPGUARD_RETENTION_DAYS:
        return None
    return WorkerChore("pruning", CHECK_SECONDS, daily_round)
