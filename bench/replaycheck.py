"""How fast the release check replays histories (issue 53 §1): `manage.py replaycheck`'s work.

    .venv/bin/python bench/replaycheck.py        # ~1 minute

Seeds 2,000 runs of a 20-step workflow (bulk-inserted rows, as a worker would have left them):
half waiting for a signal after step 10 (live), half completed (finished in the last day).
Then, in the same invocation on the same database, 5 times each, alternating:

- baseline: reading what the check reads (the runs, then their steps by batch, in the same
  read-only transactions) and nothing else: the floor under any check;
- check: runs.replaycheck.check(), the whole check: read, replay dry, report.

Prints the median histories/s of each (wall time, and this process's CPU time), the ratio,
and the divergent-release variant's (the same histories against code that diverges at step 5:
the check stops early on each). Uses
bench/steps.py's database (DATABASE_URL, default stepguard_bench) on PostgreSQL; deletes its
rows at the start and the end, so it runs twice in a row.
"""

from __future__ import annotations

import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django.utils import timezone

from bench.steps import prepare_database, progress, table  # sets Django up
from runs import replaycheck
from runs.engine import registry
from runs.engine.registry import WorkflowDef
from runs.models import Run, Step
from runs.sdk import RunContext, workflow

WORKFLOW, RUNS, STEPS, WAIT_AT, ROUNDS = "bench.replaycheck", 2000, 20, 10, 5


def noop(i: int) -> int:
    return i


@workflow(WORKFLOW)
def twenty_steps(ctx: RunContext, input: dict) -> int:
    for i in range(STEPS):
        if i == WAIT_AT:
            ctx.wait_for_event("go", "go")
        ctx.step(f"step-{i}", noop, i)
    return STEPS


def diverging(ctx: RunContext, input: dict) -> int:
    """The same workflow with step 5 renamed: every history diverges there."""
    for i in range(STEPS):
        if i == WAIT_AT:
            ctx.wait_for_event("go", "go")
        ctx.step(f"renamed-{i}" if i == 5 else f"step-{i}", noop, i)
    return STEPS


def clean() -> None:
    Run.objects.filter(workflow=WORKFLOW).delete()


def seed() -> None:
    now = timezone.now()
    runs = []
    for n in range(RUNS):
        done = n % 2 == 1
        runs.append(
            Run(
                workflow=WORKFLOW, version="1", input={}, status="completed" if done else "waiting",
                output=STEPS if done else None, event_seq=2 * STEPS + 4,
                finished_at=now - timedelta(minutes=n % 600) if done else None,
            )
        )  # fmt: skip
    Run.objects.bulk_create(runs, batch_size=500)
    steps = []
    for n, run in enumerate(runs):
        done = n % 2 == 1
        keys = [f"step-{i}" for i in range(WAIT_AT)] + ["go"]
        if done:
            keys += [f"step-{i}" for i in range(WAIT_AT, STEPS)]
        for seq, key in enumerate(keys):
            waiting = key == "go" and not done
            steps.append(
                Step(
                    run=run, seq=seq, key=key, kind="event" if key == "go" else "call",
                    status="waiting" if waiting else "completed",
                    output=None if key == "go" else int(key.split("-")[1]),
                    idempotency_key=f"{run.id}:{key}", started_at=now,
                    finished_at=None if waiting else now,
                )
            )  # fmt: skip
    Step.objects.bulk_create(steps, batch_size=2000)


def read_only_floor() -> int:
    """What the check reads, in the same transactions, and nothing more."""
    chosen = replaycheck.select(workflow=WORKFLOW)
    for start in range(0, len(chosen), replaycheck.BATCH):
        batch = chosen[start : start + replaycheck.BATCH]
        with replaycheck.read_only():
            replaycheck._histories([r.id for r in batch])
    return len(chosen)


def whole_check() -> int:
    report = replaycheck.check(workflow=WORKFLOW)
    return report.checked


def rate(fn) -> tuple[float, float]:
    """Histories per second of wall time, and per second of this process's CPU time (steadier
    on a shared host; PostgreSQL's own time is not in it)."""
    wall, cpu = time.perf_counter(), time.process_time()
    count = fn()
    return count / (time.perf_counter() - wall), count / (time.process_time() - cpu)


def main() -> None:
    error = prepare_database()
    if error:
        sys.exit(error)
    clean()
    progress(f"seed {RUNS} runs of {STEPS} steps (half waiting at step {WAIT_AT})")
    seed()
    report = replaycheck.check(workflow=WORKFLOW)
    assert report.ok and report.checked == RUNS, report.as_json()
    figures: dict[str, list[tuple[float, float]]] = {"baseline (read only)": [], "check": []}
    for i in range(ROUNDS):
        progress(f"round {i + 1}/{ROUNDS}")
        figures["baseline (read only)"].append(rate(read_only_floor))
        figures["check"].append(rate(whole_check))
    same = registry._workflows[(WORKFLOW, "1")]
    registry._workflows[(WORKFLOW, "1")] = WorkflowDef(WORKFLOW, "1", diverging)
    try:
        diverged = replaycheck.check(workflow=WORKFLOW)
        assert diverged.diverging == RUNS, diverged.as_json()
        figures["check, diverging at step 5"] = [rate(whole_check) for _ in range(ROUNDS)]
    finally:
        registry._workflows[(WORKFLOW, "1")] = same
    medians = {k: statistics.median(w for w, _ in v) for k, v in figures.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in figures.items()}
    rows = [[name, f"{medians[name]:,.0f}", f"{cpu[name]:,.0f}"] for name in medians]
    print(f"replaycheck over {RUNS} histories of {STEPS} steps, median of {ROUNDS}")
    print(table(["what", "histories/s", "per CPU-second"], rows))
    floor = medians["baseline (read only)"]
    print(f"  check / baseline: {floor / medians['check']:.2f}x the time of reading alone")
    clean()


if __name__ == "__main__":
    main()
