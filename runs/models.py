"""Runs, their step checkpoints, the append-only event history, and workers.

The database holds the invariants: a step's identity is a row (`UNIQUE(run, key)`,
`UNIQUE(run, seq)`), an event's place in the history is a row (`UNIQUE(run, seq)`), a run key
starts one run, and statuses are checked. Writes that change ownership are compare-and-swap on
`lease_epoch` (see runs/engine/).
"""

import uuid
from datetime import datetime

from django.conf import settings
from django.db import connections, models, router
from django.db.models import JSONField, Q, Value
from django.db.models.expressions import RawSQL
from django.utils import timezone

from runs.fields import ExactJSONField


class RunStatus(models.TextChoices):
    PENDING = "pending"
    RUNNING = "running"
    WAITING = "waiting"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    HALTED = "halted"
    OVER_BUDGET = "over_budget"


TERMINAL_STATUSES = (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)
#: Statuses a run waits in until its `wake_at` comes due (a claim takes it up then).
WAKEABLE_STATUSES = (RunStatus.PENDING, RunStatus.WAITING, RunStatus.OVER_BUDGET)


class StepStatus(models.TextChoices):
    STARTED = "started"
    COMPLETED = "completed"
    FAILED = "failed"
    WAITING = "waiting"


class StepKind(models.TextChoices):
    CALL = "call"
    LLM = "llm"
    TOOL = "tool"
    SLEEP = "sleep"
    EVENT = "event"
    APPROVAL = "approval"
    CHILD = "child"
    TRANSACTION = "transaction"


class Recovery(models.TextChoices):
    """How a step found `started` on resume (an ambiguous outcome) was recovered."""

    NONE = "", "not recovered"
    RESENT = "resent", "re-sent with the same idempotency key"
    RECONCILED = "reconciled", "outcome looked up by its idempotency key"
    CONFIRMED = "confirmed", "a person said it happened and recorded its outcome"


