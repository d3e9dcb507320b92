"""Notification channels and the deliveries of events to them (runs/notifications.py)."""

from django.db import models
from django.db.models import Q

from runs.models.runs import Run
from runs.models.steps import Step


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
