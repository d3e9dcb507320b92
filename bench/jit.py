"""Whether a worker's claim pays for JIT compilation at a million runs after a prune (issue 48 §6).

    .venv/bin/python bench/jit.py                   # 1,000,000 runs; a few minutes
    .venv/bin/python bench/jit.py --runs 200000

Seeds RUNS finished runs of `bench.prune` and a tenth as many waiting ones (bench/prune.py's
rows, without their events and steps), vacuums and analyzes, then deletes the finished ones (a
prune's effect on the table: dead rows, statistics not yet refreshed) and measures a worker's
idle claim: the claim statement's plan (estimated cost, whether JIT compiled, its time) and
the whole idle claim's latency, with the engine's setting (jit off on its connections) and
with `jit = on` as before. Exits non-zero if the engine's claim compiled JIT code.

Uses bench/steps.py's database (DATABASE_URL, default stepguard_bench) on PostgreSQL.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from bench import steps as bench_steps
from bench.prune import KEPT, PRUNED, SEED
from bench.steps import prepare_database, progress
from runs.engine.worker import WorkerProcess

CLAIMS = 50


def seed(runs: int) -> None:
    began = time.monotonic()
    runs_only = SEED.split("INSERT INTO runs_event")[0]  # the runs, without events and steps
    with connection.cursor() as cursor:
        for workflow, status, n, age in (
            (PRUNED, "completed", runs, "61 days"),
            (KEPT, "waiting", runs // 10, "0 days"),
        ):
            params = {"workflow": workflow, "status": status, "runs": n, "age": age}
            cursor.execute(runs_only, params | {"events": 0})
        cursor.execute("VACUUM (ANALYZE) runs_run")
        cursor.execute("DELETE FROM runs_run WHERE workflow = %s", [PRUNED])  # the prune
    progress(f"seeded {runs:,} runs, deleted them again, in {time.monotonic() - began:.0f} s")


def claim_plan(worker: WorkerProcess) -> dict:
    """EXPLAIN ANALYZE of the claim statement an idle claim sends (rolled back)."""
    with CaptureQueriesContext(connection) as queries:
        worker.claim(1)
    (sql,) = [q["sql"] for q in queries.captured_queries if "SKIP LOCKED" in q["sql"]]
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
            (plan,) = cursor.fetchone()[0]
        transaction.set_rollback(True)
    return plan


def idle_claims(worker: WorkerProcess) -> float:
    samples = []
    for _ in range(CLAIMS):
        began = time.perf_counter()
        assert worker.claim(1) == []
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        sys.exit("bench/jit.py needs PostgreSQL")
    if error := prepare_database():
        sys.exit(error)
    bench_steps.delete_bench_rows()
    seed(args.runs)
    worker = WorkerProcess(concurrency=1)
    worker.register()
    rows = []
    try:
        for label, jit in (("engine (jit off)", None), ("jit = on, as before", "on")):
            if jit:
                with connection.cursor() as cursor:
                    cursor.execute(f"SET jit = {jit}")
            plan = claim_plan(worker)
            compiled = plan.get("JIT", {}).get("Timing", {}).get("Total")
            rows.append(
                (label, plan["Plan"]["Total Cost"], compiled, plan["Execution Time"],
                 idle_claims(worker))
            )  # fmt: skip
    finally:
        worker.claims.mark_stopped()
        with connection.cursor() as cursor:
            cursor.execute("RESET jit")
        bench_steps.delete_bench_rows()
    print(f"Stepguard claim and JIT: {args.runs:,} runs deleted, {args.runs // 10:,} waiting")
    print("setting              | est. cost | JIT ms | claim stmt ms | idle claim median ms")
    for label, cost, compiled, took, median in rows:
        shown = "none" if compiled is None else f"{compiled:.1f}"
        print(f"{label:20} | {cost:9,.0f} | {shown:>6} | {took:13.1f} | {median:20.1f}")
    if rows[0][2] is not None:
        sys.exit("the engine's claim compiled JIT code")


if __name__ == "__main__":
    main()
