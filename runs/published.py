"""Reading what runs publish (`ctx.set_event`): the SDK's get_event and the API's
`GET /api/runs/{id}/events/{name}` share it."""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

from runs.engine.recorded import check_event_name
from runs.errors import NotFound
from runs.models import TERMINAL_STATUSES, Published, Run

#: The longest a caller may wait for a value (the API's `wait`; the SDK's `timeout` too).
MAX_WAIT_SECONDS = 300.0


def find(run_id: str | UUID, name: str, *, wait: float = 0.0, poll: float = 0.1):
    """The run's latest `name`, waiting up to `wait` seconds for it to be set; None if it is
    not set by then, or never will be (the run ended without it). Two queries a poll. Raises
    NotFound for an unknown run."""
    check_event_name(name)
    if not 0 <= wait <= MAX_WAIT_SECONDS:
        raise ValueError(f"a wait is 0 to {MAX_WAIT_SECONDS:g} seconds, not {wait!r}")
    deadline = time.monotonic() + wait
    while True:
        # The status first: a run found ended before the read of its values set them all.
        row = Run.objects.filter(pk=run_id).values("status").first()
        if row is None:
            raise NotFound(f"no run {run_id}")
        found = Published.objects.filter(run_id=run_id, name=name).first()
        if found is not None:
            return found
        if row["status"] in TERMINAL_STATUSES or time.monotonic() >= deadline:
            return None
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def value_of(run_id: str | UUID, name: str, *, wait: float = 0.0, default: Any = None) -> Any:
    found = find(run_id, name, wait=wait)
    return default if found is None else found.value
