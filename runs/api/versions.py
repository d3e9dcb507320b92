"""The release check and the versions in flight over REST (runs.replaycheck, runs.versions):
the same check as `manage.py replaycheck`, against the code this web process imports."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ninja import Field, Schema

from runs.api.common import ERRORS_422, TEXT, In, Router, viewer
from runs.engine import registry
from runs.errors import Forbidden
from runs.replaycheck import CHECK_PERMISSION, check
from runs.versions import in_flight

router = Router(tags=["versions"], ids="runs_api_versions")


class ReplayCheckIn(In):
    workflow: str | None = Field(None, min_length=1, max_length=200, pattern=TEXT)
    runs: int | None = Field(None, ge=1, le=100_000, description="the N most recent runs")
    since: datetime | None = Field(
        None, description="live runs and runs finished since then (a day ago by default)"
    )


class Divergence(Schema):
    run: str
    status: str
    outcome: str
    seq: int | None
    recorded: str | None
    requested: str | None
    error: str | None
    says: str
    fix: str


class VersionChecked(Schema):
    workflow: str
    version: str
    served: bool = Field(description="this process has code for this version")
    checked: int
    live: int
    compatible: int
    diverging: int
    diverging_live: int
    first_divergence: Divergence | None
    must_stay_on_old_workers: list[str] = Field(
        description="live runs that would diverge (the first 100): leave them to old workers"
    )


class ReplayCheckOut(Schema):
    ok: bool
    checked: int
    diverging: int
    seconds: float
    versions: list[VersionChecked]


class VersionOut(Schema):
    workflow: str
    version: str
    live: int
    waiting: int
    waiting_without_deadline: int
    oldest_live: datetime | None
    last_deadline: datetime | None
    finished_last_day: int
    workers: int
    served: bool = Field(description="a live worker serves this version")
    newest: bool = Field(description="the version of the workflow's most recent run")
    drains: str


@router.post("/replaycheck", response={200: ReplayCheckOut, **ERRORS_422})
def replaycheck(request, body: ReplayCheckIn) -> Any:
    """Replay the histories of live runs (and of runs finished since `since`, a day by
    default; or the `runs` most recent) against the workflow code this server imports,
    writing nothing and calling nothing: which runs this code could take over and which would
    diverge (`ok` false), with the first divergence of each version and the fix to consider.
    Needs runs.set_flow (operators)."""
    if not request.user.has_perm(CHECK_PERMISSION):
        raise Forbidden(
            f"{request.user.get_username()} may not run the release check "
            f"(needs {CHECK_PERMISSION})"
        )
    registry.load_configured()
    report = check(workflow=body.workflow, runs=body.runs, since=body.since)
    return report.as_json()


@router.get("/versions", response={200: list[VersionOut], **ERRORS_422})
def versions(request, engine: bool = False) -> Any:
    """Each workflow version with live runs or runs finished in the last day: its live runs,
    whether a live worker serves it, and when it drains."""
    viewer(request)
    return [v.as_json() for v in in_flight(engine=engine)]
