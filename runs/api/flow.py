"""Flow control over REST: queue depth, running runs and concurrency limits per workflow."""

from __future__ import annotations

from ninja import Field, Schema

from runs import operations
from runs.api.common import ERRORS, ERRORS_422, ReasonIn, Router, viewer
from runs.api.policies import workflow_name
from runs.engine import flow

router = Router(tags=["runs"])


class LimitsIn(ReasonIn):
    max_running: int | None = Field(None, ge=1, le=100_000, description="null: the code's")
    max_running_per_key: int | None = Field(None, ge=1, le=100_000)


class KeyLoad(Schema):
    key: str
    running: int
    queued: int


class FlowLimits(Schema):
    max_running: int | None
    max_running_per_key: int | None


class WorkflowFlowOut(Schema):
    workflow: str
    running: int
    queued: int = Field(description="pending runs, due or not")
    waiting: int = Field(description="on a timer, a signal, an approval, children or a budget")
    code_limits: FlowLimits
    operator_limits: FlowLimits = Field(description="over the code's where not null")
    keys: list[KeyLoad] = Field(description="the busiest concurrency keys, at most 20")


@router.get("/flow", response={200: list[WorkflowFlowOut], **ERRORS}, tags=["flow"])
def flow_overview(request):
    """Queue depth and running runs per workflow and per concurrency key, with the limits."""
    viewer(request)
    return flow.overview()


@router.put("/flow/workflows/{name}", response={200: FlowLimits, **ERRORS_422}, tags=["flow"])
def set_workflow_limits(request, name: str, body: LimitsIn):
    """An operator's concurrency limits over the code's (null: back to the code's)."""
    given = body.model_fields_set - {"reason"}
    limits = {k: getattr(body, k) for k in ("max_running", "max_running_per_key") if k in given}
    policy = operations.set_limits(workflow_name(name), request.user, body.reason, **limits)
    return {"max_running": policy.max_running, "max_running_per_key": policy.max_running_per_key}
