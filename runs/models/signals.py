"""What crosses a running run's boundary: signals sent to it, values it publishes."""

from django.db import models
from django.db.models import Q

from runs.fields import ExactJSONField
from runs.models.runs import Run


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
