"""Compensation: undo what a run did, newest first, when it is cancelled or finally fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from runs.errors import StepFailed

log = logging.getLogger("stepguard.executor")


class Compensations:
    """One execution's undo list, owned by its Execution (`undo`).

    `done` holds each completed step's compensation with its output; `in_doubt` the steps
    found `started` (they may have run) whose re-send a cancel refused, each with how to
    resolve it first; `running` is set while the undo runs (its steps pass a cancel).
    """

    def __init__(self) -> None:
        self.done: list[tuple[str, Callable, Any]] = []
        self.in_doubt: dict[str, Callable[[], Any]] = {}
        self.running = False

    def remember(self, key: str, compensate: Callable | None, output: Any) -> Any:
        """`output`, after noting its undo (if the step has one)."""
        if compensate is not None:
            self.done.append((key, compensate, output))
        return output

    def run(
        self, run_id: str, seek: Callable[[str], None], undo: Callable[[str, Callable, Any], Any]
    ) -> list[str]:
        """Run the compensations of completed steps, newest first, each one a step itself
        (`seek` puts the replay cursor at the undo's position, `undo` runs it as a step).

        A step that may have happened (found `started` after a crash, its re-send refused by
        the cancel) is first resolved as a recovery would: reconciled, or re-sent with its
        idempotency key so the service answers with what it did; then it is undone too.
        """
        self.running = True
        doubts, self.in_doubt = self.in_doubt, {}
        for key, resolve in doubts.items():
            # Reconciled or re-sent with its key, and remembered if it happened; a StepFailed
            # means it did not (recorded as failed): nothing to undo. Any other error leaves
            # its outcome unknown (the run's end marks it so): the others are still undone.
            try:
                resolve()
            except StepFailed:
                pass
            except Exception:
                log.exception("run %s: step %r may have run and could not be resolved; "
                              "it is not undone", run_id, key)  # fmt: skip
        undone = []
        for key, compensate, output in reversed(self.done):
            seek(key)
            undo(key, compensate, output)
            undone.append(key)
        return undone
