"""API keys for the REST API, bound to a user."""

from datetime import datetime

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone


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
