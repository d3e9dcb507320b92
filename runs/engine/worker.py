"""The worker loop: claim runnable runs, execute them on threads, heartbeat their leases.

Recovery goes through the normal claim path: a run whose lease expired is just another
runnable run. Each loop tick is a method tests can call directly.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import reduce
from operator import or_

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import F, Min, Q
from django.utils import timezone

from runs import logcontext, schedules
from runs.engine import flow, holds, registry
from runs.engine.budget import release_holds
from runs.engine.executor import execute, release
from runs.engine.outage import is_disconnect, outage, reconnect, wait_for_database
from runs.engine.store import Lease, append_event, completion_writer, wake_parent
from runs.engine.wakeup import Listener, doorbell, is_postgres
from runs.logcontext import event_written
from runs.models import Event, EventType, Run, RunStatus, Worker

log = logging.getLogger("stepguard.worker")


WAKEABLE = (RunStatus.PENDING, RunStatus.WAITING, RunStatus.OVER_BUDGET)
RUN_TABLE = f'"{Run._meta.db_table}"'
EVENT_TABLE = f'"{Event._meta.db_table}"'
#: Times one claim of a run is taken up again after its connection broke; past that, a
#: connection that breaks whatever we do is left to lease recovery and its poison-run bound.
MAX_CARRY_ON = 10


def runnable_filter(now) -> Q:
    """Due pending or waiting runs, and running runs whose worker stopped heartbeating."""
    return Q(status__in=WAKEABLE, wake_at__lte=now) | Q(
        status=RunStatus.RUNNING, lease_until__lt=now
    )


class WorkerProcess:
    def __init__(
        self,
        *,
        concurrency: int = 4,
        lease_seconds: float | None = None,
        poll_interval: float | None = None,
        grace: float | None = None,
    ):
        self.concurrency = concurrency
        self.lease = timedelta(seconds=lease_seconds or settings.STEPGUARD_LEASE_SECONDS)
        self.poll_interval = poll_interval or settings.STEPGUARD_POLL_INTERVAL
        self.grace = settings.STEPGUARD_SHUTDOWN_GRACE if grace is None else grace
        self.id = uuid.uuid4()
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.bell = threading.Event()
        self.active: dict[uuid.UUID, Lease] = {}
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="stepguard-run")
        definitions = registry.all_workflows()
        if all(registry.builtin(d.name) for d in definitions):
            raise registry.UnknownWorkflow(
                "no workflows registered: pass --import MODULE or set STEPGUARD_WORKFLOW_MODULES"
            )
        self.workflows = sorted(d.ref for d in definitions)
        self._mine_refs = sorted((d.name, d.version) for d in definitions)
        self._mine = reduce(or_, (Q(workflow=d.name, version=d.version) for d in definitions))
        self._names = {d.name for d in definitions}
        self._schedules_at = 0.0  # when tick() next looks for due schedules (monotonic)
        self._turn = 0  # which limited workflow's claim goes first (_claim_limited)
        self._code_limits = flow.code_limits(self._names)  # fixed once imported

    # -- lifecycle -----------------------------------------------------------------------------

    def register(self) -> Worker:
        now = timezone.now()
        return Worker.objects.create(
            id=self.id,
            host=socket.gethostname(),
            pid=os.getpid(),
            concurrency=self.concurrency,
            workflows=self.workflows,
            started_at=now,
            heartbeat_at=now,
        )

    def stop(self) -> None:
        """Stop claiming; running runs release at their next step boundary."""
        self.stopping.set()
        self.bell.set()

    def run_forever(self) -> None:
        self.register()
        threading.Thread(
            target=self._heartbeat_loop, name="stepguard-heartbeat", daemon=True
        ).start()
        if is_postgres():
            Listener(self.bell, self.stopped).start()
        if settings.STEPGUARD_RETENTION_DAYS:  # the daily prune: one worker of all does it
            from runs.retention import daily

            threading.Thread(target=daily, args=(self.stopped, str(self.id)), daemon=True).start()
        from runs import notifications  # one worker of all sweeps events into deliveries

        threading.Thread(
            target=notifications.loop, args=(self.stopped, str(self.id)), daemon=True
        ).start()
        self._report_unknown()
        schedules.sync_code_schedules()
        while not self.stopping.is_set():
            self.bell.clear()
            try:
                if not self.tick():
                    self.bell.wait(self.idle_wait())
            except Exception as exc:
                # A database restart: said once, then quiet until it is back. Anything else
                # (a locked SQLite file, a bug) is logged in full. Reconnect, poll again.
                if not is_disconnect(exc):
                    log.exception("worker loop error; retrying after a poll interval")
                    close_old_connections()
                elif reconnect("claiming runs"):
                    continue  # the restart was already over: claim again at once
                self.stopping.wait(self.poll_interval)
        self.shutdown()

    def shutdown(self) -> None:
        started = time.monotonic()
        # `self.grace` is re-read each turn: a second SIGTERM sets it to 0.
        while self.active and time.monotonic() - started < self.grace:
            self.bell.clear()
            self.bell.wait(0.05)
        with self._lock:
            leftovers = list(self.active.values())
        for lease in leftovers:
            # A step that returned while the workflow works between steps: written first (if
            # its thread is not writing right now, when that write carries it), so the next
            # owner replays it instead of re-sending it.
            completion_writer.write(lease, wait=1.0)
            # The step outlived the grace period: give the run back now, epoch bumped, so the
            # thread still inside the step can never write; the next owner re-sends that step.
            lease.lost.set()
            try:
                # A lease of its own: the run's thread may still be writing with `lease`, and a
                # completion pending there is not this thread's to write (it is re-sent).
                mine = Lease(lease.run_id, lease.epoch)
                if release(mine, "worker shutting down; grace period expired mid-step"):
                    log.warning("run %s released mid-step after the grace period", lease.run_id)
            except Exception:
                log.exception("run %s: could not release; its lease will expire", lease.run_id)
        try:
            Worker.objects.filter(pk=self.id).update(stopped_at=timezone.now())
        except Exception:
            log.exception("could not mark the worker stopped")
        self.stopped.set()
        self.pool.shutdown(wait=not leftovers, cancel_futures=True)

    def idle_wait(self) -> float:
        """Sleep until the next poll, or sooner if a timer of ours is due before it."""
        now = timezone.now()
        due = Run.objects.filter(self._mine, status__in=WAKEABLE, wake_at__gt=now).aggregate(
            due=Min("wake_at")
        )["due"]
        fire = schedules.next_due(self._names)
        if fire is not None:
            # Not before tick() looks at schedules again (a due schedule another worker is
            # firing, or one just looked at, must not make this loop spin).
            look = now + timedelta(seconds=max(0.0, self._schedules_at - time.monotonic()))
            fire = max(fire, look)
            if due is None or fire < due:
                due = fire
        if due is None:
            return self.poll_interval
        return max(0.0, min(self.poll_interval, (due - now).total_seconds()))

    # -- one tick ------------------------------------------------------------------------------

    def tick(self) -> int:
        """Fire due schedules; claim as many runs as there are free threads and start them;
        return how many."""
        if time.monotonic() >= self._schedules_at:
            self._schedules_at = time.monotonic() + min(self.poll_interval, 0.5)
            try:
                schedules.fire_due(self._names)
            except Exception as exc:
                if is_disconnect(exc):
                    raise  # the loop's outage handling: said once, reconnect
                log.exception("firing schedules failed; claiming runs all the same")
        free = self.concurrency - len(self.active)
        if free <= 0:
            return 0
        claimed = self.claim(free)
        for run in claimed:
            # The epoch is the one our compare-and-swap wrote, never one read back later:
            # a stalled worker must not pick up the epoch of whoever claimed the run after it.
            lease = Lease(run.id, run.lease_epoch, stopping=self.stopping)
            with self._lock:
                self.active[run.id] = lease
            # In a context naming the run, so that every line logged while it runs says so.
            self.pool.submit(logcontext.run_context(run, self.id).run, self._execute, run, lease)
        return len(claimed)

    def claim(self, limit: int) -> list[Run]:
        now = timezone.now()
        stopped, limits = flow.policies(self._names, self._code_limits)
        if connection.vendor == "postgresql":
            # Limited workflows first: their limits bound what they take, and behind an
            # unlimited backlog they would never get a thread.
            claimed = self._claim_limited(limit, limits, now) if limits else []
            if len(claimed) < limit:
                claimed += self._claim_in_one_statement(limit - len(claimed), now, sorted(limits))
            outage.ok()  # the database answered
            if len(claimed) < limit:
                # Nothing more is runnable now: the due runs left are held or poison runs,
                # which the statement skips. Park the held ones; fail the poison ones.
                self._park_held(now)
                self._fail_poisoned(now)
            return claimed
        self._park_held(now)
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
                .filter(runnable_filter(now) & self._mine)
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
            Run.objects.filter(self._mine, workflow__in=limits)
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
                        self._mine, workflow=name, status__in=WAKEABLE, wake_at__lte=now
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
        runs = Run.objects.filter(id__in=epochs, worker=self.id)
        # Whatever was taken over between our commit and this read is dropped, not adopted.
        return [run for run in runs if run.lease_epoch == epochs[run.id]]

    def _claim_in_one_statement(self, limit: int, now, limited: list[str]) -> list[Run]:
        """PostgreSQL: lock up to `limit` runnable runs (SKIP LOCKED: workers never wait on
        each other), take their leases and append their claim events, in one statement.

        Due runs and runs whose worker died are looked up apart, each in the order of its own
        partial index, so a claim reads about `limit` rows however long the queue is: runs
        whose worker died and runs due for longer than the priority aging time first, oldest
        first, then the other due runs by priority. Held runs and poison runs (recovered too
        often) are left to `claim`'s slow path; due runs of the `limited` workflows to
        `_claim_limited`.
        """
        mine = " OR ".join(["(workflow = %s AND version = %s)"] * len(self._mine_refs))
        chosen = f"""
            WITH aged AS (
                SELECT id, status AS was, 0 AS grp, 0 AS prio, wake_at AS at FROM {RUN_TABLE}
                WHERE status = ANY(%s) AND wake_at < %s AND ({mine})
                  AND NOT (workflow = ANY(%s))
                  AND NOT {holds.covered_sql()}
                ORDER BY wake_at
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            ), due AS (
                SELECT id, status AS was, 1 AS grp, -priority AS prio, wake_at AS at
                FROM {RUN_TABLE}
                WHERE status = ANY(%s) AND wake_at <= %s AND wake_at >= %s AND ({mine})
                  AND NOT (workflow = ANY(%s))
                  AND NOT {holds.covered_sql()}
                ORDER BY priority DESC, wake_at
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            ), lost AS (
                SELECT id, status AS was, 0 AS grp, 0 AS prio, lease_until AS at FROM {RUN_TABLE}
                WHERE status = %s AND lease_until < %s AND ({mine})
                  AND recoveries + 1 < %s
                  AND NOT {holds.covered_sql()}
                ORDER BY lease_until
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            ), c AS (
                SELECT id, was FROM (
                    SELECT * FROM lost UNION ALL SELECT * FROM aged UNION ALL SELECT * FROM due
                ) AS all_
                ORDER BY grp, prio, at LIMIT %s
            )"""
        poison = 2 * settings.STEPGUARD_MAX_RECOVERIES
        refs = [part for ref in self._mine_refs for part in ref]
        old = flow.aged(now)
        params = [
            list(WAKEABLE), old, *refs, limited, limit,
            list(WAKEABLE), now, old, *refs, limited, limit,
            RunStatus.RUNNING, now, *refs, poison, limit,
            limit,
        ]  # fmt: skip
        return self._take_chosen(chosen, params, now)

    def _take_chosen(self, chosen: str, params: list, now) -> list[Run]:
        """Complete a claim statement whose CTEs end in `c` (id, was: the status it had):
        take those runs' leases and append their claim events, in the same statement."""
        columns = ", ".join(f'r."{f.column}"' for f in Run._meta.concrete_fields)
        sql = f"""{chosen}, u AS (
                UPDATE {RUN_TABLE} r SET
                    status = %s, worker_id = %s, lease_until = %s,
                    lease_epoch = r.lease_epoch + 1, event_seq = r.event_seq + 1,
                    recoveries = r.recoveries + CASE WHEN c.was = %s THEN 1 ELSE 0 END,
                    started_at = CASE WHEN r.lease_epoch = 0 THEN %s ELSE r.started_at END
                FROM c WHERE r.id = c.id
                RETURNING {columns}, c.was
            ), e AS (
                INSERT INTO {EVENT_TABLE}
                    (run_id, seq, step_key, type, actor, payload, created_at)
                SELECT id, event_seq, '',
                    CASE was WHEN %s THEN %s WHEN %s THEN %s ELSE %s END,
                    'system', jsonb_build_object('worker', %s::text, 'epoch', lease_epoch), %s
                FROM u
            )
            SELECT * FROM u ORDER BY wake_at
        """
        params = [
            *params,
            RunStatus.RUNNING, self.id, now + self.lease, RunStatus.RUNNING, now,
            RunStatus.RUNNING, EventType.RUN_RECOVERED,
            RunStatus.WAITING, EventType.RUN_WOKEN, EventType.RUN_CLAIMED,
            str(self.id), now,
        ]  # fmt: skip
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
        mine = " OR ".join(["(workflow = %s AND version = %s)"] * len(self._mine_refs))
        order = "aged DESC, CASE WHEN aged THEN 0 ELSE priority END DESC, wake_at"
        chosen = f"""
            WITH running AS (
                SELECT concurrency_key AS k, count(*) AS n FROM {RUN_TABLE}
                WHERE workflow = %s AND status = %s GROUP BY concurrency_key
            ), room AS (
                SELECT GREATEST(0, LEAST(%s::int,
                    COALESCE(%s::int - (SELECT COALESCE(sum(n), 0) FROM running), %s::int)
                )) AS n
            ), locked AS (
                SELECT id, status AS was, concurrency_key AS k, priority, wake_at,
                    (status = ANY(%s) AND wake_at < %s) AS aged
                FROM {RUN_TABLE}
                WHERE workflow = %s AND status = ANY(%s) AND wake_at <= %s AND ({mine})
                  AND NOT {holds.covered_sql()}
                  AND concurrency_key NOT IN (
                      SELECT k FROM running WHERE %s::int IS NOT NULL AND n >= %s::int
                  )
                ORDER BY (wake_at < %s) DESC,
                    CASE WHEN wake_at < %s THEN 0 ELSE priority END DESC, wake_at
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            ), ranked AS (
                SELECT l.id, l.was, l.aged, l.priority, l.wake_at,
                    row_number() OVER (PARTITION BY l.k ORDER BY {order})
                        + COALESCE(r.n, 0) AS load
                FROM locked l LEFT JOIN running r ON r.k = l.k
            ), c AS (
                SELECT id, was FROM ranked
                WHERE %s::int IS NULL OR load <= %s::int
                ORDER BY {order}
                LIMIT (SELECT n FROM room)
            )"""
        refs = [part for ref in self._mine_refs for part in ref]
        old = flow.aged(now)
        params = [
            name, RunStatus.RUNNING,
            free, limit.total, free,
            list(WAKEABLE), old,
            name, list(WAKEABLE), now, *refs,
            limit.per_key, limit.per_key,
            old, old,
            free * 4 + 8,
            limit.per_key, limit.per_key,
        ]  # fmt: skip
        return self._take_chosen(chosen, params, now)

    def _fail_poisoned(self, now) -> None:
        """Fail the due runs past twice the poison-run bound (see `_claim_one`)."""
        poisoned = Run.objects.filter(
            self._mine,
            holds.uncovered(),
            status=RunStatus.RUNNING,
            lease_until__lt=now,
            recoveries__gte=2 * settings.STEPGUARD_MAX_RECOVERIES - 1,
        ).values_list("id", "status", "lease_epoch", "event_seq", "recoveries")[:50]
        for candidate in poisoned:
            with transaction.atomic():
                self._claim_one(*candidate, now)

    def _park_held(self, now) -> None:
        """Runs a hold covers that are due or whose worker died: mark them halted, never run
        them. Also catches a run requeued at the instant a hold was placed (the hold's own
        parking saw it running)."""
        due = Q(status=RunStatus.RUNNING, lease_until__lt=now) | Q(
            status__in=WAKEABLE, wake_at__lte=now
        )
        stuck = Run.objects.filter(due, holds.covered())
        for run_id, epoch, event_seq in stuck.values_list("id", "lease_epoch", "event_seq")[:50]:
            with transaction.atomic():
                parked = (
                    Run.objects.filter(pk=run_id, lease_epoch=epoch, event_seq=event_seq)
                    .filter(due, holds.covered())
                    .update(
                        status=RunStatus.HALTED,
                        worker=None,
                        lease_until=None,
                        lease_epoch=F("lease_epoch") + 1,
                        event_seq=F("event_seq") + 1,
                    )
                )
                if parked:
                    held_by = [h.as_json() for h in holds.holds_on(Run.objects.get(pk=run_id))]
                    append_event(
                        run_id, event_seq + 1, EventType.RUN_HALTED,
                        reason="a hold covers the run", held_by=held_by,
                    )  # fmt: skip

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
                release_holds(run_id)
                append_event(run_id, event_seq + 1, EventType.RUN_FAILED, reason=reason)
                wake_parent(run_id, RunStatus.FAILED)
                log.error("run %s failed: %s", run_id, reason)
            return False
        updated = current.update(
            status=RunStatus.RUNNING,
            worker=self.id,
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
            worker=str(self.id),
            epoch=epoch + 1,
        )
        return True

    def _execute(self, run: Run, lease: Lease) -> None:
        try:
            close_old_connections()
            for _ in range(MAX_CARRY_ON + 1):
                try:
                    outcome: str = execute(run, lease)
                except Exception as exc:
                    if not is_disconnect(exc):
                        raise
                    outcome = "disconnected"  # in a final write: the same as in a step
                if outcome != "disconnected":
                    break
                current = self._carry_on(run, lease)
                if current is None:
                    outcome = "disconnected; no longer ours, or stopping"
                    break
                run = current
            else:
                outcome = f"disconnected {MAX_CARRY_ON + 1} times; left to lease recovery"
            log.info("run %s (%s@%s): %s", run.id, run.workflow, run.version, outcome)
        except Exception:
            log.exception("run %s: unexpected error in the executor", run.id)
        finally:
            with self._lock:
                # The run may have been claimed again (woken while this thread unwound): only
                # our own lease leaves the table.
                if self.active.get(run.id) is lease:
                    del self.active[run.id]
            self.bell.set()

    def _carry_on(self, run: Run, lease: Lease) -> Run | None:
        """After a broken connection, wait for the database and take the run up again.

        Nothing the run did after its last commit is recorded, so executing it again under the
        same lease is exactly a crash recovery without the wait for the lease to expire: steps
        replay, a step caught in flight is re-sent with its same key (or reconciled, or asked
        about). Every write is still fenced by the lease epoch, so if another worker claimed the
        run meanwhile, the first write says so. Returns the run as it is now, or None when it
        is no longer ours (or the worker is stopping: the lease then expires as usual).
        """
        give_up = lambda: self.stopping.is_set() or lease.lost.is_set()  # noqa: E731
        if not wait_for_database(give_up):
            return None
        ours = Run.objects.filter(pk=run.id, lease_epoch=lease.epoch, status=RunStatus.RUNNING)
        # The outage may have outlasted the lease: renew it before anything else.
        if not ours.update(lease_until=timezone.now() + self.lease):
            lease.lost.set()
            return None
        log.info("run %s: database back, carrying on under the same lease", run.id)
        return ours.first()

    # -- heartbeats ----------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Extend every held lease (compare-and-swap on its epoch) and the worker's heartbeat."""
        now = timezone.now()
        with self._lock:
            leases = list(self.active.values())
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
                log.info("run %s: lease no longer held by this worker", lease.run_id)
        Worker.objects.filter(pk=self.id).update(heartbeat_at=now)

    def _heartbeat_loop(self) -> None:
        interval = self.lease.total_seconds() / 3
        while not self.stopped.wait(interval):
            for _ in range(2):  # again on a new connection if a restart broke the old one
                try:
                    self.heartbeat()
                    outage.ok()
                except Exception as exc:
                    if is_disconnect(exc) and reconnect("heartbeat"):
                        continue
                    if not is_disconnect(exc):
                        log.exception("heartbeat failed; retrying next interval")
                        close_old_connections()
                break

    def _report_unknown(self) -> None:
        waiting = (
            Run.objects.filter(status=RunStatus.PENDING)
            .exclude(self._mine)
            .values_list("workflow", "version")
            .distinct()[:20]
        )
        for name, version in waiting:
            log.warning(
                "pending runs of %s@%s are left alone: this worker does not have that workflow",
                name,
                version,
            )