class Worker(models.Model):
    """One `runworker` process. The id is per process, never reused, so a restarted pod with
    the same hostname can't inherit its predecessor's leases."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    concurrency = models.PositiveIntegerField()
    workflows = models.JSONField(default=list, help_text="name@version pairs it can run")
    started_at = models.DateTimeField()
    heartbeat_at = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"


class Run(models.Model):
    #: Set by start_run on the run it returns: whether that call created it (not a column).
    was_created: bool

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    workflow = models.CharField(max_length=200)
    version = models.CharField(max_length=50)
    input = ExactJSONField(null=True, blank=True)
    status = models.CharField(max_length=20, choices=RunStatus, default=RunStatus.PENDING)
    output = ExactJSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    # NULL, not "", for "no key": UNIQUE allows many NULLs but only one "".
    key = models.CharField(max_length=255, null=True, blank=True)  # noqa: DJ001
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="children"
    )

    # Ownership. Every checkpoint write is fenced by lease_epoch: a claim bumps it, so a worker
    # that lost its lease finds its next write refused.
    worker = models.ForeignKey(
        Worker, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs"
    )
    lease_until = models.DateTimeField(null=True, blank=True)
    lease_epoch = models.BigIntegerField(default=0)
    wake_at = models.DateTimeField(null=True, blank=True, help_text="runnable from this time")

    attempt = models.PositiveIntegerField(default=1, help_text="run-level attempt, from 1")
    max_attempts = models.PositiveIntegerField(default=3)
    recoveries = models.PositiveIntegerField(
        default=0, help_text="leases lost since the last step completed (poison-run bound)"
    )
    event_seq = models.BigIntegerField(default=0, help_text="seq of the last event written")

    # Flow control (docs/flow-control.md): claims take higher priorities first, and at most so
    # many runs of a workflow, or of one of its concurrency keys, run at once.
    priority = models.SmallIntegerField(default=0, help_text="-1000 to 1000; higher goes first")
    concurrency_key = models.CharField(max_length=200, blank=True, default="")
    # A debounced run's key ("" without a key function); NULL for every other run.
    debounce_key = models.CharField(max_length=200, null=True, blank=True, default=None)  # noqa: DJ001

    # Spend and budgets. USD is kept in integer micro-dollars so SQLite compares it exactly.
    tokens_in = models.BigIntegerField(default=0)
    tokens_out = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0, help_text="USD spent, in 1e-6 USD")
    budget_micros = models.BigIntegerField(null=True, blank=True, help_text="USD limit, 1e-6")
    budget_tokens = models.BigIntegerField(null=True, blank=True)
    reserved_micros = models.BigIntegerField(default=0, help_text="estimates of steps in flight")
    reserved_tokens = models.BigIntegerField(default=0)
    possibly_spent_micros = models.BigIntegerField(
        default=0,
        help_text="estimates of model calls a crash interrupted: maybe paid, never recorded",
    )
    possibly_spent_tokens = models.BigIntegerField(default=0)
    budget_warned = models.BooleanField(default=False)

    # The authority flag: written by a person through runs.operations.halt, cleared only by
    # runs.operations.unhalt. No recovery, retry or restart path touches it.
    halted_at = models.DateTimeField(null=True, blank=True)
    halted_by = models.CharField(max_length=150, blank=True, default="")
    halt_reason = models.TextField(blank=True, default="")

    # Who the run is for (`{"tenant": "acme"}`), given at start and kept by its children and
    # forks: spend is attributed, budgeted and filtered by them (runs/labels.py).
    # db_default: code from before the column (a rolling upgrade) still inserts runs.
    labels = models.JSONField(default=dict, db_default=Value({}, JSONField()), blank=True)

    forked_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="forks"
    )
    forked_at_seq = models.PositiveIntegerField(null=True, blank=True)

    # Who started the run (None: code or the CLI), for the four-eyes rule on approvals.
    started_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_by = models.CharField(max_length=150, blank=True, default="")
    cancel_reason = models.TextField(blank=True, default="")
    # Where the run's trace continues (W3C traceparent carrier; runs/tracing.py): null when the
    # process that started it had no tracer configured.
    trace_context = models.JSONField(null=True, blank=True, editable=False)

    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        permissions = [
            ("cancel_run", "Can cancel runs (their compensations run)"),
            ("halt_run", "Can halt runs, workflows and everything (the kill switch)"),
            ("unhalt_run", "Can lift halts"),
            ("retry_run", "Can retry failed runs"),
            ("fork_run", "Can fork a run from a step"),
            ("set_budget", "Can set budgets of runs, workflows and the global daily budget"),
            ("set_flow", "Can set concurrency limits and manage schedules"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["key"], name="runs_run_key_unique"),
            models.CheckConstraint(
                condition=Q(status__in=RunStatus.values), name="runs_run_status_valid"
            ),
            models.CheckConstraint(
                condition=~Q(status=RunStatus.RUNNING) | Q(lease_until__isnull=False),
                name="runs_run_running_has_lease",
            ),
            models.CheckConstraint(
                condition=Q(attempt__gte=1) & Q(attempt__lte=models.F("max_attempts")),
                name="runs_run_attempt_bounded",
            ),
            models.CheckConstraint(
                condition=Q(reserved_micros__gte=0) & Q(reserved_tokens__gte=0),
                name="runs_run_reserved_not_negative",
            ),
            models.CheckConstraint(
                condition=Q(possibly_spent_micros__gte=0) & Q(possibly_spent_tokens__gte=0),
                name="runs_run_possibly_spent_not_negative",
            ),
            models.CheckConstraint(
                condition=~Q(status="halted") | Q(worker__isnull=True, lease_until__isnull=True),
                name="runs_run_halted_holds_no_worker",
            ),
            models.CheckConstraint(
                condition=Q(priority__gte=-1000, priority__lte=1000),
                name="runs_run_priority_range",
            ),
            # Debounce: one run per workflow and key waits out its quiet period (never claimed;
            # halted meanwhile it still waits, and takes the newer inputs).
            models.UniqueConstraint(
                fields=["workflow", "debounce_key"],
                condition=Q(
                    status__in=["pending", "halted"], lease_epoch=0, debounce_key__isnull=False
                ),
                name="runs_run_one_debouncing_per_key",
            ),
        ]
        indexes = [
            # Claim query, first half: pending, waiting and paused runs whose wake_at has come.
            models.Index(
                fields=["wake_at"],
                condition=Q(status__in=["pending", "waiting", "over_budget"]),
                name="runs_run_wake_idx",
            ),
            # Claim query, due runs not yet aged: highest priority first, then first come.
            models.Index(
                models.F("priority").desc(),
                "wake_at",
                condition=Q(status__in=["pending", "waiting", "over_budget"]),
                name="runs_run_priority_wake_idx",
            ),
            # Concurrency limits: the running runs of a workflow, per concurrency key.
            models.Index(
                fields=["workflow", "concurrency_key"],
                condition=Q(status="running"),
                name="runs_run_running_key_idx",
            ),
            # The flow page's busiest keys (runs.engine.flow._load): the keyed runs running or
            # queued, read index-only, however many unkeyed runs are live.
            models.Index(
                fields=["workflow", "concurrency_key", "status"],
                condition=Q(status__in=["running", "pending"]) & ~Q(concurrency_key=""),
                name="runs_run_live_key_idx",
            ),
            # Claim query, second half: running runs whose lease expired (crash recovery).
            models.Index(
                fields=["lease_until"],
                condition=Q(status="running"),
                name="runs_run_running_lease_idx",
            ),
            # The held-runs sweep (unheld.park_held): whether any run has a hold of its own.
            models.Index(
                fields=["halted_at"],
                condition=Q(halted_at__isnull=False),
                name="runs_run_halted_idx",
            ),
            # The held-runs sweep (unheld.park_held) when only runs' own holds are in force:
            # the due or lapsed runs a run's hold can cover (its own, or an ancestor's). The
            # wake-up and lease indexes ANDed with the held and parent ones read every due run
            # and every halted one (76,012 rows per idle poll at a million runs).
            models.Index(
                fields=["wake_at"],
                condition=Q(status__in=["pending", "waiting", "over_budget"])
                & (Q(halted_at__isnull=False) | Q(parent__isnull=False)),
                name="runs_run_due_holdable_idx",
            ),
            models.Index(
                fields=["lease_until"],
                condition=Q(status="running")
                & (Q(halted_at__isnull=False) | Q(parent__isnull=False)),
                name="runs_run_lapsed_holdable_idx",
            ),
            # Runs list in the admin and the dashboard, newest first, filtered by status.
            models.Index(fields=["status", "-created_at"], name="runs_run_status_created_idx"),
            # The same, as the dashboard and the API list by default (the engine's own runs
            # left out: queries.runs_matching), and the capped count of each status: an index
            # range, where the status index alone left the exclusion to a scan of the table
            # (381,527 rows read for one status at a million runs, statuses following age).
            models.Index(
                "status",
                models.F("created_at").desc(),
                models.F("id").desc(),
                condition=~Q(workflow__startswith="stepguard."),
                name="runs_run_listed_status_idx",
            ),
            # Unfiltered and per-workflow lists, and their keyset pages (created_at, id).
            models.Index(fields=["-created_at", "-id"], name="runs_run_created_idx"),
            models.Index(fields=["workflow", "-created_at"], name="runs_run_workflow_created_idx"),
            # A workflow and a status together: a pair that matches nothing is an index probe,
            # not a walk of the workflow's whole history (282 ms at a million runs).
            models.Index(
                fields=["workflow", "status", "-created_at"], name="runs_run_wf_status_created_idx"
            ),
            # Retention (runs/retention.py): finished root runs, oldest first, keyset-paged.
            models.Index(
                fields=["finished_at", "id"],
                condition=Q(parent__isnull=True, finished_at__isnull=False),
                name="runs_run_finished_root_idx",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.workflow}@{self.version} {self.id}"

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


class Step(models.Model):
    """A checkpoint: one row per step of a run, written ahead (`started`) and then finished."""

    # No index of its own: the unique (run, key) and (run, seq) constraints lead with run.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps", db_index=False)
    seq = models.PositiveIntegerField(help_text="position in the run's call sequence, from 0")
    key = models.CharField(max_length=255)
    kind = models.CharField(max_length=20, choices=StepKind, default=StepKind.CALL)
    status = models.CharField(max_length=20, choices=StepStatus)
    input = models.JSONField(null=True, blank=True)
    output = ExactJSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    idempotency_key = models.CharField(max_length=300)
    attempt = models.PositiveIntegerField(default=1, help_text="times the function was called")
    run_attempt = models.PositiveIntegerField(default=1)
    recovered = models.CharField(max_length=20, choices=Recovery, default="", blank=True)
    tokens_in = models.BigIntegerField(default=0)
    tokens_out = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0)
    usage = models.JSONField(
        null=True, blank=True, help_text="a model call's tokens and USD per kind, and its model"
    )
    reserved_micros = models.BigIntegerField(default=0, help_text="estimate held while running")
    possibly_spent_micros = models.BigIntegerField(
        default=0, help_text="estimates of this step's interrupted calls: maybe paid"
    )
    possibly_spent_tokens = models.BigIntegerField(default=0)
    reserved_tokens = models.BigIntegerField(default=0)
    reserved_on = models.DateField(null=True, blank=True, help_text="ledger day of the hold")
    reserved_scopes = models.JSONField(
        default=list, blank=True, help_text="shared budgets the hold was reserved against"
    )
    inherited = models.BooleanField(
        default=False,
        help_text="copied from the run this one was forked from: its side effect is that run's",
    )
    wake_at = models.DateTimeField(null=True, blank=True, help_text="timer or wait deadline")
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "key"], name="runs_step_run_key_unique"),
            # Also the index for loading a run's checkpoints in order (one query per claim).
            models.UniqueConstraint(fields=["run", "seq"], name="runs_step_run_seq_unique"),
            models.CheckConstraint(
                condition=Q(status__in=StepStatus.values), name="runs_step_status_valid"
            ),
            models.CheckConstraint(
                condition=Q(kind__in=StepKind.values), name="runs_step_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(recovered__in=Recovery.values), name="runs_step_recovered_valid"
            ),
            models.CheckConstraint(
                condition=~Q(status="completed") | Q(finished_at__isnull=False),
                name="runs_step_completed_has_finish",
            ),
        ]
        # No index on what a step spent: the spend pages read SpendDay (migration 0024 drops
        # the one they used, which every priced step's write kept up for nothing).

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.key} ({self.status})"


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


class Shaped(models.TextChoices):
    """How a person shaped what a run does (the four-eyes rule: runs/approvals/services.py)."""

    STARTED = "started", "started the run"
    FORKED = "forked", "forked it from another run"
    DEBOUNCED = "debounced", "gave it its input through a debounced start"
    SCHEDULED = "scheduled", "authored, edited or resumed the schedule that started it"


class RunShaper(models.Model):
    """A person who shaped what a run does, recorded as it happens: none of them may decide
    an approval the run (or a run below it, or a fork of it) asks for."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="shapers")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    how = models.CharField(max_length=20, choices=Shaped.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "user"], name="runs_runshaper_once"),
            models.CheckConstraint(condition=Q(how__in=Shaped.values), name="runs_runshaper_how"),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} {self.how} {self.run_id}"


