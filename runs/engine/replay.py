"""Replay: whether each call may take its position, the determinism check, and the recorded
values (now, random, uuid, patch markers). The cursor itself is history.py's."""

from __future__ import annotations

import random
from datetime import datetime
from uuid import UUID

from django.utils import timezone

from runs.engine.state import ContextState
from runs.errors import Cancelled, LeaseLost, NonDeterminismError, Released, StepMisuse
from runs.models import Step


class Replay(ContextState):
    """Each call takes the next position from the History; a recorded step there is handed
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
        return self.history.take(key, internal=internal)

    def _admit(self, key: str, seq: int, record: Step | None) -> None:
        """Decide whether the step at this position may go on; raise what replay must raise."""
        if self.history.replays(key, seq, record):
            return
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
            raise LeaseLost(f"run {self.who.run_id}: lease lost")
        if self._lease.stopping.is_set():
            raise Released("worker shutting down")

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
        seq, record = self.history.next_seq, self.history.peek()
        if record is not None and record.key != key:
            self._patches[change_id] = False
            return False
        self.history.skip()
        if record is None:
            cancelled = self._cancel_requested and not self._undo.running
            self.checkpoints.mark_patch(seq, key, change_id, cancelled=cancelled)
        self._patches[change_id] = True
        return True
