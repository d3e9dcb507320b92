"""The outside world of the demos: tables that stand in for other companies' databases.

They are written by the stand-in services in examples/services.py, never by the engine, and
let the demo and the tests count side effects.
"""

from django.db import models


class Booking(models.Model):
    """The airline's bookings; like a real payment API, it dedupes on the idempotency key."""

    idempotency_key = models.CharField(max_length=300, unique=True)
    flight = models.CharField(max_length=20)
    passenger = models.CharField(max_length=200)
    price = models.DecimalField(max_digits=10, decimal_places=2)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.flight} for {self.passenger}"


class Effect(models.Model):
    """A ledger of every call a side-effecting step made, one row per call (not deduped)."""

    idempotency_key = models.CharField(max_length=300, db_index=True)
    label = models.CharField(max_length=100, blank=True)
    pid = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.label} {self.idempotency_key}"