class Signal(models.Model):
    """An external event sent to a run; consumed by at most one `wait_for_event` step."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="signals")
    name = models.CharField(max_length=200)
    payload = ExactJSONField(null=True, blank=True)
    sent_by = models.CharField(max_length=150, default="system")
    created_at = models.DateTimeField()
    consumed_by = models.CharField(max_length=255, blank=True, default="", help_text="step key")
    consumed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["run", "id"]
        constraints = [
            # A wait step consumes one signal at most, and a signal feeds one wait at most.
            models.UniqueConstraint(
                fields=["run", "consumed_by"],
                condition=~Q(consumed_by=""),
                name="runs_signal_consumed_once",
            ),
            models.CheckConstraint(
                condition=Q(consumed_by="", consumed_at__isnull=True)
                | (~Q(consumed_by="") & Q(consumed_at__isnull=False)),
                name="runs_signal_consumed_consistent",
            ),
        ]
        indexes = [
            # wait_for_event: the oldest unconsumed signal of a name for a run.
            models.Index(
                fields=["run", "name", "id"],
                condition=Q(consumed_at__isnull=True),
                name="runs_signal_unconsumed_idx",
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} -> {self.run_id}"


GLOBAL = "*"


class Policy(models.Model):
    """Rules for one workflow (`scope` = its name), for everything (`scope` = "*"), or the
    daily budget of one label value (`scope` = "label:tenant=acme", runs/labels.py)."""

    scope = models.CharField(max_length=200, unique=True)
    halted_at = models.DateTimeField(null=True, blank=True)
    halted_by = models.CharField(max_length=150, blank=True, default="")
    halt_reason = models.TextField(blank=True, default="")
    daily_budget_micros = models.BigIntegerField(null=True, blank=True)
    daily_budget_tokens = models.BigIntegerField(null=True, blank=True)
    run_budget_micros = models.BigIntegerField(
        null=True, blank=True, help_text="default budget of each new run"
    )
    run_budget_tokens = models.BigIntegerField(null=True, blank=True)
    # Concurrency limits set by an operator; None: the workflow's own (`@workflow(...)`).
    max_running = models.PositiveIntegerField(
        null=True, blank=True, help_text="runs of the workflow running at once"
    )
    max_running_per_key = models.PositiveIntegerField(
        null=True, blank=True, help_text="runs of one concurrency key running at once"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "policies"

    def __str__(self) -> str:
        if self.scope == GLOBAL:
            return "global"
        if self.scope.startswith("label:"):
            return f"label {self.scope.removeprefix('label:')}"
        return f"workflow {self.scope}"


class BudgetLedger(models.Model):
    """Spend against a shared (workflow or global) budget for one UTC day.

    Steps reserve their estimate here and settle their actual spend, each under the row lock,
    so concurrent runs sharing the budget cannot overspend it by racing.
    """

    scope = models.CharField(max_length=200)
    day = models.DateField()
    spent_micros = models.BigIntegerField(default=0)
    spent_tokens = models.BigIntegerField(default=0)
    reserved_micros = models.BigIntegerField(default=0)
    reserved_tokens = models.BigIntegerField(default=0)
    warned = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "day"], name="runs_ledger_scope_day_unique"),
            models.CheckConstraint(
                condition=Q(reserved_micros__gte=0) & Q(reserved_tokens__gte=0),
                name="runs_ledger_reserved_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.day}"


class SpendDay(models.Model):
    """What runs of one workflow carrying one set of labels spent on one UTC day: what the
    budgets page, the spend charts and `/api/spend` read, so their cost follows the number of
    workflows and label sets, not of steps. Kept by database triggers on the steps table
    (migration 0023), whichever code writes a step's cost; it outlives the runs retention
    deletes, so a report of past spend stays whole."""

    day = models.DateField()
    workflow = models.CharField(max_length=200)
    labels = models.JSONField(default=dict)
    micros = models.BigIntegerField(default=0, help_text="USD recorded, in 1e-6 USD")
    tokens = models.BigIntegerField(default=0)
    possibly_micros = models.BigIntegerField(
        default=0, help_text="estimates of model calls cut off in flight: maybe paid"
    )
    runs = models.PositiveIntegerField(default=0, help_text="runs that spent that day")

    # Unique by (day, workflow, labels): an index of migration 0023, not a constraint here, as
    # on PostgreSQL it keys the labels by their md5 (a long label set passes a btree entry's
    # size limit) and the triggers name it in their ON CONFLICT.

    def __str__(self) -> str:
        return f"{self.workflow} {self.labels} {self.day}"


class SpendRun(models.Model):
    """A run that spent on a day: so a run spending twice that day counts once in
    `SpendDay.runs`. Written by the same triggers, deleted with the run."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="spend_days")
    day = models.DateField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "day"], name="runs_spendrun_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id} {self.day}"


