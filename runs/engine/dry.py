"""A dry replay: a run's recorded history handed to the code now importable, writing nothing.

It is the executor's own replay (Execution, History, the concerns of context.py), with two
things swapped: the gate (`DryExecution.admit`) stops at the first position the history does
not hold completed, where the live run is now or would act next, instead of running the call;
and the writer (`RefusingCheckpoints`) refuses every write, so no path that would record
something (a patch marker, a wait, a retry) reaches the database. Recorded outputs and failures
are handed back as on any replay: no step function, reconcile or model call runs. What a
release check (runs/replaycheck.py) asks of one run: would this code take it over?
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runs.engine.aio.bridge import run_async
from runs.engine.checkpoints import Checkpoints
from runs.engine.context import Engine, RunContext
from runs.engine.execution import Execution
from runs.engine.fences import Lease
from runs.engine.records import brief, error_record
from runs.errors import ControlFlow, NonDeterminismError
from runs.models import Run, RunStatus, Step

#: What a dry replay reads of a run, besides its steps (Execution and Identity read these).
RUN_FIELDS = (
    "id", "workflow", "version", "status", "input", "error", "attempt", "labels", "worker_id",
    "forked_from_id", "recoveries", "cancel_requested_at", "budget_micros", "budget_tokens",
    "lease_epoch", "created_at", "finished_at",
)  # fmt: skip


#: What a dry replay reads of each step: what the cursor and the gate look at up to the first
#: position not recorded completed (the rest of REPLAY_FIELDS serves writes it never makes;
#: a deferred field read anyway loads by itself).
STEP_FIELDS = ("id", "run", "seq", "key", "status", "output", "error", "run_attempt", "inherited")


class HistoryEnds(ControlFlow):
    """The code reached a position its history does not hold completed: where the run is now,
    or would act next. Up to here code and history agree ("compatible so far")."""


class RefusingCheckpoints(Checkpoints):
    """A Checkpoints that refuses every write: each writing method raises HistoryEnds (the
    code wants to record something new, so the history has ended). Built from Checkpoints'
    own methods, so one added later is refused too; only the reads below go through."""

    READS = frozenset({"check_approval"})


def _refuse_writes() -> None:
    def refused(name: str) -> Callable[..., Any]:
        def refuse(self: RefusingCheckpoints, *args: Any, **kwargs: Any) -> Any:
            raise HistoryEnds(f"a dry replay writes nothing ({name})")

        refuse.__name__ = refuse.__qualname__ = name
        return refuse

    reads = RefusingCheckpoints.READS
    for name, member in list(vars(Checkpoints).items()):
        if inspect.isfunction(member) and not name.startswith("_") and name not in reads:
            setattr(RefusingCheckpoints, name, refused(name))


_refuse_writes()


class DryExecution(Execution):
    """An execution over a loaded history with a lease nobody holds, that never writes."""

    def __init__(self, run: Run, history: dict[int, Step]):
        super().__init__(run, history, Lease(run_id=run.id, epoch=run.lease_epoch))
        # After a cancel the positions past it hold compensations, cut off by `_before_undo`:
        # the code is replayed forward as far as it went, not undone.
        self.cancel_requested = False
        self.checkpoints = RefusingCheckpoints(self.lease, self.who, self.undo, give_up=None)

    def admit(self, key: str, seq: int, record: Step | None) -> None:
        """Replay's checks, then stop where the live run would do something."""
        if record is not None and record.key != key:
            raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
        if self.history.replays(key, seq, record):  # may raise a recorded failure, as live
            return
        raise HistoryEnds(f"position {seq} ({key!r}) is not recorded completed")


@dataclass(frozen=True)
class Verdict:
    """How one run's history met the code: `outcome` is one of

    - "completed": the code returned, having asked for every recorded position;
    - "so_far": the code reached the end of the history (the live run's position) in step;
    - "as_recorded": the code raised what the failed run raised (it ended the same way);
    - "diverges": at `seq` the history has `recorded`, the code asks for `requested`;
    - "fails": the code raised `error` replaying the history (after `positions` positions).
    """

    outcome: str
    positions: int  # positions the code took
    recorded: int  # positions the history holds
    seq: int | None = None
    recorded_key: str = ""
    requested_key: str = ""
    error: str = ""

    @property
    def compatible(self) -> bool:
        return self.outcome in ("completed", "so_far", "as_recorded")


def replay(run: Run, history: dict[int, Step], fn: Callable) -> Verdict:
    """Replay `run`'s `history` (its steps by seq) through workflow function `fn`, dry."""
    history = _before_undo(history)
    execution = DryExecution(run, history)
    engine = Engine(execution)
    recorded = len(history)
    try:
        if inspect.iscoroutinefunction(fn):
            run_async(fn, engine, run.input)
        else:
            fn(RunContext(engine), run.input)
        execution.history.check_all_replayed()
    except HistoryEnds:
        return Verdict("so_far", execution.history.next_seq - 1, recorded)
    except NonDeterminismError as exc:
        if _ended_so(run, exc):
            return Verdict("as_recorded", exc.seq, recorded)
        return Verdict(
            "diverges", exc.seq, recorded, exc.seq, exc.recorded, exc.requested, str(exc)
        )
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # what workflow code raises is the run's own outcome
        taken = execution.history.next_seq
        if _ended_so(run, exc):
            return Verdict("as_recorded", taken, recorded)
        said = brief(exc)
        error = f"{said['type']}: {said['message']}"
        return Verdict("fails", taken, recorded, max(taken - 1, 0), error=error)
    return Verdict("completed", execution.history.next_seq, recorded)


def _before_undo(history: dict[int, Step]) -> dict[int, Step]:
    """The positions before a cancel's compensations (`undo:<key>`), which the code reaches
    only by being cancelled: a dry replay goes forward only."""
    undo = min((seq for seq, s in history.items() if s.key.startswith("undo:")), default=None)
    return history if undo is None else {q: s for q, s in history.items() if q < undo}


def _ended_so(run: Run, exc: BaseException) -> bool:
    """Whether a failed run's recorded error is what the code raised replaying it."""
    if run.status != RunStatus.FAILED or not run.error:
        return False
    now = error_record(exc)
    return all(now.get(field) == run.error.get(field) for field in ("code", "type", "step"))
