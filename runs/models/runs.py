"""Runs: their status, ownership (the lease), flow control, spend and budgets, halts, and
who shaped what they do."""

import uuid

from django.conf import settings
from django.db import models
from django.db.models import JSONField, Q, Value
from django.db.models.fields.json import KeyTextTransform

from runs.fields import ExactJSONField
from runs.models.workers import Worker


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
            # The `tenant` label (labels.INDEXED) in created-at order, alone and with a status:
            # a tenant's page, its status counts and a label+status pair are index ranges.
            # Through the labels' GIN index a tenant's page read every run of it (25,000 at 5M
            # runs, 159 ms), and a tenant whose newest runs are live walked the newest-first
            # index past every newer run to reach its completed ones (133,884 rows at 1M).
            # Whole, not partial: a tenant's budget or hold finds its runs through them too.
            models.Index(
                KeyTextTransform("tenant", "labels"),
                models.F("created_at").desc(),
                models.F("id").desc(),
                name="runs_run_tenant_created_idx",
            ),
            models.Index(
                KeyTextTransform("tenant", "labels"),
                "status",
                models.F("created_at").desc(),
                models.F("id").desc(),
                name="runs_run_tenant_status_idx",
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