class RateLimit(models.Model):
    """At most `requests` calls and `tokens` tokens of a resource (a model, an API) in any
    `window_seconds`, across every worker (runs/engine/rates.py)."""

    resource = models.CharField(max_length=200, unique=True)
    requests = models.PositiveIntegerField(null=True, blank=True)
    tokens = models.PositiveBigIntegerField(null=True, blank=True)
    window_seconds = models.PositiveIntegerField(default=60)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(requests__isnull=False) | Q(tokens__isnull=False),
                name="runs_ratelimit_limits_something",
            ),
            models.CheckConstraint(
                condition=Q(requests__gte=1) | Q(requests__isnull=True),
                name="runs_ratelimit_requests_positive",
            ),
            models.CheckConstraint(
                condition=Q(tokens__gte=1) | Q(tokens__isnull=True),
                name="runs_ratelimit_tokens_positive",
            ),
            models.CheckConstraint(
                condition=Q(window_seconds__gte=1, window_seconds__lte=86400),
                name="runs_ratelimit_window_range",
            ),
        ]

    def __str__(self) -> str:
        parts = [f"{self.requests} requests"] if self.requests else []
        parts += [f"{self.tokens} tokens"] if self.tokens else []
        return f"{self.resource}: {' and '.join(parts)} per {self.window_seconds} s"


