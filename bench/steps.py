"""Stepguard step benchmark: per-step overhead, replay, throughput, against a floor and DBOS.

    .venv/bin/python bench/steps.py

Uses DATABASE_URL (default postgres://postgres@127.0.0.1:5432/stepguard_bench), creating that
database and migrating it if needed; DBOS Transact gets its own database next to it
(`<name>_dbos`, dropped and recreated on every run; override with STEPGUARD_BENCH_DBOS_URL).
Progress goes to stderr, the report to stdout. See bench/README.md for what the figures mean.
"""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_DB_NAME = "stepguard_bench"
os.environ.setdefault("DATABASE_URL", f"postgres://postgres@127.0.0.1:5432/{DEFAULT_DB_NAME}")
# bench/requests_per_call.py runs the suite's workflows, which need its settings (its test app).
os.environ["DJANGO_SETTINGS_MODULE"] = os.environ.get(
    "STEPGUARD_BENCH_SETTINGS", "controlplane.settings"
)
# DEBUG would make Django keep every query in memory (and slow each one down): keep it off.
os.environ["DEBUG"] = "0"
os.environ.setdefault("SECRET_KEY", "stepguard-bench-throwaway-not-a-secret")
# The worker logs every finished run at INFO; that would bury the report.
os.environ.setdefault("LOG_LEVEL", "WARNING")
# DBOS reads DBOS__CLOUD, DBOS__CONDUCTOR_*, DBOS_DOMAIN... from the environment: none of that
# here, so nothing can switch on Conductor or OTLP export behind our back.
CLEARED_DBOS_ENV = sorted(name for name in os.environ if name.startswith("DBOS"))
for _name in CLEARED_DBOS_ENV:
    del os.environ[_name]

import django  # noqa: E402

django.setup()

import psycopg  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, connections, transaction  # noqa: E402
from django.db.models import F  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402
from psycopg import sql  # noqa: E402

from bench.workflows import noop, short_workflow  # noqa: E402  (bench.short registers)
from runs.engine.lifecycle import execute  # noqa: E402
from runs.engine.store import Lease  # noqa: E402
from runs.engine.worker import WorkerProcess  # noqa: E402
from runs.models import TERMINAL_STATUSES, Run, RunStatus, Worker  # noqa: E402
from runs.sdk import RunContext, start_run, workflow  # noqa: E402

# -- workload sizes and targets ----------------------------------------------------------------

LONG_STEPS = 1_000  # steps in the per-step / replay workflow
LONG_REPS = 2  # 1,000-step executions per engine, pooled for the per-step percentiles
WARMUP_STEPS = 50
REPLAY_REPS = 7
PROFILE_STEPS = 200  # steps in the statement-profile run
THROUGHPUT_RUNS = 200
THROUGHPUT_STEPS = 10
THREAD_COUNTS = (1, 4)
FLOW_VARIANTS = (  # [3c]: (label, workflow, concurrency keys)
    ("workflow limit 4 (not binding)", "bench.limited", 0),
    ("per-key limit 2, 50 keys", "bench.keyed", 50),
)
PROCESS_COUNTS = (1, 2, 4)  # `runworker --processes N --concurrency 4`
FLOOR_N = 2_000
DBOS_QUEUE_POLL = float(os.environ.get("STEPGUARD_BENCH_DBOS_POLL", "0.005"))
DRAIN_TIMEOUT = 120.0

TARGET_VS_DBOS = 1 / 3  # Stepguard per-step median at most a third of DBOS's
TARGET_VS_FLOOR = 5.0  # ... and within 5x of one INSERT + COMMIT
TARGET_THROUGHPUT_VS_DBOS = 3.0  # runs/s at 4 threads, at least 3x DBOS's queue
TARGET_REPLAY_S = 0.100  # replay of 1,000 completed steps

BENCH_WORKFLOWS = ("bench.long", "bench.short", "bench.limited", "bench.keyed")

# -- the workflows -----------------------------------------------------------------------------

MARKS: list[float] = []  # perf_counter() at workflow start and after every step return


@workflow("bench.long", version="1")
def long_workflow(ctx: RunContext, input: dict) -> int:
    MARKS.append(time.perf_counter())
    for i in range(input["steps"]):
        ctx.step("noop", noop, i)
        MARKS.append(time.perf_counter())
    return input["steps"]


def plain_loop(n: int) -> None:
    MARKS.append(time.perf_counter())
    for i in range(n):
        noop(i)
        MARKS.append(time.perf_counter())


# -- helpers -----------------------------------------------------------------------------------


def progress(message: str) -> None:
    print(f"... {message}", file=sys.stderr, flush=True)


def gaps(marks: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(marks)]


def p(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float | None, digits: int = 3) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


def us(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e6:.1f} us"


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("MET" if ok else "MISSED")


