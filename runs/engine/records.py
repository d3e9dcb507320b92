"""Values the engine and workflow code share: NOT_FOUND, a granted Decision, error records, an
execution's Identity."""

from __future__ import annotations

import contextvars
import inspect
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from runs.engine.aio.threads import StepThread
from runs.errors import StepguardError, StepMisuse


@dataclass(frozen=True, slots=True)
class Identity:
    """Who an execution is and how it was claimed: read from the run row once, at the claim,
    and handed to the execution and its checkpoints, so neither derives it again."""

    run_id: str
    workflow: str
    version: str
    attempt: int
    #: Who the run is for (runs/labels.py): its spend counts against their budgets too.
    labels: Mapping[str, str]
    #: Recorded with each step attempt, so an attempt's error names where it happened.
    worker_id: str
    #: The run this one was forked from: a fork replays its origin's approvals.
    forked_from: Any
    #: Recovering from a lost worker: each step's completion is written at once.
    recovering: bool
    #: The tick a schedule started the run for (its key says), else None.
    scheduled_at: datetime | None = None

    @classmethod
    def of(cls, run: Any) -> Identity:
        return cls(
            run_id=str(run.id),
            workflow=run.workflow,
            version=run.version,
            attempt=run.attempt,
            labels=dict(run.labels or {}),
            worker_id=str(run.worker_id or ""),
            forked_from=run.forked_from_id,
            recovering=run.recoveries > 0,
            scheduled_at=scheduled_tick(run.key),
        )


def scheduled_tick(key: str | None) -> datetime | None:
    """The tick in a schedule's run key, `schedule:<name>:<tick in UTC>` (runs/schedules.py
    run_key): part of the run's identity, so the same on every replay."""
    if not isinstance(key, str) or not key.startswith("schedule:"):
        return None
    try:
        return datetime.fromisoformat(key.split(":", 2)[2])
    except (IndexError, ValueError):
        return None


class _NotFound:
    def __repr__(self) -> str:
        return "NOT_FOUND"


#: Returned by a `reconcile` function that found no trace of the step's side effect.
NOT_FOUND: Any = _NotFound()


@dataclass(frozen=True)
class Decision:
    """A granted approval, as `ctx.approval(...)` returns it (and replays it)."""

    approval_id: int
    decided_by: str
    decided_at: datetime
    comment: str
    #: The digest of what the approver saw (runs.approvals.models.approved_digest): the step
    #: it guards starts only if the approval it names approved that ("": recorded before).
    sha256: str = ""

    def as_json(self) -> dict:
        return {
            "approval_id": self.approval_id,
            "decided_by": self.decided_by,
            "decided_at": self.decided_at.isoformat(),
            "comment": self.comment,
            "sha256": self.sha256,
        }

    @classmethod
    def from_json(cls, data: dict) -> Decision:
        return cls(
            data["approval_id"],
            data["decided_by"],
            datetime.fromisoformat(data["decided_at"]),
            data["comment"],
            data.get("sha256", ""),
        )


#: The error type of a step its run ended without coming back to: it may have happened.
INTERRUPTED = "Interrupted"


def storable(text: str) -> str:
    """`text` as a database can hold it: NUL and lone surrogates (which PostgreSQL's text and
    JSON refuse, and UTF-8 cannot encode) written as their escapes, so an error message that
    holds them is still recorded on its run instead of failing the write that records it."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def message_of(exc: BaseException) -> str:
    """`str(exc)`, storable, and something readable even when the exception's own __str__
    fails."""
    try:
        text = str(exc)
    except Exception:
        text = f"<unprintable {type(exc).__name__}>"
    return storable(text)


def error_record(exc: BaseException) -> dict:
    if isinstance(exc, StepguardError):
        record = {k: storable(v) if isinstance(v, str) else v for k, v in exc.as_record().items()}
    else:
        record = {"code": "exception", "type": type(exc).__name__, "message": message_of(exc)}
    try:
        trace = "".join(traceback.format_exception(exc, limit=15))
    except Exception:
        trace = f"{type(exc).__name__}: {record['message']}"
    record["traceback"] = storable(trace[-4000:])
    return record


def signature_names(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def accepts(fn: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values())


def brief(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": message_of(exc)[:500]}


def as_timedelta(value: float | timedelta, what: str) -> timedelta:
    delta = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if delta < timedelta(0):
        raise StepMisuse(f"{what} cannot be negative")
    return delta


class Running(NamedTuple):
    key: str
    idempotency_key: str
    seq: int
    owner: int  # id() of the Execution: another run executed inside a step is not nested
    #: Reserve an Amount against the run's budget for a model call made inside the step (None:
    #: the step has no row, a transaction); called on the step's thread (`thread`).
    reserve: Callable[[Any], None] | None = None
    thread: StepThread | None = None
    #: Report what the model calls made inside the step were paid so far in this attempt (a
    #: Usage): booked on the step if the attempt fails after all.
    answered: Callable[[Any], None] | None = None
    #: The attempt's deadline (time.monotonic()) and its timeout in seconds, if it has one:
    #: every async call the step waits for is cancelled then (runs/engine/step_deadline.py).
    deadline: float | None = None
    timeout: float | None = None


#: The step whose function runs in this thread, or whose coroutine runs in this asyncio task:
#: concurrent steps of an async workflow each see their own.
CURRENT_STEP: contextvars.ContextVar[Running | None] = contextvars.ContextVar(
    "stepguard_current_step", default=None
)
