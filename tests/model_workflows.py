"""Workflows of the model-based test (tests/test_model.py) and the probe their steps report to.

Every step function reports to `probe`, in-process: that it is starting (the test checks, at
that very moment, that no hold, cancel, revoked approval or spent budget should have stopped
it), the side effect it makes under its idempotency key (as a downstream service would record
it), and the value it returns live, which the test compares with what replay hands back to the
workflow code. A step may also crash, after its side effect happened, as if the process died
mid-call. Each call's ending is kept per idempotency key (returned, raised, interrupted, cut
off, crashed), so a call made again can be told from a silent second call.

The second machine's workflows (ConcurrentModel) add work between steps, an async gather with
a sibling that fails while another is in flight, and a workflow with a concurrency key.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal
from typing import Any

from runs.engine.context import engine_of
from runs.sdk import (
    NOT_FOUND,
    ApprovalExpired,
    ApprovalRejected,
    ChildFailed,
    Metered,
    RetryPolicy,
    RunContext,
    StepFailed,
    Usage,
    WaitTimeout,
    workflow,
)
from tests.testapp.models import Effect

NO_RETRY = RetryPolicy(max_attempts=1)
ONE_RETRY = RetryPolicy(max_attempts=2, initial_interval=timedelta(0), jitter=0.0)
#: What every costed step spends (and, with an estimate, declares up front).
COST = Usage(tokens_in=10, tokens_out=5, usd=Decimal("1"))
#: Step keys whose steps have a compensation.
COMPENSABLE = frozenset({"reserve", "charge", "pay", "prep", "work", "fetch"})
#: Step keys of transactional steps (their write is a tests.testapp Effect row).
TRANSACTIONAL = frozenset({"ledger"})


class Crash(KeyboardInterrupt):
    """The process dying: the one exception the engine never records (as KeyboardInterrupt)."""


def canon(value: Any) -> Any:
    """A comparable form of a JSON value that keeps types and key order (1 != 1.0 here)."""
    if value is None or isinstance(value, bool | str):
        return (type(value).__name__, value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", value + 0.0)  # -0.0 and 0.0 are one number
    if isinstance(value, list | tuple):
        return ("list", tuple(canon(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, canon(v)) for k, v in value.items()))
    return ("other", repr(value))


class Probe:
    """What the step functions saw and did, for the test to check against the database."""

    def __init__(self) -> None:
        #: Called as observer(run_id, workflow, step_key, info) when a step function starts.
        self.observer: Callable[..., None] | None = None
        #: Called as on_call(run_id, step_key, idempotency_key, ends so far) when a step
        #: function is called (sync or async), before anything else.
        self.on_call: Callable[..., None] | None = None
        #: Called as on_between(run_id, step_key) when workflow code works between steps,
        #: after step `step_key` returned to it.
        self.on_between: Callable[..., None] | None = None
        self.reset()

    def reset(self) -> None:
        #: idempotency key -> the logical calls made under it (a service's request log).
        self.effects: dict[str, set] = {}
        #: idempotency key -> the value the service produced (what a reconcile finds).
        self.results: dict[str, Any] = {}
        #: idempotency key -> canon(value) the step function returned live.
        self.live: dict[str, Any] = {}
        #: (run id, step key, canon(value)) as the workflow code received it, live or replayed.
        self.received: list[tuple[str, str, Any]] = []
        #: payload id -> the Python value steps return (never round-tripped through the DB).
        self.payloads: dict[str, Any] = {}
        self.calls: dict[str, int] = {}
        #: Crash in the n-th step function called from now on (None: never).
        self.crash_countdown: int | None = None
        self.outage = False
        #: Compensations that undid a step their own run never performed: (run id, key).
        self.foreign_undos: list[tuple[str, str]] = []
        #: idempotency key -> how each call of the step function ended, in order: "returned",
        #: "raised" (a failure of its own), "interrupted" (it raised CancelledError itself),
        #: "cut off" (cancelled from outside while in flight), "crashed"; "in flight" meanwhile.
        self.ends: dict[str, list[str]] = {}

    def call_starts(self, ctx: RunContext, key: str) -> None:
        idem = ctx.idempotency_key
        if self.on_call is not None:
            self.on_call(ctx.run_id, key, idem, list(self.ends.get(idem, ())))
        self.ends.setdefault(idem, []).append("in flight")

    def call_ends(self, idem: str, how: str) -> None:
        ends = self.ends.setdefault(idem, [])
        if ends and ends[-1] == "in flight":
            ends[-1] = how
        else:  # never told it started: keep it visible
            ends.append(f"{how} (unstarted)")

    def started(self, ctx: RunContext, key: str, **info: Any) -> None:
        if self.observer is not None:
            self.observer(ctx.run_id, ctx.workflow, key, info)

    def crash_now(self) -> bool:
        if self.crash_countdown is None:
            return False
        self.crash_countdown -= 1
        if self.crash_countdown > 0:
            return False
        self.crash_countdown = None
        return True


probe = Probe()


def _payload(ctx: RunContext) -> Any:
    data = ctx.input if isinstance(ctx.input, dict) else {}
    return probe.payloads.get(data.get("payload"))


def _call(ctx: RunContext, key: str, args: Any, usage: Usage | None, fail: str | None, info):
    """The body of every step: a call to a downstream service keyed by the idempotency key."""
    idem = ctx.idempotency_key
    probe.call_starts(ctx, key)
    # A step in doubt that a cancel re-sends (with its key) to learn what to undo.
    probe.started(ctx, key, **info, resolving=engine_of(ctx).execution.undo.running)
    calls = probe.calls[idem] = probe.calls.get(idem, 0) + 1
    if fail == "always" or (fail == "outage" and probe.outage) or (fail == "first" and calls == 1):
        probe.call_ends(idem, "raised")
        raise ValueError(f"{key}: the service refused the call")
    value = {"step": key, "data": _payload(ctx)}
    probe.effects.setdefault(idem, set()).add((ctx.workflow, key, args))
    probe.results[idem] = value
    if probe.crash_now():
        probe.call_ends(idem, "crashed")
        raise Crash(key)
    probe.live[idem] = canon(value)
    probe.call_ends(idem, "returned")
    return Metered(value, usage) if usage is not None else value


def _undo(ctx: RunContext, key: str) -> Callable[[Any], Any]:
    def compensate(output):
        idem = ctx.idempotency_key
        probe.started(ctx, f"undo:{key}", compensation=True, estimated=False, approval=None)
        if f"{ctx.run_id}:{key}" not in probe.effects:
            probe.foreign_undos.append((ctx.run_id, key))
        probe.effects.setdefault(idem, set()).add(("undo", key, canon(output)))
        if probe.crash_now():
            raise Crash(f"undo:{key}")
        return {"undone": key}

    return compensate


def _lookup(idempotency_key: str) -> Any:
    return probe.results.get(idempotency_key, NOT_FOUND)


def _transaction(ctx: RunContext, key: str) -> Any:
    """A write to Stepguard's own database that commits with its checkpoint or not at all."""

    def write():
        idem = ctx.idempotency_key
        probe.started(ctx, key, transaction=True, estimated=False, approval=None)
        Effect.objects.create(idempotency_key=idem, label=key, pid=0)
        value = {"step": key, "data": _payload(ctx)}
        if probe.crash_now():
            raise Crash(key)  # inside the transaction: the write goes with the checkpoint
        probe.live[idem] = canon(value)
        return value

    value = ctx.transaction(key, write)
    probe.received.append((ctx.run_id, key, canon(value)))
    return value