def table(headers: list[str], rows: list[list[Any]], right: set[int] | None = None) -> str:
    right = set(range(1, len(headers))) if right is None else right
    cells = [headers, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  " + "  ".join(parts).rstrip()

    rule = "  " + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


REMOTE_ATTEMPTS: list[str] = []


def _is_local(host: Any) -> bool:
    if not isinstance(host, str) or host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host.endswith(".localhost")


def _audit(event: str, args: tuple) -> None:
    # Every Python-level socket connect or DNS lookup that is not loopback (libpq's own sockets
    # are C-level and go to 127.0.0.1 anyway).
    if event == "socket.connect":
        address = args[1]
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not _is_local(host):
            REMOTE_ATTEMPTS.append(f"connect {address}")
    elif event == "socket.getaddrinfo" and not _is_local(args[0]):
        REMOTE_ATTEMPTS.append(f"getaddrinfo {args[0]!r}")


sys.addaudithook(_audit)


def host_cpu() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, sum(fields)


class CpuMeter:
    """Process CPU (all threads of this process) and whole-host CPU over a stretch of time."""

    def __enter__(self) -> CpuMeter:
        self.wall, self.proc, self.host = time.perf_counter(), time.process_time(), host_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.proc = time.process_time() - self.proc
        end = host_cpu()
        if self.host is None or end is None or end[1] == self.host[1]:
            self.host_busy = None
        else:
            self.host_busy = (end[0] - self.host[0]) / (end[1] - self.host[1])

    def summary(self) -> dict[str, float | None]:
        return {"proc_cpu": self.proc / self.wall, "host_busy": self.host_busy}


def pg_params(dbname: str | None = None) -> dict[str, Any]:
    db = settings.DATABASES["default"]
    params = {
        "host": db.get("HOST") or None,
        "port": db.get("PORT") or None,
        "user": db.get("USER") or None,
        "password": db.get("PASSWORD") or None,
        "dbname": dbname or db["NAME"],
    }
    return {k: v for k, v in params.items() if v is not None}


def ensure_database(name: str) -> bool:
    with psycopg.connect(**pg_params("postgres"), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
            return False
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return True


def drop_database(name: str, url: str | None = None) -> None:
    """Drop `name` on the server of `url` (default: the Stepguard database's server)."""
    server = psycopg.connect(url, dbname="postgres", autocommit=True) if url else None
    with server or psycopg.connect(**pg_params("postgres"), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def schema_drift() -> list[str]:
    """Tables and columns the models have but the database lacks: an edited migration that
    `migrate` will not re-apply (the project still rewrites 0001_initial in place)."""
    from django.apps import apps

    missing = []
    with connection.cursor() as cursor:
        tables = set(connection.introspection.table_names(cursor))
        for model in apps.get_models():
            table = model._meta.db_table
            if not model._meta.managed or model._meta.proxy:
                continue
            if table not in tables:
                missing.append(table)
                continue
            columns = {
                c.name for c in connection.introspection.get_table_description(cursor, table)
            }
            missing += [
                f"{table}.{f.column}"
                for f in model._meta.local_concrete_fields
                if f.column not in columns
            ]
    return missing


def prepare_database() -> str | None:
    """Create and migrate the bench database; rebuild it if its schema is stale. Error or None."""
    name = settings.DATABASES["default"]["NAME"]
    if ensure_database(name):
        progress(f"created database {name}")
    progress("migrate")
    call_command("migrate", verbosity=0, interactive=False)
    drift = schema_drift()
    if not drift:
        return None
    if name != DEFAULT_DB_NAME and os.environ.get("STEPGUARD_BENCH_REBUILD") != "1":
        return (
            f"database {name} lacks {', '.join(drift[:5])}{' ...' if len(drift) > 5 else ''} "
            "after migrate (a migration was edited in place); set STEPGUARD_BENCH_REBUILD=1 to "
            "drop and recreate it"
        )
    progress(f"stale schema ({', '.join(drift[:3])} missing): recreating database {name}")
    connection.close()
    drop_database(name)
    ensure_database(name)
    call_command("migrate", verbosity=0, interactive=False)
    drift = schema_drift()
    return f"schema still differs after rebuilding: {', '.join(drift[:5])}" if drift else None


def delete_bench_rows() -> None:
    """Remove runs of the bench workflows (and their steps, events, workers) from earlier runs,
    through the prune path: the history is append-only everywhere else. A run an interrupted
    bench left unfinished is marked cancelled first, or prune would keep it."""
    from runs.retention import prune

    names = list(BENCH_WORKFLOWS)
    now = timezone.now()
    Run.objects.filter(workflow__in=names).exclude(status__in=TERMINAL_STATUSES).update(
        status=RunStatus.CANCELLED, finished_at=now, worker=None, lease_until=None
    )
    result = prune(finished_before=now + timedelta(seconds=1), workflows=names, batch_size=20)
    progress(f"pruned {result.runs} runs of earlier bench runs ({result.counts['events']} events)")
    refs = [f"{name}@1" for name in BENCH_WORKFLOWS]
    Worker.objects.filter(workflows=refs).delete()
    Worker.objects.filter(workflows=["bench.short@1"]).delete()  # runworker --processes
    # What autovacuum does between two bench runs on a live system: without it the planner
    # works from the statistics of before the deletes and reads thousands of dead entries.
    with psycopg.connect(**pg_params(), autocommit=True) as conn:
        for table in ("runs_run", "runs_step", "runs_event"):
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))


# -- statement profile -------------------------------------------------------------------------


def classify(statement: str) -> str:
    s = " ".join(statement.split())
    if "event_seq = event_seq +" in s:
        return "UPDATE runs_run (fence)"
    m = re.match(r'(INSERT INTO|UPDATE|DELETE FROM)\s+"?(\w+)"?', s, re.IGNORECASE)
    if m:
        return f"{m[1].split()[0].upper()} {m[2]}"
    verb = s.split(" ", 1)[0].upper()
    m = re.search(r'\bFROM\s+"?(\w+)"?', s, re.IGNORECASE)
    if verb == "SELECT" and m:
        return f"SELECT {m[1]}" + (" FOR UPDATE" if "FOR UPDATE" in s.upper() else "")
    return s[:40]


class SqlProfile:
    """Wall time per kind of statement (Django execute_wrapper) and per COMMIT."""

    def __init__(self) -> None:
        self.time: dict[str, float] = defaultdict(float)
        self.count: Counter[str] = Counter()

    def __call__(self, execute: Callable, sql_: str, params: Any, many: bool, context: Any):
        t0 = time.perf_counter()
        try:
            return execute(sql_, params, many, context)
        finally:
            label = classify(sql_)
            self.time[label] += time.perf_counter() - t0
            self.count[label] += 1

    @contextmanager
    def attached(self) -> Iterator[SqlProfile]:
        wrapper = connections["default"]
        original = wrapper._commit

        def timed_commit():
            t0 = time.perf_counter()
            try:
                return original()
            finally:
                self.time["COMMIT"] += time.perf_counter() - t0
                self.count["COMMIT"] += 1

        wrapper._commit = timed_commit
        try:
            with wrapper.execute_wrapper(self):
                yield self
        finally:
            del wrapper._commit

    @property
    def statements(self) -> int:
        return sum(n for label, n in self.count.items() if label != "COMMIT")

    @property
    def db_time(self) -> float:
        return sum(self.time.values())


# -- 4. the floor ------------------------------------------------------------------------------


def measure_floor() -> dict[str, Any]:
    progress(f"floor: {FLOOR_N} x INSERT + COMMIT with plain psycopg")
    out: dict[str, Any] = {}
    with psycopg.connect(**pg_params(), autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor_scratch "
            "(id bigserial PRIMARY KEY, payload jsonb NOT NULL, created_at timestamptz NOT NULL)"
        )
        try:
            insert = (
                "INSERT INTO bench_floor_scratch (payload, created_at) VALUES (%s::jsonb, now())"
            )
            for i in range(100):  # warm-up
                conn.execute(insert, [f'{{"i": {i}}}'])
            samples = []
            for i in range(FLOOR_N):
                t0 = time.perf_counter()
                conn.execute(insert, [f'{{"i": {i}}}'])
                samples.append(time.perf_counter() - t0)
            out["insert"] = samples
            samples = []
            for _ in range(FLOOR_N):
                t0 = time.perf_counter()
                conn.execute("SELECT 1").fetchone()
                samples.append(time.perf_counter() - t0)
            out["select1"] = samples
        finally:
            conn.execute("DROP TABLE IF EXISTS bench_floor_scratch")
    samples = []
    with connection.cursor() as cursor:
        for _ in range(FLOOR_N):
            t0 = time.perf_counter()
            cursor.execute("SELECT 1")
            cursor.fetchone()
            samples.append(time.perf_counter() - t0)
    out["select1_django"] = samples
    samples = []
    for _ in range(20):
        connection.close()
        t0 = time.perf_counter()
        connection.ensure_connection()
        samples.append(time.perf_counter() - t0)
    out["connect"] = samples
    return out


# -- 1-3. Stepguard ----------------------------------------------------------------------------


def run_long(claimer: WorkerProcess, steps: int) -> tuple[list[float], float, Any]:
    """Start a run of bench.long, claim it and execute it in this thread; per-step gaps."""
    started = start_run("bench.long", {"steps": steps})
    claimed = claimer.claim(1)
    if len(claimed) != 1 or claimed[0].id != started.id:
        raise RuntimeError(f"expected to claim run {started.id}, claimed {claimed}")
    run = claimed[0]
    MARKS.clear()
    t0 = time.perf_counter()
    outcome = execute(run, Lease(run.id, run.lease_epoch))
    wall = time.perf_counter() - t0
    if outcome != "completed":
        raise RuntimeError(f"bench.long run {run.id} ended {outcome!r}")
    return gaps(MARKS), wall, run.id


def reopen(run_id: Any, worker_id: Any) -> Run:
    """Put a completed run back to `running` under a fresh lease epoch, as a resume would."""
    Run.objects.filter(pk=run_id).update(
        status=RunStatus.RUNNING,
        worker_id=worker_id,
        lease_until=timezone.now() + timedelta(minutes=10),
        lease_epoch=F("lease_epoch") + 1,
        output=None,
        finished_at=None,
    )
    return Run.objects.get(pk=run_id)


def replay(run_id: Any, worker_id: Any) -> dict[str, Any]:
    times = []
    for _ in range(REPLAY_REPS):
        run = reopen(run_id, worker_id)
        before = run.event_seq
        t0 = time.perf_counter()
        outcome = execute(run, Lease(run.id, run.lease_epoch))
        times.append(time.perf_counter() - t0)
        after = Run.objects.values_list("event_seq", flat=True).get(pk=run_id)
        # One event (run.completed) and nothing else: no step ran or wrote again.
        if outcome != "completed" or after != before + 1:
            raise RuntimeError(f"replay of {run_id}: {outcome}, event_seq {before} -> {after}")
    run = reopen(run_id, worker_id)
    profile = SqlProfile()
    with CaptureQueriesContext(connection) as captured, profile.attached():
        t0 = time.perf_counter()
        execute(run, Lease(run.id, run.lease_epoch))
        captured_wall = time.perf_counter() - t0
    return {
        "times": times,
        "queries": [q["sql"] for q in captured.captured_queries],
        "profile": profile,
        "captured_wall": captured_wall,
    }


def step_profile(claimer: WorkerProcess) -> dict[str, Any]:
    started = start_run("bench.long", {"steps": PROFILE_STEPS})
    run = claimer.claim(1)[0]
    assert run.id == started.id
    profile = SqlProfile()
    with profile.attached():
        t0 = time.perf_counter()
        execute(run, Lease(run.id, run.lease_epoch))
        wall = time.perf_counter() - t0
    return {"profile": profile, "wall": wall}


RUN_PROFILE_REPS = 7


def run_profile(claimer: WorkerProcess) -> dict[str, dict[str, Any]]:
    """What one 10-step run costs, phase by phase, serially in this thread (median of reps)."""
    samples: dict[str, list[tuple[SqlProfile, float]]] = defaultdict(list)

    def timed(phase: str, fn: Callable[[], Any]) -> Any:
        with SqlProfile().attached() as prof:
            t0 = time.perf_counter()
            value = fn()
            samples[phase].append((prof, time.perf_counter() - t0))
        return value

    for _ in range(RUN_PROFILE_REPS):
        started = timed("start_run", lambda: start_run("bench.short", {"steps": THROUGHPUT_STEPS}))
        run = timed("claim", lambda: claimer.claim(1)[0])
        assert run.id == started.id
        timed("execute", lambda run=run: execute(run, Lease(run.id, run.lease_epoch)))
    return {
        phase: {
            "statements": rows[-1][0].statements,
            "commits": rows[-1][0].count["COMMIT"],
            "wall": statistics.median(wall for _, wall in rows),
            "db": statistics.median(prof.db_time for prof, _ in rows),
        }
        for phase, rows in samples.items()
    }


def register_flow_workflows() -> None:
    """[3c]'s workflows: the same 10 no-op steps under a workflow limit and under per-key
    limits. Registered only when [3c] starts, so the claims measured before it (and in DBOS's
    turns) run with no limited workflow in the process."""
    for name, options in (
        ("bench.limited", {"concurrency": 4}),  # as many as the threads: never binding
        ("bench.keyed", {"concurrency_key": lambda input: input["key"], "per_key": 2}),
    ):
        workflow(name, version="1", **options)(short_workflow)


def throughput(threads: int, name: str = "bench.short", keys: int = 0) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = [
        start_run(name, {"steps": THROUGHPUT_STEPS, "key": f"k{i % keys}" if keys else ""}).id
        for i in range(THROUGHPUT_RUNS)
    ]
    enqueue = time.perf_counter() - t0
    worker = WorkerProcess(concurrency=threads, poll_interval=0.05, grace=5)
    worker.register()
    deadline = time.monotonic() + DRAIN_TIMEOUT
    try:
        with CpuMeter() as cpu:
            while True:
                worker.bell.clear()
                if worker.tick():
                    continue
                if not worker.active:
                    left = Run.objects.filter(id__in=ids).exclude(status__in=TERMINAL_STATUSES)
                    if not left.exists():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{threads} thread(s): not drained in {DRAIN_TIMEOUT}s")
                worker.bell.wait(0.05)
    finally:
        worker.stopping.set()
        worker.shutdown()
    statuses = Counter(Run.objects.filter(id__in=ids).values_list("status", flat=True))
    if statuses != {RunStatus.COMPLETED: THROUGHPUT_RUNS}:
        raise RuntimeError(f"{threads}-thread throughput: run statuses {dict(statuses)}")
    return {"enqueue": enqueue, "drain": cpu.wall, **cpu.summary()}


def process_throughput(processes: int) -> dict[str, Any]:
    """`runworker --processes N --concurrency 4` draining 200 runs, as a deployment runs it.

    The workers are started and registered first (their start-up is not timed); the runs are
    created in one transaction, and the drain is timed from its commit (NOTIFY wakes the
    workers) until every run has completed.
    """
    launched = timezone.now()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", "LOG_LEVEL": "WARNING"}
    argv = [
        sys.executable, "manage.py", "runworker", "--processes", str(processes),
        "--concurrency", "4", "--poll-interval", "0.05", "--import", "bench.workflows",
        "--verbosity", "0",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while Worker.objects.filter(started_at__gte=launched, stopped_at=None).count() < processes:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{processes} worker process(es) did not start")
            time.sleep(0.05)
        with transaction.atomic():
            ids = [
                start_run("bench.short", {"steps": THROUGHPUT_STEPS}).id
                for _ in range(THROUGHPUT_RUNS)
            ]
        t0 = time.perf_counter()
        cpu0 = host_cpu()
        left = Run.objects.filter(id__in=ids).exclude(status__in=TERMINAL_STATUSES)
        while left.exists():
            if time.perf_counter() - t0 > DRAIN_TIMEOUT:
                raise RuntimeError(f"{processes} process(es): not drained in {DRAIN_TIMEOUT}s")
            time.sleep(0.01)
        drain = time.perf_counter() - t0
        cpu1 = host_cpu()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    statuses = Counter(Run.objects.filter(id__in=ids).values_list("status", flat=True))
    if statuses != {RunStatus.COMPLETED: THROUGHPUT_RUNS}:
        raise RuntimeError(f"{processes} process(es): run statuses {dict(statuses)}")
    busy = None
    if cpu0 and cpu1 and cpu1[1] > cpu0[1]:
        busy = (cpu1[0] - cpu0[0]) / (cpu1[1] - cpu0[1])
    return {"drain": drain, "host_cpu": busy}


# -- 5. DBOS Transact --------------------------------------------------------------------------


def dbos_url(name: str) -> str:
    params = pg_params(name)
    auth = params.get("user", "")
    if params.get("password"):
        auth += f":{params['password']}"
    host = params.get("host", "127.0.0.1")
    port = params.get("port", 5432)
    return f"postgresql://{auth}{'@' if auth else ''}{host}:{port}/{name}"


class DbosBench:
    """The same workloads on DBOS Transact, launched once in this process.

    Any failure is kept in `out["error"]` and stops further DBOS measurements; the Stepguard
    ones go on.
    """

    IDLE_POLL = 1.0  # a drained queue's polling, while other things are measured

    def __init__(self) -> None:
        self.out: dict[str, Any] = {"error": None}
        self.launched = False
        self.DBOS: Any = None

    @property
    def ok(self) -> bool:
        return self.launched and self.out["error"] is None

    def fail(self, exc: BaseException) -> None:
        self.out["error"] = f"{type(exc).__name__}: {exc}"
        progress(f"DBOS failed: {self.out['error']}")

    def start(self) -> None:
        try:
            from dbos import DBOS, DBOSConfig
        except ImportError as exc:
            self.out["error"] = (
                f"DBOS is not importable ({exc}); install it with "
                ".venv/bin/pip install -e '.[bench]'"
            )
            return
        self.DBOS = DBOS
        self.out["version"] = metadata.version("dbos")
        name = settings.DATABASES["default"]["NAME"] + "_dbos"
        url = os.environ.get("STEPGUARD_BENCH_DBOS_URL") or dbos_url(name)
        self.url, self.out["database"] = url, url.rsplit("/", 1)[-1].split("?")[0]
        try:
            progress(f"DBOS {self.out['version']}: fresh database {self.out['database']}, launch")
            # DBOS recreates it: a clean slate, so no recovery of runs left by an earlier run.
            drop_database(self.out["database"], url)

            noop_step = DBOS.step(name="bench_noop")(noop)
            self.finished = {"count": 0, "target": 0}
            self.lock, self.all_done = threading.Lock(), threading.Event()

            @DBOS.workflow(name="bench_long")
            def dbos_long(n: int) -> int:
                MARKS.append(time.perf_counter())
                for i in range(n):
                    noop_step(i)
                    MARKS.append(time.perf_counter())
                return n

            @DBOS.workflow(name="bench_short")
            def dbos_short(n: int) -> int:
                for i in range(n):
                    noop_step(i)
                with self.lock:
                    self.finished["count"] += 1
                    if self.finished["count"] >= self.finished["target"]:
                        self.all_done.set()
                return n

            self.dbos_long, self.dbos_short = dbos_long, dbos_short
            config: DBOSConfig = {
                "name": "stepguard-bench",
                "system_database_url": url,
                "enable_otlp": False,  # no OTLP traces or logs exported anywhere
                "log_level": "WARNING",
                # No conductor_key / conductor_url: no websocket to DBOS Conductor.
            }
            self.out["offline"] = (
                "enable_otlp=False, no conductor_key/conductor_url, DBOS* environment cleared"
                + (f" ({', '.join(CLEARED_DBOS_ENV)})" if CLEARED_DBOS_ENV else "")
            )
            DBOS(config=config)
            DBOS.launch()
            self.launched = True
            MARKS.clear()
            dbos_long(WARMUP_STEPS)
        except Exception as exc:
            self.fail(exc)

    def long(self, steps: int) -> tuple[list[float], float] | None:
        if not self.ok:
            return None
        try:
            MARKS.clear()
            t0 = time.perf_counter()
            self.dbos_long(steps)
            return gaps(MARKS), time.perf_counter() - t0
        except Exception as exc:
            self.fail(exc)
            return None

    def queue_throughput(self, threads: int) -> dict[str, Any] | None:
        if not self.ok:
            return None
        try:
            # Registered only now, so its worker thread polls at DBOS_QUEUE_POLL from the start
            # (a queue's polling interval only decays slowly towards a lowered value), and
            # paused (worker_concurrency=0) while we enqueue.
            queue = self.DBOS.register_queue(
                f"bench-{threads}", worker_concurrency=0, polling_interval_sec=DBOS_QUEUE_POLL
            )
            self.finished.update(count=0, target=THROUGHPUT_RUNS)
            self.all_done.clear()
            t0 = time.perf_counter()
            handles = [
                queue.enqueue(self.dbos_short, THROUGHPUT_STEPS) for _ in range(THROUGHPUT_RUNS)
            ]
            enqueue = time.perf_counter() - t0
            time.sleep(1.5)  # DBOS starts a queue's worker thread within a second of registration
            with psycopg.connect(self.url, autocommit=True) as watch, CpuMeter() as cpu:
                queue.set_worker_concurrency(threads)  # unpause
                if not self.all_done.wait(DRAIN_TIMEOUT):
                    raise RuntimeError(f"DBOS queue bench-{threads} did not drain")
                while True:  # the last workflow's status row is written after it returns
                    (done,) = watch.execute(
                        "SELECT count(*) FROM dbos.workflow_status "
                        "WHERE queue_name = %s AND status = 'SUCCESS'",
                        [f"bench-{threads}"],
                    ).fetchone()
                    if done >= THROUGHPUT_RUNS:
                        break
                    time.sleep(0.001)
            queue.set_worker_concurrency(0)
            queue.set_polling_interval_sec(self.IDLE_POLL)  # stop loading the host from now on
            if [h.get_result() for h in handles] != [THROUGHPUT_STEPS] * THROUGHPUT_RUNS:
                raise RuntimeError(f"DBOS queue bench-{threads}: unexpected results")
            return {"enqueue": enqueue, "drain": cpu.wall, **cpu.summary()}
        except Exception as exc:
            self.fail(exc)
            return None

    def direct_throughput(self, threads: int) -> dict[str, Any] | None:
        if not self.ok:
            return None

        def call_until_done(tickets: Iterator[int]) -> None:
            while next(tickets) < THROUGHPUT_RUNS:
                self.dbos_short(THROUGHPUT_STEPS)

        try:
            self.finished.update(count=0, target=10**9)
            tickets = itertools.count()
            pool = [
                threading.Thread(target=call_until_done, args=(tickets,)) for _ in range(threads)
            ]
            with CpuMeter() as cpu:
                for thread in pool:
                    thread.start()
                for thread in pool:
                    thread.join()
            if self.finished["count"] != THROUGHPUT_RUNS:
                raise RuntimeError(f"DBOS direct: {self.finished['count']} runs finished")
            return {"enqueue": None, "drain": cpu.wall, **cpu.summary()}
        except Exception as exc:
            self.fail(exc)
            return None

    def close(self) -> None:
        if self.launched:
            try:
                self.DBOS.destroy(destroy_registry=True)
            except Exception as exc:
                progress(f"DBOS.destroy failed: {exc}")


# -- the driver: both engines, interleaved -----------------------------------------------------


def run_all() -> tuple[dict[str, Any], dict[str, Any]]:
    """Stepguard alone (replay, profiles), then both engines turn by turn (per-step,
    throughput), so drifting load on the host hits both alike."""
    sg: dict[str, Any] = {"steps": [], "walls": []}
    dbos = DbosBench()
    claimer = WorkerProcess(concurrency=1)
    claimer.register()
    try:
        # Stepguard-only measurements first, before DBOS's background threads share the process.
        progress("Stepguard: warm-up")
        run_long(claimer, WARMUP_STEPS)
        progress(f"Stepguard: a {LONG_STEPS}-step run to replay")
        *_, completed = run_long(claimer, LONG_STEPS)
        progress(f"Stepguard: replaying {LONG_STEPS} completed steps x {REPLAY_REPS + 1}")
        sg["replay"] = replay(completed, claimer.id)
        progress(f"Stepguard: statement profile of a {PROFILE_STEPS}-step workflow")
        sg["profile"] = step_profile(claimer)
        sg["run_profile"] = run_profile(claimer)

        # Then both engines, turn by turn.
        dbos.start()
        db = dbos.out
        db.update(steps=[], walls=[])
        for rep in range(1, LONG_REPS + 1):
            progress(f"{LONG_STEPS}-step workflow, repetition {rep}/{LONG_REPS}: Stepguard")
            samples, wall, _ = run_long(claimer, LONG_STEPS)
            sg["steps"] += samples
            sg["walls"].append(wall)
            if dbos.ok:
                progress(f"{LONG_STEPS}-step workflow, repetition {rep}/{LONG_REPS}: DBOS")
                measured = dbos.long(LONG_STEPS)
                if measured:
                    db["steps"] += measured[0]
                    db["walls"].append(measured[1])
        for threads in THREAD_COUNTS:
            what = f"{THROUGHPUT_RUNS} runs x {THROUGHPUT_STEPS} steps, {threads} thread(s)"
            progress(f"{what}: Stepguard")
            sg[f"tp{threads}"] = throughput(threads)
            if dbos.ok:
                progress(f"{what}: DBOS queue")
                db[f"tp{threads}"] = dbos.queue_throughput(threads)
            if dbos.ok:
                progress(f"{what}: DBOS direct calls")
                db[f"direct{threads}"] = dbos.direct_throughput(threads)
        for processes in PROCESS_COUNTS:
            progress(f"{THROUGHPUT_RUNS} runs x {THROUGHPUT_STEPS} steps: {processes} process(es)")
            sg[f"proc{processes}"] = process_throughput(processes)
        register_flow_workflows()
        for label, name, keys in FLOW_VARIANTS:
            progress(f"{THROUGHPUT_RUNS} runs x {THROUGHPUT_STEPS} steps, 4 threads: {label}")
            sg[f"flow:{name}"] = throughput(4, name, keys)
    finally:
        claimer.stopping.set()
        claimer.shutdown()
        dbos.close()
    return sg, db


# -- the report --------------------------------------------------------------------------------


def environment() -> list[str]:
    with psycopg.connect(**pg_params(), autocommit=True) as conn:
        version = conn.execute("SHOW server_version").fetchone()[0]
        sync = conn.execute("SHOW synchronous_commit").fetchone()[0]
        fsync = conn.execute("SHOW fsync").fetchone()[0]
    db = settings.DATABASES["default"]
    dbos = "not installed"
    with suppress(metadata.PackageNotFoundError):
        dbos = metadata.version("dbos")
    return [
        f"PostgreSQL {version} at {db.get('HOST') or 'local socket'}:{db.get('PORT') or 5432}"
        f"/{db['NAME']} (synchronous_commit={sync}, fsync={fsync})",
        f"Python {platform.python_version()}, Django {django.get_version()}, "
        f"psycopg {psycopg.__version__}, dbos {dbos}, {os.cpu_count()} CPUs, {platform.machine()}",
    ]


def cpu_cells(t: dict) -> list[str]:
    host = t.get("host_busy")
    return [f"{t['proc_cpu']:.0%}", "n/a" if host is None else f"{host:.0%}"]


def report(env: list[str], floor: dict, sg: dict, db: dict, elapsed: float) -> str:
    out: list[str] = []
    w = out.append
    floor_med = statistics.median(floor["insert"])
    w("Stepguard step benchmark")
    w("=" * 24)
    for line in env:
        w(line)
    w("")

    w(f"[4] Floor: one round trip with plain psycopg (autocommit), n={FLOOR_N}")
    w(
        table(
            ["what", "median", "p99"],
            [
                ["INSERT + COMMIT (scratch table)", ms(floor_med), ms(p(floor["insert"], 99))],
                ["SELECT 1", ms(statistics.median(floor["select1"])), ms(p(floor["select1"], 99))],
                [
                    "SELECT 1 via a Django cursor",
                    ms(statistics.median(floor["select1_django"])),
                    ms(p(floor["select1_django"], 99)),
                ],
                [
                    "new Django connection (n=20)",
                    ms(statistics.median(floor["connect"])),
                    ms(p(floor["connect"], 99)),
                ],
            ],
        )
    )
    w("")

    plain = MARKS_PLAIN
    plain_med = statistics.median(plain)
    sg_med, sg_p99 = statistics.median(sg["steps"]), p(sg["steps"], 99)
    db_ok = db.get("error") is None and "steps" in db
    db_med = statistics.median(db["steps"]) if db_ok else None
    db_p99 = p(db["steps"], 99) if db_ok else None
    w(
        f"[1] Per-step time, {LONG_STEPS}-step workflow of a no-op step "
        f"(gap between consecutive step returns, {LONG_REPS} x {LONG_STEPS} samples)"
    )
    rows = [
        ["plain Python loop", us(plain_med), us(p(plain, 99)), "-", "-", "-"],
        [
            "Stepguard",
            ms(sg_med),
            ms(sg_p99),
            ms(sg_med - plain_med),
            ratio(sg_med, floor_med),
            f"{statistics.median(sg['walls']):.2f} s",
        ],
    ]
    if db_ok:
        rows.append(
            [
                f"DBOS {db['version']}",
                ms(db_med),
                ms(db_p99),
                ms(db_med - plain_med),
                ratio(db_med, floor_med),
                f"{statistics.median(db['walls']):.2f} s",
            ]
        )
    else:
        rows.append(["DBOS", "n/a", "n/a", "n/a", "n/a", "n/a"])
    w(table(["engine", "median", "p99", "overhead", "median/floor", f"{LONG_STEPS} steps"], rows))
    w("  overhead = median minus the plain loop's; median/floor = median / INSERT+COMMIT median.")
    if db_ok:
        w(
            f"  Stepguard/DBOS per-step time: median {ratio(sg_med, db_med)}, "
            f"p99 {ratio(sg_p99, db_p99)} (below 1 = Stepguard faster)."
        )
    w(
        f"  Targets: Stepguard/DBOS median <= {TARGET_VS_DBOS:.2f}x, "
        f"Stepguard median/floor <= {TARGET_VS_FLOOR:g}x (verdicts at the end)."
    )
    w("")

    rp = sg["replay"]
    rp_med = statistics.median(rp["times"])
    kinds = Counter(
        q.strip().upper() if q.strip().upper() in ("BEGIN", "COMMIT") else "stmt"
        for q in rp["queries"]
    )
    w(
        f"[2] Replay of {LONG_STEPS} completed steps: executor.execute on the reopened run "
        f"(fresh lease epoch), {REPLAY_REPS} repetitions"
    )
    w(
        table(
            ["what", "value"],
            [
                ["median", ms(rp_med, 1)],
                ["target", f"< {ms(TARGET_REPLAY_S, 0)}"],
                ["min / max", f"{ms(min(rp['times']), 1)} / {ms(max(rp['times']), 1)}"],
                ["per replayed step (median)", us(rp_med / LONG_STEPS)],
                [
                    "queries (CaptureQueriesContext)",
                    f"{len(rp['queries'])}: {kinds['stmt']} statements + {kinds['BEGIN']} BEGIN"
                    f" + {kinds['COMMIT']} COMMIT",
                ],
            ],
        )
    )
    prof: SqlProfile = rp["profile"]
    w("  statements (wall time of the captured repetition):")
    for label, n in prof.count.most_common():
        w(f"    {n:>3} x {label:<28} {ms(prof.time[label])}")
    w(
        f"    Python (model instantiation, replay loop, JSON), by difference: "
        f"{ms(rp['captured_wall'] - prof.db_time, 1)} of {ms(rp['captured_wall'], 1)}"
    )
    w("")

    w(
        f"[3] Throughput: {THROUGHPUT_RUNS} runs x {THROUGHPUT_STEPS} no-op steps "
        "(runs created first, then drained; runs/s and steps/s over the drain)"
    )
    rows = []
    sg_rates = {}
    for threads in THREAD_COUNTS:
        t = sg[f"tp{threads}"]
        sg_rates[threads] = THROUGHPUT_RUNS / t["drain"]
        rows.append(
            [
                "Stepguard WorkerProcess.tick",
                threads,
                f"{t['enqueue']:.2f} s",
                f"{t['drain']:.2f} s",
                f"{sg_rates[threads]:.1f}",
                f"{sg_rates[threads] * THROUGHPUT_STEPS:.0f}",
                *cpu_cells(t),
                "-",
            ]
        )
    for mode, label in (("tp", "DBOS queue"), ("direct", "DBOS direct call, no queue")):
        for threads in THREAD_COUNTS:
            t = db.get(f"{mode}{threads}")
            if t is None:
                rows.append([label, threads, *["n/a"] * 7])
                continue
            rate = THROUGHPUT_RUNS / t["drain"]
            rows.append(
                [
                    label,
                    threads,
                    "-" if t["enqueue"] is None else f"{t['enqueue']:.2f} s",
                    f"{t['drain']:.2f} s",
                    f"{rate:.1f}",
                    f"{rate * THROUGHPUT_STEPS:.0f}",
                    *cpu_cells(t),
                    ratio(sg_rates[threads], rate),
                ]
            )
    w(
        table(
            [
                "engine",
                "threads",
                f"create {THROUGHPUT_RUNS}",
                "drain",
                "runs/s",
                "steps/s",
                "py CPU",
                "host CPU",
                "Stepguard/this",
            ],
            rows,
            right=set(range(1, 9)),
        )
    )
    w(
        f"  DBOS queue: registered with polling_interval_sec={DBOS_QUEUE_POLL:g} and paused "
        "(worker_concurrency=0) while enqueuing, then set to the thread count."
    )
    w("  Stepguard: runs claimed by WorkerProcess.tick() in this thread, executed on its pool.")
    w("  Stepguard/this: Stepguard's runs/s at that thread count / this row's (above 1: faster).")
    w(
        f"  py CPU: CPU time of this Python process / drain time (100% = one core, the most "
        f"one GIL allows for Python code); host CPU: all {os.cpu_count()} CPUs busy, PostgreSQL "
        "included."
    )
    rprof = sg["run_profile"]
    parts = []
    for phase in ("start_run", "claim", "execute"):
        ph = rprof[phase]
        parts.append(
            f"{phase:<9} {ph['statements']:>3} statements + {ph['commits']:>2} BEGIN/COMMIT  "
            f"{ms(ph['wall'], 2):>9}, of which {ms(ph['db'], 2)} in database calls"
        )
    w(f"  One {THROUGHPUT_STEPS}-step run, serially in one thread (median of {RUN_PROFILE_REPS}):")
    for part in parts:
        w(f"    {part}")
    w("")

    w(
        f"[3b] Throughput with worker processes: `runworker --processes N --concurrency 4`, "
        f"{THROUGHPUT_RUNS} runs x {THROUGHPUT_STEPS} steps, created in one transaction, drained"
    )
    one = sg["proc1"]["drain"] if "proc1" in sg else None
    dbos4 = db.get("tp4")
    rows = []
    for processes in PROCESS_COUNTS:
        t = sg[f"proc{processes}"]
        rate = THROUGHPUT_RUNS / t["drain"]
        rows.append(
            [
                processes,
                f"{t['drain']:.2f} s",
                f"{rate:.1f}",
                f"{rate * THROUGHPUT_STEPS:.0f}",
                "-" if t["host_cpu"] is None else f"{t['host_cpu']:.0%}",
                ratio(one, t["drain"]),
                ratio(rate, THROUGHPUT_RUNS / dbos4["drain"]) if dbos4 else "n/a",
            ]
        )
    w(
        table(
            ["processes", "drain", "runs/s", "steps/s", "host CPU", "vs 1", "vs DBOS queue 4"],
            rows,
            right=set(range(0, 7)),
        )
    )
    w(
        f"  On {os.cpu_count()} CPUs shared with PostgreSQL: more processes than cores only add "
        "contention; each process adds one GIL's worth of Python."
    )
    w("")
    w(
        f"[3c] Claims under flow control: {THROUGHPUT_RUNS} runs x {THROUGHPUT_STEPS} steps, "
        "4 threads, as in [3]; each limited workflow's due runs are claimed under its lock"
    )
    off = sg["tp4"]["drain"]
    rows = [["no limits ([3], 4 threads)", f"{off:.2f} s", f"{THROUGHPUT_RUNS / off:.1f}", "1.00x"]]
    for label, name, _ in FLOW_VARIANTS:
        t = sg[f"flow:{name}"]
        rows.append(
            [
                label,
                f"{t['drain']:.2f} s",
                f"{THROUGHPUT_RUNS / t['drain']:.1f}",
                ratio(off, t["drain"]),
            ]
        )
    w(table(["claims", "drain", "runs/s", "vs no limits"], rows, right={1, 2, 3}))
    w("  A workflow limit of 4 never binds with 4 threads: what it costs is the claim path alone.")
    w("")

    sp = sg["profile"]
    prof = sp["profile"]
    per_step = sp["wall"] / PROFILE_STEPS
    w(
        f"Where a Stepguard step's time goes ({PROFILE_STEPS}-step workflow, wall time per "
        "statement kind via connection.execute_wrapper; BEGIN is sent by psycopg with a "
        "transaction's first statement and counted there)"
    )
    rows = []
    for label, n in sorted(prof.count.items(), key=lambda kv: -prof.time[kv[0]]):
        per = prof.time[label] / PROFILE_STEPS
        rows.append(
            [
                label,
                f"{n / PROFILE_STEPS:.2f}",
                us(prof.time[label] / n),
                us(per),
                f"{per / per_step:.0%}",
            ]
        )
    other = sp["wall"] - prof.db_time
    rows.append(
        [
            "Python (engine + ORM), by difference",
            "-",
            "-",
            us(other / PROFILE_STEPS),
            f"{other / sp['wall']:.0%}",
        ]
    )
    rows.append(["total per step", "-", "-", us(per_step), "100%"])
    w(table(["statement", "per step", "each", "per step time", "share"], rows))
    commits = prof.count["COMMIT"] / PROFILE_STEPS
    w(
        f"  Round trips per step: {prof.statements / PROFILE_STEPS:.2f} statements + "
        f"{commits:.2f} BEGIN + {commits:.2f} COMMIT = "
        f"{prof.statements / PROFILE_STEPS + 2 * commits:.1f} (the floor is 1)."
    )
    w("")

    w("Targets")
    vs_dbos = sg_med / db_med if db_med else None
    vs_floor = sg_med / floor_med
    tp_ratio = (db["tp4"]["drain"] / sg["tp4"]["drain"]) if db.get("tp4") else None
    tp_measured = "n/a" if tp_ratio is None else f"{tp_ratio:.2f}x DBOS queue"
    w(
        table(
            ["target", "measured", "verdict"],
            [
                [
                    "Stepguard per-step median <= 1/3 of DBOS's",
                    "n/a"
                    if vs_dbos is None
                    else f"{vs_dbos:.2f}x DBOS (p99 {ratio(sg_p99, db_p99)})",
                    verdict(None if vs_dbos is None else vs_dbos <= TARGET_VS_DBOS),
                ],
                [
                    f"Stepguard per-step median <= {TARGET_VS_FLOOR:g}x floor",
                    f"{vs_floor:.2f}x floor",
                    verdict(vs_floor <= TARGET_VS_FLOOR),
                ],
                [
                    f"replay of {LONG_STEPS} steps < 100 ms",
                    ms(rp_med, 1),
                    verdict(rp_med < TARGET_REPLAY_S),
                ],
                [
                    f"runs/s at 4 threads >= {TARGET_THROUGHPUT_VS_DBOS:g}x DBOS queue",
                    tp_measured,
                    verdict(None if tp_ratio is None else tp_ratio >= TARGET_THROUGHPUT_VS_DBOS),
                ],
            ],
            right={1},
        )
    )
    w("")
    if db.get("error"):
        w(f"DBOS: FAILED - {db['error']}")
    elif "offline" in db:
        w(f"DBOS offline: {db['offline']}; database {db['database']}.")
    w(
        "Non-loopback network attempts from this process: "
        + (", ".join(sorted(set(REMOTE_ATTEMPTS))) if REMOTE_ATTEMPTS else "none")
    )
    w(f"Total time {elapsed:.0f} s.")
    return "\n".join(out)


MARKS_PLAIN: list[float] = []


def main() -> int:
    started = time.perf_counter()
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.postgresql":
        print(f"DATABASE_URL must point at PostgreSQL, not {db['ENGINE']}", file=sys.stderr)
        return 2
    error = prepare_database()
    if error:
        print(f"cannot benchmark: {error}", file=sys.stderr)
        return 2
    delete_bench_rows()
    env = environment()

    progress("plain Python loop")
    for _ in range(3):
        MARKS.clear()
        plain_loop(LONG_STEPS)
    for _ in range(LONG_REPS):
        MARKS.clear()
        plain_loop(LONG_STEPS)
        MARKS_PLAIN.extend(gaps(MARKS))

    floor = measure_floor()
    sg, dbos = run_all()
    print(report(env, floor, sg, dbos, time.perf_counter() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
