"""Forks: a new run that replays a run's completed steps up to a point (their outputs edited,
if asked) and executes the rest."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from django.db import transaction

from runs import forks
from runs.engine import holds, registry
from runs.engine.store import create_run, run_event
from runs.errors import OperationError
from runs.models import EventType, Run, RunStatus, Shaped, Step, StepKind, StepStatus
from runs.operations.common import (
    KEEP,
    find_run,
    lock_run,
    needs_reason,
    require,
    retried_on_deadlock,
)


def _fork_point(run: Run, step) -> int:
    if isinstance(step, int):
        seq = step
    else:
        seq = run.steps.filter(key=step).values_list("seq", flat=True).first()
        if seq is None:
            raise OperationError(f"run {run.pk} has no step {step!r}")
    if seq < 0 or not run.steps.filter(seq=seq).exists():
        raise OperationError(f"run {run.pk} has no step at position {seq}")
    return seq


def fork_preview(run_id, step, *, input: Any = KEEP, outputs: dict | None = None) -> list[dict]:
    """What a fork from `step` with these edits runs again, so a person sees it before
    confirming: the copied approvals it asks again (`asked_again` says why), then the recorded
    steps from the fork point on (if the code takes the same path)."""
    run = find_run(run_id)
    seq = _fork_point(run, step)
    kept = list(run.steps.filter(seq__lt=seq, status=StepStatus.COMPLETED).order_by("seq"))
    again = forks.asked_again(run, kept, fork_edits(run, seq, kept, input, outputs))
    asks = [
        {"seq": s.seq, "key": s.key, "kind": s.kind, "asked_again": again[s.key]}
        for s in kept
        if s.key in again
    ]
    rest = run.steps.filter(seq__gte=seq).order_by("seq").values("seq", "key", "kind")
    return asks + [{**s, "asked_again": None} for s in rest]


#: An edited value whose old and new JSON together are longer is recorded by digest.
EDIT_INLINE_CHARS = 4096


def _edit(old: Any, new: Any, what: str) -> dict | None:
    """What an edit replaced, for the fork's `run.created` event: both values, or (when they
    are large) their SHA-256 digests and sizes; None when nothing changed."""
    new_text = forks.stored_text(new, what)
    old_text = json.dumps(old, sort_keys=True, ensure_ascii=False, default=str)
    if new_text == old_text:
        return None
    if len(old_text) + len(new_text) <= EDIT_INLINE_CHARS:
        return {"old": old, "new": new}
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()  # noqa: E731
    return {
        "old_sha256": digest(old_text), "old_chars": len(old_text),
        "new_sha256": digest(new_text), "new_chars": len(new_text),
    }  # fmt: skip


def fork_edits(origin: Run, seq: int, kept: list[Step], input: Any, outputs: dict | None):
    """Check a fork's edits against the origin before anything is written: `input` (KEEP: the
    origin's) and `outputs` ({step key: replacement output} for steps before the fork point).
    Returns what the fork's run.created event records (empty: nothing edited)."""
    edited: dict[str, Any] = {}
    if input is not KEEP:
        change = _edit(origin.input, input, "the input")
        if change is not None:
            edited["input"] = change
    if outputs is None:
        return edited
    if not isinstance(outputs, dict):
        raise OperationError("outputs is an object: {step key: replacement output}")
    by_key = {s.key: s for s in kept}
    for key, value in outputs.items():
        if key not in by_key:
            editable = [k for k, s in by_key.items() if s.kind != StepKind.APPROVAL]
            allowed = ", ".join(map(repr, editable)) or "none: the fork point is the first"
            raise OperationError(
                f"outputs names step {key!r}, which is not a step before the fork point at"
                f" position {seq} (steps whose output can be edited: {allowed})"
            )
        change = _edit(by_key[key].output, value, f"the output of step {key!r}")
        if change is not None:
            forks.refuse_decision_edit(by_key[key])
            edited.setdefault("outputs", {})[key] = change
    return edited


def fork_summary(edited: dict) -> list[str]:
    """What a fork edited, as the run page says it: "the input", "the output of step K"."""
    said = ["the input"] if "input" in edited else []
    return said + [f"the output of step {key}" for key in edited.get("outputs", {})]


