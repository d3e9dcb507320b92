"""Steps: a run's checkpoints, one row per step, and the pieces of a step's streamed answer."""

from django.db import models
from django.db.models import Q

from runs.fields import ExactJSONField
from runs.models.runs import Run


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
