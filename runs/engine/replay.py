"""Replay: the position cursor over a run's history, and the determinism check."""

from __future__ import annotations

import random
from datetime import datetime
from typing import NoReturn
from uuid import UUID

from django.utils import timezone

from runs.engine.fences import Fence
from runs.engine.state import ContextState
from runs.engine.store import atomic, fence
from runs.errors import (
    REPLAYED,
    Cancelled,
    LeaseLost,
    NonDeterminismError,
    Released,
    StepFailed,
    StepMisuse,
)
from runs.models import EventType, Run, Step, StepKind, StepStatus

MAX_KEY_LENGTH = 200


#: What replay reads of each checkpoint; the rest (input, timestamps) loads only if needed.
REPLAY_FIELDS = (
    "id",
    "seq",
    "key",
    "status",
    "output",
    "error",
    "attempt",
    "run_attempt",
    "wake_at",
    "reserved_micros",
    "reserved_tokens",
    "possibly_spent_micros",
    "possibly_spent_tokens",
    "tokens_in",
    "tokens_out",
    "cost_micros",
    "reserved_on",
    "reserved_scopes",
    "inherited",
)


class Replay(ContextState):
    """Each call takes the next position in the run's history; a recorded step there is handed
    back instead of run, and a different one is a NonDeterminismError."""

    def _enter(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        key, seq, record = self._position(key, internal=internal)
        self._admit(key, seq, record)
        return key, seq, record

    def _position(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        """Take the next position in the call sequence for `key` (with its repeat suffix)."""
        if (running := self._running()) is not None:
            raise StepMisuse(
                f"step {key!r} was called inside step {running.key!r}; steps do not nest"
            )
        limit = 255 if internal else MAX_KEY_LENGTH
        if not isinstance(key, str) or not key or len(key) > limit or ("#" in key and not internal):
            raise StepMisuse(
                f"invalid step key {key!r}: use a non-empty string of at most {MAX_KEY_LENGTH} "
                "characters without '#' ('#' marks repeats: search, search#2, ...)"
            )
        count = self._occurrences.get(key, 0) + 1
        self._occurrences[key] = count
        if count > 1:
            key = f"{key}#{count}"
        seq = self._seq
        self._seq += 1
        return key, seq, self._history.get(seq)

    def _seek_undo(self, key: str) -> None:
        """Put the cursor where the undo of step `key` belongs: where an earlier execution
        recorded it, else past everything recorded. Undos are found by key, not by counting:
        the position where a cancel stops the code moves once a step it found in doubt is
        resolved (recorded completed, it replays, and the code stops one position later)."""
        undo = f"undo:{key}"
        found = next((seq for seq, r in self._history.items() if r.key == undo), None)
        if found is None:
            found = max(self._seq, max(self._history, default=-1) + 1)
        self._seq = found

    def _admit(self, key: str, seq: int, record: Step | None) -> None:
        """Decide whether the step at this position may go on; raise what replay must raise."""
        if record is not None and record.key == key:
            if record.status == StepStatus.COMPLETED:
                return
            # A failure replays as itself, so code that caught it takes the same branch again,
            # even under a cancel: replay must reach every completed step after it, or their
            # compensations would never be known. Only the failure that ended an earlier run
            # attempt is attempted afresh when the run is retried.
            # The failure that ended the attempt is the run's error: a gathered step's, not
            # the last position, is attempted afresh too.
            ended_it = record.key == self._failed_step or seq == self._last_seq
            if record.status == StepStatus.FAILED and (
                record.run_attempt == self.attempt or not ended_it
            ):
                self._raise_recorded(key, record.error or {})
        if self._give_up is not None and not self._undo.running:
            if record is not None and record.key != key:
                raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
            raise self._give_up
        if self._cancel_requested and not self._undo.running:
            # Before the determinism check: after a cancel, the positions past this one hold
            # the compensations, not the steps the code would take next.
            raise Cancelled("cancel requested")
        if record is not None and record.key != key:
            raise NonDeterminismError(seq=seq, recorded=record.key, requested=key)
        if self._lease.lost.is_set():
            raise LeaseLost(f"run {self.run_id}: lease lost")
        if self._lease.stopping.is_set():
            raise Released("worker shutting down")

    def _check_all_replayed(self) -> None:
        """A run that returns before the positions its history holds took another path than
        it recorded (steps removed from the end of the code): that is a changed workflow too."""
        if self._seq <= self._last_seq:
            recorded = self._history[min(k for k in self._history if k >= self._seq)]
            raise NonDeterminismError(
                seq=recorded.seq, recorded=recorded.key, requested="(the workflow returned)"
            )

    @staticmethod
    def _raise_recorded(key: str, error: dict) -> NoReturn:
        cls = REPLAYED.get(error.get("code", ""))
        if cls is not None:
            raise cls(error.get("message", ""))
        raise StepFailed(key, error, retryable=error.get("retryable", True))

    def _fork_lineage(self) -> list:
        """This run and the runs it was forked from: a fork replays their approvals."""
        chain, origin = [self._lease.run_id], self._forked_from
        while origin is not None:
            chain.append(origin)
            origin = Run.objects.filter(pk=origin).values_list("forked_from_id", flat=True)[0]
        return chain

    def now(self) -> datetime:
        """The current time, recorded once: replay sees the same instant."""
        return datetime.fromisoformat(self.step("now", lambda: timezone.now().isoformat()))

    def random(self) -> float:
        """A random float in [0, 1), recorded once."""
        return self.step("random", random.random)

    def uuid(self) -> UUID:
        """A random UUID, recorded once."""
        import uuid

        return UUID(self.step("uuid", lambda: str(uuid.uuid4())))

    def patched(self, change_id: str) -> bool:
        """True where new code may take its new path; False for a run that recorded the old one.

        Wrap a change to a running workflow: `if ctx.patched("use-v2-search"): new() else:
        old()`. A run whose history already holds a different step at this position replays
        the old path; any other run records a marker and takes the new path from here on.
        """
        if change_id in self._patches:
            return self._patches[change_id]
        key = f"patch:{change_id}"
        seq = self._seq
        record = self._history.get(seq)
        if record is not None and record.key != key:
            self._patches[change_id] = False
            return False
        self._seq += 1
        if record is None:
            with atomic(self._lease):
                # A marker spends nothing: halts and cancels stop it, a spent budget does not.
                event_seq = fence(self._lease, Fence(starting=True, compensating=True))
                if self._cancel_requested and not self._undo.running:
                    raise Cancelled("cancel requested")
                self._new_step(
                    seq, key, StepKind.CALL, StepStatus.COMPLETED, finished_at=timezone.now()
                )
                self._event(event_seq, EventType.STEP_COMPLETED, key, patch=change_id)
        self._patches[change_id] = True
        return True
