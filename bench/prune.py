"""What `manage.py prune` costs: its time, the WAL it writes, and the claims it must not stall.

    .venv/bin/python bench/prune.py                 # 100,000 runs (1,000,000 events); ~3 min
    .venv/bin/python bench/prune.py --runs 500000   # the issue 35 measure

Seeds RUNS finished runs of `bench.prune` (each with EVENTS events and STEPS steps, finished 60
days ago) beside a tenth as many runs it keeps (`bench.prune-live`, waiting), then, on the same
database in the same invocation:

- [1] a worker's idle claim, 300 times, with nothing else running: the baseline;
- [2] `retention.prune` of the finished runs (30-day limit) while the same claim runs in a loop
  beside it: its time, its batches, and the claims' latency against [1];
- [3] the WAL the prune wrote (`pg_current_wal_lsn()` before and after), against the size of
  what it deleted and per run: retention should write WAL in proportion to what it keeps, not
  to what it drops (issue 35: 1,407 MB for 500,018 runs and 5M events). The pruned runs were
  created in a month of their own, so their events' partition is dropped whole.

Uses bench/steps.py's database (DATABASE_URL, default stepguard_bench) on PostgreSQL; cleans up
after itself, so it runs twice in a row on the same database.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django.db import connection, connections
from django.utils import timezone

from bench import steps as bench_steps
from bench.steps import p, prepare_database, progress, table
from runs import partitions
from runs.engine.worker import WorkerProcess
from runs.models import TERMINAL_STATUSES, Run, RunStatus
from runs.retention import prune

PRUNED, KEPT = "bench.prune", "bench.prune-live"
EVENTS, STEPS = 10, 2
BASELINE_CLAIMS = 300

bench_steps.BENCH_WORKFLOWS += (PRUNED, KEPT)  # an interrupted invocation's rows go next time

SEED = """
INSERT INTO runs_run (id, workflow, version, input, status, key, lease_epoch, attempt,
    max_attempts, recoveries, event_seq, tokens_in, tokens_out, cost_micros, reserved_micros,
    reserved_tokens, budget_warned, halted_by, halt_reason, cancel_requested_by, cancel_reason,
    concurrency_key, priority, possibly_spent_micros, possibly_spent_tokens, created_at, wake_at,
    finished_at)
SELECT gen_random_uuid(), %(workflow)s, '1', '{}'::jsonb, %(status)s, %(workflow)s || '-' || g,
       1, 1, 3, 0, %(events)s, 0, 0, 0, 0, 0, false, '', '', '', '', '', 0, 0, 0,
       now() - %(age)s::interval, now() + interval '1 day',
       CASE WHEN %(status)s = 'completed' THEN now() - interval '60 days' END
FROM generate_series(1, %(runs)s) g;
INSERT INTO runs_event (run_id, seq, type, step_key, actor, payload, created_at, run_created_at)
SELECT r.id, s, 'step.completed', 'step-' || s, 'system',
       jsonb_build_object('attempt', 1, 'worker', 'bench'), r.created_at, r.created_at
FROM runs_run r, generate_series(1, %(events)s) s WHERE r.workflow = %(workflow)s;
INSERT INTO runs_step (run_id, seq, key, kind, status, idempotency_key, attempt, run_attempt,
    recovered, tokens_in, tokens_out, cost_micros, reserved_micros, possibly_spent_micros,
    possibly_spent_tokens, reserved_tokens, reserved_scopes, inherited, input, output,
    started_at, finished_at)
SELECT r.id, s, 'step-' || s, 'call', 'completed', r.id || ':step-' || s, 1, 1, '', 0, 0, 0,
       0, 0, 0, 0, '[]'::jsonb, false, '[]'::jsonb, '"done"'::jsonb, r.created_at, r.created_at
FROM runs_run r, generate_series(1, %(steps)s) s WHERE r.workflow = %(workflow)s;
"""


def seed(runs: int) -> None:
    started = time.monotonic()
    with connection.cursor() as cursor:
        # The pruned runs were created 61 days ago, the kept ones today: a month of finished
        # runs is then all gone, and its events' partition goes whole (runs/partitions.py).
        partitions.ensure(since=timezone.now() - timedelta(days=61))
        for workflow, status, n, age in (
            (PRUNED, "completed", runs, "61 days"),
            (KEPT, "waiting", runs // 10, "0 days"),
        ):
            params = {"workflow": workflow, "status": status, "runs": n, "age": age}
            cursor.execute(SEED, params | {"events": EVENTS, "steps": STEPS})
    with connection.cursor() as cursor:  # autocommit: VACUUM runs outside a transaction
        # Vacuumed now, not by autovacuum during the measure: a vacuum of pages just written
        # (hint bits, the visibility map) writes WAL too, which is the seed's, not the prune's.
        cursor.execute("VACUUM (ANALYZE) runs_run, runs_event, runs_step")
    progress(f"seeded {runs:,} runs to prune and {runs // 10:,} to keep in "
             f"{time.monotonic() - started:.0f} s")  # fmt: skip


def clean_up() -> None:
    """Everything this invocation seeded leaves through the prune path (the history is
    append-only everywhere else), so the next invocation starts from the same database."""
    now = timezone.now()
    live = Run.objects.filter(workflow__in=[PRUNED, KEPT]).exclude(status__in=TERMINAL_STATUSES)
    live.update(status=RunStatus.CANCELLED, finished_at=now)
    prune(finished_before=now + timedelta(seconds=1), workflows=[PRUNED, KEPT], batch_size=1000)


def wal() -> tuple[int, int]:
    """The server's WAL written so far, in bytes, and its full-page images (pg_stat_wal): a
    page's first change after each checkpoint is logged whole, so a write that touches pages
    scattered over tables larger than shared_buffers costs up to 8 kB per page, again after
    every checkpoint."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, wal_fpi FROM pg_stat_wal"
        )
        return cursor.fetchone()


