"""Policies (halts, budgets, limits of a workflow, a label value or everything) and what
shared budgets and runs spent, per day."""

from django.db import models
from django.db.models import Q

from runs.models.runs import Run

GLOBAL = "*"


class Policy(models.Model):
    """Rules for one workflow (`scope` = its name), for everything (`scope` = "*"), or the
    daily budget of one label value (`scope` = "label:tenant=acme", runs/labels.py)."""

    scope = models.CharField(max_length=200, unique=True)
    halted_at = models.DateTimeField(null=True, blank=True)
    halted_by = models.CharField(max_length=150, blank=True, default="")
    halt_reason = models.TextField(blank=True, default="")
    daily_budget_micros = models.BigIntegerField(null=True, blank=True)
    daily_budget_tokens = models.BigIntegerField(null=True, blank=True)
    run_budget_micros = models.BigIntegerField(
        null=True, blank=True, help_text="default budget of each new run"
    )
    run_budget_tokens = models.BigIntegerField(null=True, blank=True)
    # Concurrency limits set by an operator; None: the workflow's own (`@workflow(...)`).
    max_running = models.PositiveIntegerField(
        null=True, blank=True, help_text="runs of the workflow running at once"
    )
    max_running_per_key = models.PositiveIntegerField(
        null=True, blank=True, help_text="runs of one concurrency key running at once"
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "policies"

    def __str__(self) -> str:
        if self.scope == GLOBAL:
            return "global"
        if self.scope.startswith("label:"):
            return f"label {self.scope.removeprefix('label:')}"
        return f"workflow {self.scope}"


class BudgetLedger(models.Model):
    """Spend against a shared (workflow or global) budget for one UTC day.

    Steps reserve their estimate here and settle their actual spend, each under the row lock,
    so concurrent runs sharing the budget cannot overspend it by racing.
    """

    scope = models.CharField(max_length=200)
    day = models.DateField()
    spent_micros = models.BigIntegerField(default=0)
    spent_tokens = models.BigIntegerField(default=0)
    reserved_micros = models.BigIntegerField(default=0)
    reserved_tokens = models.BigIntegerField(default=0)
    warned = models.BooleanField(default=False)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "day"], name="runs_ledger_scope_day_unique"),
            models.CheckConstraint(
                condition=Q(reserved_micros__gte=0) & Q(reserved_tokens__gte=0),
                name="runs_ledger_reserved_not_negative",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope} {self.day}"


class SpendDay(models.Model):
    """What runs of one workflow carrying one set of labels spent on one UTC day: what the
    budgets page, the spend charts and `/api/spend` read, so their cost follows the number of
    workflows and label sets, not of steps. Kept by database triggers on the steps table
    (migration 0023), whichever code writes a step's cost; it outlives the runs retention
    deletes, so a report of past spend stays whole."""

    day = models.DateField()
    workflow = models.CharField(max_length=200)
    labels = models.JSONField(default=dict)
    micros = models.BigIntegerField(default=0, help_text="USD recorded, in 1e-6 USD")
    tokens = models.BigIntegerField(default=0)
    possibly_micros = models.BigIntegerField(
        default=0, help_text="estimates of model calls cut off in flight: maybe paid"
    )
    runs = models.PositiveIntegerField(default=0, help_text="runs that spent that day")

    # Unique by (day, workflow, labels): an index of migration 0023, not a constraint here, as
    # on PostgreSQL it keys the labels by their md5 (a long label set passes a btree entry's
    # size limit) and the triggers name it in their ON CONFLICT.

    def __str__(self) -> str:
        return f"{self.workflow} {self.labels} {self.day}"


class SpendRun(models.Model):
    """A run that spent on a day: so a run spending twice that day counts once in
    `SpendDay.runs`. Written by the same triggers, deleted with the run."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="spend_days")
    day = models.DateField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["run", "day"], name="runs_spendrun_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.run_id} {self.day}"
