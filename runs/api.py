"""Runs, signals, halts, budgets and workers over REST. Each route calls the same operation the
CLI calls (runs.operations, runs.sdk), so permissions and audit events are the same."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any
from uuid import UUID

from django.conf import settings
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from ninja import Field, Path, Query, Router, Schema, Status
from pydantic import ConfigDict

from runs import bounded, notifications, operations, published, queries
from runs.engine import flow, rates, registry
from runs.engine.budget import PLAIN_USD, to_usd
from runs.engine.deltas import Conversations
from runs.errors import Forbidden, NotFound, OperationError
from runs.models import (
    GLOBAL,
    ApiKeyScope,
    Event,
    NotificationChannel,
    Policy,
    RateLimit,
    Run,
    Schedule,
    Worker,
)
from runs.operations import KEEP, Target
from runs.sdk import send_signal, start_run

router = Router(tags=["runs"])

TEXT = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL
# USD travels as a decimal string (no float rounding), at most 8 + 6 digits.
USD = rf"^{PLAIN_USD}$"  # ASCII digits: "\d" would take "٣" as 3


class In(Schema):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(Schema):
    code: str
    message: str
    details: list[Any] | None = None


class ErrorOut(Schema):
    error: ErrorBody


ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut}
ERRORS_422 = {**ERRORS, 413: ErrorOut, 422: ErrorOut}


class Spend(Schema):
    tokens_in: int
    tokens_out: int
    usd: Decimal


class Budget(Schema):
    usd: Decimal | None
    tokens: int | None


class HaltState(Schema):
    at: datetime
    by: str
    reason: str


class RunOut(Schema):
    id: UUID
    workflow: str
    version: str
    status: str
    key: str | None
    parent_id: UUID | None
    forked_from_id: UUID | None
    labels: dict[str, str]
    attempt: int
    max_attempts: int
    input: Any
    output: Any
    error: Any
    spend: Spend
    budget: Budget
    halted: HaltState | None
    cancel_requested_by: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def of(run: Run) -> dict:
        return {
            **{f: getattr(run, f) for f in ("id", "workflow", "version", "status", "key")},
            **{f: getattr(run, f) for f in ("parent_id", "forked_from_id", "attempt", "labels")},
            **{f: getattr(run, f) for f in ("max_attempts", "input", "output", "error")},
            **{f: getattr(run, f) for f in ("created_at", "started_at", "finished_at")},
            "spend": {
                "tokens_in": run.tokens_in,
                "tokens_out": run.tokens_out,
                "usd": to_usd(run.cost_micros),
            },
            "budget": {"usd": to_usd(run.budget_micros), "tokens": run.budget_tokens},
            "halted": (
                {"at": run.halted_at, "by": run.halted_by, "reason": run.halt_reason}
                if run.halted_at
                else None
            ),
            "cancel_requested_by": run.cancel_requested_by or None,
        }


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


class ReasonIn(In):
    reason: str = Field(min_length=1, max_length=2000, pattern=TEXT, examples=["runaway loop"])


class ForkPreviewIn(In):
    # Text as every text field is (no NUL: PostgreSQL refused it with a 500, schemathesis).
    step: (
        Annotated[str, Field(min_length=1, max_length=255, pattern=TEXT)]
        | Annotated[int, Field(ge=0, le=2**31 - 1)]
    ) = Field(description="the key of the first step to run again, or its position")
    input: Any = Field(
        None, description="a replacement run input (absent: the origin's; null is a value)"
    )
    outputs: dict[str, Any] | None = Field(
        None,
        description="{step key: replacement output} for steps before the fork point: the fork"
        " replays them as if the steps had returned them (an approval's decision is not"
        " editable)",
    )


class ForkIn(ForkPreviewIn, ReasonIn):
    pass


class StepPreview(Schema):
    seq: int
    key: str
    kind: str
    asked_again: str | None = Field(
        None,
        description="for an approval before the fork point: why the fork asks it again (its"
        " inputs are edited, it was revoked); null for the steps from the fork point on",
    )


class SignalIn(In):
    name: str = Field(min_length=1, max_length=200, pattern=TEXT, examples=["go"])
    payload: Any = None
    if_finished: str = Field(
        "raise",
        pattern="^(raise|ignore)$",
        description="a finished run: 409 saying so (raise), or 200 with nothing stored (ignore)",
    )


class SignalOut(Schema):
    id: int | None = Field(description="null when nothing was stored (if_finished=ignore)")
    run_id: UUID
    name: str


class PublishedOut(Schema):
    name: str
    value: Any
    updated_at: datetime


class BudgetIn(ReasonIn):
    usd: str | None = Field(None, pattern=USD, examples=["50"])
    tokens: int | None = Field(None, ge=0, le=10**15)
    run_usd: str | None = Field(None, pattern=USD, examples=["2.50"])
    run_tokens: int | None = Field(None, ge=0, le=10**15)


class PolicyOut(Schema):
    scope: str
    halted: HaltState | None
    daily_usd: Decimal | None
    daily_tokens: int | None
    run_usd: Decimal | None
    run_tokens: int | None

    @staticmethod
    def of(policy: Policy) -> dict:
        return {
            "scope": policy.scope,
            "halted": (
                {"at": policy.halted_at, "by": policy.halted_by, "reason": policy.halt_reason}
                if policy.halted_at
                else None
            ),
            "daily_usd": to_usd(policy.daily_budget_micros),
            "daily_tokens": policy.daily_budget_tokens,
            "run_usd": to_usd(policy.run_budget_micros),
            "run_tokens": policy.run_budget_tokens,
        }


class WorkerOut(Schema):
    id: UUID
    host: str
    pid: int
    concurrency: int
    workflows: list[str]
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    runs: list[UUID]


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


def viewer(request: HttpRequest):
    if not request.user.has_perm("runs.view_run"):
        raise Forbidden(f"{request.user.get_username()} may not view runs (needs runs.view_run)")
    return request.user


def run_or_404(run_id: UUID) -> Run:
    return operations.find_run(run_id)


# -- runs --------------------------------------------------------------------------------------


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
    runs = queries.runs_matching(
        {
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
    )
    page, cursor = queries.page(bounded.sized(runs, RUN_VALUES), filters.limit, filters.cursor)
    bounded.fill(page, RUN_VALUES, settings.STEPGUARD_API_MAX_RESPONSE, whole_run)
    return {"items": [RunOut.of(r) for r in page], "next_cursor": cursor}


RUN_VALUES = ("input", "output", "error")


def whole_run(run: Run, field: str) -> str:
    return reverse("stepguard:api:get_run", kwargs={"run_id": run.pk})


@router.get("/runs/{run_id}", response={200: RunOut, **ERRORS_422})
def get_run(request, run_id: UUID):
    viewer(request)
    return RunOut.of(run_or_404(run_id))


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


def _action(request, run_id: UUID, action, *args):
    run_or_404(run_id)
    action(str(run_id), request.user, *args)
    return RunOut.of(Run.objects.get(pk=run_id))


@router.post("/runs/{run_id}/halt", response={200: RunOut, **ERRORS_422}, tags=["halts"])
def halt_run(request, run_id: UUID, body: ReasonIn):
    """Halt the run and its children: they stop at their next step. Only unhalt clears it."""
    return _action(request, run_id, operations.halt, body.reason)


def person_only(request, action: str) -> None:
    if getattr(request, "api_key", None) is not None:
        raise Forbidden(f"{action} needs a person's browser session, not an API key")


@router.post("/runs/{run_id}/unhalt", response={200: RunOut, **ERRORS_422}, tags=["halts"])
def unhalt_run(request, run_id: UUID, body: ReasonIn):
    """Lift a halt. A person's act: refused for API keys (automation may halt, never unhalt)."""
    person_only(request, "unhalt")
    return _action(request, run_id, operations.unhalt, body.reason)