def _step(
    ctx: RunContext,
    key: str,
    *,
    args: Any = None,
    usage: Usage | None = None,
    estimate: Usage | None = None,
    fail: str | None = None,
    compensate: bool = False,
    approval=None,
    reconcile: bool = False,
    retry: RetryPolicy = NO_RETRY,
) -> Any:
    info = {
        "compensation": False,
        "estimated": estimate is not None,
        "approval": approval.approval_id if approval is not None else None,
    }
    value = ctx.step(
        key,
        lambda: _call(ctx, key, args, usage, fail, info),
        retry=retry,
        estimate=estimate,
        approval=approval,
        compensate=_undo(ctx, key) if compensate else None,
        reconcile=_lookup if reconcile else None,
    )
    probe.received.append((ctx.run_id, key, canon(value)))
    return value


@workflow("model-saga")
def saga(ctx: RunContext, input: dict):
    """Compensated steps around a failure the code catches, a signal, then a step that fails
    while the outage is on."""
    reserved = _step(ctx, "reserve", compensate=True)
    with contextlib.suppress(StepFailed):  # replayed as the same failure, caught again
        _step(ctx, "probe", fail="always")
    charged = _step(
        ctx, "charge", args=canon(reserved), compensate=True, fail="first", retry=ONE_RETRY
    )
    ctx.wait_for_event("confirm", "confirm")
    return _step(ctx, "ship", args=canon(charged), fail="outage")


@workflow("model-metered")
def metered(ctx: RunContext, input: dict):
    """Costed steps with and without an estimate, one that reconciles, a transactional one,
    and a sleep."""
    first = _step(ctx, "llm-0", usage=COST, estimate=COST)
    _step(ctx, "llm-1", args=canon(first), usage=COST)
    _step(ctx, "book", usage=COST, estimate=COST, reconcile=True)
    _transaction(ctx, "ledger")
    ctx.sleep("nap", 60)
    return _step(ctx, "llm-2", usage=COST)


@workflow("model-approval")
def approval(ctx: RunContext, input: dict):
    """A person approves, then the guarded (costed, compensated) step; a receipt may come."""
    try:
        decision = ctx.approval("ok", action="pay the invoice", timeout=90)
    except (ApprovalRejected, ApprovalExpired):
        return "refused"
    paid = _step(ctx, "pay", usage=COST, estimate=COST, approval=decision, compensate=True)
    try:
        receipt = ctx.wait_for_event("receipt", "receipt", timeout=60)
    except WaitTimeout:
        receipt = None
    return _step(ctx, "file", args=(canon(paid), canon(receipt)))


