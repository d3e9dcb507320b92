"""Annotations over REST: mark a run or a step good, bad or with a note, read a run's, and
export them by verdict, workflow, person and time. Each route calls runs.annotations, as the
dashboard and `manage.py annotate` do: one permission check, one audit event."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any
from uuid import UUID

from ninja import Field, Query, Schema, Status

from runs import annotations
from runs.api.common import ERRORS_422, TEXT, In, Router, run_or_404, viewer

router = Router(tags=["annotations"], ids="runs_api_annotations")


class AnnotationIn(In):
    verdict: str = Field(
        pattern=r"^(good|bad|note)$", description="good, bad, or note (a note only)"
    )
    note: str = Field("", max_length=annotations.MAX_NOTE, pattern=TEXT)
    step: (
        Annotated[str, Field(min_length=1, max_length=255, pattern=TEXT)]
        | Annotated[int, Field(ge=0, le=2**31 - 1)]
        | None
    ) = Field(None, description="the step's key or position; absent: the whole run")


class AnnotationOut(Schema):
    id: int
    run_id: UUID
    workflow: str
    run_status: str
    labels: dict[str, str]
    step_seq: int | None
    step_key: str | None
    verdict: str
    note: str
    by: str
    created_at: datetime


class ExportFilters(Schema):
    verdict: str | None = Field(None, pattern=r"^(good|bad|note)$")
    workflow: str | None = Field(None, max_length=200, pattern=TEXT)
    run: UUID | None = None
    by: str | None = Field(None, max_length=150, pattern=TEXT)
    since: datetime | None = None
    until: datetime | None = None
    limit: int = Field(500, ge=1, le=5000)


@router.post("/runs/{run_id}/annotations", response={201: AnnotationOut, **ERRORS_422})
def annotate_run(request, run_id: UUID, body: AnnotationIn):
    """Mark the run, or one of its steps, good or bad, or leave a note (needs
    runs.annotate_run: operators and approvers). Recorded as a `run.annotated` event."""
    made = annotations.annotate(
        run_id, request.user, verdict=body.verdict, note=body.note, step=body.step
    )
    made.run = run_or_404(run_id)
    return Status(201, annotations.as_row(made))


@router.get("/runs/{run_id}/annotations", response={200: list[AnnotationOut], **ERRORS_422})
def run_annotations(request, run_id: UUID):
    """The run's annotations, newest first."""
    viewer(request)
    run = run_or_404(run_id)
    rows = annotations.of_run(run.pk)
    for a in rows:
        a.run = run
    return [annotations.as_row(a) for a in rows]


@router.get("/annotations", response={200: list[AnnotationOut], **ERRORS_422})
def export_annotations(request, filters: Query[ExportFilters]) -> Any:
    """Annotations of every run, newest first, filtered: the export (at most `limit`)."""
    viewer(request)
    rows = annotations.matching(filters.dict(exclude={"limit"}))[: filters.limit]
    return [annotations.as_row(a) for a in rows]


__all__ = ["router"]
