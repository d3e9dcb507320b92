"""Signals to a run, and the values a run publishes (`ctx.set_event`), over REST."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from ninja import Field, Path, Query, Schema, Status

from runs import published
from runs.api.common import ERRORS_422, TEXT, In, Router, viewer
from runs.errors import Forbidden, NotFound
from runs.sdk import send_signal

router = Router(tags=["runs"])


class SignalIn(In):
    name: str = Field(min_length=1, max_length=200, pattern=TEXT, examples=["go"])
    payload: Any = None
    if_finished: str = Field(
        "raise",
        pattern="^(raise|ignore)$",
        description="a finished run: 409 saying so (raise), or 200 with nothing stored (ignore)",
    )


class SignalOut(Schema):
    id: int | None = Field(description="null when nothing was stored (if_finished=ignore)")
    run_id: UUID
    name: str


class PublishedOut(Schema):
    name: str
    value: Any
    updated_at: datetime


@router.post(
    "/runs/{run_id}/signals", response={201: SignalOut, 200: SignalOut, **ERRORS_422},
    tags=["signals"],
)  # fmt: skip
def signal_run(request, run_id: UUID, body: SignalIn):
    """Send a signal; the run's next wait_for_event for `name` consumes it. A finished run
    never would: 409 (`if_finished: "raise"`), or 200 with `id: null` (`"ignore"`)."""
    if not request.user.has_perm("runs.add_signal"):
        raise Forbidden(
            f"{request.user.get_username()} may not send signals (needs runs.add_signal)"
        )
    signal = send_signal(
        run_id, body.name, body.payload, sent_by=request.user.get_username(),
        if_finished=body.if_finished,
    )  # fmt: skip
    if signal is None:
        return Status(200, {"id": None, "run_id": run_id, "name": body.name})
    return Status(201, {"id": signal.pk, "run_id": signal.run_id, "name": signal.name})


@router.get(
    "/runs/{run_id}/events/{name}", response={200: PublishedOut, **ERRORS_422}, tags=["runs"]
)
def get_published(
    request,
    run_id: UUID,
    name: str = Path(..., min_length=1, max_length=100, pattern=r"^[^\x00#]*$"),
    wait: float = Query(0, ge=0, le=30, description="seconds to wait for it to be set"),
):
    """The latest value the run published as `name` (`ctx.set_event`), waiting up to `wait`
    seconds for it to be set: 404 if it is not by then, or never will be (the run ended)."""
    viewer(request)
    found = published.find(run_id, name, wait=wait)
    if found is None:
        raise NotFound(f"run {run_id} has not set event {name!r}")
    return found
