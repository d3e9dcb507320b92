"""Stepguard load curve: offered runs/s rising until the step latency passes a bound.

    .venv/bin/python bench/load.py                      # workers on this host
    .venv/bin/python bench/load.py --processes 2 --rates 5,10,20,40,80 --stage 20
    .venv/bin/python bench/load.py --worker-cmd "ssh w1 'cd /srv/sg && .venv/bin/python \
        manage.py runworker --import bench.workflows'" --worker-cmd "ssh w2 ..."

Same database rules as bench/steps.py (DATABASE_URL, default stepguard_bench, migrated). Each
stage offers runs of `bench.load` (bench/workflows.py: 60% short, 20% model-call-like, 10% with
a durable timer, 10% waiting for a signal this process sends) at a fixed rate for `--stage`
seconds, lets the backlog drain, and measures from the rows:

- completed steps/s over the stage;
- claim latency: a run's creation (or its wake-up) to its next step's start, p50/p99;
- step cost: one no-op step's start to the next one's in the short runs (the checkpoint and the
  engine: what a step costs beyond its function), p50/p99;
- PostgreSQL CPU (its processes on this host, from /proc) and WAL bytes per completed step.

The curve stops at the first stage whose p99 claim latency passes `--bound` seconds or that
completes less than 90% of what it offered. Runs twice in a row on the same database: each
start prunes the runs an earlier one left.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from django.db import connection  # noqa: E402
from django.db.models.fields.json import KT  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.steps import pg_params, prepare_database, progress  # noqa: E402  (sets Django up)
from bench.workflows import load_workflow  # noqa: E402, F401  (registers bench.load)
from runs.models import TERMINAL_STATUSES, Run, RunStatus, Step, Worker  # noqa: E402
from runs.retention import prune  # noqa: E402
from runs.sdk import send_signal, start_run  # noqa: E402

WORKFLOW = "bench.load"
MIX = ["short"] * 6 + ["model"] * 2 + ["timer", "signal"]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def postgres_cpu_seconds() -> float:
    """CPU time of this host's postgres processes (0 when PostgreSQL runs elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        if name.startswith("postgres"):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def wal_lsn() -> int:
    with psycopg.connect(**pg_params(), autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    return int(row[0])


def clean() -> None:
    now = timezone.now()
    Run.objects.filter(workflow=WORKFLOW).exclude(status__in=TERMINAL_STATUSES).update(
        status=RunStatus.CANCELLED, finished_at=now, worker=None, lease_until=None
    )
    result = prune(finished_before=now + timedelta(seconds=1), workflows=[WORKFLOW])
    progress(f"pruned {result.runs} runs of an earlier load run")
    Worker.objects.filter(workflows=[f"{WORKFLOW}@1"]).delete()


def start_workers(commands: list[str]) -> list[subprocess.Popen]:
    launched = timezone.now()
    procs = [
        subprocess.Popen(command, shell=True, cwd=ROOT, start_new_session=True)
        for command in commands
    ]
    deadline = time.monotonic() + 90
    expected = len(commands)
    while Worker.objects.filter(started_at__gte=launched, stopped_at=None).count() < expected:
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop_workers(procs)
            raise SystemExit("the worker processes did not start")
        time.sleep(0.2)
    return procs


def stop_workers(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def signaller(stop: threading.Event) -> None:
    """Answers the runs that wait for `go`, as the outside world would, every 0.2 s."""
    while not stop.is_set():
        waiting = (
            Run.objects.filter(workflow=WORKFLOW, status=RunStatus.WAITING)
            .annotate(kind=KT("input__kind"))
            .filter(kind="signal")
            .values_list("pk", flat=True)
        )
        for run_id in waiting:
            send_signal(run_id, "go")
        connection.close()
        stop.wait(0.2)


def stage(rate: float, seconds: float, drain: float) -> dict:
    """Offer `rate` runs/s for `seconds`; wait up to `drain` s more for them; measure."""
    ids: list = []
    cpu0, wal0, began = postgres_cpu_seconds(), wal_lsn(), timezone.now()
    t0 = time.monotonic()
    owed = 0.0
    while (elapsed := time.monotonic() - t0) < seconds:
        owed = rate * elapsed - len(ids)
        for _ in range(int(owed)):
            kind = MIX[len(ids) % len(MIX)]
            ids.append(start_run(WORKFLOW, {"kind": kind}).pk)
        time.sleep(0.02)
    offered_for = time.monotonic() - t0
    deadline = time.monotonic() + drain
    while Run.objects.filter(pk__in=ids).exclude(status__in=TERMINAL_STATUSES).exists():
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    ended = timezone.now()
    cpu1, wal1 = postgres_cpu_seconds(), wal_lsn()
    steps = list(
        Step.objects.filter(run_id__in=ids)
        .order_by("run_id", "seq")
        .values_list("run_id", "seq", "kind", "started_at", "finished_at", "status")
    )
    runs = Run.objects.filter(pk__in=ids).annotate(kind=KT("input__kind"))
    created = dict(runs.values_list("pk", "created_at"))
    short = set(runs.filter(kind="short").values_list("pk", flat=True))
    completed = [s for s in steps if s[5] == "completed" and s[2] == "call"]
    claims, gaps = [], []
    previous: dict = {}
    for run_id, _seq, kind, started, finished, _status in steps:
        before = previous.get(run_id)
        if started is None:
            continue
        if before is None:
            claims.append((started - created[run_id]).total_seconds())
        elif before[0] != "call" and before[2] is not None:
            # After a wait the next step starts on a wake-up: that is a claim too.
            claims.append((started - before[2]).total_seconds())
        elif run_id in short:
            # No-op steps back to back: one step's start to the next one's is what a step
            # costs (its checkpoint, the engine), not what its function does.
            gaps.append((started - before[1]).total_seconds())
        previous[run_id] = (kind, started, finished)
    done_runs = Run.objects.filter(pk__in=ids, status=RunStatus.COMPLETED).count()
    wall = (ended - began).total_seconds()
    return {
        "offered": rate,
        "runs": len(ids),
        "done": done_runs,
        "steps_s": len(completed) / wall,
        "offered_s": len(ids) / offered_for,
        "claim50": statistics.median(claims) if claims else float("nan"),
        "claim99": percentile(claims, 0.99),
        "gap50": statistics.median(gaps) * 1000 if gaps else float("nan"),
        "gap99": percentile(gaps, 0.99) * 1000,
        "pg_cpu": (cpu1 - cpu0) / wall,
        "wal_step": (wal1 - wal0) / max(1, len(completed)),
    }


def saturated(row: dict, bound: float) -> str | None:
    """Why this stage is past what the deployment serves, or None."""
    if row["claim99"] > bound:
        return f"p99 claim latency {row['claim99']:.2f} s (bound {bound:g} s)"
    if row["done"] < 0.9 * row["runs"]:
        return f"{row['done']}/{row['runs']} done in the stage and its drain"
    if row["offered_s"] < 0.9 * row["offered"]:
        # start_run in this process competes with the workers and PostgreSQL for the host.
        return (
            f"the load generator could offer only {row['offered_s']:.1f} of "
            f"{row['offered']:g} runs/s on this host"
        )
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="local worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="threads per local process")
    parser.add_argument(
        "--worker-cmd", action="append", default=[],
        help="a worker's command (any host, e.g. over ssh); replaces the local processes",
    )  # fmt: skip
    parser.add_argument("--rates", default="5,10,20,40,80,160", help="offered runs/s per stage")
    parser.add_argument("--stage", type=float, default=15.0, help="seconds each rate is offered")
    parser.add_argument("--bound", type=float, default=1.0, help="p99 claim latency bound (s)")
    args = parser.parse_args()

    error = prepare_database()
    if error:
        raise SystemExit(error)
    clean()
    local = (
        f"{shlex.quote(sys.executable)} manage.py runworker --import bench.workflows "
        f"--concurrency {args.concurrency} --verbosity 0"
    )
    commands = args.worker_cmd or [local] * args.processes
    env_note = "" if args.worker_cmd else f"{args.processes} x {args.concurrency} threads, "
    procs = start_workers(commands)
    stop = threading.Event()
    answering = threading.Thread(target=signaller, args=(stop,), daemon=True)
    answering.start()
    rows = []
    try:
        for rate in (float(r) for r in args.rates.split(",")):
            progress(f"offering {rate:g} runs/s for {args.stage:g} s")
            row = stage(rate, args.stage, drain=max(10.0, args.stage))
            rows.append(row)
            if saturated(row, args.bound):
                break
    finally:
        stop.set()
        stop_workers(procs)
    print(f"Load curve: bench.load, {env_note}{os.cpu_count()} CPUs on this host")
    header = (
        "offered/s  runs  done  steps/s  claim p50  claim p99  step p50  step p99  pg CPU  WAL/step"
    )
    print(header)
    for r in rows:
        print(
            f"{r['offered_s']:9.1f}  {r['runs']:4d}  {r['done']:4d}  {r['steps_s']:7.1f}  "
            f"{r['claim50'] * 1000:7.0f}ms  {r['claim99'] * 1000:7.0f}ms  {r['gap50']:6.1f}ms  "
            f"{r['gap99']:6.1f}ms  {r['pg_cpu'] * 100:5.0f}%  {r['wal_step']:6.0f} B"
        )
    last = rows[-1] if rows else None
    why = saturated(last, args.bound) if last else None
    if last and why:
        print(f"Saturated at {last['offered_s']:.1f} runs/s offered: {why}.")
    else:
        print("Not saturated at the highest rate offered: pass higher --rates.")


if __name__ == "__main__":
    main()
