"""The failover bench's workflow, in a module of its own so that workers serve it
(`runworker --import bench.failover.workflows`) without importing the bench."""

import json
import os
import time
from pathlib import Path

from runs.sdk import RunContext, workflow


def effect(ctx: RunContext, directory: str, label: str, sleep: float) -> int:
    """A side effect logged outside the database (one file per process, appended before the
    step returns), so no failover can take its record back: a key logged twice is a step
    called twice."""
    line = {"key": ctx.idempotency_key, "label": label, "pid": os.getpid(), "at": time.time()}
    with (Path(directory) / f"effects-{os.getpid()}.jsonl").open("a") as log:
        log.write(json.dumps(line) + "\n")
    time.sleep(sleep)
    return 1


@workflow("bench.failover", version="1")
def failover_workflow(ctx: RunContext, input: dict) -> int:
    return sum(
        ctx.step(f"s{i}", effect, ctx, input["dir"], f"s{i}", input["sleep"])
        for i in range(input["steps"])
    )
