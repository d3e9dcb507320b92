"""The outside world of the test workflows: a table no engine code writes to."""

from django.db import models


class Effect(models.Model):
    """A ledger of every call a side-effecting step made, one row per call (not deduped), so a
    test can count how often each step's function really ran."""

    idempotency_key = models.CharField(max_length=300, db_index=True)
    label = models.CharField(max_length=100, blank=True)
    pid = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.label} {self.idempotency_key}"