@router.post("/runs/{run_id}/cancel", response={200: RunOut, **ERRORS_422})
def cancel_run(request, run_id: UUID, body: ReasonIn):
    """Cancel: the run stops at its next step, its compensations run, it ends cancelled."""
    return _action(request, run_id, operations.cancel_run, body.reason)


@router.post("/runs/{run_id}/retry", response={200: RunOut, **ERRORS_422})
def retry_run(request, run_id: UUID, body: ReasonIn):
    """Retry a failed run from the top; completed steps are reused."""
    return _action(request, run_id, operations.retry_run, body.reason)


@router.get("/runs/{run_id}/fork-preview", response={200: list[StepPreview], **ERRORS_422})
def fork_preview(request, run_id: UUID, step: str = Query(..., max_length=255, pattern=TEXT)):
    """The recorded steps a fork from `step` would run again (side effects to expect), after
    the approvals before it that it asks again (revoked ones)."""
    viewer(request)
    return operations.fork_preview(run_id, int(step) if step.isdigit() else step)


@router.post("/runs/{run_id}/fork-preview", response={200: list[StepPreview], **ERRORS_422})
def fork_preview_edits(request, run_id: UUID, body: ForkPreviewIn):
    """What a fork with these edits would run again: the approvals before `step` it asks again
    (those its edits may change what they approved, and revoked ones), then the steps from
    `step` on. Nothing is created."""
    viewer(request)
    step = int(body.step) if isinstance(body.step, str) and body.step.isdigit() else body.step
    edits = {"input": body.input} if "input" in body.model_fields_set else {}
    return operations.fork_preview(run_id, step, outputs=body.outputs, **edits)


