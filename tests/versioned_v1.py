"""Version 1 of a workflow that a later deploy changes (see versioned_v2)."""

from runs.sdk import RunContext, workflow
from tests.workflows import effect


@workflow("versioned", version="1")
def versioned(ctx: RunContext, input):
    ctx.step("a", effect, ctx, "v1-a")
    ctx.wait_for_event("wait", "go")
    return ctx.step("b", effect, ctx, "v1-b")
