"""Values recorded once and handed back on replay: the time, randomness, ids and patch markers
(`ctx.now`, `ctx.random`, `ctx.uuid`, `ctx.patched`), and the values a run publishes
(`ctx.set_event`)."""

from __future__ import annotations

import random
import uuid
from datetime import datetime
from typing import Any
from uuid import UUID

from django.utils import timezone

from runs.engine.execution import Execution
from runs.engine.serialization import to_json
from runs.engine.steps import Steps
from runs.errors import StepMisuse
from runs.models import Published

#: The engine's own generator, not the `random` module's: code that seeds or draws from
#: the module (a workflow's, a test's) neither steers nor is disturbed by `ctx.random`.
_RANDOM = random.Random()


def check_event_name(name: Any) -> str:
    """`name` if it can name a published value: 1 to 100 characters, no '#' nor NUL."""
    if not isinstance(name, str) or not 0 < len(name) <= 100 or "#" in name or "\x00" in name:
        raise StepMisuse(
            f"an event name is 1 to 100 characters without '#' or NUL, not {name!r}"[:300]
        )
    return name


class Recorded:
    """What workflow code may not compute itself, since it re-runs on every resume: each value
    is a step, so a replay sees the one the first execution saw."""

    def __init__(self, ex: Execution, steps: Steps):
        self.ex, self.steps = ex, steps
        self._patches: dict[str, bool] = {}  # by change id: whether this run takes the new path

    def now(self) -> datetime:
        """The current time, recorded once: replay sees the same instant."""
        return datetime.fromisoformat(self.steps.step("now", lambda: timezone.now().isoformat()))

    def random(self) -> float:
        """A random float in [0, 1), recorded once."""
        return self.steps.step("random", _RANDOM.random)

    def uuid(self) -> UUID:
        """A random UUID, recorded once."""
        return UUID(self.steps.step("uuid", lambda: str(uuid.uuid4())))

    def patched(self, change_id: str) -> bool:
        """True where new code may take its new path; False for a run that recorded the old one.

        Wrap a change to a running workflow: `if ctx.patched("use-v2-search"): new() else:
        old()`. A run whose history already holds a different step at this position replays
        the old path; any other run records a marker and takes the new path from here on.
        """
        if change_id in self._patches:
            return self._patches[change_id]
        key = f"patch:{change_id}"
        seq, record = self.ex.history.next_seq, self.ex.history.peek()
        if record is not None and record.key != key:
            self._patches[change_id] = False
            return False
        self.ex.history.skip()
        if record is None:
            cancelled = self.ex.cancel_requested and not self.ex.undo.running
            self.ex.checkpoints.mark_patch(seq, key, change_id, cancelled=cancelled)
        self._patches[change_id] = True
        return True

    def set_event(self, name: str, value: Any = None) -> None:
        """Publish `value` (JSON) under `name` for the run's clients: `get_event(run_id, name)`
        and `GET /api/runs/{id}/events/{name}` read the latest set (DBOS's set_event). A step
        of its own, `set_event:<name>`, written in one transaction with the value: the value
        is set exactly once, and a replay sets nothing again."""
        check_event_name(name)
        data = to_json(value, what=f"the value of event {name!r}")
        run_id = self.ex.lease.run_id

        def publish() -> None:
            Published.objects.update_or_create(
                run_id=run_id, name=name, defaults={"value": data, "updated_at": timezone.now()}
            )

        self.steps.transaction(f"set_event:{name}", publish)
