"""Where a call stands in its run and how a step ended, as values: what Checkpoints turns
into a step row's columns and its event, so that no caller builds either."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runs.engine.records import brief, error_record
from runs.engine.retry import RetryPolicy, retryable
from runs.models import StepStatus


@dataclass(frozen=True, slots=True)
class Position:
    """A call's place in its run: its seq in the call sequence and its key (with its repeat
    suffix). What the run does there is done at most once: its idempotency key says so to
    the services a step calls, and names the child run a wait starts there."""

    run_id: Any
    seq: int
    key: str

    @property
    def idempotency_key(self) -> str:
        """`<run id>:<step key>`, stable across every retry and resume of the step."""
        return f"{self.run_id}:{self.key}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Completed:
    """A started step's end with its `output`: from its function, its reconcile or a person
    (`recovered` says which, and `approval_id` whose answer it was)."""

    output: Any
    attempt: int | None = None
    kind: str | None = None  # what the call turned out to be (a metered call: `llm`)
    recovered: str | None = None
    approval_id: int | None = None

    def columns(self) -> dict[str, Any]:
        columns: dict[str, Any] = {"status": StepStatus.COMPLETED, "output": self.output}
        if self.kind is not None:
            columns["kind"] = self.kind
        if self.recovered is not None:
            columns["recovered"] = self.recovered
        return columns

    def payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {}
        if self.attempt is not None:
            payload["attempt"] = self.attempt
        if self.recovered is not None:
            payload["recovered"] = self.recovered
        if self.approval_id is not None:
            payload["approval_id"] = self.approval_id
        return payload


@dataclass(frozen=True, slots=True)
class Failed:
    """A step's final failure with `error`, after `attempt` attempts. `policy` (the step's
    retry policy, else the default's judgement) says whether it retries this error at all:
    not retryable is an answer (a retry, of the step or of the run, gets the same one),
    retryable an outage the policy gave up on."""

    error: BaseException
    attempt: int
    policy: RetryPolicy | None = None
    #: The error as the step's row keeps it (and StepFailed carries it).
    record: dict[str, Any] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        exc = self.error
        final = not (self.policy.retries(exc) if self.policy is not None else retryable(exc))
        record = {**error_record(exc), "retryable": not final, "attempts": self.attempt}
        object.__setattr__(self, "record", record)

    def payload(self, worker: str) -> dict[str, Any]:
        return {"attempt": self.attempt, "error": brief(self.error), "worker": worker}
