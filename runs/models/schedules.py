"""Cron schedules: each tick starts a run (runs/schedules.py)."""

from django.conf import settings
from django.db import models
from django.db.models import Q


class Catchup(models.TextChoices):
    """What a schedule fires of the ticks it missed while no worker was up."""

    SKIP = "skip", "skip missed ticks"
    LAST = "last", "run the last missed tick"
    ALL = "all", "run every missed tick, up to a bound"


class Overlap(models.TextChoices):
    """What a schedule does with a tick while its last run is still open (Temporal's
    ScheduleOverlapPolicy)."""

    SKIP = "skip", "skip the tick"
    BUFFER_ONE = "buffer_one", "start one tick when the last run ends"
    BUFFER_ALL = "buffer_all", "start every tick, one after another"
    ALLOW_ALL = "allow_all", "start every tick at once"


#: The most ticks a `buffer_all` schedule keeps waiting; ticks past it are skipped.
MAX_BUFFERED_TICKS = 1000


class Schedule(models.Model):
    """A cron schedule: each tick starts one run of `workflow` (runs/schedules.py)."""

    name = models.CharField(max_length=200, unique=True)
    workflow = models.CharField(max_length=200)
    cron = models.CharField(max_length=200, help_text="5 fields, or 6 with seconds first")
    timezone = models.CharField(max_length=64, default="UTC")
    input = models.JSONField(null=True, blank=True)
    paused = models.BooleanField(default=False)
    catchup = models.CharField(max_length=10, choices=Catchup.choices, default=Catchup.SKIP)
    catchup_limit = models.PositiveIntegerField(default=10)
    # Seconds a tick may be late and still fire (null: STEPGUARD_SCHEDULE_GRACE_SECONDS).
    catchup_window = models.PositiveIntegerField(null=True, blank=True)
    overlap = models.CharField(max_length=12, choices=Overlap.choices, default=Overlap.SKIP)
    # The run of its newest started tick (no foreign key: retention may prune it, which
    # counts as ended), and the ticks waiting for it to end (`buffer_one`, `buffer_all`).
    last_run_id = models.UUIDField(null=True, blank=True)
    buffered = models.JSONField(default=list, blank=True)
    source = models.CharField(max_length=10, default="api", help_text="code or api")
    # Who added it: its runs are started in their name (the four-eyes rule applies to them),
    # and it fires only while they are active.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Ids of everyone who authored, replaced or resumed it: each shapes what its runs do.
    shaped_by = models.JSONField(default=list, blank=True)
    next_fire_at = models.DateTimeField()
    last_fired_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(catchup__in=Catchup.values), name="runs_schedule_catchup_valid"
            ),
            models.CheckConstraint(
                condition=Q(catchup_limit__gte=1, catchup_limit__lte=1000),
                name="runs_schedule_catchup_limit_range",
            ),
            models.CheckConstraint(
                condition=Q(overlap__in=Overlap.values), name="runs_schedule_overlap_valid"
            ),
            models.CheckConstraint(
                condition=Q(catchup_window__isnull=True)
                | Q(catchup_window__gte=1, catchup_window__lte=366 * 86400),
                name="runs_schedule_catchup_window_range",
            ),
        ]
        indexes = [
            # Firing: the due schedules that are not paused, soonest first.
            models.Index(
                fields=["next_fire_at"], condition=Q(paused=False), name="runs_schedule_due_idx"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.cron} {self.timezone})"