@router.post("/runs/{run_id}/fork", response={201: RunOut, **ERRORS_422})
def fork_run(request, run_id: UUID, body: ForkIn):
    """A new run reusing the recorded outputs before `step`; the rest runs again. `input` and
    `outputs` edit what the fork starts from (recorded in its `run.created` event)."""
    run_or_404(run_id)
    step = int(body.step) if isinstance(body.step, str) and body.step.isdigit() else body.step
    edits = {"input": body.input} if "input" in body.model_fields_set else {}
    fork = operations.fork_run(
        str(run_id), step, request.user, body.reason, outputs=body.outputs, **edits
    )
    return Status(201, RunOut.of(fork))


@router.post(
    "/runs/{run_id}/signals", response={201: SignalOut, 200: SignalOut, **ERRORS_422},
    tags=["signals"],
)  # fmt: skip
def signal_run(request, run_id: UUID, body: SignalIn):
    """Send a signal; the run's next wait_for_event for `name` consumes it. A finished run
    never would: 409 (`if_finished: "raise"`), or 200 with `id: null` (`"ignore"`)."""
    if not request.user.has_perm("runs.add_signal"):
        raise Forbidden(
            f"{request.user.get_username()} may not send signals (needs runs.add_signal)"
        )
    signal = send_signal(
        run_id, body.name, body.payload, sent_by=request.user.get_username(),
        if_finished=body.if_finished,
    )  # fmt: skip
    if signal is None:
        return Status(200, {"id": None, "run_id": run_id, "name": body.name})
    return Status(201, {"id": signal.pk, "run_id": signal.run_id, "name": signal.name})


@router.get(
    "/runs/{run_id}/events/{name}", response={200: PublishedOut, **ERRORS_422}, tags=["runs"]
)
def get_published(
    request,
    run_id: UUID,
    name: str = Path(..., min_length=1, max_length=100, pattern=r"^[^\x00#]*$"),
    wait: float = Query(0, ge=0, le=30, description="seconds to wait for it to be set"),
):
    """The latest value the run published as `name` (`ctx.set_event`), waiting up to `wait`
    seconds for it to be set: 404 if it is not by then, or never will be (the run ended)."""
    viewer(request)
    found = published.find(run_id, name, wait=wait)
    if found is None:
        raise NotFound(f"run {run_id} has not set event {name!r}")
    return found


# -- budgets and halts on workflows and everything ---------------------------------------------


def workflow_name(name: str) -> str:
    if not 0 < len(name) <= 200 or "\x00" in name:
        raise OperationError("a workflow name is 1 to 200 characters, without NUL")
    return name


def _policy(scope: str) -> dict:
    return PolicyOut.of(Policy.objects.filter(scope=scope).first() or Policy(scope=scope))


def _set_budget(request, target: Target, body: BudgetIn) -> None:
    given = body.model_fields_set - {"reason"}
    limits = {k: getattr(body, k) if k in given else KEEP for k in BUDGET_FIELDS}
    for k in ("usd", "run_usd"):
        if isinstance(limits[k], str):
            limits[k] = Decimal(limits[k])
    if all(v is KEEP for v in limits.values()):
        raise OperationError("give at least one of usd, tokens, run_usd, run_tokens")
    operations.set_budget(target, request.user, body.reason, **limits)


BUDGET_FIELDS = ("usd", "tokens", "run_usd", "run_tokens")


