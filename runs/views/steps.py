"""A step's panel on the run page: its input, output and error (shown up to a size, whole as a
download) and its attempts."""

from __future__ import annotations

import json
from datetime import timedelta
from uuid import UUID

from django.conf import settings
from django.http import Http404
from django.shortcuts import render
from django.urls import reverse

from runs.conversation import conversation
from runs.engine.deltas import Conversations
from runs.models import Annotation, Event, EventType, Step, StepKind, StepStatus
from runs.views.common import json_download, viewer_required


@viewer_required
def step_body(request, run_id: UUID, seq: int):
    """A step's details for the side panel, loaded when its row is opened (rows stay light):
    every attempt, a model call as a conversation, and the raw input, output and error. A
    value too big to show in a page is cut, with a link to the whole of it."""
    step = Step.objects.filter(run_id=run_id, seq=seq).first()
    if step is None:
        raise Http404(f"run {run_id} has no step {seq}")
    step.input = Conversations(run_id).expanded(seq, step.input)
    step.annotated = list(
        Annotation.objects.filter(run_id=run_id, step_seq=seq).order_by("-created_at", "-id")
    )
    parts = [
        shown(
            name, getattr(step, name), reverse("stepguard:run-step-json", args=[run_id, seq, name])
        )
        for name in STEP_PARTS
        if getattr(step, name) is not None or name == "input"
    ]
    sent = step.input
    if isinstance(sent, list) and sent and isinstance(sent[0], dict):
        sent = sent[0]  # a long conversation's request, stored as a delta and expanded
    turns = conversation(sent, step.output) if step.kind == StepKind.LLM else []
    return render(
        request,
        "runs/detail.html#step-body",
        {
            "s": step,
            "parts": parts,
            "turns": turns,
            "model": sent.get("model", "") if isinstance(sent, dict) and turns else "",
            "attempts": attempts(step) if step.kind in ATTEMPTED else None,
            "step_annotations": step.annotated,
            "can_annotate": request.user.has_perm("runs.annotate_run"),
        },
    )


#: Kinds whose function is called, maybe several times; waits are not attempted.
ATTEMPTED = (StepKind.CALL, StepKind.LLM, StepKind.TOOL, StepKind.TRANSACTION)


ATTEMPT_EVENTS = (
    EventType.STEP_STARTED,
    EventType.STEP_RETRYING,
    EventType.STEP_FAILED,
    EventType.STEP_COMPLETED,
)


def attempts(step: Step) -> list[dict]:
    """Every attempt of a step, from its events: when it began and ended, on which worker, and
    how it ended (the error of each failed one; the step row keeps only the last)."""
    found: list[dict] = []
    current: dict | None = None
    events = Event.objects.filter(run_id=step.run_id, step_key=step.key, type__in=ATTEMPT_EVENTS)
    for e in events.order_by("seq"):
        p = e.payload
        if e.type == EventType.STEP_STARTED:
            current = {"n": p.get("attempt", 1), "start": e.created_at, "worker": p.get("worker")}
            continue
        if current is None:  # an attempt that began before history was kept, or a transaction
            current = {"n": p.get("attempt", 1), "start": None, "worker": p.get("worker")}
        end = e.created_at
        if e.type == EventType.STEP_RETRYING and p.get("delay_s"):
            end -= timedelta(seconds=p["delay_s"])  # written after the backoff's sleep
        current |= {"end": end, "worker": p.get("worker") or current["worker"]}
        if e.type == EventType.STEP_COMPLETED:
            found.append({**current, "outcome": "completed"})
            current = None
        elif e.type == EventType.STEP_FAILED:
            found.append({**current, "outcome": "failed", "error": p.get("error")})
            current = None
        elif p.get("error"):  # retrying: the next attempt starts after the delay
            found.append({**current, "outcome": "failed, tried again", "error": p["error"]})
            current = {"n": p.get("attempt", current["n"] + 1), "start": e.created_at,
                       "worker": p.get("worker")}  # fmt: skip
        # else: a durable retry woken early goes back to waiting; the same attempt waits on
    if current is not None and step.status in (StepStatus.STARTED, StepStatus.WAITING):
        found.append({**current, "outcome": step.status})
    return found


STEP_PARTS = ("input", "output", "error")


def shown(name: str, value, whole_url: str) -> dict:
    """How a JSON value appears in a page: as a tree, or cut to STEPGUARD_UI_MAX_JSON bytes."""
    text = json.dumps(value, ensure_ascii=False)
    size = len(text.encode())
    limit = settings.STEPGUARD_UI_MAX_JSON
    cut = text.encode()[:limit].decode(errors="ignore") if size > limit else None
    return {"name": name, "value": value, "cut": cut, "size": size, "url": whole_url}


@viewer_required
def step_json(request, run_id: UUID, seq: int, part: str):
    """One whole value of a step, as JSON (a download, never rendered in a page)."""
    if part not in STEP_PARTS:
        raise Http404(f"a step has no {part!r}")
    step = Step.objects.filter(run_id=run_id, seq=seq).only(part).first()
    if step is None:
        raise Http404(f"run {run_id} has no step {seq}")
    value = getattr(step, part)
    if part == "input":
        value = Conversations(run_id).expanded(seq, value)
    return json_download(value, f"run-{run_id}-step-{seq}-{part}.json")
