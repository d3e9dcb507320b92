"""Compensation: undo what a run did, newest first, when it is cancelled or finally fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runs.engine.records import error_record
from runs.engine.state import ContextState
from runs.errors import StepFailed

log = logging.getLogger("stepguard.executor")

if TYPE_CHECKING:
    from runs.engine.context import Execution


class Compensation(ContextState):
    """Remembers each completed step's undo; `_compensate` runs them in reverse."""

    def _remember(self, key: str, compensate: Callable | None, output: Any) -> Any:
        if compensate is not None:
            self._compensations.append((key, compensate, output))
        return output

    def _compensate(self) -> list[str]:
        """Run the compensations of completed steps, newest first, each one a step itself.

        A step that may have happened (found `started` after a crash, its re-send refused by
        the cancel) is first resolved as a recovery would: reconciled, or re-sent with its
        idempotency key so the service answers with what it did; then it is undone too.
        """
        self._compensating = True
        doubts, self._in_doubt = self._in_doubt, {}
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
                              "it is not undone", self.run_id, key)  # fmt: skip
        done = []
        for key, undo, output in reversed(self._compensations):
            self._seek_undo(key)
            self._run_step(f"undo:{key}", undo, (output,), {}, internal=True)
            done.append(key)
        return done


def run_compensations(ctx: Execution) -> tuple[list[str], dict | None]:
    """Returns the undone step keys and, if an undo failed, its error. Control flow passes."""
    try:
        return ctx._compensate(), None
    except Exception as exc:
        return [], error_record(exc)