DELETED_BYTES = """
SELECT (SELECT sum(pg_column_size(r.*)) FROM runs_run r WHERE r.workflow = %(w)s)
     + (SELECT sum(pg_column_size(e.*)) FROM runs_event e JOIN runs_run r ON r.id = e.run_id
        WHERE r.workflow = %(w)s)
     + (SELECT sum(pg_column_size(s.*)) FROM runs_step s JOIN runs_run r ON r.id = s.run_id
        WHERE r.workflow = %(w)s)
"""


def deleted_bytes() -> int:
    """What the rows the prune deletes hold, as stored (indexes not counted)."""
    with connection.cursor() as cursor:
        cursor.execute(DELETED_BYTES, {"w": PRUNED})
        return int(cursor.fetchone()[0])


def claim_latencies(stop, count: int | None, out) -> None:
    """A worker's idle claim (nothing it serves is runnable), back to back, `count` times or
    until `stop`; the latencies go to `out`. In a process of its own, as a worker is: the
    prune's Python must not hold its interpreter lock."""
    worker = WorkerProcess(concurrency=1)
    worker.register()
    samples: list[float] = []
    done = (lambda: len(samples) >= count) if count else stop.is_set
    try:
        while not done():
            began = time.perf_counter()
            assert worker.claim(1) == []
            samples.append(time.perf_counter() - began)
        worker.claims.mark_stopped()
    finally:
        connections.close_all()
    out.send(samples)


def claiming(count: int | None = None):
    """Start a claiming process; returns collect(), which stops it and gives its latencies."""
    connections.close_all()  # the child opens its own
    fork = multiprocessing.get_context("fork")
    stop, (receive, send) = fork.Event(), fork.Pipe(duplex=False)
    child = fork.Process(target=claim_latencies, args=(stop, count, send))
    child.start()

    def collect() -> list[float]:
        stop.set()
        samples = receive.recv()
        child.join()
        return samples

    return collect


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100_000)
    args = parser.parse_args()
    if connection.vendor != "postgresql":
        sys.exit("bench/prune.py needs PostgreSQL (its WAL is what it measures)")
    if error := prepare_database():
        sys.exit(error)
    bench_steps.delete_bench_rows()  # an interrupted invocation's runs, and the other benches'
    seed(args.runs)
    progress(f"[1] {BASELINE_CLAIMS} idle claims, nothing else running")
    collect = claiming(BASELINE_CLAIMS)
    baseline = collect()

    progress(f"[2] prune of {args.runs:,} runs, a worker claiming beside it")
    before, (lsn, fpi) = deleted_bytes(), wal()
    collect = claiming()
    began = time.monotonic()
    result = prune(finished_before=timezone.now() - timedelta(days=30), workflows=[PRUNED, KEPT])
    took = time.monotonic() - began
    during = collect()
    written, images = (after - at for after, at in zip(wal(), (lsn, fpi), strict=True))
    kept = Run.objects.filter(workflow=KEPT).count()
    progress("cleaning up")
    clean_up()

    print("Stepguard prune benchmark")
    print("=========================")
    print(f"PostgreSQL {connection.pg_version // 10000}: {args.runs:,} finished runs x ({EVENTS} "
          f"events, {STEPS} steps), {kept:,} waiting runs kept")  # fmt: skip
    print()
    print("[2] the prune, and a worker's idle claim beside it (median / p95 / max)")
    rows = [
        ["claim, nothing else running", *(f"{v * 1e3:.1f} ms" for v in
                                          (statistics.median(baseline), p(baseline, 95),
                                           max(baseline)))],
        [f"claim during the prune (n={len(during)})", *(f"{v * 1e3:.1f} ms" for v in
                                                         (statistics.median(during),
                                                          p(during, 95), max(during)))],
    ]  # fmt: skip
    print(table(["what", "median", "p95", "max"], rows))
    ratio = p(during, 95) / p(baseline, 95)
    print(f"  p95 during / p95 alone: {ratio:.2f}x")
    print(f"  pruned {result.runs:,} runs, {result.counts['events']:,} events, "
          f"{result.counts['steps']:,} steps in {took:.1f} s, {result.batches:,} batches "
          f"({result.runs / took:,.0f} runs/s)")  # fmt: skip
    print()
    print("[3] WAL written by the prune")
    rows = [
        ["WAL written (the whole server, autovacuum included)", f"{written / 2**20:,.1f} MB"],
        ["full-page images in it (8 kB each uncompressed)", f"{images:,}"],
        ["the rows it deletes, as stored (no indexes)", f"{before / 2**20:,.1f} MB"],
        ["WAL / rows deleted", f"{written / max(before, 1):.2f}x"],
        ["WAL per run pruned", f"{written / max(result.runs, 1) / 1024:,.2f} kB"],
        ["WAL per event pruned", f"{written / max(result.counts['events'], 1):,.0f} B"],
    ]
    print(table(["what", "value"], rows))
    print(f"  event partitions dropped whole: {', '.join(result.partitions_dropped) or 'none'}; "
          f"orphaned events deleted row by row: {result.orphaned_events:,}")  # fmt: skip
    print("  Runs and steps are deleted row by row; events leave with their month's partition.")


if __name__ == "__main__":
    main()
