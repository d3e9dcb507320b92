"""The benchmark's short workflow, in a module of its own so that worker processes can serve
it (`runworker --import bench.workflows`) without importing the benchmark itself."""

import time

from runs.sdk import RunContext, workflow


def noop(i: int) -> int:
    return i


@workflow("bench.short", version="1")
def short_workflow(ctx: RunContext, input: dict) -> int:
    for i in range(input["steps"]):
        ctx.step("noop", noop, i)
    return input["steps"]


@workflow("bench.load", version="1")
def load_workflow(ctx: RunContext, input: dict) -> str:
    """bench/load.py's mix: `short` (5 no-op steps), `model` (3 steps of 50-150 ms, a model
    call's wait held by the worker thread), `timer` (a step, a 1 s durable sleep, a step),
    `signal` (a step, a wait for the signal `go` the load generator sends, a step)."""
    kind = input["kind"]
    if kind == "short":
        for i in range(5):
            ctx.step("noop", noop, i)
    elif kind == "model":
        for i in range(3):
            ctx.step("call", time.sleep, 0.05 + 0.05 * (i % 3))
    else:
        ctx.step("before", noop, 0)
        if kind == "timer":
            ctx.sleep("timer", 1.0)
        else:
            ctx.wait_for_event("wait", "go")
        ctx.step("after", noop, 1)
    return kind
