"""The benchmark's short workflow, in a module of its own so that worker processes can serve
it (`runworker --import bench.workflows`) without importing the benchmark itself."""

from runs.sdk import RunContext, workflow


def noop(i: int) -> int:
    return i


@workflow("bench.short", version="1")
def short_workflow(ctx: RunContext, input: dict) -> int:
    for i in range(input["steps"]):
        ctx.step("noop", noop, i)
    return input["steps"]