class RateGrant(models.Model):
    """One call let through a rate limit: it counts while in flight, and for a window after
    it ended (the request reached the provider at some moment in between)."""

    resource = models.CharField(max_length=200)
    at = models.DateTimeField(help_text="granted")
    ended_at = models.DateTimeField(null=True, blank=True, help_text="the call returned")
    tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        indexes = [
            # rates.acquire: a resource's grants inside the window, oldest first.
            models.Index(fields=["resource", "at"], name="runs_rategrant_resource_at_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.resource} at {self.at:%H:%M:%S.%f} ({self.tokens} tokens)"


class Catchup(models.TextChoices):
    """What a schedule fires of the ticks it missed while no worker was up."""

    SKIP = "skip", "skip missed ticks"
    LAST = "last", "run the last missed tick"
    ALL = "all", "run every missed tick, up to a bound"


class Published(models.Model):
    """A named value a run publishes for its clients (`ctx.set_event`, DBOS's set_event): the
    latest set wins. Written in the transaction of the step that sets it, so a replay writes
    nothing again and a client never reads a value the run's history does not hold."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="published")
    name = models.CharField(max_length=200)
    value = ExactJSONField(null=True, blank=True)
    updated_at = models.DateTimeField()

    class Meta:
        constraints = [
            # One value per name (its latest); also the index get_event reads by.
            models.UniqueConstraint(fields=["run", "name"], name="runs_published_one_per_name"),
        ]

    def __str__(self) -> str:
        return f"{self.name} of run {self.run_id}"


class Overlap(models.TextChoices):
    """What a schedule does with a tick while its last run is still open (Temporal's
    ScheduleOverlapPolicy)."""

    SKIP = "skip", "skip the tick"
    BUFFER_ONE = "buffer_one", "start one tick when the last run ends"
    BUFFER_ALL = "buffer_all", "start every tick, one after another"
    ALLOW_ALL = "allow_all", "start every tick at once"


#: The most ticks a `buffer_all` schedule keeps waiting; ticks past it are skipped.
MAX_BUFFERED_TICKS = 1000


class Schedule(models.Model):
    """A cron schedule: each tick starts one run of `workflow` (runs/schedules.py)."""

    name = models.CharField(max_length=200, unique=True)
    workflow = models.CharField(max_length=200)
    cron = models.CharField(max_length=200, help_text="5 fields, or 6 with seconds first")
    timezone = models.CharField(max_length=64, default="UTC")
    input = models.JSONField(null=True, blank=True)
    paused = models.BooleanField(default=False)
    catchup = models.CharField(max_length=10, choices=Catchup.choices, default=Catchup.SKIP)
    catchup_limit = models.PositiveIntegerField(default=10)
    # Seconds a tick may be late and still fire (null: STEPGUARD_SCHEDULE_GRACE_SECONDS).
    catchup_window = models.PositiveIntegerField(null=True, blank=True)
    overlap = models.CharField(max_length=12, choices=Overlap.choices, default=Overlap.SKIP)
    # The run of its newest started tick (no foreign key: retention may prune it, which
    # counts as ended), and the ticks waiting for it to end (`buffer_one`, `buffer_all`).
    last_run_id = models.UUIDField(null=True, blank=True)
    buffered = models.JSONField(default=list, blank=True)
    source = models.CharField(max_length=10, default="api", help_text="code or api")
    # Who added it: its runs are started in their name (the four-eyes rule applies to them),
    # and it fires only while they are active.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Ids of everyone who authored, replaced or resumed it: each shapes what its runs do.
    shaped_by = models.JSONField(default=list, blank=True)
    next_fire_at = models.DateTimeField()
    last_fired_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(catchup__in=Catchup.values), name="runs_schedule_catchup_valid"
            ),
            models.CheckConstraint(
                condition=Q(catchup_limit__gte=1, catchup_limit__lte=1000),
                name="runs_schedule_catchup_limit_range",
            ),
            models.CheckConstraint(
                condition=Q(overlap__in=Overlap.values), name="runs_schedule_overlap_valid"
            ),
            models.CheckConstraint(
                condition=Q(catchup_window__isnull=True)
                | Q(catchup_window__gte=1, catchup_window__lte=366 * 86400),
                name="runs_schedule_catchup_window_range",
            ),
        ]
        indexes = [
            # Firing: the due schedules that are not paused, soonest first.
            models.Index(
                fields=["next_fire_at"], condition=Q(paused=False), name="runs_schedule_due_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.cron} {self.timezone})"


class Chore(models.Model):
    """A periodic job of the whole deployment (the daily prune), done by one worker at a time:
    the worker whose conditional UPDATE moves `due_at` forward does it, on any engine."""

    name = models.CharField(max_length=50, primary_key=True)
    due_at = models.DateTimeField()
    claimed_by = models.CharField(max_length=255, blank=True, default="")
    claimed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} (due {self.due_at:%Y-%m-%d %H:%M})"


class ApiKeyScope(models.TextChoices):
    """What a key may do, within its user's permissions (runs.rest enforces it on every route)."""

    FULL = "full", "full: whatever its user may do"
    READ = "read", "read-only: GET routes only"
    START = "start", "start runs and send signals, nothing else"


class ApiKey(models.Model):
    """A key for the REST API, bound to a user so Django permissions apply to it.

    Only a SHA-256 of the secret is stored; the key (`sg_<prefix>_<secret>`) is shown once, at
    creation. The prefix identifies it in lists and logs. `scope` narrows what the user's
    permissions allow (a CI job that starts runs needs no more); past `expires_at` the key is
    refused with a 401 that says so.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys"
    )
    name = models.CharField(max_length=100, blank=True, default="")
    prefix = models.CharField(max_length=12, unique=True)
    digest = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    scope = models.CharField(max_length=10, choices=ApiKeyScope, default=ApiKeyScope.FULL)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="blank: never")

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"
        # Everyone sees and revokes their own keys; other people's take this (superusers).
        permissions = [("revoke_others_apikey", "Can see and revoke other people's API keys")]
        constraints = [
            models.CheckConstraint(
                condition=Q(scope__in=ApiKeyScope.values), name="runs_apikey_scope_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"sg_{self.prefix}… ({self.user})"

    def expired(self, now: datetime | None = None) -> bool:
        return self.expires_at is not None and self.expires_at <= (now or timezone.now())


class ChannelKind(models.TextChoices):
    WEBHOOK = "webhook"
    EMAIL = "email"


class NotificationChannel(models.Model):
    """Where to tell people that something happened (runs/notifications.py): a webhook URL or
    email addresses, for some event types, of one workflow or of all. Removing one keeps the
    row (its deliveries stay readable) and stops new deliveries."""

    kind = models.CharField(max_length=10, choices=ChannelKind)
    target = models.CharField(max_length=2000, help_text="the URL, or comma-separated addresses")
    events = models.JSONField(help_text="event types delivered, e.g. ['run.failed']")
    workflow = models.CharField(max_length=200, blank=True, default="", help_text="blank: all")
    secret = models.CharField(
        max_length=200, blank=True, default="", help_text="signs webhook bodies (HMAC-SHA256)"
    )
    created_by = models.CharField(max_length=150, default="system")
    created_at = models.DateTimeField()
    # Events up to here were looked at (less a margin for transactions that commit late).
    scanned_until = models.DateTimeField()
    removed_at = models.DateTimeField(null=True, blank=True)
    removed_by = models.CharField(max_length=150, blank=True, default="")
    # Paused: nothing is sent (the events meanwhile are not delivered later, and deliveries
    # under way stop retrying), until resumed. Audited like adding and removing.
    paused_at = models.DateTimeField(null=True, blank=True)
    paused_by = models.CharField(max_length=150, blank=True, default="")
    pause_reason = models.CharField(max_length=500, blank=True, default="")
    resumed_at = models.DateTimeField(null=True, blank=True)  # events before it: never sent

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(kind__in=ChannelKind.values), name="runs_channel_kind_valid"
            ),
            models.CheckConstraint(
                condition=Q(paused_at__isnull=True) | ~Q(paused_by=""),
                name="runs_channel_paused_by_someone",
            ),
        ]

    def __str__(self) -> str:
        return f"#{self.pk} {self.kind} {self.target}"


class NotificationDelivery(models.Model):
    """One event told to one channel: delivered by its own run of the built-in workflow
    `stepguard.notify`, which retries and keeps the record of every attempt."""

    channel = models.ForeignKey(
        NotificationChannel, on_delete=models.PROTECT, related_name="deliveries"
    )
    # Not a foreign key: retention prunes the event's run and this delivery's run apart.
    event_id = models.BigIntegerField()
    event_type = models.CharField(max_length=64)
    run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="delivery")
    created_at = models.DateTimeField()
    #: The delivery's send step, attached by runs.notifications.deliveries (not a column).
    step: "Step | None"

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "notification deliveries"
        constraints = [
            # Exactly one delivery of an event to a channel, however many workers sweep.
            models.UniqueConstraint(
                fields=["channel", "event_id"], name="runs_delivery_channel_event_unique"
            ),
        ]

    def __str__(self) -> str:
        return f"event {self.event_id} -> channel {self.channel_id}"


class Verdict(models.TextChoices):
    GOOD = "good", "good"
    BAD = "bad", "bad"
    NOTE = "note", "a note only"


class Annotation(models.Model):
    """A person's verdict on a run or one of its steps (good, bad, or a note), with who and
    when: the feedback operators filter and export runs by (runs/annotations.py). Rows are
    added, never edited; each is also a `run.annotated` event in the run's history."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="annotations")
    # The step by its position and key (null: the whole run); the key is kept for exports.
    step_seq = models.PositiveIntegerField(null=True, blank=True)
    step_key = models.CharField(max_length=255, blank=True, default="")
    verdict = models.CharField(max_length=10, choices=Verdict)
    note = models.TextField(blank=True, default="")
    by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    by_name = models.CharField(max_length=150, help_text="who, kept if the user is deleted")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [("annotate_run", "Can mark runs and steps good or bad, with a note")]
        constraints = [
            models.CheckConstraint(
                condition=Q(verdict__in=Verdict.values), name="runs_annotation_verdict_valid"
            ),
            models.CheckConstraint(
                condition=~Q(verdict="note") | ~Q(note=""), name="runs_annotation_note_has_text"
            ),
            models.CheckConstraint(
                condition=Q(step_seq__isnull=True, step_key="")
                | Q(step_seq__isnull=False) & ~Q(step_key=""),
                name="runs_annotation_step_whole",
            ),
        ]
        indexes = [
            # A run's annotations, and the runs list's "runs marked bad" (an EXISTS per run).
            models.Index(fields=["run", "verdict"], name="runs_annotation_run_idx"),
            # The export, newest first, filtered by verdict.
            models.Index(fields=["verdict", "-created_at"], name="runs_annotation_verdict_idx"),
        ]

    def __str__(self) -> str:
        where = f"#{self.step_seq} {self.step_key}" if self.step_seq is not None else "run"
        return f"{self.run_id} {where}: {self.verdict}"


class StreamPiece(models.Model):
    """A piece of a step's streamed answer as the run's readers see it (the live page, the SSE
    stream): `text` written at `offset` of the step's stream, cutting whatever was after it. A
    re-sent step's stream is written against what its earlier attempt already showed, so an
    identical re-send adds nothing and a different one cuts back to where they part
    (runs/engine/streaming.py). Display data, not a checkpoint: pruned with its run."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(
        Run, on_delete=models.CASCADE, related_name="stream_pieces", db_index=False
    )
    seq = models.PositiveIntegerField(help_text="the step's position in the run")
    attempt = models.PositiveIntegerField(help_text="the step attempt that streamed it")
    offset = models.PositiveIntegerField(help_text="where in the step's stream the text goes")
    kind = models.CharField(max_length=20, default="text", help_text="text or tool_call")
    text = models.TextField(blank=True)

    class Meta:
        indexes = [
            # The SSE stream and the live page read a run's pieces after a cursor, in order.
            models.Index(fields=["run", "id"], name="runs_streampiece_run_id"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id} step {self.seq} @{self.offset}"


class Tally(models.Model):
    """Running totals /metrics reads instead of summing the runs and steps tables (issue 51):
    runs by workflow and status, the steps of finished runs by outcome, duration, spend and
    tokens. Kept on PostgreSQL by triggers (migration 0032, runs/tally.py says what they keep)
    that append signed rows, never update one, so no two writers wait on a counter; one
    worker per period folds them into one row per key (`folded`)."""

    id = models.BigAutoField(primary_key=True)
    family = models.CharField(max_length=20, help_text="runs, steps, usd_micros, duration, ...")
    a = models.CharField(max_length=200, blank=True, help_text="workflow, or a step's kind")
    b = models.CharField(max_length=200, blank=True, help_text="status, outcome, model, bucket")
    n = models.BigIntegerField()
    folded = models.BooleanField(default=False)

    class Meta:
        constraints = [
            # The fold's ON CONFLICT target: one folded row per key.
            models.UniqueConstraint(
                fields=["family", "a", "b"],
                condition=models.Q(folded=True),
                name="runs_tally_folded_unique",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.family} {self.a} {self.b}: {self.n}"
