"""Bulk actions over REST: `POST /api/runs/bulk` halts, cancels or retries up to BULK_MAX runs,
named by id or by the runs list's filter, through runs.operations.bulk (as the dashboard's runs
list and `manage.py bulk` do): each run with its own operation's checks and audit event, and
what became of each in the answer."""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

from ninja import Field, Schema

from runs.api.common import ERRORS_422, TEXT, In, Router
from runs.operations import bulk

router = Router(tags=["runs"], ids="runs_api_bulk")  # its ids from runs/api_bulk.py

FilterValue = Annotated[str, Field(max_length=255, pattern=TEXT)]


class BulkIn(In):
    action: str = Field(
        max_length=20, pattern=TEXT, description="halt, cancel or retry", examples=["cancel"]
    )
    reason: str = Field("", max_length=2000, pattern=TEXT, examples=["bad prompt deployed"])
    ids: list[UUID] | None = Field(
        None, max_length=bulk.BULK_MAX, description="the runs, by id (or `filter`)"
    )
    filter: dict[str, FilterValue] | None = Field(
        None,
        description="the runs list's filters (status, workflow, version, parent, since, until, "
        "q, top, label, annotation, engine): the runs matching all of them (or `ids`)",
        examples=[{"status": "waiting", "workflow": "outreach"}],
    )


class BulkRunOut(Schema):
    run_id: UUID
    ok: bool
    code: str = Field(description="why it was refused (an error code); empty if done")
    message: str


class BulkOut(Schema):
    action: str
    matched: int
    done: int
    refused: int
    runs: list[BulkRunOut]


@router.post("/runs/bulk", response={200: BulkOut, **ERRORS_422})
def bulk_runs(request, body: BulkIn):
    """Halt, cancel or retry many runs: those `ids` names, or every run `filter` matches (at
    most 1,000), each with the permission, checks and audit event of the single-run action.
    The answer says which were done and which were refused, and why; a bad action, filter or
    id, no match, too many or no reason is a 400 that names it, before any run is touched."""
    result = bulk.bulk_action(
        body.action, request.user, body.reason, ids=body.ids, filters=body.filter
    )
    return {
        "action": result.action,
        "matched": len(result.outcomes),
        "done": result.done,
        "refused": len(result.refused),
        "runs": [
            {"run_id": o.run_id, "ok": o.ok, "code": o.code, "message": o.message}
            for o in result.outcomes
        ],
    }
