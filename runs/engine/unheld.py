"""The holds' two sweeps: due runs a hold covers are parked `halted` (`park_held`, from the
claim), and the net under the holds: a `halted` run that no hold covers is resumed within
seconds (the chore below).

Every write that decides between `halted` and `pending` locks the rows whose holds it reads
first (`holds.lock_covering`), and operators' hold changes wait for each other
(`holds.serialise_hold_changes`), so a run is `halted` exactly when a hold covers it and this
sweep finds nothing: tests/test_holds_concurrency.py proves the locks with it switched off. It
is there for a path that breaks the rule (a bug; a row changed by hand), whose run would
otherwise stay `halted` for good: `unhalt` of it is refused ("not halted by a hold of its
own") and nothing else resumes it. Each run it resumes is said in the log (a warning: report
it) and in the run's history (`run.requeued` with `swept: true`).
"""

from __future__ import annotations

import contextlib
import logging

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from runs.engine import holds
from runs.engine.chores import Chore, ChoreContext, my_turn
from runs.engine.outage import is_disconnect, reconnect
from runs.engine.store import append_event, run_event
from runs.engine.wakeup import notify_runnable
from runs.models import GLOBAL, WAKEABLE_STATUSES, EventType, Policy, Run, RunStatus

log = logging.getLogger("stepguard.holds")

#: The halted policies' scopes, and one NULL row if any run has a hold of its own
#: (`runs_run_halted_idx`): what `park_held` needs to know whether to sweep at all.
HELD_SCOPES = (
    f'SELECT scope FROM "{Policy._meta.db_table}" WHERE halted_at IS NOT NULL'
    f' UNION ALL SELECT NULL FROM (SELECT 1 FROM "{Run._meta.db_table}" WHERE halted_at IS NOT NULL'
    " LIMIT 1) AS held"
)


CHORE = "resuming unheld runs"
BATCH = 100


def unheld() -> list:
    """Ids of `halted` runs no hold covers (at most BATCH; read without locks). While the kill
    switch is on only the engine's own runs can be such, and only they are read: the halted
    runs of an incident can be many."""
    candidates = Run.objects.filter(status=RunStatus.HALTED).filter(holds.uncovered())
    if Policy.objects.filter(scope=GLOBAL, halted_at__isnull=False).exists():
        candidates = candidates.filter(workflow__startswith=holds.ENGINE_PREFIX)
    return list(candidates.order_by().values_list("id", flat=True)[:BATCH])


def resume_unheld() -> int:
    """Resume the halted runs no hold covers, checked again in the statement that resumes
    each, after the lock hold changes take (an unhalt's own resumption is ordered against it,
    a halt placed meanwhile is seen). Returns how many it resumed."""
    found = unheld()
    if not found:
        return 0
    resumed = []
    with transaction.atomic():
        holds.serialise_hold_changes()
        for run_id in found:
            moved = Run.objects.filter(holds.uncovered(), pk=run_id, status=RunStatus.HALTED)
            if moved.update(status=RunStatus.PENDING, wake_at=timezone.now()):
                run_event(
                    run_id, EventType.RUN_REQUEUED, swept=True,
                    reason="no hold covered the halted run: resumed by the workers' sweep",
                )  # fmt: skip
                resumed.append(run_id)
        if resumed:
            transaction.on_commit(notify_runnable)
    if resumed:
        log.warning(
            "resumed %s halted run(s) no hold covered (a write decided `halted` without the"
            " holds' locks: please report it): %s",
            len(resumed),
            ", ".join(str(r) for r in resumed),
        )
    return len(resumed)


def sweep_if_due(worker: str) -> int:
    """The sweep, by the one worker whose conditional UPDATE moves the chore's due time on."""
    if my_turn(CHORE, worker, settings.STEPGUARD_HOLD_SWEEP_SECONDS) is None:
        return 0
    return resume_unheld()


def sweep_round(context: ChoreContext) -> None:
    try:
        sweep_if_due(context.worker)
    except Exception as exc:
        if is_disconnect(exc):  # a database restart or failover: said once, by the outage
            with contextlib.suppress(Exception):
                reconnect("sweeping unheld runs")
        else:
            log.exception("holds: the sweep of unheld runs failed; trying again")
            close_old_connections()


def chore() -> Chore | None:
    """Every worker looks every STEPGUARD_HOLD_SWEEP_SECONDS (0: never); one at a time sweeps."""
    if not settings.STEPGUARD_HOLD_SWEEP_SECONDS:
        return None
    return Chore(CHORE, settings.STEPGUARD_HOLD_SWEEP_SECONDS, sweep_round)


def park_held(now) -> None:
    """Runs a hold covers that are due or whose worker died: mark them halted, never run
    them. Also catches a run requeued at the instant a hold was placed (the hold's own
    parking saw it running)."""
    scopes = held_scopes()
    if scopes is None:
        return  # no hold anywhere: no run is covered, the sweep would read every due run
    due = Q(status=RunStatus.RUNNING, lease_until__lt=now) | Q(
        status__in=WAKEABLE_STATUSES, wake_at__lte=now
    )
    # Unordered, so the LIMIT stops the scan at the 50th covered run; and, unless the kill
    # switch is on, only among runs a hold can cover (implied by `covered`, but indexable).
    stuck = Run.objects.filter(due, holds.covered()).order_by()
    if GLOBAL not in scopes:
        stuck = stuck.filter(
            Q(halted_at__isnull=False) | Q(workflow__in=scopes) | Q(parent__isnull=False)
        )
    for run_id, epoch, event_seq in stuck.values_list("id", "lease_epoch", "event_seq")[:50]:
        with transaction.atomic():
            # The holds read under lock, in the lock order, as a pause reads them: an
            # unhalt committed meanwhile is seen, or waits and finds the run to resume.
            chain = holds.chain_of(run_id)
            holds.lock_policies(chain)
            list(Run.objects.select_for_update().filter(pk=run_id).values_list("pk"))
            holds.lock_ancestors(chain)
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


def held_scopes() -> set[str] | None:
    """The scopes of the workflow holds and the kill switch in force, or None when nothing
    at all is held (no such hold and no run's own): one statement over the policies and
    the partial index of held runs, whatever the runs table holds."""
    with connection.cursor() as cursor:
        cursor.execute(HELD_SCOPES)
        rows = cursor.fetchall()
    if not rows:
        return None
    return {scope for (scope,) in rows if scope is not None}
