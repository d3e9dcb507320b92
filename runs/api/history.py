"""A run's history over REST: its steps and its events, a page at a time."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from uuid import UUID

from django.conf import settings
from django.urls import reverse
from ninja import Field, Query, Schema

from runs import bounded
from runs.api.common import ERRORS_422, Router, run_or_404, viewer
from runs.engine.deltas import Conversations
from runs.models import Event

router = Router(tags=["runs"])


class StepOut(Schema):
    seq: int
    key: str
    kind: str
    status: str
    attempt: int
    recovered: str
    idempotency_key: str
    input: Any
    output: Any
    error: Any
    tokens_in: int
    tokens_out: int
    usage: Any = Field(description="a model call's model, and its tokens and USD per kind")
    possibly_spent_micros: int = Field(
        description="micro-USD of this call's attempts cut off in flight: maybe paid"
    )
    started_at: datetime
    finished_at: datetime | None
    wake_at: datetime | None


class EventOut(Schema):
    seq: int
    type: str
    step_key: str
    actor: str
    payload: Any
    created_at: datetime


@router.get("/runs/{run_id}/steps", response={200: list[StepOut], **ERRORS_422})
def list_steps(
    request,
    run_id: UUID,
    after: int = Query(-1, ge=-1, le=2**62, description="the last seq you have (steps start at 0)"),
    limit: int = Query(100, ge=1, le=500),
):
    """The run's steps after `after` (a seq), in order, a page at a time: ask again with the last
    seq until the list is empty. A page also ends before its input, output and error pass
    STEPGUARD_API_MAX_RESPONSE bytes (one step always fits), so no run, however long or large
    its steps, makes a response that a server cannot hold."""
    viewer(request)
    steps = run_or_404(run_id).steps.filter(seq__gt=after).order_by("seq")[:limit]
    page, size, conversations = [], 0, Conversations(run_id)
    for step in steps.iterator(chunk_size=10):
        step.input = conversations.expanded(step.seq, step.input)
        size += sum(json_size(v) for v in (step.input, step.output, step.error))
        if page and size > settings.STEPGUARD_API_MAX_RESPONSE:
            break
        page.append(step)
    return page


def json_size(value: Any) -> int:
    return 4 if value is None else len(json.dumps(value, ensure_ascii=False).encode())


@router.get("/runs/{run_id}/events", response={200: list[EventOut], **ERRORS_422})
def list_events(
    request,
    run_id: UUID,
    after: int = Query(0, ge=0, le=2**62),
    limit: int = Query(500, ge=1, le=1000),
):
    """The run's history after `after` (a seq), in order: poll with the last seq to tail it.
    Payloads come whole while the page's stay under about STEPGUARD_API_MAX_RESPONSE bytes;
    past that a payload is `{"cut": true, "bytes": N, "whole": "<URL of that one event>"}`."""
    viewer(request)
    run = run_or_404(run_id)
    events = Event.objects.of(run).filter(seq__gt=after).order_by("seq")
    page = list(bounded.sized(events, ("payload",))[:limit])
    bounded.fill(page, ("payload",), settings.STEPGUARD_API_MAX_RESPONSE, whole_event)
    return page


def whole_event(event: Event, field: str) -> str:
    url = reverse("stepguard:api:list_events", kwargs={"run_id": event.run_id})
    return f"{url}?after={event.seq - 1}&limit=1"  # a page of one always carries its payload
