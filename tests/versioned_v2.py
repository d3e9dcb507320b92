from runs.sdk import RunContext, workflow
from tests.workflows import effect


@workflow("versioned", version="2")
def versioned(ctx: RunContext, input):
    ctx.step("a2", effect, ctx, "v2-a")
    ctx.wait_for_event("wait", "go")
    return ctx.step("b2", effect, ctx, "v2-b")
