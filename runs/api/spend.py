"""What runs spent over REST: one run's bill, per model and kind of token, and a label's
(a tenant's) per day."""

from __future__ import annotations

from datetime import UTC, date, timedelta
from decimal import Decimal
from uuid import UUID

from django.utils import timezone
from ninja import Field, Query, Schema

from runs import queries
from runs.api.common import ERRORS_422, TEXT, Router, Spend, run_or_404, viewer

router = Router(tags=["runs"])


class KindUsage(Schema):
    tokens: int
    usd: Decimal


class ModelUsage(Schema):
    calls: int
    tokens_in: int
    tokens_out: int
    usd: Decimal
    kinds: dict[str, KindUsage]


class PossiblySpent(Schema):
    tokens: int
    usd: Decimal
    steps: list[str] = Field(description="keys of the model calls re-sent after being cut off")


class UsageOut(Schema):
    spend: Spend
    possibly_spent: PossiblySpent = Field(
        description="estimates of model calls a crash cut off in flight, then sent again: maybe "
        "paid, never recorded; held against the run's budget, apart from what was recorded"
    )
    models: dict[str, ModelUsage]
    unpriced: list[str] = Field(description="models called with no price: their USD is 0")


class LabelSpend(Schema):
    day: date
    value: str | None = Field(description="the label's value; null: runs without the label")
    usd: Decimal
    tokens: int
    possibly_spent_usd: Decimal = Field(
        description="estimates of model calls a crash cut off: maybe paid, never recorded"
    )
    runs: int


@router.get("/spend", response={200: list[LabelSpend], **ERRORS_422}, tags=["budgets"])
def spend(
    request,
    label: str = Query(..., max_length=40, pattern=TEXT, examples=["tenant"]),
    since: date | None = None,
    until: date | None = None,
):
    """What runs spent per value of one label (`tenant`), per UTC day from `since` to
    `until` (inclusive; the last 7 days by default): a tenant's bill."""
    viewer(request)
    today = timezone.now().astimezone(UTC).date()
    until = until or today
    since = since or until - timedelta(days=6)
    return queries.spend_by_label(label, since, until)


@router.get("/runs/{run_id}/usage", response={200: UsageOut, **ERRORS_422})
def run_usage(request, run_id: UUID):
    """What the run's model calls spent, per model and per kind of token (input, cached input,
    cache write, output, reasoning), each priced at its own rate: the run's bill."""
    viewer(request)
    run = run_or_404(run_id)
    return queries.usage(run)
