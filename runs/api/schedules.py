"""Cron schedules over REST (runs/schedules.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.conf import settings
from django.urls import reverse
from ninja import Field, Path, Schema, Status

from runs import bounded, operations
from runs.api.common import ERRORS, ERRORS_422, TEXT, In, Router, may
from runs.engine import registry
from runs.errors import NotFound
from runs.models import Schedule

router = Router(tags=["runs"])


class ScheduleIn(In):
    workflow: str = Field(min_length=1, max_length=200, pattern=TEXT)
    cron: str = Field(min_length=1, max_length=200, pattern=TEXT, examples=["*/5 * * * *"])
    timezone: str = Field("UTC", min_length=1, max_length=64, pattern=TEXT)
    input: Any = None
    catchup: str = Field("skip", pattern="^(skip|last|all)$")
    catchup_limit: int = Field(10, ge=1, le=1000)
    catchup_window: int | None = Field(
        None, ge=1, le=366 * 86400, description="seconds a tick may be late and still fire"
    )
    overlap: str = Field(
        "skip",
        pattern="^(skip|buffer_one|buffer_all|allow_all)$",
        description="what a tick does while the schedule's last run is still open",
    )
    paused: bool = False


class ScheduleOut(Schema):
    name: str
    workflow: str
    cron: str
    timezone: str
    input: Any
    paused: bool
    catchup: str
    catchup_limit: int
    catchup_window: int | None
    overlap: str
    buffered: list[str] = Field(description="ticks waiting for the last run to end")
    source: str
    next_fire_at: datetime
    last_fired_at: datetime | None


@router.get("/flow/schedules", response={200: list[ScheduleOut], **ERRORS}, tags=["flow"])
def list_schedules(request):
    """Every schedule, by name. Inputs come whole while the list's stay under about
    STEPGUARD_API_MAX_RESPONSE bytes; past that an input is `{"cut": true, "bytes": N,
    "whole": "<the schedule's URL>"}`."""
    may(request, "runs.view_schedule", "view schedules")
    schedules = list(bounded.sized(Schedule.objects.order_by("name"), ("input",)))
    bounded.fill(schedules, ("input",), settings.STEPGUARD_API_MAX_RESPONSE, whole_schedule)
    return schedules


def whole_schedule(schedule: Schedule, field: str) -> str:
    return reverse("stepguard:api:get_schedule", kwargs={"name": schedule.name})


@router.get("/flow/schedules/{name}", response={200: ScheduleOut, **ERRORS_422}, tags=["flow"])
def get_schedule(request, name: str = Path(..., max_length=200, pattern=TEXT)):
    """One schedule, its input whole."""
    may(request, "runs.view_schedule", "view schedules")
    schedule = Schedule.objects.filter(name=name).first()
    if schedule is None:
        raise NotFound(f"no schedule named {name!r}")
    return schedule


@router.put("/flow/schedules/{name}", response={200: ScheduleOut, **ERRORS_422}, tags=["flow"])
def save_schedule(request, name: str, body: ScheduleIn):
    """Create or replace a schedule: each tick of `cron` (in `timezone`) starts one run."""
    registry.load_configured()
    return operations.save_schedule(
        request.user, name, workflow=body.workflow, cron=body.cron, timezone_name=body.timezone,
        input=body.input, catchup=body.catchup, catchup_limit=body.catchup_limit,
        catchup_window=body.catchup_window, overlap=body.overlap, paused=body.paused,
    )  # fmt: skip


@router.post("/flow/schedules/{name}/pause", response={200: ScheduleOut, **ERRORS}, tags=["flow"])
def pause_schedule(request, name: str):
    return operations.pause_schedule(request.user, name, True)


@router.post("/flow/schedules/{name}/resume", response={200: ScheduleOut, **ERRORS}, tags=["flow"])
def resume_schedule(request, name: str):
    """Fire again from the next tick (ticks while paused are not caught up)."""
    return operations.pause_schedule(request.user, name, False)


@router.delete("/flow/schedules/{name}", response={204: None, **ERRORS}, tags=["flow"])
def remove_schedule(request, name: str):
    operations.remove_schedule(request.user, name)
    return Status(204, None)
