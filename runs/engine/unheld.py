"""The net under the holds: a `halted` run that no hold covers is resumed within seconds.

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

import logging
from datetime import timedelta

from django.conf import settings
from django.db import close_old_connections, transaction
from django.utils import timezone

from runs.engine import holds
from runs.engine.chores import Chore, ChoreContext
from runs.engine.store import run_event
from runs.engine.wakeup import notify_runnable
from runs.models import GLOBAL, EventType, Policy, Run, RunStatus
from runs.models import Chore as ChoreRow

log = logging.getLogger("stepguard.holds")

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
    now = timezone.now()
    ChoreRow.objects.get_or_create(name=CHORE, defaults={"due_at": now})
    interval = timedelta(seconds=settings.STEPGUARD_HOLD_SWEEP_SECONDS)
    due = ChoreRow.objects.filter(name=CHORE, due_at__lte=now)
    if not due.update(due_at=now + interval, claimed_by=worker, claimed_at=now):
        return 0
    return resume_unheld()


def sweep_round(context: ChoreContext) -> None:
    try:
        sweep_if_due(context.worker)
    except Exception:
        log.exception("holds: the sweep of unheld runs failed; trying again")
        close_old_connections()


def chore() -> Chore | None:
    """Every worker looks every STEPGUARD_HOLD_SWEEP_SECONDS (0: never); one at a time sweeps."""
    if not settings.STEPGUARD_HOLD_SWEEP_SECONDS:
        return None
    return Chore(CHORE, settings.STEPGUARD_HOLD_SWEEP_SECONDS, sweep_round)
