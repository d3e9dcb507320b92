"""Claims: the statements that take runnable runs for one worker, and the rows a worker keeps.

Every statement a worker's claim loop sends is here or in the holds' sweeps (`unheld.py`;
the worker process, `worker.py`, has threads, signals and the loop, and no SQL). On
PostgreSQL a claim is one statement built from named queries with named parameters
(statements.py: `CLAIM_DUE` or `CLAIM_LIMITED`, then `TAKE_CLAIMED`); on SQLite a
compare-and-swap on `(lease_epoch, event_seq)` per run (`_claim_one`). Due runs that a hold
covers are parked (`unheld.park_held`), runs past the poison bound failed (`_fail_poisoned`).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import BooleanField, F, Min, Q
from django.db.models.expressions import RawSQL
from django.utils import timezone

from runs.engine import flow, holds, statements
from runs.engine.checkpoints import release_reservations
from runs.engine.fences import Lease
from runs.engine.outage import outage
from runs.engine.pooling import jit_off
from runs.engine.registry import WorkflowDef
from runs.engine.store import append_event, wake_parent
from runs.engine.unheld import park_held
from runs.engine.wakeup import doorbell
from runs.logcontext import event_written
from runs.models import WAKEABLE_STATUSES, EventType, Run, RunStatus, Worker

log = logging.getLogger("stepguard.worker")

WAKEABLE = WAKEABLE_STATUSES
#: A run whose worker dies under it this many times in a row (no step finished since) may be
#: what kills its workers: only a worker with nothing in flight takes it up, and takes nothing
#: more until it ends or finishes a step (which clears it: `recoveries` is reset). While one
#: waits, one busy worker makes way for it (claims nothing until it is idle): the live one
#: with the lowest id among those that run its workflow; the others claim healthy runs as
#: before (`makes_way`). Its losses are then its own, not those of the runs that shared a
#: worker with it (a run that killed every worker had the runs beside it failed by the bound).
SUSPECT_AFTER = 2


def suspect(run: Run) -> bool:
    """Whether a claimed run is to run alone (see SUSPECT_AFTER; a run taken up by an idle
    worker after a wait or a release with that many losses runs alone too)."""
    return run.recoveries >= SUSPECT_AFTER


def not_suspect() -> Q:
    """The lost runs that one more loss would make suspects, left out (SQLite's claims; on
    PostgreSQL `suspects` false in statements.CLAIM_DUE)."""
    return ~Q(status=RunStatus.RUNNING, recoveries__gte=SUSPECT_AFTER - 1)


def runnable_filter(now) -> Q:
    """Due pending or waiting runs, and running runs whose worker stopped heartbeating."""
    return Q(status__in=WAKEABLE, wake_at__lte=now) | Q(
        status=RunStatus.RUNNING, lease_until__lt=now
    )


class Claims:
    """One worker's claims: which runs are its own (`mine`, its workflows at their versions),
    and every statement it sends about them and about itself."""

    def __init__(self, worker_id: uuid.UUID, lease: timedelta, definitions: Iterable[WorkflowDef]):
        definitions = list(definitions)
        self.worker_id = worker_id
        self.lease = lease
        self.mine_refs = sorted((d.name, d.version) for d in definitions)
        self.names = {d.name for d in definitions}
        self._turn = 0  # which limited workflow's claim goes first (_claim_limited)
        self.code_limits = flow.code_limits(self.names)  # fixed once imported
        mine = " OR ".join(["(workflow = %s AND version = %s)"] * len(self.mine_refs))
        #: The runs of our workflows' versions, as a condition built once: the same OR of
        #: Q objects was compiled again by every idle poll (half its CPU with a few dozen
        #: workflows registered).
        self.mine = RawSQL(
            f"({mine})",
            [part for ref in self.mine_refs for part in ref],
            output_field=BooleanField(),
        )
        self._claim_due_sql = statements.claim(statements.CLAIM_DUE, len(self.mine_refs))
        self._claim_limited_sql = statements.claim(statements.CLAIM_LIMITED, len(self.mine_refs))
        self._mine_params = statements.mine_params(self.mine_refs)

    def claim(self, limit: int, idle: bool = True) -> list[Run]:
        """Claim up to `limit` runnable runs of ours. An idle worker takes its first run with
        suspects (SUSPECT_AFTER) allowed, and a suspect alone; a worker with runs in flight
        (`idle` false) takes none, and, if it is the one that makes way for a waiting
        suspect, nothing at all, so that it comes to be idle and a suspect is not starved
        by workers that never are. Before, every busy worker stopped: 8 short runs waited
        29.8 s for their first claim behind one suspect (1.1 s without it)."""
        if not idle:
            waiting = self.suspect_waiting()
            if waiting and self.makes_way(waiting):
                return []
            return self._claim(limit, suspects=False)
        first = self._claim(1, suspects=True)
        if limit == 1 or not first or suspect(first[0]):
            return first
        return first + self._claim(limit - 1, suspects=False)

    def suspect_waiting(self) -> set[str]:
        """The workflows (`name@version`) of our runs whose worker died that would be suspects
        once taken up (through the running runs' lease index: what lapsed, not the table)."""
        lapsed = Run.objects.filter(
            self.mine,
            status=RunStatus.RUNNING,
            lease_until__lt=timezone.now(),
            recoveries__gte=SUSPECT_AFTER - 1,
            recoveries__lt=2 * settings.STEPGUARD_MAX_RECOVERIES - 1,  # past it: failed, not taken
        ).filter(holds.uncovered())  # a held one waits for its unhalt
        refs = lapsed.values_list("workflow", "version").order_by().distinct()[:10]
        return {f"{name}@{version}" for name, version in refs}

    def makes_way(self, refs: set[str]) -> bool:
        """Whether this worker is the one to make way for a suspect of `refs`: the live worker
        (heartbeat within a lease) with the lowest id among those that run one of them. The
        same answer on every worker, from the same rows; a worker that dies or stops hands it
        to the next at its next heartbeat's lapse."""
        live = Worker.objects.filter(
            stopped_at__isnull=True, heartbeat_at__gte=timezone.now() - self.lease
        ).values_list("id", "workflows")
        able = [worker for worker, workflows in live if refs & set(workflows or ())]
        return not able or min(able) == self.worker_id

    def progressed(self, run_id: uuid.UUID) -> bool:
        """Whether a suspect finished a step since it was claimed (no longer a suspect)."""
        return Run.objects.filter(pk=run_id, recoveries=0).exists()

    def _claim(self, limit: int, suspects: bool) -> list[Run]:
        now = timezone.now()
        stopped, limits = flow.policies(self.names, self.code_limits)
        if connection.vendor == "postgresql":
            # Limited workflows first: their limits bound what they take, and behind an
            # unlimited backlog they would never get a thread.
            claimed = self._claim_limited(limit, limits, now) if limits else []
            if len(claimed) < limit:
                claimed += self._claim_in_one_statement(
                    limit - len(claimed), now, sorted(limits), suspects
                )
            outage.ok()  # the database answered
            if len(claimed) < limit:
                # Nothing more is runnable now: the due runs left are held or poison runs,
                # which the statement skips. Park the held ones; fail the poison ones.
                park_held(now)
                self._fail_poisoned(now)
            return claimed
        park_held(now)
        outage.ok()  # the database answered
        if stopped:
            return []  # the kill switch: nothing starts
        claimed = self._claim_limited(limit, limits, now) if limits else []
        if len(claimed) >= limit:
            return claimed
        limit -= len(claimed)
        claimed_ids = []
        with transaction.atomic():
            candidates = list(
                Run.objects.select_for_update(skip_locked=True)
                .filter(runnable_filter(now) & self.mine)
                .filter(Q() if suspects else not_suspect())
                .exclude(workflow__in=limits, status__in=WAKEABLE)
                .filter(holds.uncovered())
                .order_by(*flow.claim_order(now))
                .values_list("id", "status", "lease_epoch", "event_seq", "recoveries")[:limit]
            )
            for run_id, status, epoch, event_seq, recoveries in candidates:
                if self._claim_one(run_id, status, epoch, event_seq, recoveries, now):
                    claimed_ids.append((run_id, epoch + 1))
        return claimed + self._adopt(claimed_ids)

    def _claim_limited(self, free: int, limits: dict[str, flow.Limit], now) -> list[Run]:
        """Claim due runs of limited workflows, each workflow under its lock, within what its
        running runs leave of its limits (per key too)."""
        claimed_ids: list = []
        claimed: list[Run] = []
        due = (
            Run.objects.filter(self.mine, workflow__in=limits)
            .filter(status__in=WAKEABLE, wake_at__lte=now)
            .values_list("workflow", flat=True)
            .order_by()
            .distinct()
        )
        names = sorted(set(due))
        self._turn += 1  # each claim starts with the next one: none waits behind the others
        for i in range(len(names)):
            name = names[(self._turn + i) % len(names)]
            limit = limits[name]
            if free <= 0:
                break
            if connection.vendor == "postgresql":
                with transaction.atomic():
                    flow.lock(name)
                    taken = self._claim_limited_in_one_statement(name, limit, free, now)
                claimed += taken
                free -= len(taken)
                continue
            with transaction.atomic():
                flow.lock(name)
                running = flow.running(name)
                room = (
                    free if limit.total is None else min(free, limit.total - sum(running.values()))
                )
                if room <= 0:
                    continue
                per_key = limit.per_key
                full = [k for k, n in running.items() if per_key is not None and n >= per_key]
                candidates = (
                    Run.objects.filter(
                        self.mine, workflow=name, status__in=WAKEABLE, wake_at__lte=now
                    )
                    .exclude(concurrency_key__in=full)
                    .filter(holds.uncovered())
                    .order_by(*flow.claim_order(now))
                    .values_list(
                        "id", "status", "lease_epoch", "event_seq", "recoveries", "concurrency_key"
                    )[: room * 4 + 8]
                )
                for run_id, status, epoch, event_seq, recoveries, key in candidates:
                    if room <= 0:
                        break
                    if per_key is not None and running.get(key, 0) >= per_key:
                        continue
                    if self._claim_one(run_id, status, epoch, event_seq, recoveries, now):
                        claimed_ids.append((run_id, epoch + 1))
                        running[key] = running.get(key, 0) + 1
                        room -= 1
                        free -= 1
        return claimed + self._adopt(claimed_ids)

    def _adopt(self, claimed_ids: list) -> list[Run]:
        """The runs our claims took, read back; one taken over since is dropped."""
        if not claimed_ids:
            return []
        epochs = dict(claimed_ids)
        runs = Run.objects.filter(id__in=epochs, worker=self.worker_id)
        # Whatever was taken over between our commit and this read is dropped, not adopted.
        return [run for run in runs if run.lease_epoch == epochs[run.id]]

    def _claim_in_one_statement(
        self, limit: int, now, limited: list[str], suspects: bool
    ) -> list[Run]:
        """PostgreSQL: lock up to `limit` runnable runs (SKIP LOCKED: workers never wait on
        each other), take their leases and append their claim events, in one statement.

        Due runs and runs whose worker died are looked up apart, each in the order of its own
        partial index, so a claim reads about `limit` rows however long the queue is: runs
        whose worker died and runs due for longer than the priority aging time first, oldest
        first, then the other due runs by priority. Held runs and poison runs (recovered too
        often) are left to `claim`'s slow path; due runs of the `limited` workflows to
        `_claim_limited`.
        """
        params = {
            "wakeable": list(WAKEABLE), "aged_before": flow.aged(now), "limited": limited,
            "limit": limit, "poison": 2 * settings.STEPGUARD_MAX_RECOVERIES,
            "suspects": suspects, "suspect_after": SUSPECT_AFTER,
        }  # fmt: skip
        return self._take_chosen(self._claim_due_sql, params, now)

    def _take_chosen(self, sql: str, params: dict, now) -> list[Run]:
        """Run a claim statement (statements.claim: the CTEs choosing `c`, then TAKE_CLAIMED,
        which takes those runs' leases and appends their claim events)."""
        params = {
            **params, **self._mine_params, "now": now, "running": RunStatus.RUNNING,
            "waiting": RunStatus.WAITING, "worker": self.worker_id,
            "worker_text": str(self.worker_id), "lease_until": now + self.lease,
            "recovered": EventType.RUN_RECOVERED, "woken": EventType.RUN_WOKEN,
            "claimed": EventType.RUN_CLAIMED,
        }  # fmt: skip
        with jit_off(connection):
            runs = list(Run.objects.raw(sql, params))
        kinds = {RunStatus.RUNNING: EventType.RUN_RECOVERED, RunStatus.WAITING: EventType.RUN_WOKEN}
        for run in runs:
            doorbell.ring(run.id)
            was = run.was  # type: ignore[attr-defined]  # a column of the claim statement
            event_written(run.id, kinds.get(was, EventType.RUN_CLAIMED))
        return runs

    def _claim_limited_in_one_statement(
        self, name: str, limit: flow.Limit, free: int, now
    ) -> list[Run]:
        """PostgreSQL: claim due runs of one limited workflow in one statement, after its lock
        (taken by the caller in a statement of its own, so that this one's snapshot sees every
        claim committed before it). The count of its running runs per key, the room they leave
        (`row_number()` per key for the per-key limit), the leases and the events: all here."""
        params = {
            "workflow": name, "free": free, "total": limit.total, "per_key": limit.per_key,
            "wakeable": list(WAKEABLE), "aged_before": flow.aged(now), "fetch": free * 4 + 8,
        }  # fmt: skip
        return self._take_chosen(self._claim_limited_sql, params, now)

    def _fail_poisoned(self, now) -> None:
        """Fail the due runs past twice the poison-run bound (see `_claim_one`)."""
        poisoned = Run.objects.filter(
            self.mine,
            holds.uncovered(),
            status=RunStatus.RUNNING,
            lease_until__lt=now,
            recoveries__gte=2 * settings.STEPGUARD_MAX_RECOVERIES - 1,
        ).values_list("id", "status", "lease_epoch", "event_seq", "recoveries")[:50]
        for candidate in poisoned:
            with transaction.atomic():
                self._claim_one(*candidate, now)

    def _claim_one(self, run_id, status, epoch, event_seq, recoveries, now) -> bool:
        # Compare-and-swap on (epoch, event_seq): on SQLite there is no row lock, so this is
        # what makes two workers' claims of one run exclusive.
        current = Run.objects.filter(
            runnable_filter(now), pk=run_id, lease_epoch=epoch, event_seq=event_seq
        )
        recovering = status == RunStatus.RUNNING
        # Past the poison-run bound the run is claimed to be failed with its compensations
        # (see executor.execute); past twice the bound even those kept killing workers, so it
        # is failed here, where nothing of it runs.
        if recovering and recoveries + 1 >= 2 * settings.STEPGUARD_MAX_RECOVERIES:
            reason = (
                f"its worker was lost {recoveries + 1} times in a row without progress, "
                "its compensations included (STEPGUARD_MAX_RECOVERIES)"
            )
            updated = current.update(
                status=RunStatus.FAILED,
                error={"code": "worker_lost", "type": "WorkerLost", "message": reason},
                finished_at=now,
                worker=None,
                lease_until=None,
                lease_epoch=F("lease_epoch") + 1,
                event_seq=F("event_seq") + 1,
            )
            if updated:
                release_reservations(run_id)
                append_event(run_id, event_seq + 1, EventType.RUN_FAILED, reason=reason)
                wake_parent(run_id, RunStatus.FAILED)
                log.error("run %s failed: %s", run_id, reason)
            return False
        updated = current.update(
            status=RunStatus.RUNNING,
            worker=self.worker_id,
            lease_until=now + self.lease,
            lease_epoch=F("lease_epoch") + 1,
            event_seq=F("event_seq") + 1,
            recoveries=F("recoveries") + (1 if recovering else 0),
            started_at=now if epoch == 0 else F("started_at"),
        )
        if not updated:
            return False
        append_event(
            run_id,
            event_seq + 1,
            EventType.RUN_RECOVERED
            if recovering
            else (EventType.RUN_WOKEN if status == RunStatus.WAITING else EventType.RUN_CLAIMED),
            worker=str(self.worker_id),
            epoch=epoch + 1,
        )
        return True

    # -- the worker's own rows -----------------------------------------------------------------

    def register(self, concurrency: int, workflows: list[str]) -> Worker:
        now = timezone.now()
        return Worker.objects.create(
            id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            concurrency=concurrency,
            workflows=workflows,
            started_at=now,
            heartbeat_at=now,
        )

    def mark_stopped(self) -> None:
        Worker.objects.filter(pk=self.worker_id).update(stopped_at=timezone.now())

    def next_wake(self, now: datetime) -> datetime | None:
        """When the first of our timers comes due after `now`, if any."""
        return Run.objects.filter(self.mine, status__in=WAKEABLE, wake_at__gt=now).aggregate(
            due=Min("wake_at")
        )["due"]

    def extend(self, leases: list[Lease]) -> None:
        """Extend every held lease (compare-and-swap on its epoch) and the worker's heartbeat."""
        now = timezone.now()
        for lease in leases:
            if lease.lost.is_set():
                continue
            extended = Run.objects.filter(
                pk=lease.run_id, lease_epoch=lease.epoch, status=RunStatus.RUNNING
            ).update(lease_until=now + self.lease)
            if not extended:
                # Usually the run just finished, waits or was released while this thread was
                # still unwinding; a takeover by another worker is the rare case.
                lease.lost.set()
                log.debug("run %s: lease no longer held by this worker", lease.run_id)
        Worker.objects.filter(pk=self.worker_id).update(heartbeat_at=now)

    def renew(self, run_id: uuid.UUID, lease: Lease) -> Run | None:
        """The run as it is now with its lease renewed, or None (and `lease` lost) when it is
        no longer ours."""
        ours = Run.objects.filter(pk=run_id, lease_epoch=lease.epoch, status=RunStatus.RUNNING)
        if not ours.update(lease_until=timezone.now() + self.lease):
            lease.lost.set()
            return None
        return ours.first()

    def unknown_pending(self) -> list[tuple[str, str]]:
        """Workflows (name, version) with pending runs that this worker does not have."""
        return list(
            Run.objects.filter(status=RunStatus.PENDING)
            .exclude(self.mine)
            .values_list("workflow", "version")
            .distinct()[:20]
        )
