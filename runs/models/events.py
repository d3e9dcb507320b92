"""The append-only history of runs (and of actions on a whole workflow or on everything):
the timeline, the audit log and the source of live updates."""

from datetime import datetime

from django.db import connections, models, router
from django.db.models import Q
from django.db.models.expressions import RawSQL
from django.utils import timezone

from runs.models.runs import Run


class EventType(models.TextChoices):
    """Every kind of event, named once: code, filters and the dashboard use these."""

    RUN_CREATED = "run.created", "the run was created"
    RUN_CLAIMED = "run.claimed", "a worker claimed the run"
    RUN_WOKEN = "run.woken", "a worker took up the run after a wait"
    RUN_RECOVERED = "run.recovered", "a worker took over the run of a lost one"
    RUN_RESUMED = "run.resumed", "the run was resumed"
    RUN_REQUEUED = "run.requeued", "the run became runnable again"
    RUN_RELEASED = "run.released", "the worker gave the run back"
    RUN_COMPLETED = "run.completed", "the run completed"
    RUN_FAILED = "run.failed", "the run failed"
    RUN_CANCELLED = "run.cancelled", "the run was cancelled"
    RUN_CANCEL_REQUESTED = "run.cancel_requested", "a cancel was requested"
    RUN_RETRYING = "run.retrying", "the run will be retried from the top"
    RUN_RETRY_REQUESTED = "run.retry_requested", "a retry was requested"
    RUN_HALTED = "run.halted", "the run was halted"
    RUN_HALT_REQUESTED = "run.halt_requested", "a halt was requested while the run ran"
    RUN_UNHALTED = "run.unhalted", "the run was unhalted"
    RUN_FORKED = "run.forked", "a fork was made of the run"
    RUN_FORKED_FROM = "run.forked_from", "the run was forked from another"
    STEP_STARTED = "step.started", "a step started"
    STEP_COMPLETED = "step.completed", "a step completed"
    STEP_FAILED = "step.failed", "a step failed"
    STEP_RETRYING = "step.retrying", "a step will be tried again"
    TIMER_SET = "timer.set", "a timer was set"
    TIMER_FIRED = "timer.fired", "a timer fired"
    SIGNAL_WAITING = "signal.waiting", "the run waits for a signal"
    SIGNAL_RECEIVED = "signal.received", "a signal was received"
    APPROVAL_REQUESTED = "approval.requested", "an approval was requested"
    APPROVAL_WAITING = "approval.waiting", "the run waits for an approval"
    APPROVAL_DECIDED = "approval.decided", "an approval was decided"
    APPROVAL_RESOLVED = "approval.resolved", "an ambiguous step was resolved"
    APPROVAL_REVOKED = "approval.revoked", "an approval was revoked"
    CHILDREN_WAITING = "children.waiting", "the run waits for its child runs"
    CHILD_STARTED = "child.started", "a child run was started"
    CHILD_FINISHED = "child.finished", "a child run ended"
    BUDGET_SET = "budget.set", "a budget was set"
    BUDGET_EXCEEDED = "budget.exceeded", "the run stopped over budget"
    BUDGET_WARNING = "budget.warning", "a budget passed its warning threshold"
    MODEL_UNPRICED = "model.unpriced", "a model call had no price"
    LOGIN_LOCKED_OUT = "login.locked_out", "a login was locked out"
    RUNS_PRUNED = "runs.pruned", "finished runs were pruned"
    SCOPE_HALTED = "scope.halted", "a workflow or everything was halted"
    SCOPE_UNHALTED = "scope.unhalted", "a workflow or everything was unhalted"
    NOTIFICATIONS_CHANGED = (
        "notifications.changed",
        "a notification channel was added, removed, paused or resumed",
    )
    NOTIFICATION_TEST = "notification.test", "a test notification was sent to a channel"
    LIMITS_SET = "limits.set", "a workflow's concurrency limits were set"
    RATE_LIMIT_SET = "rate_limit.set", "a resource's rate limit was set or removed"
    STEP_THROTTLED = "step.throttled", "a step waits for a rate limit's capacity"
    RUN_DEBOUNCED = "run.debounced", "a debounced run took a newer input and waits again"
    SCHEDULE_CHANGED = "schedule.changed", "a schedule was added, changed, paused or removed"
    API_KEY_REVOKED = "apikey.revoked", "an API key was revoked"
    API_KEY_CREATED = "apikey.created", "an API key was created"
    RUN_ANNOTATED = "run.annotated", "a person marked the run or a step good, bad or with a note"


#: What a notification channel may be told of (runs/notifications.py).
NOTIFIABLE = (
    EventType.RUN_COMPLETED,
    EventType.RUN_FAILED,
    EventType.RUN_CANCELLED,
    EventType.RUN_HALTED,
    EventType.RUN_UNHALTED,
    EventType.BUDGET_EXCEEDED,
    EventType.BUDGET_WARNING,
    EventType.APPROVAL_REQUESTED,
    EventType.MODEL_UNPRICED,
    EventType.SCOPE_HALTED,
    EventType.SCOPE_UNHALTED,
)


