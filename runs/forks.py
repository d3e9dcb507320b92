"""What a fork's edits may be, and which of the approvals it copies stand for it.

An approval stands for one action: the workflow, the step and what the approver saw (its
digest, runs.approvals.models.approved_digest). A fork copies the decisions recorded before its
fork point; one of them stands for the fork only if nothing it was computed from was edited
(the input, or the output of a step before it) and it is still approved. Otherwise the fork
asks again (the engine, runs/engine/waits.py, also checks what the code asks now). A recorded
decision is never edited: who decided and which approval are what was decided.
docs/governance.md, "Forks and approvals".
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings

from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.errors import OperationError
from runs.models import Run, Step, StepKind


def _holds_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_nul(v) for v in value)
    return False


def stored_text(value: Any, what: str) -> str:
    """`value`'s canonical JSON text, if a checkpoint can hold it as a step's output can:
    else OperationError naming why (NUL and lone surrogates, which PostgreSQL refuses, and
    more than STEPGUARD_MAX_OUTPUT_BYTES, the cap every step's output is held to)."""
    try:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise OperationError(f"{what} is not a JSON value: {exc}") from None
    if "\\u0000" in text and _holds_nul(value):
        raise OperationError(
            f"{what} holds a NUL character (\\u0000), which the database cannot store"
        )
    try:
        compact = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError as exc:
        raise OperationError(f"{what} is not valid Unicode (a lone surrogate): {exc}") from None
    limit = settings.STEPGUARD_MAX_OUTPUT_BYTES
    if len(compact) > limit:
        raise OperationError(
            f"{what} is {len(compact)} bytes of JSON, over the {limit}-byte limit a step's"
            " output has (STEPGUARD_MAX_OUTPUT_BYTES)"
        )
    return text


def refuse_decision_edit(step: Step) -> None:
    """A recorded decision is not an output to edit: refused, saying why."""
    if step.kind == StepKind.APPROVAL:
        raise OperationError(
            f"step {step.key!r} is an approval: its recorded decision cannot be edited (who"
            " decided and which approval are what was decided). A fork whose edits change"
            " what it approved asks again"
        )


def lineage(run: Run) -> list:
    """`run` and the runs it was forked from, nearest first: a fork replays their approvals."""
    chain, origin = [run.pk], run.forked_from_id
    while origin is not None:
        chain.append(origin)
        origin = Run.objects.filter(pk=origin).values_list("forked_from_id", flat=True)[0]
    return chain


def asked_again(origin: Run, kept: list[Step], edited: dict) -> dict[str, str]:
    """The approvals among the steps a fork of `origin` copies (`kept`) that do not stand for
    it, given what it edits (fork_edits' record): {step key: why the fork asks again}."""
    approvals = [s for s in kept if s.kind == StepKind.APPROVAL]
    if not approvals:
        return {}
    seq_of = {s.key: s.seq for s in kept}
    edits = sorted((seq_of[key], key) for key in edited.get("outputs", {}))
    named = {s.key: _approval_id(s) for s in approvals}
    requests = ApprovalRequest.objects.filter(
        pk__in=[i for i in named.values() if i is not None], run_id__in=lineage(origin)
    ).in_bulk()
    why = {}
    for step in approvals:
        before = [(seq, key) for seq, key in edits if seq < step.seq]
        request = requests.get(named[step.key])
        if "input" in edited:
            why[step.key] = "the input is edited"
        elif before:
            why[step.key] = "the output of step {1!r} (#{0}) is edited".format(*before[0])
        elif request is None or request.step_key != step.key:
            why[step.key] = "its recorded decision names no approval of this step in its lineage"
        elif request.status != ApprovalStatus.APPROVED:
            why[step.key] = f"approval #{request.pk} was {request.status}"
    return why


def _approval_id(step: Step) -> int | None:
    found = step.output.get("approval_id") if isinstance(step.output, dict) else None
    return found if isinstance(found, int) else None
