"""Rate limits of a resource across every worker, and the calls they let through."""

from django.db import models
from django.db.models import Q


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
