"""Worker processes, and the deployment's periodic chores one of them does at a time."""

import uuid

from django.db import models


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


class Chore(models.Model):
    """A periodic job of the whole deployment (the daily prune), done by one worker at a time:
    the worker whose conditional UPDATE moves `due_at` forward does it, on any engine."""

    name = models.CharField(max_length=50, primary_key=True)
    due_at = models.DateTimeField()
    claimed_by = models.CharField(max_length=255, blank=True, default="")
    claimed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} (due {self.due_at:%Y-%m-%d %H:%M})"
