"""The budgets page: the shared daily budgets (everything, each workflow, each label value) with
what each spent today, and the form that sets them."""

from __future__ import annotations

from datetime import date

from django.contrib.auth.decorators import login_required
from django.db.models import Sum
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from runs import charts, operations
from runs import labels as run_labels
from runs.models import GLOBAL, BudgetLedger, Run, RunStatus, SpendDay
from runs.views.common import do_action, plain_usd, viewer_required
from runs.views.halts import scope_rows


def _spent_per_label(day: date, labels: list[str]) -> dict[str, int]:
    """Micro-USD spent on `day` by the runs carrying each label: one statement over the day's
    spend rows, however many label budgets the page lists."""
    if not labels:
        return {}
    sums = {f"l{i}": Sum("micros", filter=run_labels.carrying(t)) for i, t in enumerate(labels)}
    found = SpendDay.objects.filter(day=day).aggregate(**sums)
    return {t: found[f"l{i}"] or 0 for i, t in enumerate(labels)}


@viewer_required
def budgets_page(request):
    """Shared daily budgets with what was spent today, and the runs a budget has stopped.

    Today's spend is read from the day's spend rows (SpendDay), not from the ledgers: a ledger
    only counts a scope while it has a daily budget, so a page reading them said $0 for
    workflows that spent money."""
    today = timezone.now().date()
    spent = dict(
        SpendDay.objects.filter(day=today)
        .values_list("workflow")
        .annotate(total=Sum("micros"))
        .order_by()
    )
    held = {row.scope: row for row in BudgetLedger.objects.filter(day=today)}
    scopes = scope_rows(labels=True)
    labelled = _spent_per_label(today, [r["label_value"] for r in scopes if "label_value" in r])
    for row in scopes:
        row["ledger"] = ledger = held.get(row["scope"])
        policy = row["policy"]
        if ledger is not None and policy is not None and policy.daily_budget_micros is not None:
            row["spent"] = ledger.spent_micros  # what the daily budget is enforced against
        elif row["scope"] == GLOBAL:
            row["spent"] = sum(spent.values())
        elif "label_value" in row:
            row["spent"] = labelled[row["label_value"]]
        else:
            row["spent"] = spent.get(row["scope"], 0)
    return render(
        request,
        "runs/budgets.html",
        {
            "scopes": scopes,
            "stopped": list(
                Run.objects.filter(status=RunStatus.OVER_BUDGET).order_by("-created_at")[:100]
            ),
            "can_budget": request.user.has_perm("runs.set_budget"),
            "daily": charts.spend_per_day(),
            "days": charts.DAYS,
        },
    )


@login_required
@require_POST
def budget_scope(request):
    """A workflow's (`workflow` field) or everything's shared daily budget and run default,
    or a label value's (`label`: `tenant=acme`) daily budget, in USD; an empty field removes
    that limit."""
    post = request.POST
    target = f"workflow:{post['workflow']}" if post.get("workflow") else "all"
    if post.get("label"):
        target = f"{run_labels.SCOPE_PREFIX}{post['label']}"
    # Amounts are checked by set_budget (to_micros), which names a bad one.
    fields = ("usd",) if post.get("label") else ("usd", "run_usd")
    amounts = {f: post.get(f, "").strip() or None for f in fields}
    reason = request.POST.get("reason", "")

    def set_it():
        for name, value in amounts.items():
            plain_usd(value, "the daily budget" if name == "usd" else "the run budget")
        operations.set_budget(target, request.user, reason, **amounts)

    return do_action(request, set_it, reverse("stepguard:budgets"), "Budgets set.")