#: Earlier spellings of renamed event types, still accepted where a person or a script names
#: an event type (channel subscriptions, the API), so nothing stored or scripted breaks.
RENAMED_EVENTS = {
    "halt": EventType.SCOPE_HALTED.value,  # renamed by migration runs 0013
    "unhalt": EventType.SCOPE_UNHALTED.value,
}


#: The partition key of an event without a run (halts and budgets on a whole workflow or on
#: everything): a partition of its own on PostgreSQL, never dropped by retention.
NO_RUN = datetime(1970, 1, 1, tzinfo=timezone.get_fixed_timezone(0))


class EventQuerySet(models.QuerySet):
    def of(self, run: Run) -> "EventQuerySet":
        """`run`'s events, its partition named: PostgreSQL then plans one month's table instead
        of every month's (1.2 ms of planning per query at 29 partitions, against 0.1 ms)."""
        return self.filter(run_id=run.pk, run_created_at=run.created_at)


class EventManager(models.Manager.from_queryset(EventQuerySet)):  # type: ignore[misc]
    def bulk_create(self, objs, *args, **kwargs):
        """Each event's partition key from its run, as Event.save() gives it."""
        objs = list(objs)
        missing = {e.run_id for e in objs if e.run_created_at is None and e.run_id is not None}
        created = dict(Run.objects.filter(pk__in=missing).values_list("pk", "created_at"))
        for event in objs:
            if event.run_created_at is None:
                event.run_created_at = created[event.run_id] if event.run_id else NO_RUN
        return super().bulk_create(objs, *args, **kwargs)


class Event(models.Model):
    """Append-only history: the timeline, the audit log and the source of live updates.

    On PostgreSQL the table is partitioned by month of `run_created_at` (runs/partitions.py),
    so retention drops a month of history whole instead of deleting its rows one by one. That
    is also why `run` is not a database foreign key: a pruned run's events stay until their
    month goes. Every writer takes `run_created_at` from the run row in the statement that
    writes the event (Event.save() for the ORM's).
    """

    # No index of its own: the unique (run, seq, ...) constraint leads with run. NULL for
    # actions on a whole workflow or on everything (halts, budgets): audit-only events.
    run = models.ForeignKey(
        Run,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="events",
        db_index=False,
        db_constraint=False,
    )
    seq = models.BigIntegerField()
    type = models.CharField(max_length=64, choices=EventType.choices)
    step_key = models.CharField(max_length=255, blank=True, default="")
    actor = models.CharField(max_length=150, default="system")
    payload = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField()
    #: The run's created_at (NO_RUN without a run): the partition key, so all of a run's
    #: history is in one month's partition.
    run_created_at = models.DateTimeField(editable=False)

    objects = EventManager()

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            # Also the index for tailing a run's history after a given seq. The partition key
            # is in it because PostgreSQL requires it; a run has one creation time.
            models.UniqueConstraint(
                fields=["run", "seq", "run_created_at"], name="runs_event_run_seq_unique"
            ),
            models.CheckConstraint(
                condition=Q(run__isnull=False, run_created_at__gt=NO_RUN)
                | Q(run__isnull=True, run_created_at=NO_RUN),
                name="runs_event_partition_key",
            ),
        ]
        indexes = [
            # The audit page: operator actions (actor other than "system"), newest first.
            models.Index(
                fields=["-created_at"], condition=~Q(actor="system"), name="runs_event_audit_idx"
            ),
            # GET /metrics: lease losses, counted on each scrape (controlplane/metrics.py).
            models.Index(
                fields=["created_at"],
                condition=Q(type="run.recovered"),
                name="runs_event_recovered_idx",
            ),
            # The notification sweep: events people can be told of, by time.
            models.Index(
                fields=["created_at"],
                condition=Q(type__in=[t.value for t in NOTIFIABLE]),
                name="runs_event_notifiable_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.type}"

    def save(self, *args, **kwargs):
        """The partition key from the run row, read by the INSERT itself (no extra round trip),
        or from the run object given. Callers do not pass it; one that does (a bulk seed) is
        trusted. (Raw SQL: a compiled Subquery cost half a millisecond of Python per event.)"""
        if self.run_created_at is None:
            if self.run_id is None:
                self.run_created_at = NO_RUN
            elif (run := self._state.fields_cache.get("run")) is not None:
                self.run_created_at = run.created_at
            else:
                db = connections[kwargs.get("using") or router.db_for_write(Event, instance=self)]
                self.run_created_at = RawSQL(
                    f"(SELECT created_at FROM {Run._meta.db_table} WHERE id = %s)",
                    [Run._meta.pk.get_db_prep_value(self.run_id, db)],
                )
        super().save(*args, **kwargs)
        if isinstance(self.run_created_at, RawSQL):
            del self.run_created_at  # read back on first use, like a deferred field