@retried_on_deadlock
def fork_run(
    run_id, step, user, reason: str, *, input: Any = KEEP, outputs: dict | None = None
) -> Run:
    """A new run of the same workflow, version and input that reuses the recorded outputs of
    the steps before `step` (a key or a position) and runs the rest anew.

    `input` replaces the run's input and `outputs` ({step key: output}) the recorded outputs
    of steps before the fork point: the fork replays them as if the steps had returned them
    (edit what a model said, and go on from there). The edits are checked before anything is
    written and recorded, old and new, in the fork's `run.created` event. A copied approval
    that does not stand for the fork (runs/forks.py) is not copied: the fork asks again.
    The engine's own runs (`stepguard.*`) are not forked, as they are not started, by hand."""
    user = require(user, "runs.fork_run", "fork runs")
    reason = needs_reason(reason, "a fork")
    actor = user.get_username()
    with transaction.atomic():
        # The holds the fork inherits or is covered by are read under lock, in the lock order.
        chain = holds.lineage(find_run(run_id))
        holds.lock_policies(chain)
        origin = lock_run(run_id)
        if registry.builtin(origin.workflow):  # it could send any event to any channel
            raise OperationError(
                f"workflow {origin.workflow!r} is Stepguard's own: its runs are not forked by hand"
            )
        holds.lock_ancestors(chain)
        seq = _fork_point(origin, step)
        kept = _completed_before(origin, seq)
        edited = fork_edits(origin, seq, kept, input, outputs)
        again = forks.asked_again(origin, kept, edited)
        fork = create_run(
            workflow=origin.workflow,
            version=origin.version,
            input=input if "input" in edited else origin.input,
            key=None,
            created={"edited": edited} if edited else None,
            forked_from=origin,
            forked_at_seq=seq,
            **_origin_options(origin),
            **_held_as(_inherited_hold(origin)),
            # The forker chose what the fork does again; the origin's shapers are found
            # through `forked_from` (runs.approvals.services.four_eyes).
            shapers=[(user.pk, Shaped.FORKED)],
        )
        replaced = outputs or {}
        # A replaced output is the step's recorded output on every replay of the fork; the
        # copy is inherited, so it registers no compensation (the fork did not perform it).
        Step.objects.bulk_create(
            [_copy_step(s, fork, replaced.get(s.key, s.output)) for s in kept if s.key not in again]
        )
        at = kept[-1].key if kept else None
        run_event(
            fork.pk,
            EventType.RUN_FORKED_FROM,
            actor=actor,
            origin=str(origin.pk),
            at_seq=seq,
            reason=reason,
            **({"edited": fork_summary(edited)} if edited else {}),
            **({"asks_again": again} if again else {}),
        )
        run_event(
            origin.pk,
            EventType.RUN_FORKED,
            actor=actor,
            fork=str(fork.pk),
            seq=seq,
            after_step=at,
            reason=reason,
        )
    return fork


def _completed_before(origin: Run, seq: int) -> list[Step]:
    """The origin's steps before the fork point, which the fork keeps: all of them completed,
    else OperationError naming the others."""
    kept = list(origin.steps.filter(seq__lt=seq).order_by("seq"))
    unfinished = [s.key for s in kept if s.status != StepStatus.COMPLETED]
    if unfinished:
        raise OperationError(f"steps before the fork point are not completed: {unfinished}")
    return kept


def _origin_options(origin: Run) -> dict[str, Any]:
    """Every option a user set on the origin, with the budgets it had: the fork's too."""
    return {
        "max_attempts": origin.max_attempts,
        "budget_micros": origin.budget_micros,
        "budget_tokens": origin.budget_tokens,
        "priority": origin.priority,
        "concurrency_key": origin.concurrency_key,
        "labels": origin.labels,
    }


def _inherited_hold(origin: Run) -> holds.Hold | None:
    """The hold a fork of `origin` takes as its own, if any.

    Forking is no way around a halt: a hold on the origin or its ancestors holds the fork too
    (workflow and global holds cover it anyway). A fork has no parent, so a hold that covers
    the origin through its ancestors (their own, or their workflow's) would not cover the
    fork: it becomes the fork's own hold. Its own workflow's hold and the kill switch cover it
    anyway (create_run parks it)."""
    inherited = ("run", "ancestor")
    return next(
        (
            h
            for h in holds.holds_on(origin)
            if h.kind in inherited
            or (h.kind == "workflow" and h.scope != f"workflow {origin.workflow}")
        ),
        None,
    )


def _held_as(own: holds.Hold | None) -> dict[str, Any]:
    """A new run's fields for the hold `own` of its own (halted from the start), or none."""
    return {
        "halted_at": own.at if own else None,
        "halted_by": own.by if own else "",
        "halt_reason": own.reason if own else "",
        "status": RunStatus.HALTED if own else RunStatus.PENDING,
    }


def _copy_step(step: Step, fork: Run, output: Any) -> Step:
    return Step(
        run=fork,
        seq=step.seq,
        key=step.key,
        kind=step.kind,
        status=StepStatus.COMPLETED,
        input=step.input,
        output=output,
        idempotency_key=f"{fork.pk}:{step.key}",
        attempt=step.attempt,
        inherited=True,
        started_at=step.started_at,
        finished_at=step.finished_at,
    )