@workflow("model-parent")
def parent(ctx: RunContext, input: dict):
    """Two child runs of another workflow, between compensated and plain steps."""
    _step(ctx, "prep", compensate=True)
    child_input = {"payload": input.get("payload") if isinstance(input, dict) else None}
    try:
        results = ctx.children(
            [("c0", "model-child", child_input), ("c1", "model-child", child_input)]
        )
    except ChildFailed:
        results = None
    return _step(ctx, "after", args=canon(results))


@workflow("model-child")
def child(ctx: RunContext, input: dict):
    work = _step(ctx, "work", usage=COST, estimate=COST, compensate=True)
    ctx.sleep("nap", 30)
    return _step(ctx, "done", args=canon(work), fail="outage")


# -- the second machine's workflows (ConcurrentModel) ------------------------------------------


def _between(ctx: RunContext, after: str) -> int:
    """Workflow code working outside steps after step `after` returned (parsing, a local
    computation): no write of the run's comes, yet the step's completion must be recorded
    within STEPGUARD_COMPLETION_WINDOW. The test (`on_between`) may act there, wait for that,
    or crash the process."""
    total = sum(i * i for i in range(300))
    if probe.on_between is not None:
        probe.on_between(ctx.run_id, after)
    return total


@workflow("model-between")
def between(ctx: RunContext, input: dict):
    """Three steps with work outside steps between them; the first has a compensation."""
    fetched = _step(ctx, "fetch", compensate=True)
    _between(ctx, "fetch")
    parsed = _step(ctx, "parse", args=canon(fetched))
    _between(ctx, "parse")
    return _step(ctx, "store", args=canon(parsed), fail="outage")


async def _acall(ctx, key: str, *, fail: bool | str = False, wait=None, interrupt=False):
    """An async step's body: like `_call`, awaited on the engine's event loop. With `wait`
    (an asyncio.Event), it stays in flight until that is set (or 10 s, told as a call that
    was never let go) and a few turns of the event loop more; with `interrupt`, its first call
    raises CancelledError itself before its side effect, as an async client cut off
    mid-request does. `fail`: True, or "outage" (while the test's outage is on). It reports
    no start to `probe.observer`, which reads the database: not from the event loop."""
    idem = ctx.idempotency_key
    probe.call_starts(ctx, key)
    probe.calls[idem] = probe.calls.get(idem, 0) + 1
    try:
        if wait is not None:
            try:
                await asyncio.wait_for(wait.wait(), timeout=10)
            except TimeoutError:
                probe.call_ends(idem, "stuck")
                raise
            for _ in range(3):  # still in flight while the workflow function ends
                await asyncio.sleep(0)
        if interrupt and probe.calls[idem] == 1:
            probe.call_ends(idem, "interrupted")
            raise asyncio.CancelledError(f"{key}: interrupted in flight")
        if fail is True or (fail == "outage" and probe.outage):
            probe.call_ends(idem, "raised")
            raise ValueError(f"{key}: the service refused the call")
    except asyncio.CancelledError:
        if probe.ends[idem][-1] == "in flight":
            probe.call_ends(idem, "cut off")  # cancelled from outside, not by itself
        raise
    value = {"step": key, "data": _payload(ctx)}
    probe.effects.setdefault(idem, set()).add((ctx.workflow, key, None))
    probe.results[idem] = value
    probe.live[idem] = canon(value)
    probe.call_ends(idem, "returned")
    return value


@workflow("model-gather")
async def gather(ctx, input: dict):
    """gather(`fails`, `slow`): `slow` stays in flight until the workflow has left the
    gather (or `fails` returned). `fails` fails when asked (the workflow catches it, or not);
    `slow` may be interrupted in flight (its first call). Then one more step."""
    data = input if isinstance(input, dict) else {}
    left = asyncio.Event()

    async def first():
        value = await ctx.step(
            "fails", lambda: _acall(ctx, "fails", fail=data.get("fail", False)), retry=NO_RETRY
        )
        left.set()  # it returned: the gather waits for `slow`, which must not wait for it
        return value

    async def second():
        return await ctx.step(
            "slow",
            lambda: _acall(ctx, "slow", wait=left, interrupt=data.get("interrupt", False)),
            retry=NO_RETRY,
        )

    try:
        results = await asyncio.gather(first(), second())
    except StepFailed:
        if not data.get("catch"):
            raise
        results = None
    finally:
        left.set()
    for key, value in zip(("fails", "slow"), results or (), strict=False):
        probe.received.append((ctx.run_id, key, canon(value)))
    after = await ctx.step("after", lambda: _acall(ctx, "after", fail="outage"), retry=NO_RETRY)
    probe.received.append((ctx.run_id, "after", canon(after)))
    return after


@workflow("model-tenant", concurrency_key=lambda input: input["tenant"])
def tenant(ctx: RunContext, input: dict):
    """Runs keyed by tenant (the test sets the per-key limit as an operator: a limit in the
    code would make every worker of the suite claim through the limited path): a costed,
    compensated step, a durable wait, then one more step."""
    work = _step(ctx, "work", usage=COST, estimate=COST, compensate=True)
    ctx.sleep("nap", 30)
    return _step(ctx, "done", args=canon(work))
