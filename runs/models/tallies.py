"""The running totals /metrics reads (runs/tally.py keeps them)."""

from django.db import models


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