@router.put("/runs/{run_id}/budget", response={200: RunOut, **ERRORS_422}, tags=["budgets"])
def set_run_budget(request, run_id: UUID, body: BudgetIn):
    """Set the run's own budget (usd, tokens; null removes). A run over budget resumes."""
    run_or_404(run_id)
    _set_budget(request, Target("run", str(run_id)), body)
    return RunOut.of(Run.objects.get(pk=run_id))


@router.get("/workflows/{name}/policy", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def workflow_policy(request, name: str):
    viewer(request)
    return _policy(workflow_name(name))


@router.put("/workflows/{name}/budget", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def set_workflow_budget(request, name: str, body: BudgetIn):
    """The workflow's shared daily budget (usd, tokens) and default per-run budget."""
    _set_budget(request, Target("workflow", workflow_name(name)), body)
    return _policy(name)


@router.get("/labels/{label}/policy", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def label_policy(request, label: str):
    """The daily budget of one label value (`tenant=acme`)."""
    viewer(request)
    return _policy(Target("label", label).scope)


@router.put("/labels/{label}/budget", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def set_label_budget(request, label: str, body: BudgetIn):
    """The shared daily budget (usd, tokens) of the runs carrying one label value
    (`tenant=acme`), on top of their workflow's and the global one."""
    target = Target("label", label)
    _set_budget(request, target, body)
    return _policy(target.scope)


@router.post("/workflows/{name}/halt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def halt_workflow(request, name: str, body: ReasonIn):
    operations.halt(Target("workflow", workflow_name(name)), request.user, body.reason)
    return _policy(name)


@router.post("/workflows/{name}/unhalt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def unhalt_workflow(request, name: str, body: ReasonIn):
    person_only(request, "unhalt")
    operations.unhalt(Target("workflow", workflow_name(name)), request.user, body.reason)
    return _policy(name)


@router.get("/global/policy", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def global_policy(request):
    viewer(request)
    return _policy(GLOBAL)


@router.put("/global/budget", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def set_global_budget(request, body: BudgetIn):
    """The global daily budget (usd, tokens) and default per-run budget."""
    _set_budget(request, Target("all"), body)
    return _policy(GLOBAL)


@router.post("/global/halt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def halt_everything(request, body: ReasonIn):
    """The kill switch: nothing starts a step until it is lifted."""
    operations.halt(Target("all"), request.user, body.reason)
    return _policy(GLOBAL)


@router.post("/global/unhalt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def unhalt_everything(request, body: ReasonIn):
    person_only(request, "unhalt")
    operations.unhalt(Target("all"), request.user, body.reason)
    return _policy(GLOBAL)


@router.get("/halts", response={200: list[PolicyOut], **ERRORS_422}, tags=["halts"])
def list_halts(request):
    """Workflow-wide and global halts in force."""
    viewer(request)
    return [PolicyOut.of(p) for p in Policy.objects.filter(halted_at__isnull=False)]


# -- workers -------------------------------------------------------------------------------------


@router.get("/workers", response={200: list[WorkerOut], **ERRORS_422}, tags=["workers"])
def list_workers(request, include_stopped: bool = False):
    """Workers with their last heartbeat and the runs they hold now."""
    viewer(request)
    workers = Worker.objects.all() if include_stopped else Worker.objects.filter(stopped_at=None)
    held: dict = {}
    for run_id, worker_id in Run.objects.filter(worker__in=workers).values_list("id", "worker_id"):
        held.setdefault(worker_id, []).append(run_id)
    return [
        {**{f.name: getattr(w, f.name) for f in Worker._meta.fields}, "runs": held.get(w.pk, [])}
        for w in workers[:500]
    ]


# -- notifications -------------------------------------------------------------------------------


class ChannelIn(In):
    kind: str = Field(..., pattern="^(webhook|email)$")
    target: str = Field(..., max_length=2000, pattern=TEXT)
    events: list[str] = Field(..., min_length=1, max_length=20)
    workflow: str = Field("", max_length=200, pattern=TEXT)
    secret: str = Field("", max_length=200, pattern=TEXT, description="signs webhook bodies")


class ChannelOut(Schema):
    id: int
    kind: str
    target: str
    events: list[str]
    workflow: str | None
    signed: bool
    created_by: str
    created_at: datetime
    paused_at: datetime | None = None
    paused_by: str | None = None
    pause_reason: str | None = None


class PauseIn(In):
    reason: str = Field("", max_length=500, pattern=TEXT, examples=["receiver down for upgrade"])


class DeliveryOut(Schema):
    id: int
    channel_id: int
    event_id: int
    event_type: str
    run_id: UUID
    status: str
    attempts: int
    error: Any
    created_at: datetime
    finished_at: datetime | None


def _may(request, permission: str, action: str) -> None:
    if not request.user.has_perm(permission):
        raise Forbidden(f"{request.user.get_username()} may not {action} (needs {permission})")


@router.get(
    "/notifications/channels", response={200: list[ChannelOut], **ERRORS}, tags=["notifications"]
)
def list_channels(request):
    """The channels in use (removed ones are kept for their deliveries, not listed)."""
    _may(request, "runs.view_notificationchannel", "view notification channels")
    channels = NotificationChannel.objects.filter(removed_at__isnull=True)
    return [notifications.describe(c, request.user) for c in channels]


@router.post(
    "/notifications/channels", response={201: ChannelOut, **ERRORS_422}, tags=["notifications"]
)
def add_channel(request, body: ChannelIn):
    """A webhook (Slack-compatible JSON, signed with `secret` if given) or email addresses,
    told of `events` (of runs of `workflow`, if given) from now on."""
    channel = notifications.add_channel(
        request.user, body.kind, body.target, body.events, workflow=body.workflow,
        secret=body.secret,
    )  # fmt: skip
    return Status(201, notifications.describe(channel, request.user))


@router.delete(
    "/notifications/channels/{channel_id}",
    response={200: ChannelOut, **ERRORS_422},
    tags=["notifications"],
)
def remove_channel(request, channel_id: int = Path(..., ge=1, le=2**62)):
    """Stop a channel: no new deliveries; its past ones stay listed."""
    channel = notifications.remove_channel(request.user, channel_id)
    return notifications.describe(channel, request.user)


@router.post(
    "/notifications/channels/{channel_id}/pause",
    response={200: ChannelOut, **ERRORS_422},
    tags=["notifications"],
)
def pause_channel(request, body: PauseIn, channel_id: int = Path(..., ge=1, le=2**62)):
    """Send nothing on a channel until it is resumed: its events meanwhile are not delivered,
    later either, and its deliveries under way stop retrying. Audited."""
    channel = notifications.pause_channel(request.user, channel_id, body.reason)
    return notifications.describe(channel, request.user)


@router.post(
    "/notifications/channels/{channel_id}/resume",
    response={200: ChannelOut, **ERRORS_422},
    tags=["notifications"],
)
def resume_channel(request, channel_id: int = Path(..., ge=1, le=2**62)):
    """Send on a paused channel again, from now on. Audited."""
    channel = notifications.resume_channel(request.user, channel_id)
    return notifications.describe(channel, request.user)


@router.post(
    "/notifications/channels/{channel_id}/test",
    response={201: DeliveryOut, **ERRORS_422},
    tags=["notifications"],
)
def test_channel(request, channel_id: int = Path(..., ge=1, le=2**62)):
    """Send a test message on a channel as every notification is sent (signed, keyed,
    retried): the delivery returned shows how it went (`GET /notifications/deliveries`)."""
    delivery = notifications.send_test(request.user, channel_id)
    delivery.step = None
    return Status(201, notifications.delivery_row(delivery))


@router.get(
    "/notifications/deliveries",
    response={200: list[DeliveryOut], **ERRORS_422},
    tags=["notifications"],
)
def list_deliveries(
    request, channel: int | None = Query(None, ge=1, le=2**62), failed: bool = False
):
    """Recent deliveries, newest first: each is a run of `stepguard.notify` (its attempts and
    last error are its step's)."""
    _may(request, "runs.view_notificationdelivery", "view notification deliveries")
    return [notifications.delivery_row(d) for d in notifications.deliveries(channel, failed=failed)]


# -- flow control ----------------------------------------------------------------------------------


class LimitsIn(ReasonIn):
    max_running: int | None = Field(None, ge=1, le=100_000, description="null: the code's")
    max_running_per_key: int | None = Field(None, ge=1, le=100_000)


class KeyLoad(Schema):
    key: str
    running: int
    queued: int


class FlowLimits(Schema):
    max_running: int | None
    max_running_per_key: int | None


class WorkflowFlowOut(Schema):
    workflow: str
    running: int
    queued: int = Field(description="pending runs, due or not")
    waiting: int = Field(description="on a timer, a signal, an approval, children or a budget")
    code_limits: FlowLimits
    operator_limits: FlowLimits = Field(description="over the code's where not null")
    keys: list[KeyLoad] = Field(description="the busiest concurrency keys, at most 20")


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


@router.get("/flow", response={200: list[WorkflowFlowOut], **ERRORS}, tags=["flow"])
def flow_overview(request):
    """Queue depth and running runs per workflow and per concurrency key, with the limits."""
    viewer(request)
    return flow.overview()


@router.put("/flow/workflows/{name}", response={200: FlowLimits, **ERRORS_422}, tags=["flow"])
def set_workflow_limits(request, name: str, body: LimitsIn):
    """An operator's concurrency limits over the code's (null: back to the code's)."""
    given = body.model_fields_set - {"reason"}
    limits = {k: getattr(body, k) for k in ("max_running", "max_running_per_key") if k in given}
    policy = operations.set_limits(workflow_name(name), request.user, body.reason, **limits)
    return {"max_running": policy.max_running, "max_running_per_key": policy.max_running_per_key}


@router.get("/flow/schedules", response={200: list[ScheduleOut], **ERRORS}, tags=["flow"])
def list_schedules(request):
    """Every schedule, by name. Inputs come whole while the list's stay under about
    STEPGUARD_API_MAX_RESPONSE bytes; past that an input is `{"cut": true, "bytes": N,
    "whole": "<the schedule's URL>"}`."""
    _may(request, "runs.view_schedule", "view schedules")
    schedules = list(bounded.sized(Schedule.objects.order_by("name"), ("input",)))
    bounded.fill(schedules, ("input",), settings.STEPGUARD_API_MAX_RESPONSE, whole_schedule)
    return schedules


def whole_schedule(schedule: Schedule, field: str) -> str:
    return reverse("stepguard:api:get_schedule", kwargs={"name": schedule.name})


@router.get("/flow/schedules/{name}", response={200: ScheduleOut, **ERRORS_422}, tags=["flow"])
def get_schedule(request, name: str = Path(..., max_length=200, pattern=TEXT)):
    """One schedule, its input whole."""
    _may(request, "runs.view_schedule", "view schedules")
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


class RateLimitIn(ReasonIn):
    requests: int | None = Field(None, ge=1, le=10**9, description="calls per window")
    tokens: int | None = Field(None, ge=1, le=10**15, description="tokens per window")
    window_seconds: int = Field(60, ge=1, le=86400)


class RateLimitOut(Schema):
    resource: str
    requests: int | None
    tokens: int | None
    window_seconds: int
    used_requests: int = Field(description="granted inside the current window")
    used_tokens: int


def _rate_out(limit: RateLimit) -> dict:
    used = rates.usage(limit.resource, timezone.now())
    return {
        "resource": limit.resource, "requests": limit.requests, "tokens": limit.tokens,
        "window_seconds": limit.window_seconds, "used_requests": used["requests"],
        "used_tokens": used["tokens"],
    }  # fmt: skip


@router.get("/flow/rate-limits", response={200: list[RateLimitOut], **ERRORS}, tags=["flow"])
def list_rate_limits(request):
    """Every rate limit, with what its window holds now."""
    _may(request, "runs.view_ratelimit", "view rate limits")
    return [_rate_out(limit) for limit in RateLimit.objects.order_by("resource")]


@router.put(
    "/flow/rate-limits/{path:resource}", response={200: RateLimitOut, **ERRORS_422}, tags=["flow"]
)
def set_rate_limit(request, resource: str, body: RateLimitIn):
    """Set a resource's limit (a model's name: `ctx.llm` declares it by itself)."""
    if body.requests is None and body.tokens is None:
        raise OperationError("give requests, tokens or both (DELETE removes a limit)")
    limit = operations.set_rate_limit(
        resource, request.user, body.reason, requests=body.requests, tokens=body.tokens,
        window_seconds=body.window_seconds,
    )  # fmt: skip
    assert limit is not None
    return _rate_out(limit)


@router.delete(
    "/flow/rate-limits/{path:resource}", response={204: None, **ERRORS_422}, tags=["flow"]
)
def remove_rate_limit(request, resource: str, body: ReasonIn):
    operations.set_rate_limit(resource, request.user, body.reason)
    return Status(204, None)
