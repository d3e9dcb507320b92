"""The worker process: claim runnable runs, execute them on threads; its heart (a process of
its own, `heart.py`) renews their leases and writes their completions.

Threads, the loop, the shutdown grace; no SQL: every statement is in `claims.py`. Recovery
goes through the normal claim path: a run whose lease expired is just another runnable run.
Each loop tick is a method tests can call directly.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from runs import logcontext
from runs.engine import registry
from runs.engine.chores import Chore, ChoreContext
from runs.engine.claims import WAKEABLE, Claims, runnable_filter, suspect
from runs.engine.deadline import exempt, watchdog
from runs.engine.fences import Lease
from runs.engine.heart import Heart
from runs.engine.lifecycle import Outcome, execute, release
from runs.engine.outage import is_disconnect, reconnect, wait_for_database
from runs.engine.store import completion_writer
from runs.engine.unheld import HELD_SCOPES
from runs.engine.wakeup import Listener, is_postgres
from runs.models import Run, Worker

__all__ = [
    "HELD_SCOPES",
    "MAX_CARRY_ON",
    "WAKEABLE",
    "Chore",
    "ChoreContext",
    "WorkerProcess",
    "runnable_filter",
]

log = logging.getLogger("stepguard.worker")


#: The shortest lease a worker starts without a warning. The heart renews every third of a
#: lease and a renewal must land before the lease runs out: a 1 s lease leaves it 0.67 s, which
#: a machine short of CPU (more runnable processes than cores, a container's CPU quota) takes
#: from the heart, and the step in flight is re-sent by another worker though nothing crashed.
#: 10 s leaves 6.7 s. Tests, benchmarks and the demo run 1-3 s leases on purpose, to recover
#: fast; with DEBUG on (the demo, development) the worker does not warn.
LEASE_FLOOR_SECONDS = 10.0

#: Times one claim of a run is taken up again after its connection broke; past that, a
#: connection that breaks whatever we do is left to lease recovery and its poison-run bound.
MAX_CARRY_ON = 10


class WorkerProcess:
    def __init__(
        self,
        *,
        concurrency: int = 4,
        lease_seconds: float | None = None,
        poll_interval: float | None = None,
        grace: float | None = None,
        chores: Iterable[Chore] = (),
    ):
        self.concurrency = concurrency
        self.lease = timedelta(seconds=lease_seconds or settings.STEPGUARD_LEASE_SECONDS)
        self.poll_interval = poll_interval or settings.STEPGUARD_POLL_INTERVAL
        self.grace = settings.STEPGUARD_SHUTDOWN_GRACE if grace is None else grace
        self.id = uuid.uuid4()
        self.chores = list(chores)
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.bell = threading.Event()
        self.active: dict[uuid.UUID, Lease] = {}
        self.heart: Heart | None = None  # run_forever's; none when tests drive ticks
        self._alone: uuid.UUID | None = None  # the suspect run in flight, which runs alone
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="stepguard-run")
        definitions = registry.all_workflows()
        if all(registry.builtin(d.name) for d in definitions):
            raise registry.UnknownWorkflow(
                "no workflows registered: pass --import MODULE or set STEPGUARD_WORKFLOW_MODULES"
            )
        self.workflows = sorted(d.ref for d in definitions)
        self.claims = Claims(self.id, self.lease, definitions)
        self.chore_context = ChoreContext(str(self.id), frozenset(self.claims.names))
        # When tick() next calls each chore that runs between claims (monotonic).
        self._due_at = {chore.name: 0.0 for chore in self.chores if chore.between_claims}

    # -- lifecycle -----------------------------------------------------------------------------

    def register(self) -> Worker:
        return self.claims.register(self.concurrency, self.workflows)

    def stop(self) -> None:
        """Stop claiming; running runs release at their next step boundary."""
        self.stopping.set()
        self.bell.set()

    def run_forever(self) -> None:
        lease = self.lease.total_seconds()
        if lease < LEASE_FLOOR_SECONDS and not settings.DEBUG:  # the demo's is 3 s on purpose
            log.warning(
                "a lease of %g s: the heart renews it every %.2g s, and a machine short of CPU "
                "that delays a renewal by %.2g s lets another worker re-send the step in "
                "flight; use %g s or more in production (docs/operations.md, *Lease length*)",
                lease, lease / 3, 2 * lease / 3, LEASE_FLOOR_SECONDS,
            )  # fmt: skip
        watchdog.enable(settings.STEPGUARD_STATEMENT_DEADLINE)
        if connection.connection is not None and is_postgres():
            watchdog.watch(connection.connection)
        # Started first, it sets Django up while the worker registers; no run is claimed
        # before it answers (it keeps every lease from the first).
        self.heart = Heart(
            self.id, self.lease.total_seconds(), self._lost, self._held, renew=self.heartbeat
        )
        self.heart.start()
        self._at_start(self.register)
        self.heart.wait_ready()
        if is_postgres():
            Listener(self.bell, self.stopped).start()
        for chore in self.chores:
            if not chore.between_claims:
                name = "stepguard-" + chore.name.replace(" ", "-")
                threading.Thread(
                    target=self._chore_loop, args=(chore,), name=name, daemon=True
                ).start()
        self._at_start(self._report_unknown)
        for chore in self.chores:
            if chore.start is not None:
                self._at_start(lambda c=chore: c.start(self.chore_context))
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
        if self.heart is not None:
            self.heart.stop()  # it writes what it still holds, then exits
        try:
            self.claims.mark_stopped()
        except Exception:
            log.exception("could not mark the worker stopped")
        self.stopped.set()
        self.pool.shutdown(wait=not leftovers, cancel_futures=True)

    def idle_wait(self) -> float:
        """Sleep until the next poll, or sooner if a timer of ours or a chore's work between
        claims is due before it."""
        now = timezone.now()
        due = self.claims.next_wake(now)
        for chore in self.chores:
            if not chore.between_claims or chore.next_due is None:
                continue
            fire = chore.next_due(self.chore_context)
            if fire is None:
                continue
            # Not before tick() calls the chore again (work another worker is doing, or work
            # just looked at, must not make this loop spin).
            look = now + timedelta(seconds=max(0.0, self._due_at[chore.name] - time.monotonic()))
            fire = max(fire, look)
            if due is None or fire < due:
                due = fire
        if due is None:
            return self.poll_interval
        return max(0.0, min(self.poll_interval, (due - now).total_seconds()))

    # -- one tick ------------------------------------------------------------------------------

    def tick(self) -> int:
        """Do the chores due between claims; claim as many runs as there are free threads and
        start them; return how many."""
        self._between_claims()
        free = self.concurrency - len(self.active)
        if free <= 0:
            return 0
        if self._alone in self.active:  # a suspect runs alone (SUSPECT_AFTER) until a step ends
            if not self.claims.progressed(self._alone):
                return 0
            self._alone = None
        claimed = self.claim(free)
        for run in claimed:
            if suspect(run):
                self._alone = run.id
            # The epoch is the one our compare-and-swap wrote, never one read back later:
            # a stalled worker must not pick up the epoch of whoever claimed the run after it.
            lease = Lease(run.id, run.lease_epoch, stopping=self.stopping, heart=self.heart)
            with self._lock:
                self.active[run.id] = lease
            if self.heart is not None:
                self.heart.hold(lease)
            # In a context naming the run, so that every line logged while it runs says so.
            self.pool.submit(logcontext.run_context(run, self.id).run, self._execute, run, lease)
        return len(claimed)

    def claim(self, limit: int) -> list[Run]:
        """Claim up to `limit` runnable runs of ours (see `claims.Claims.claim`): a suspect
        only with nothing in flight."""
        return self.claims.claim(limit, idle=not self.active)

    # -- chores --------------------------------------------------------------------------------

    def _between_claims(self) -> None:
        for chore in self.chores:
            if not chore.between_claims or time.monotonic() < self._due_at[chore.name]:
                continue
            self._due_at[chore.name] = time.monotonic() + min(self.poll_interval, chore.interval)
            try:
                chore.run(self.chore_context)
            except Exception as exc:
                if is_disconnect(exc):
                    raise  # the loop's outage handling: said once, reconnect
                log.exception("%s failed; claiming runs all the same", chore.name)

    def _chore_loop(self, chore: Chore) -> None:
        """A chore's own thread: call it at start, then every interval, until the worker has
        stopped."""
        while True:
            try:
                with exempt():  # a long statement of its own (a prune) is no hang
                    chore.run(self.chore_context)
            except Exception:  # the chore logs its own errors; this is the last resort
                log.exception("%s failed; again in %ss", chore.name, chore.interval)
                close_old_connections()
            if self.stopped.wait(chore.interval):
                connection.close()
                return

    def _execute(self, run: Run, lease: Lease) -> None:
        try:
            close_old_connections()
            why = ""  # after DISCONNECTED: why the worker stopped carrying on
            for _ in range(MAX_CARRY_ON + 1):
                try:
                    outcome = execute(run, lease)
                except Exception as exc:
                    if not is_disconnect(exc):
                        raise
                    outcome = Outcome.DISCONNECTED  # in a final write: the same as in a step
                if outcome is not Outcome.DISCONNECTED:
                    break
                current = self._carry_on(run, lease)
                if current is None:
                    why = "; no longer ours, or stopping"
                    break
                run = current
            else:
                why = f" {MAX_CARRY_ON + 1} times; left to lease recovery"
            log.info("run %s (%s@%s): %s%s", run.id, run.workflow, run.version, outcome, why)
        except Exception:
            log.exception("run %s: unexpected error in the executor", run.id)
        finally:
            with self._lock:
                # The run may have been claimed again (woken while this thread unwound): only
                # our own lease leaves the table.
                if self.active.get(run.id) is lease:
                    del self.active[run.id]
            if self.heart is not None:
                self.heart.drop(lease)
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
        # The outage may have outlasted the lease: renew it before anything else.
        current = self.claims.renew(run.id, lease)
        if current is not None:
            log.info("run %s: database back, carrying on under the same lease", run.id)
        return current

    # -- heartbeats ----------------------------------------------------------------------------

    def heartbeat(self) -> None:
        """Extend every held lease (compare-and-swap on its epoch) and the worker's heartbeat,
        from this process (the heart does it from its own: `heart.Beat.renew`)."""
        with self._lock:
            leases = list(self.active.values())
        self.claims.extend(leases)

    def _held(self) -> list[Lease]:
        with self._lock:
            return list(self.active.values())

    def _lost(self, run_id: uuid.UUID, epoch: int) -> None:
        """The heart found a lease of ours taken (or the run just finished, waits or was
        released while its thread was still unwinding: the common case)."""
        with self._lock:
            lease = self.active.get(run_id)
        if lease is not None and lease.epoch == epoch and not lease.lost.is_set():
            lease.lost.set()
            # DEBUG: usually the run just finished or waits; a real takeover is said where
            # the fence refuses the worker's next write (the demo's output showed it as news).
            log.debug("run %s: lease no longer held by this worker", run_id)

    def _at_start(self, step) -> None:
        """A statement of the worker's start, with a database that is down or failing over
        waited out, not an exit: one that went as the worker started (after it registered)
        ended the process, and `runworker --processes` stopped the whole fleet for it."""
        while True:
            try:
                step()
                return
            except Exception as exc:
                if not is_disconnect(exc) or not wait_for_database(self.stopping.is_set):
                    raise

    def _report_unknown(self) -> None:
        for name, version in self.claims.unknown_pending():
            log.warning(
                "pending runs of %s@%s are left alone: this worker does not have that workflow",
                name,
                version,
            )
