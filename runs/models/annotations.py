"""People's verdicts on runs and steps (runs/annotations.py)."""

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from runs.models.runs import Run


class Verdict(models.TextChoices):
    GOOD = "good", "good"
    BAD = "bad", "bad"
    NOTE = "note", "a note only"


class Annotation(models.Model):
    """A person's verdict on a run or one of its steps (good, bad, or a note), with who and
    when: the feedback operators filter and export runs by (runs/annotations.py). Rows are
    added, never edited; each is also a `run.annotated` event in the run's history."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="annotations")
    # The step by its position and key (null: the whole run); the key is kept for exports.
    step_seq = models.PositiveIntegerField(null=True, blank=True)
    step_key = models.CharField(max_length=255, blank=True, default="")
    verdict = models.CharField(max_length=10, choices=Verdict)
    note = models.TextField(blank=True, default="")
    by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    by_name = models.CharField(max_length=150, help_text="who, kept if the user is deleted")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        permissions = [("annotate_run", "Can mark runs and steps good or bad, with a note")]
        constraints = [
            models.CheckConstraint(
                condition=Q(verdict__in=Verdict.values), name="runs_annotation_verdict_valid"
            ),
            models.CheckConstraint(
                condition=~Q(verdict="note") | ~Q(note=""), name="runs_annotation_note_has_text"
            ),
            models.CheckConstraint(
                condition=Q(step_seq__isnull=True, step_key="")
                | Q(step_seq__isnull=False) & ~Q(step_key=""),
                name="runs_annotation_step_whole",
            ),
        ]
        indexes = [
            # A run's annotations, and the runs list's "runs marked bad" (an EXISTS per run).
            models.Index(fields=["run", "verdict"], name="runs_annotation_run_idx"),
            # The export, newest first, filtered by verdict.
            models.Index(fields=["verdict", "-created_at"], name="runs_annotation_verdict_idx"),
        ]

    def __str__(self) -> str:
        where = f"#{self.step_seq} {self.step_key}" if self.step_seq is not None else "run"
        return f"{self.run_id} {where}: {self.verdict}"
