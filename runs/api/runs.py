"""Runs over REST: start them, list them, read one."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.conf import settings
from django.urls import reverse
from ninja import Field, Query, Schema, Status

from runs import bounded, queries
from runs.api.common import ERRORS_422, TEXT, USD, In, Router, RunOut, run_or_404, viewer
from runs.engine import registry
from runs.errors import Forbidden
from runs.models import ApiKeyScope, Run
from runs.sdk import start_run

router = Router(tags=["runs"])


class RunStarted(Schema):
    """What a `start`-scoped API key learns of the run its start made or found: a key that
    only starts runs reads none (a guessed idempotency key must not read another's run)."""

    id: UUID
    workflow: str
    status: str


class RunPage(Schema):
    items: list[RunOut]
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page")


class StartIn(In):
    workflow: str = Field(min_length=1, max_length=200, pattern=TEXT, examples=["flight-booking"])
    input: Any = Field(None, examples=[{"from": "LIS", "to": "BER", "passenger": "Ada"}])
    key: str | None = Field(None, min_length=1, max_length=255, pattern=TEXT, examples=["o-42"])
    version: str | None = Field(None, min_length=1, max_length=50, pattern=TEXT)
    budget_usd: str | None = Field(None, pattern=USD, examples=["2.50"])
    budget_tokens: int | None = Field(None, ge=0, le=10**15)
    priority: int | None = Field(None, ge=-1000, le=1000, description="higher goes first")
    labels: dict[str, str] | None = Field(
        None,
        description="who the run is for: up to 10, names of a-z 0-9 _ . - (40 characters), "
        "values of up to 100 characters; kept by its children and forks",
        examples=[{"tenant": "acme"}],
    )


class Filters(Schema):
    status: str | None = Field(None, max_length=20, pattern=TEXT)
    workflow: str | None = Field(None, max_length=200, pattern=TEXT)
    parent: UUID | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    q: str | None = Field(None, max_length=255, pattern=TEXT, description="id or key contains")
    label: str | None = Field(
        None, max_length=500, pattern=TEXT, description="tenant=acme: runs with that label"
    )
    annotation: str | None = Field(
        None, pattern=r"^(good|bad|note|any)$", description="runs someone marked so (any: at all)"
    )
    engine: bool = Field(
        False,
        description="include the engine's own runs (notification deliveries, workflows "
        "stepguard.*); filtering by such a workflow or searching with q includes them too",
    )
    cursor: str | None = Field(None, max_length=200, pattern=TEXT)
    limit: int = Field(50, ge=1, le=200)


@router.post(
    "/runs",
    response={200: RunOut | RunStarted, 201: RunOut | RunStarted, **ERRORS_422},
    tags=["runs"],
)
def create_run(request, body: StartIn):
    """Start a run. Idempotent by `key`: a repeat returns the existing run with 200. A
    `start`-scoped key gets the run's id, workflow and status only (RunStarted)."""
    if not request.user.has_perm("runs.add_run"):
        raise Forbidden(f"{request.user.get_username()} may not start runs (needs runs.add_run)")
    registry.load_configured()
    run = start_run(
        body.workflow,
        body.input,
        key=body.key,
        version=body.version,
        budget_usd=None if body.budget_usd is None else Decimal(body.budget_usd),
        budget_tokens=body.budget_tokens,
        priority=body.priority,
        labels=body.labels,
        started_by=request.user,
        api_key=getattr(getattr(request, "api_key", None), "prefix", None),
    )
    code = 201 if run.was_created else 200
    if getattr(getattr(request, "api_key", None), "scope", None) == ApiKeyScope.START:
        return Status(code, {"id": run.pk, "workflow": run.workflow, "status": run.status})
    return Status(code, RunOut.of(run))


@router.get("/runs", response={200: RunPage, **ERRORS_422})
def list_runs(request, filters: Query[Filters]):
    """Runs, newest first, with cursor pagination. Their inputs, outputs and errors come whole
    while the page's stay under about STEPGUARD_API_MAX_RESPONSE bytes; past that a value is
    `{"cut": true, "bytes": N, "whole": "<the run's URL>"}` (GET the run for the whole of it)."""
    viewer(request)
    chosen = {
        "status": filters.status,
        "workflow": filters.workflow,
        "parent": filters.parent,
        "since": filters.created_after,
        "until": filters.created_before,
        "q": filters.q,
        "label": filters.label,
        "annotation": filters.annotation,
        "engine": filters.engine,
    }
    runs = queries.runs_matching(chosen)
    page, cursor = queries.page(
        bounded.sized(runs, RUN_VALUES),
        filters.limit,
        filters.cursor,
        probe=queries.probed(chosen),
    )
    bounded.fill(page, RUN_VALUES, settings.STEPGUARD_API_MAX_RESPONSE, whole_run)
    return {"items": [RunOut.of(r) for r in page], "next_cursor": cursor}


RUN_VALUES = ("input", "output", "error")


def whole_run(run: Run, field: str) -> str:
    return reverse("stepguard:api:get_run", kwargs={"run_id": run.pk})


@router.get("/runs/{run_id}", response={200: RunOut, **ERRORS_422})
def get_run(request, run_id: UUID):
    viewer(request)
    return RunOut.of(run_or_404(run_id))
