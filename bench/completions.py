"""How long a finished step waits to be recorded, and what back-to-back steps cost.

    .venv/bin/python bench/completions.py

A step's completion rides with the run's next write; when the workflow works between steps,
the completion writer records it after STEPGUARD_COMPLETION_WINDOW. This measures, on the same
database in the same run:

- [1] back-to-back steps (bench/steps.py's `bench.long`): statements and commits per step
  (the carried path: one each);
- [2] a step followed by 0.5 s of work outside steps: the time from its function's return to
  its row reading `completed` from another process, with the default window and, as the
  baseline, with STEPGUARD_EAGER_COMPLETIONS (a commit of its own at once);
- [3] the same with the work a `sorted()` of GAP_FLOATS floats (one C call holding the GIL
  for about a second): written by the worker's heart, a process of its own (as every
  `runworker` does), and, as before it, by a thread of this process.

Each execution's lease has a heart attached (runs/engine/heart.py), as in a worker, except in
the "thread" column.

Uses bench/steps.py's database (DATABASE_URL, default stepguard_bench); runs twice in a row.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from django.db import connections
from django.test.utils import override_settings

from bench import steps as bench_steps
from bench.steps import (
    SqlProfile,
    delete_bench_rows,
    prepare_database,
    progress,
    table,
)
from runs.engine.fences import Lease
from runs.engine.heart import Heart
from runs.engine.lifecycle import execute
from runs.engine.worker import WorkerProcess
from runs.sdk import RunContext, start_run, workflow

STEPS = 200
GAP_RUNS = 15
GAP_SECONDS = 0.5
GAP_FLOATS = 1_000_000
RETURNED: dict[str, float] = {}  # run id -> monotonic() when step a's function returned


bench_steps.BENCH_WORKFLOWS += ("bench.gap", "bench.gil")  # pruned between rounds with the others


@workflow("bench.gap", version="1")
def gap(ctx: RunContext, input: dict) -> str:
    def a() -> str:
        RETURNED[str(ctx.run_id)] = time.monotonic()
        return "a"

    ctx.step("a", a)
    deadline = time.perf_counter() + input["gap"]
    while time.perf_counter() < deadline:  # work outside any step
        time.sleep(0.001)
    return ctx.step("b", lambda: "b")


@workflow("bench.gil", version="1")
def gil(ctx: RunContext, input: dict) -> str:
    import random

    data = [random.random() for _ in range(input["floats"])]

    def a() -> str:
        RETURNED[str(ctx.run_id)] = time.monotonic()
        return "a"

    ctx.step("a", a)
    sorted(data)  # one C call: the GIL is held from start to end
    return ctx.step("b", lambda: "b")


def leased(run, heart: Heart | None) -> Lease:
    lease = Lease(run.id, run.lease_epoch, heart=heart)
    if heart is not None:
        heart.hold(lease)
    return lease


def carried(claimer: WorkerProcess, heart: Heart) -> dict[str, float]:
    started = start_run("bench.long", {"steps": STEPS})
    run = claimer.claim(1)[0]
    assert run.id == started.id
    profile = SqlProfile()
    with profile.attached():
        execute(run, leased(run, heart))
    return {
        "statements": profile.statements / STEPS,
        "commits": profile.count["COMMIT"] / STEPS,
    }


#: Polls step a's row from a process of its own (a thread here would wait for the GIL too) and
#: prints the time.monotonic() at which it first reads `completed`.
WATCH = """
import sys, time, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as db:
    print("ready", flush=True)
    q = "SELECT status FROM runs_step WHERE run_id = %s AND key = 'a'"
    while (db.execute(q, [sys.argv[2]]).fetchone() or [None])[0] != "completed":
        time.sleep(0.001)
    print(time.monotonic(), flush=True)
"""


def dsn() -> str:
    s = connections["default"].settings_dict
    return psycopg.conninfo.make_conninfo(
        dbname=s["NAME"], user=s["USER"], password=s["PASSWORD"] or None,
        host=s["HOST"] or None, port=s["PORT"] or None,
    )  # fmt: skip


def recorded_after(
    claimer: WorkerProcess, heart: Heart | None, workflow: str = "bench.gap"
) -> list[float]:
    """Seconds from step a's return to its row reading `completed`, per run."""
    delays = []
    for _ in range(GAP_RUNS):
        started = start_run(workflow, {"gap": GAP_SECONDS, "floats": GAP_FLOATS})
        run = claimer.claim(1)[0]
        assert run.id == started.id
        watcher = subprocess.Popen(
            [sys.executable, "-c", WATCH, dsn(), str(run.id)], stdout=subprocess.PIPE, text=True
        )
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "ready"
        execute(run, leased(run, heart))
        seen = float(watcher.communicate(timeout=60)[0])
        delays.append(seen - RETURNED[str(run.id)])
    return delays


def main() -> int:
    error = prepare_database()
    if error:
        print(f"cannot benchmark: {error}", file=sys.stderr)
        return 2
    rows = []
    for round_ in (1, 2):  # twice in a row on the same database
        delete_bench_rows()
        claimer = WorkerProcess(concurrency=1)
        claimer.register()
        heart = Heart(claimer.id, 600.0, on_lost=lambda run_id, epoch: None, held=list)
        heart.start()
        heart.wait_ready()
        progress(f"round {round_}: {STEPS} back-to-back steps")
        cost = carried(claimer, heart)
        progress(f"round {round_}: {GAP_RUNS} runs with {GAP_SECONDS} s between steps")
        window = recorded_after(claimer, heart)
        with override_settings(STEPGUARD_EAGER_COMPLETIONS=True):
            eager = recorded_after(claimer, heart)
        progress(f"round {round_}: {GAP_RUNS} runs with sorted({GAP_FLOATS:,} floats) between")
        gil_heart = recorded_after(claimer, heart, "bench.gil")
        gil_thread = recorded_after(claimer, None, "bench.gil")
        heart.stop()
        w, e = statistics.median(window), statistics.median(eager)
        rows.append(
            [
                round_,
                f"{cost['statements']:.2f}",
                f"{cost['commits']:.2f}",
                f"{w * 1000:.1f}",
                f"{max(window) * 1000:.1f}",
                f"{e * 1000:.1f}",
                f"{w / e:.1f}x",
                f"{statistics.median(gil_heart) * 1000:.1f} / {max(gil_heart) * 1000:.1f}",
                f"{statistics.median(gil_thread) * 1000:.1f} / {max(gil_thread) * 1000:.1f}",
            ]
        )
    from django.conf import settings

    bound = settings.STEPGUARD_COMPLETION_WINDOW * 1.1
    print(f"STEPGUARD_COMPLETION_WINDOW={settings.STEPGUARD_COMPLETION_WINDOW} s (bound {bound} s)")
    print(
        table(
            [
                "round",
                "statements/step",
                "commits/step",
                "recorded after (ms, median)",
                "max",
                "eager baseline (ms)",
                "ratio",
                "GIL held: heart (ms, median / max)",
                "GIL held: thread",
            ],
            rows,
            right={1, 2, 3, 4, 5, 6, 7, 8},
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
