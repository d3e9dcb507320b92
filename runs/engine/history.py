"""History: the replay cursor over a run's recorded steps. It reads; it never writes.

Each call in workflow code takes the next position; what an earlier execution recorded there is
handed back (a completed step's output, a failure raised again) instead of run. The cursor owns
its own state, so the positions a call takes are decided in one place, apart from the code that
writes checkpoints (checkpoints.py) and the execution's modes (a cancel, a halt, a lost lease),
which `Execution.admit` checks after the cursor has spoken.
"""

from __future__ import annotations

from typing import NoReturn

from runs.errors import REPLAYED, NonDeterminismError, StepFailed, StepMisuse
from runs.models import Step, StepStatus

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


class History:
    """The positions of one execution: the next one to take, and what is recorded at each."""

    __slots__ = (
        "_attempt",
        "_failed_step",
        "_last_own",
        "_next",
        "_occurrences",
        "_records",
        "last_recorded",
    )

    def __init__(self, records: dict[int, Step], *, attempt: int, failed_step: str | None):
        self._records = records
        self._next = 0
        self._occurrences: dict[str, int] = {}
        self._attempt = attempt
        #: The step whose failure ended the run's last attempt, if one did: run again.
        self._failed_step = failed_step
        self.last_recorded: int = max(records, default=-1)
        #: The last position this run recorded itself (not one a fork copied).
        self._last_own: int = max((q for q, r in records.items() if not r.inherited), default=-1)

    @property
    def next_seq(self) -> int:
        """The position the next call takes."""
        return self._next

    def peek(self) -> Step | None:
        """What is recorded at the next position, if anything: before it is taken."""
        return self._records.get(self._next)

    def take(self, key: str, *, internal: bool = False) -> tuple[str, int, Step | None]:
        """Take the next position for `key`: its repeat-suffixed key, its seq, its record."""
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
        seq = self._next
        self._next += 1
        return key, seq, self._records.get(seq)

    def skip(self) -> None:
        """Take the next position without a key (a patch marker, which has none to repeat)."""
        self._next += 1

    def seek_undo(self, key: str) -> None:
        """Put the cursor where the undo of step `key` belongs: where an earlier execution
        recorded it, else past everything recorded. Undos are found by key, not by counting:
        the position where a cancel stops the code moves once a step it found in doubt is
        resolved (recorded completed, it replays, and the code stops one position later)."""
        undo = f"undo:{key}"
        found = next((seq for seq, r in self._records.items() if r.key == undo), None)
        self._next = max(self._next, self.last_recorded + 1) if found is None else found

    def went_past(self, seq: int) -> bool:
        """Whether this run recorded a step of its own after `seq` (not one a fork copied):
        an earlier execution went on from there, so what is recorded at `seq` was taken."""
        return self._last_own > seq

    def replays(self, key: str, seq: int, record: Step | None) -> bool:
        """True if the record at `seq` is `key` completed: hand its output back. A recorded
        failure is raised again, so code that caught it takes the same branch, except the one
        that ended an earlier attempt of the run, which is attempted afresh on a retry unless
        its error was final."""
        if record is None or record.key != key:
            return False
        if record.status == StepStatus.COMPLETED:
            return True
        # Even under a cancel: replay must reach every completed step after the failure, or
        # their compensations would never be known. The failure that ended the attempt is the
        # run's error: a gathered step's, not the last position, is attempted afresh too (a
        # step's failure fails the run, so the execution after one is a person's retry). On
        # a retry of the workflow's own error, a failure the step's policy called final
        # replays, whatever error the workflow raised from it: it is never sent again.
        final = (record.error or {}).get("retryable") is False
        ended_it = record.key == self._failed_step or (seq == self.last_recorded and not final)
        if record.status == StepStatus.FAILED and (
            record.run_attempt == self._attempt or not ended_it
        ):
            raise_recorded(key, record.error or {})
        return False

    def check_all_replayed(self) -> None:
        """A run that returns before the positions its history holds took another path than
        it recorded (steps removed from the end of the code): that is a changed workflow too."""
        if self._next <= self.last_recorded:
            recorded = self._records[min(k for k in self._records if k >= self._next)]
            raise NonDeterminismError(
                seq=recorded.seq, recorded=recorded.key, requested="(the workflow returned)"
            )


def raise_recorded(key: str, error: dict) -> NoReturn:
    """Raise a recorded failure as the exception workflow code saw live."""
    cls = REPLAYED.get(error.get("code", ""))
    if cls is not None:
        raise cls(error.get("message", ""))
    raise StepFailed(key, error, retryable=error.get("retryable", True))
