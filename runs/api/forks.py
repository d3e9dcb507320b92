"""Forks over REST: what a fork from a step would run again, and the fork itself."""

from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID

from ninja import Field, Query, Schema, Status

from runs import operations
from runs.api.common import ERRORS_422, TEXT, In, ReasonIn, Router, RunOut, run_or_404, viewer

router = Router(tags=["runs"])


class ForkPreviewIn(In):
    # Text as every text field is (no NUL: PostgreSQL refused it with a 500, schemathesis).
    step: (
        Annotated[str, Field(min_length=1, max_length=255, pattern=TEXT)]
        | Annotated[int, Field(ge=0, le=2**31 - 1)]
    ) = Field(description="the key of the first step to run again, or its position")
    input: Any = Field(
        None, description="a replacement run input (absent: the origin's; null is a value)"
    )
    outputs: dict[str, Any] | None = Field(
        None,
        description="{step key: replacement output} for steps before the fork point: the fork"
        " replays them as if the steps had returned them (an approval's decision is not"
        " editable)",
    )


class ForkIn(ForkPreviewIn, ReasonIn):
    pass


class StepPreview(Schema):
    seq: int
    key: str
    kind: str
    asked_again: str | None = Field(
        None,
        description="for an approval before the fork point: why the fork asks it again (its"
        " inputs are edited, it was revoked); null for the steps from the fork point on",
    )


@router.get("/runs/{run_id}/fork-preview", response={200: list[StepPreview], **ERRORS_422})
def fork_preview(request, run_id: UUID, step: str = Query(..., max_length=255, pattern=TEXT)):
    """The recorded steps a fork from `step` would run again (side effects to expect), after
    the approvals before it that it asks again (revoked ones)."""
    viewer(request)
    return operations.fork_preview(run_id, int(step) if step.isdigit() else step)


@router.post("/runs/{run_id}/fork-preview", response={200: list[StepPreview], **ERRORS_422})
def fork_preview_edits(request, run_id: UUID, body: ForkPreviewIn):
    """What a fork with these edits would run again: the approvals before `step` it asks again
    (those its edits may change what they approved, and revoked ones), then the steps from
    `step` on. Nothing is created."""
    viewer(request)
    step = int(body.step) if isinstance(body.step, str) and body.step.isdigit() else body.step
    edits = {"input": body.input} if "input" in body.model_fields_set else {}
    return operations.fork_preview(run_id, step, outputs=body.outputs, **edits)


@router.post("/runs/{run_id}/fork", response={201: RunOut, **ERRORS_422})
def fork_run(request, run_id: UUID, body: ForkIn):
    """A new run reusing the recorded outputs before `step`; the rest runs again. `input` and
    `outputs` edit what the fork starts from (recorded in its `run.created` event)."""
    run_or_404(run_id)
    step = int(body.step) if isinstance(body.step, str) and body.step.isdigit() else body.step
    edits = {"input": body.input} if "input" in body.model_fields_set else {}
    fork = operations.fork_run(
        str(run_id), step, request.user, body.reason, outputs=body.outputs, **edits
    )
    return Status(201, RunOut.of(fork))
