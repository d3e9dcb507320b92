"""Dashboard speed: server times with a large history, and the live feed's event-to-browser latency.

    .venv/bin/python bench/ui.py                  (local PostgreSQL; DATABASE_URL overrides)
    .venv/bin/python bench/ui.py --latency-only   (skip the fill and the server times)
    .venv/bin/python bench/ui.py --runs 1000000 --server-only   (issue 35's million runs)

1. Server times. Fills its own database (`stepguard_bench_ui`, or `stepguard_bench_ui_<N>` for
   `--runs N`; DATABASE_URL overrides) once with a production-shaped history (bench/history.py:
   statuses follow age, 200 tenants, priced steps, approvals, workers; set-based, resumable),
   then times every page, search and filter combination (each matching nothing and matching
   much), the inbox, the flow, workers and policy pages, the API lists and /metrics through
   Django's test client: medians, p95 and the rows the request's SELECTs read (their plans).
   Then /metrics with worker-kept totals and recomputed, the idle worker poll and a claim
   (`--lean`: only those two, on a fill of the runs alone, for 5,000,000 runs). Then the run
   page of a 5,000-step run (10,000 events) against a 10-step run's, the baseline measured in
   the same invocation: median server time, bytes, and their ratios. Both runs are written
   once with bulk_create (`bench.long`).

2. Event-to-browser latency of the run page's websocket. For each configuration a real daphne
   process serves the project on 127.0.0.1 (a port the OS picks), the run page is fetched over
   HTTP with a real session cookie, and a websocket client connects to the URL in the page's
   `ws-connect` (`/ws/runs/<uuid>/?after=<seq>`) with that cookie and an allowed Origin, as the
   page's htmx does. This process then writes events to the run exactly as the executor does for
   a step (`fenced_write` of `step.started`, then of `step.completed`: one autocommit statement
   each on PostgreSQL, then `doorbell.ring`), one at a time after a random pause of 0-0.5 s (so
   writes do not fall into step with the doorbell's 0.1 s rest or the 0.5 s poll), and waits
   (3 s deadline) until the fragment with `id="event-<seq>"` arrives. Latency = the time the
   write's statement returned (committed) to the time the client thread received the message,
   both on this process's monotonic clock. 50 events per configuration, after 4 warm-up events;
   median and p95 against a 250 ms target:

   a. doorbell via Redis: daphne and the writer with REDIS_URL (channels-redis group_send);
   b. doorbell via PostgreSQL NOTIFY: no REDIS_URL; daphne's EventsListener relays the NOTIFY;
   c. polling only: the consumer's poll (STEPGUARD_LIVE_POLL=0.5). There is no setting that
      turns the doorbell off (on PostgreSQL `Doorbell.enabled()` is always true), so the writer
      here has its `doorbell.enabled` replaced by `lambda: False`: it writes as a worker whose
      rings never reach the page. The server side is unchanged (its EventsListener listens to
      nothing).

   Redis is expected at redis://127.0.0.1:6379/0 (STEPGUARD_BENCH_REDIS_URL overrides); without
   it configuration (a) is skipped. A second table splits the doorbell configurations' median:
   commit to the flush that carried the ring (at once when idle, else after a 0.1 s rest),
   the publish itself, and flush to arrival. The client is a minimal websocket client on
   asyncio (see LiveFeed), not a browser: it stops at the page's socket, before htmx's swap.
   The runs written here (workflow `bench.live`, three per invocation) stay: events are append-only.

3. Runs-list live update latency. In the same three configurations, a client holds the site-wide
   feed (`/ws/live/`) every page keeps open, as an open runs list does. This process creates a
   run (`create_run`: the row and its `run.created` event, committed, then the doorbell), and
   measures the time from the commit to the feed's "changed" message; then, as the page does,
   waits the runs list's trigger delay (150 ms) and fetches the list's first page, which must
   show the new run. Total = commit to the fetched page; 30 runs per configuration after 4
   warm-up ones, 0-0.5 s apart; target under 1 s. These runs (`bench.live`) are marked
   completed afterwards and stay.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import html
import json
import math
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The history's size comes first: each size has a database of its own, filled once.
_size = argparse.ArgumentParser(add_help=False)
_size.add_argument("--runs", type=int, default=100_000)
RUNS = _size.parse_known_args()[0].runs
NAME = "stepguard_bench_ui" if RUNS == 100_000 else f"stepguard_bench_ui_{RUNS}"
os.environ.setdefault("DATABASE_URL", f"postgres://postgres@127.0.0.1:5432/{NAME}")
os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
os.environ.setdefault("SECRET_KEY", "bench-only-not-a-secret")
os.environ["DEBUG"] = "0"
os.environ.setdefault("ALLOWED_HOSTS", "testserver")
os.environ["SECURE_SSL_REDIRECT"] = "0"
# This process is the writer; which channel layer it publishes to is chosen per configuration.
os.environ.pop("REDIS_URL", None)

import psycopg  # noqa: E402

EVENTS_PER_RUN, REPEATS = 4, 15
LONG_WORKFLOW, LONG_STEPS, SHORT_STEPS = "bench.long", 5_000, 10
REDIS_URL = os.environ.get("STEPGUARD_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
LIVE_POLL = "0.5"  # STEPGUARD_LIVE_POLL for every daphne started here (the default)
LIVE_WORKFLOW = "bench.live"
WARMUP, DEADLINE, MAX_PAUSE = 4, 3.0, 0.5
LATENCY_TARGET_MS = 250
#: The runs list's `hx-trigger` delay (runs/templates/runs/list.html), and its target: a new run
#: on an open list within a second.
LIST_TRIGGER_DELAY, LIST_TARGET_MS = 0.15, 1000
CONFIGURATIONS = [
    ("doorbell via Redis", True, True),
    ("doorbell via PostgreSQL NOTIFY", False, True),
    (f"polling only ({LIVE_POLL} s)", False, False),
]


def ensure_database() -> None:
    with psycopg.connect("postgres://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [NAME]).fetchone():
            conn.execute(f'CREATE DATABASE "{NAME}"')


ensure_database()

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.test import Client, override_settings  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import history  # noqa: E402
from runs import queries  # noqa: E402
from runs.engine.fences import Fence, Lease  # noqa: E402
from runs.engine.store import create_run, fenced_write  # noqa: E402
from runs.engine.wakeup import doorbell  # noqa: E402
from runs.models import (  # noqa: E402
    Chore,
    Event,
    Policy,
    Run,
    RunStatus,
    Step,
    StepKind,
    StepStatus,
    Worker,
)


def fill(lean: bool = False) -> None:
    """The production-shaped history (bench/history.py), resumed if an earlier fill stopped."""
    approver, _ = get_user_model().objects.get_or_create(username="bench-approver")
    started = time.monotonic()
    history.fill(connection, RUNS, EVENTS_PER_RUN, approver.pk, lean=lean)
    print(f"history ready ({time.monotonic() - started:.0f} s)")
    for tenant in range(5):  # label budgets, as the budgets page lists them
        Policy.objects.get_or_create(
            scope=f"label:tenant=t-{tenant}", defaults={"daily_budget_micros": 10_000_000}
        )


def p95(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(int(len(ordered) * 0.95) - 1, 0)]


def timed(client: Client, path: str, **params) -> tuple[float, float]:
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        response = client.get(path, params)
        samples.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code)
    return statistics.median(samples), p95(samples)


def _scanned(node: dict) -> int:
    """Rows a plan node's scans read: those they returned plus those their filters removed."""
    loops = node.get("Actual Loops", 1)
    n = 0
    if "Scan" in node["Node Type"]:
        n = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
             + node.get("Rows Removed by Index Recheck", 0)) * loops  # fmt: skip
    return n + sum(_scanned(child) for child in node.get("Plans", []))


def rows_read(client: Client, path: str, **params) -> tuple[int, str]:
    """What one request's SELECTs read, by their plans (EXPLAIN ANALYZE of each statement as
    sent), and the scan of the statement that read most: where the time goes."""
    with CaptureQueriesContext(connection) as captured:
        client.get(path, params)
    total, worst, worst_n = 0, "", -1
    with connection.cursor() as cursor:
        for query in captured.captured_queries:
            sql = query["sql"]
            if not sql.lstrip().upper().startswith(("SELECT", "WITH")) or "django_session" in sql:
                continue
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            plan = cursor.fetchone()[0]
            plan = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
            n = _scanned(plan)
            total += n
            if n > worst_n:
                worst, worst_n = _scans(plan), n
    return total, worst


def _scans(node: dict) -> str:
    names = []
    if "Scan" in node["Node Type"]:
        names.append(f"{node['Node Type']} {node.get('Index Name', node.get('Relation Name', ''))}")
    for child in node.get("Plans", []):
        names.extend(filter(None, _scans(child).split("; ")))
    return "; ".join(dict.fromkeys(names))


def pages() -> list[tuple[str, str, dict]]:
    """Every page, search and filter combination timed: each filter matching nothing and
    matching much (t-7 never fails; t-25's runs all failed; see bench/history.py)."""
    middle = Run.objects.get(key=f"k-{RUNS // 2}")
    oldest = Run.objects.get(key="k-1")
    return [
        ("runs list, first page", "/", {}),
        ("runs list, status=failed", "/", {"status": "failed"}),
        ("runs list, status=running", "/", {"status": "running"}),
        ("runs list, status=halted", "/", {"status": "halted"}),
        ("runs list, workflow=bench-7", "/", {"workflow": "bench-7"}),
        ("runs list, key search", "/", {"q": f"k-{RUNS // 3}"}),
        ("runs list, short id search", "/", {"q": str(middle.pk)[:8]}),
        ("runs list, workflow+status, none", "/", {"workflow": "nope", "status": "failed"}),
        ("runs list, label t-7 (much)", "/", {"label": "tenant=t-7"}),
        ("runs list, label t-none (none)", "/", {"label": "tenant=t-none"}),
        ("label+status, none", "/", {"label": "tenant=t-7", "status": "failed"}),
        ("label+status, much", "/", {"label": "tenant=t-25", "status": "failed"}),
        ("label+status=completed, much", "/", {"label": "tenant=t-7", "status": "completed"}),
        ("wf+status+label, none", "/",
         {"workflow": "bench-7", "status": "failed", "label": "tenant=t-7"}),
        ("wf+status+label, much", "/",
         {"workflow": "bench-7", "status": "completed", "label": "tenant=t-7"}),
        (f"runs list, keyset page {RUNS // 100:,}", "/", {"before": queries.marker(middle)}),
        ("runs count, label+status none", "/runs/count",
         {"label": "tenant=t-7", "status": "failed"}),
        ("run page (events)", f"/runs/{oldest.pk}", {}),
        ("approvals inbox", "/approvals", {}),
        ("audit page", "/audit", {}),
        ("flow page", "/flow", {}),
        ("workers page", "/workers", {}),
        ("API runs list", "/api/runs", {}),
        ("API runs, status=failed", "/api/runs", {"status": "failed"}),
        ("API runs, label t-7", "/api/runs", {"label": "tenant=t-7"}),
        ("API runs, label+status none", "/api/runs", {"label": "tenant=t-7", "status": "failed"}),
        ("API runs, wf+status+label none", "/api/runs",
         {"workflow": "bench-7", "status": "failed", "label": "tenant=t-7"}),
        ("API approvals", "/api/approvals", {}),
        ("API spend per tenant, 7 days", "/api/spend", {"label": "tenant"}),
        ("budgets page (5 label budgets)", "/budgets", {}),
        ("halts page", "/halts", {}),
        ("/metrics (cached)", "/metrics", {}),
    ]  # fmt: skip


def server_times(user, only: str = "") -> None:
    client = Client()
    client.force_login(user)
    rows = [row for row in pages() if only in row[0]]
    print(f"\n{RUNS:,} runs ({EVENTS_PER_RUN} events, 2 steps each; bench/history.py); "
          f"{REPEATS} requests each, server time")  # fmt: skip
    print(f"  {'page':<34} {'median':>9} {'p95':>9} {'rows read':>10}  target < 100 ms")
    for label, path, params in rows:
        median, high = timed(client, path, **params)
        n, scans = rows_read(client, path, **params)
        verdict = "MET" if median < 100 else "MISSED"
        print(f"  {label:<34} {median:>7.1f}ms {high:>7.1f}ms {n:>10,}  {verdict}  [{scans}]")
    if only in "/metrics (summary in each scrape)":
        metrics_kept(client)


def metrics_kept(client: Client) -> None:
    """/metrics as a web process serves it with a shared cache (Redis in production: this
    process's own cache stands in, `summary.cache_shared` said true): the totals kept by
    triggers (runs/tally.py), the summary (backlog past the cap, deliveries) made by one worker
    per period (`summary.keep`, timed once with its fold of the totals: what that worker pays),
    every scrape reading it from the cache. Then the scrape that makes the summary itself (the
    embedded engine's, once a period per process; every scrape with
    STEPGUARD_METRICS_SUMMARY_SECONDS=0)."""
    from django.core.cache import cache

    from runs import summary
    from runs.engine.chores import ChoreContext

    with mock.patch.object(summary, "cache_shared", lambda: True):
        cache.delete(summary.KEY)
        Chore.objects.filter(name=summary.CHORE).delete()
        started = time.perf_counter()
        summary.keep(ChoreContext(worker="bench", workflows=frozenset()))
        kept = (time.perf_counter() - started) * 1000
        median, high = timed(client, "/metrics")
        n, scans = rows_read(client, "/metrics")
    print(f"  {'/metrics (worker-kept summary)':<34} {median:>7.1f}ms {high:>7.1f}ms {n:>10,}  "
          f"[{scans}]")  # fmt: skip
    print(f"  {'  the worker turn, once':<34} {kept:>7.1f}ms")
    with override_settings(STEPGUARD_METRICS_SUMMARY_SECONDS=0):
        median, high = timed(client, "/metrics")
        n, scans = rows_read(client, "/metrics")
    print(f"  {'/metrics (summary in each scrape)':<34} {median:>7.1f}ms {high:>7.1f}ms {n:>10,}  "
          f"[{scans}]")  # fmt: skip


def _idle(ctx, data) -> None:
    """The workflow of the idle worker: it has no runs."""


def statements_read(work) -> tuple[int, str]:
    """`rows_read` for what `work()` sends (the claim's UPDATE too): each statement is explained
    with ANALYZE inside a transaction rolled back, so nothing it would write stays."""
    with CaptureQueriesContext(connection) as captured:
        work()
    total, worst, worst_n = 0, "", -1
    for query in captured.captured_queries:
        sql = query["sql"].strip()
        if not sql.upper().startswith(("SELECT", "WITH", "UPDATE")):
            continue
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            plan = cursor.fetchone()[0]
            transaction.set_rollback(True)
        plan = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
        n = _scanned(plan)
        total += n
        if n > worst_n:
            worst, worst_n = _scans(plan), n
    return total, worst


def idle_poll() -> None:
    """A worker's poll that finds nothing it serves, while the history holds due runs of
    workflows no worker imports (the fill's pending runs, all due): its claim statement, the
    held-runs sweep, the poison check and its next-timer query, all as `WorkerProcess` sends
    them (target under 10 ms). Then a claim that takes one due run of a workflow the worker
    serves (one with due pending runs), put back to pending after each claim."""
    from uuid import uuid4

    from runs.engine import registry
    from runs.engine.claims import Claims

    claims = Claims(uuid4(), timedelta(seconds=30), [registry.register("bench.idle", "1", _idle)])
    due = Run.objects.filter(status__in=["pending", "waiting"], wake_at__lte=timezone.now())

    def poll():
        assert claims.claim(4) == []
        claims.next_wake(timezone.now())

    due_run = due.filter(status="pending", workflow__startswith="bench-").first()
    served = due_run.workflow if due_run else "bench-3"
    worker = Worker.objects.create(
        host="bench-claimer",
        pid=os.getpid(),
        concurrency=1,
        workflows=[served],
        started_at=timezone.now(),
        heartbeat_at=timezone.now(),
        stopped_at=timezone.now(),
    )  # fmt: skip  (stopped: no other page or sweep takes it for live)
    serving = Claims(worker.pk, timedelta(seconds=30), [registry.register(served, "1", _idle)])

    def claim():
        taken = serving.claim(1)
        assert len(taken) == 1, taken
        Run.objects.filter(pk=taken[0].pk).update(
            status=RunStatus.PENDING, worker=None, lease_until=None
        )

    print(f"\nworker poll and claim, {due.count():,} due runs ({served}'s among them)")
    for label, work in (("idle poll (claim+sweep+timer)", poll), ("claim of one run", claim)):
        samples = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            work()
            samples.append((time.perf_counter() - started) * 1000)
        median, high = statistics.median(samples), p95(samples)
        n, scans = statements_read(work)
        verdict = "MET" if median < 10 else "MISSED"
        print(f"  {label:<34} {median:>7.1f}ms {high:>7.1f}ms {n:>10,}  {verdict} (< 10 ms)"
              f"  [{scans}]")  # fmt: skip


def long_run(steps: int) -> Run:
    """A completed run of `steps` steps, each with its `step.started` and `step.completed`
    events, written by bulk_create in seconds instead of executed. Made once per database
    (found again by its key), so the bench runs twice in a row on the same database."""
    key = f"bench-long-{steps}"
    found = Run.objects.filter(workflow=LONG_WORKFLOW, key=key).first()
    if found is not None:
        return found
    kinds = [StepKind.TOOL, StepKind.LLM, StepKind.CALL]
    now = timezone.now()
    with transaction.atomic():
        run = create_run(workflow=LONG_WORKFLOW, version="1", input={}, key=key)
        Step.objects.bulk_create(
            [
                Step(run=run, seq=i, key=f"step-{i}", kind=kinds[i % 3],
                     status=StepStatus.COMPLETED, input={"args": [i], "kwargs": {}},
                     output={"n": i}, idempotency_key=f"{run.pk}:step-{i}",
                     started_at=now, finished_at=now)
                for i in range(steps)
            ],
            batch_size=1000,
        )  # fmt: skip
        Event.objects.bulk_create(
            [
                Event(run=run, seq=2 + 2 * i + done, step_key=f"step-{i}",
                      type="step.completed" if done else "step.started",
                      payload={"attempt": 1}, created_at=now)
                for i in range(steps)
                for done in (0, 1)
            ],
            batch_size=1000,
        )  # fmt: skip
        Run.objects.filter(pk=run.pk).update(
            status=RunStatus.COMPLETED, event_seq=1 + 2 * steps, started_at=now,
            finished_at=now, wake_at=None,
        )  # fmt: skip
    return run


def long_run_page(user) -> None:
    """The run page of a 5,000-step run against a 10-step run's, the baseline measured in the
    same invocation: server time (median of REPEATS requests) and the bytes sent."""
    client = Client()
    client.force_login(user)
    rows = []
    for steps in (SHORT_STEPS, LONG_STEPS):
        path = f"/runs/{long_run(steps).pk}"
        size = len(client.get(path).content)
        median, high = timed(client, path)
        rows.append((steps, median, high, size))
    print(f"\nrun page by run length; {REPEATS} requests each, ratios against {SHORT_STEPS} steps")
    print(f"  {'steps':>6} {'median':>9} {'p95':>9} {'bytes':>9} {'time':>7} {'bytes':>7}")
    _, base_ms, _, base_size = rows[0]
    for steps, median, high, size in rows:
        print(
            f"  {steps:>6,} {median:>7.1f}ms {high:>7.1f}ms {size:>9,}"
            f" {median / base_ms:>6.2f}x {size / base_size:>6.2f}x"
        )


# -- event-to-browser latency -----------------------------------------------------------------


@contextlib.contextmanager
def daphne(redis_url: str | None):
    """daphne serving the project on 127.0.0.1, on a port the OS picks; always terminated."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "ALLOWED_HOSTS": "127.0.0.1,localhost",
        "SERVE_STATIC": "0",
        "STEPGUARD_LIVE_POLL": LIVE_POLL,
        "LOG_LEVEL": "WARNING",
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    env.pop("REDIS_URL", None)
    if redis_url:
        env["REDIS_URL"] = redis_url
    argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", "0"]
    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        path = Path(tmp) / "daphne.log"
        with path.open("w") as out:
            proc = subprocess.Popen(
                [*argv, "controlplane.asgi:application"],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 30
            pattern = r"Listening on TCP address 127\.0\.0\.1:(\d+)"
            while not (found := re.search(pattern, path.read_text())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daphne did not start:\n{path.read_text()}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{found.group(1)}", path
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


class LiveFeed:
    """The page's websocket, on its own thread and event loop: when did each event arrive?

    A minimal RFC 6455 client on asyncio streams (text frames, ping, close): autobahn's asyncio
    client cannot be used here, because Django's setup loads daphne, which binds txaio (and so
    autobahn) to Twisted in this process."""

    EVENT_ID = re.compile(rb'id="event-(\d+)"')

    def __init__(self, url: str, origin: str, cookie: str):
        self.arrived: dict[int, float] = {}
        self.close_reason = ""
        self._url, self._origin, self._cookie = urlsplit(url), origin, cookie
        self._changed = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Future | None = None

    def __enter__(self) -> LiveFeed:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(10)
        except BaseException:
            self.__exit__()
            raise
        self._reading = asyncio.run_coroutine_threadsafe(self._read(), self._loop)
        return self

    def __exit__(self, *exc) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                close = self._send(0x8, (1000).to_bytes(2, "big"))
                asyncio.run_coroutine_threadsafe(close, self._loop).result(2)
            if self._reading is not None:
                with contextlib.suppress(Exception):
                    self._reading.result(2)
            self._loop.call_soon_threadsafe(self._writer.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _open(self) -> None:
        reader, self._writer = await asyncio.open_connection(self._url.hostname, self._url.port)
        self._reader = reader
        key = base64.b64encode(os.urandom(16)).decode()
        target = self._url.path + (f"?{self._url.query}" if self._url.query else "")
        request = (
            f"GET {target} HTTP/1.1\r\nHost: {self._url.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
            f"Origin: {self._origin}\r\nCookie: {self._cookie}\r\n\r\n"
        )
        self._writer.write(request.encode())
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        accept = base64.b64encode(
            hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()
        ).decode()
        if not head.startswith("HTTP/1.1 101") or accept not in head:
            raise RuntimeError(f"websocket refused: {head.splitlines()[0]}")

    async def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        assert len(payload) < 126
        frame = bytes([0x80 | opcode, 0x80 | len(payload)]) + mask
        frame += bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self._writer.write(frame)
        await self._writer.drain()

    async def _read(self) -> None:
        message = b""
        try:
            while True:
                first, second = await self._reader.readexactly(2)
                size = second & 0x7F
                if size >= 126:
                    width = 2 if size == 126 else 8
                    size = int.from_bytes(await self._reader.readexactly(width), "big")
                mask = await self._reader.readexactly(4) if second & 0x80 else b""
                payload = await self._reader.readexactly(size)
                if mask:
                    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                opcode = first & 0x0F
                if opcode == 0x8:
                    code = int.from_bytes(payload[:2], "big") if payload else 1005
                    self._closed(f"closed by the server (code {code})")
                    return
                if opcode == 0x9:
                    await self._send(0xA, payload)
                elif opcode in (0x0, 0x1, 0x2):
                    message += payload
                    if first & 0x80:
                        self._received(time.perf_counter(), message)
                        message = b""
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self._closed(f"connection lost ({exc.__class__.__name__})")

    def _received(self, at: float, payload: bytes) -> None:
        with self._changed:
            for seq in self.EVENT_ID.findall(payload):
                self.arrived.setdefault(int(seq), at)
            self._changed.notify_all()

    def _closed(self, reason: str) -> None:
        with self._changed:
            self.close_reason = reason
            self._changed.notify_all()

    def wait_for(self, seq: int, until: float) -> float | None:
        with self._changed:
            while seq not in self.arrived and not self.close_reason:
                left = until - time.perf_counter()
                if left <= 0:
                    return None
                self._changed.wait(left)
            return self.arrived.get(seq)


class StepWriter:
    """Writes a run's events the way the executor does for a plain step (no budget, no approval):
    `step.started` inserting the step row, then `step.completed` updating it. On PostgreSQL each
    is one autocommit statement followed by `doorbell.ring`."""

    def __init__(self, run: Run):
        self.lease = Lease(run.pk, run.lease_epoch, run.workflow)
        self.seq = run.event_seq
        self.steps = 0
        self.open_step: tuple[int, str] | None = None

    def write(self) -> tuple[int, float]:
        """Append the next event; return its seq and when the write had committed."""
        if self.open_step is None:
            key = f"step-{self.steps}"
            fields = {
                "seq": self.steps,
                "key": key,
                "kind": StepKind.CALL,
                "status": StepStatus.STARTED,
                "input": {"args": [self.steps], "kwargs": {}},
                "idempotency_key": f"{self.lease.run_id}:{key}",
                "run_attempt": 1,
                "started_at": timezone.now(),
            }
            step_pk = fenced_write(
                self.lease,
                ("step.started", key, {"attempt": 1}),
                Fence(starting=True),
                insert_step=fields,
            )
            self.open_step = (step_pk, key)
        else:
            step_pk, key = self.open_step
            fields = {
                "status": StepStatus.COMPLETED,
                "output": {"n": self.steps},
                "finished_at": timezone.now(),
            }
            fenced_write(
                self.lease,
                ("step.completed", key, {"attempt": 1}),
                Fence(progress=True),
                update_step=(step_pk, fields),
            )
            self.open_step = None
            self.steps += 1
        committed = time.perf_counter()
        self.seq += 1
        return self.seq, committed


def running_run() -> Run:
    """A new run, claimed as a worker would claim it (running, lease epoch 1, lease held)."""
    with transaction.atomic():
        run = create_run(workflow=LIVE_WORKFLOW, version="1", input={}, key=None)
    Run.objects.filter(pk=run.pk).update(
        status=RunStatus.RUNNING,
        lease_epoch=1,
        lease_until=timezone.now() + timezone.timedelta(hours=1),
        started_at=timezone.now(),
    )
    return Run.objects.get(pk=run.pk)


def redis_available() -> bool:
    url = urlsplit(REDIS_URL)
    try:
        with socket.create_connection((url.hostname, url.port or 6379), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class Latencies:
    """One configuration's figures, in ms. `total` is inf for an event lost past DEADLINE.

    For events that a doorbell flush carried (the flush ended before the event arrived; with a
    doorbell nearly all of them), the total splits into `to_flush` (commit to the start of the
    flush that carried its ring: the coalescing wait), `publish` (the flush itself, in the
    writer) and `delivery` (flush end to arrival: relay, the consumer's query and rendering,
    the websocket send)."""

    total: list[float] = field(default_factory=list)
    to_flush: list[float] = field(default_factory=list)
    publish: list[float] = field(default_factory=list)
    delivery: list[float] = field(default_factory=list)


@contextlib.contextmanager
def writer_settings(*, redis: bool, ring: bool):
    """This process writes as a worker of the configuration would: it rings through Redis, or
    through NOTIFY, or (`ring=False`) its rings reach no page."""
    layer = (
        {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [REDIS_URL]}}
        if redis
        else {"BACKEND": "channels.layers.InMemoryChannelLayer"}
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            override_settings(
                REDIS_URL=REDIS_URL if redis else "", CHANNEL_LAYERS={"default": layer}
            )
        )
        if not ring:
            stack.enter_context(mock.patch.object(doorbell, "enabled", lambda: False))
        yield


def measure(
    base: str, cookie: str, events: int, rng: random.Random, *, redis: bool, ring: bool
) -> Latencies:
    run = running_run()
    request = urllib.request.Request(f"{base}/runs/{run.pk}", headers={"Cookie": cookie})
    with urllib.request.urlopen(request, timeout=10) as response:
        page = response.read().decode()
    found = re.search(r'ws-connect="([^"]+)"', page)
    if found is None:
        raise RuntimeError("the run page has no ws-connect (not logged in?)")
    ws_url = "ws://" + urlsplit(base).netloc + html.unescape(found.group(1))
    flushes: list[tuple[float, float]] = []  # (start, end) of each doorbell publish
    publish = doorbell.publish

    def timed_publish(ids, deltas=()):
        started = time.perf_counter()
        publish(ids, deltas)
        flushes.append((started, time.perf_counter()))

    writer, result = StepWriter(run), Latencies()
    with contextlib.ExitStack() as stack:
        stack.enter_context(writer_settings(redis=redis, ring=ring))
        stack.enter_context(mock.patch.object(doorbell, "publish", timed_publish))
        feed = stack.enter_context(LiveFeed(ws_url, base, cookie))
        written = []
        for i in range(WARMUP + events):
            time.sleep(rng.uniform(0, MAX_PAUSE))
            seq, committed = writer.write()
            arrived = feed.wait_for(seq, committed + DEADLINE)
            if feed.close_reason:
                raise RuntimeError(f"websocket {feed.close_reason} after event {seq}")
            if i >= WARMUP:
                written.append((committed, arrived))
        time.sleep(0.2)  # the last flush, under these settings
    Run.objects.filter(pk=run.pk).update(status=RunStatus.COMPLETED, lease_until=None)
    for committed, arrived in written:
        result.total.append(math.inf if arrived is None else (arrived - committed) * 1000)
        # The flush that carried this ring is the first to start after the commit (the ring
        # comes right after the statement, before `committed` is read: a few microseconds).
        flush = next((f for f in flushes if f[0] >= committed - 0.001), None)
        if arrived is not None and flush is not None and flush[1] <= arrived:
            result.to_flush.append(max(flush[0] - committed, 0) * 1000)
            result.publish.append((flush[1] - flush[0]) * 1000)
            result.delivery.append((arrived - flush[1]) * 1000)
    return result


class SiteFeed(LiveFeed):
    """The site-wide feed every page keeps open (`/ws/live/`): when did each "changed" come?"""

    def __init__(self, url: str, origin: str, cookie: str):
        super().__init__(url, origin, cookie)
        self.changes: list[float] = []

    def _received(self, at: float, payload: bytes) -> None:
        if b'"changed"' in payload:
            with self._changed:
                self.changes.append(at)
                self._changed.notify_all()

    def wait_change(self, after: float, until: float) -> float | None:
        with self._changed:
            while not self.close_reason:
                found = next((t for t in self.changes if t >= after), None)
                if found is not None:
                    return found
                left = until - time.perf_counter()
                if left <= 0:
                    return None
                self._changed.wait(left)
        return None


@dataclass
class ListLatencies:
    """Per new run, in ms from its commit: the feed's "changed", and the refetched runs list
    (after the page's trigger delay) that shows it."""

    feed: list[float] = field(default_factory=list)
    fetch: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)


def measure_list(
    base: str, cookie: str, runs: int, rng: random.Random, *, redis: bool, ring: bool
) -> ListLatencies:
    """New runs (`create_run`: the row and its `run.created` event, then the doorbell) against an
    open runs list: the site feed says something changed, the page waits its trigger delay and
    fetches its first page again, as htmx does, and the new run is in it."""
    result = ListLatencies()
    url = "ws://" + urlsplit(base).netloc + "/ws/live/"
    with writer_settings(redis=redis, ring=ring), SiteFeed(url, base, cookie) as feed:
        for i in range(WARMUP + runs):
            time.sleep(rng.uniform(0, MAX_PAUSE))
            with transaction.atomic():
                run = create_run(workflow=LIVE_WORKFLOW, version="1", input={}, key=None)
            committed = time.perf_counter()
            changed = feed.wait_change(committed, committed + DEADLINE)
            if feed.close_reason:
                raise RuntimeError(f"websocket {feed.close_reason} after run {i}")
            if changed is None:
                if i >= WARMUP:
                    result.total.append(math.inf)
                continue
            time.sleep(LIST_TRIGGER_DELAY)
            fetch_start = time.perf_counter()
            request = urllib.request.Request(f"{base}/", headers={"Cookie": cookie})
            with urllib.request.urlopen(request, timeout=10) as response:
                shown = f'id="run-{run.pk}"' in response.read().decode()
            done = time.perf_counter()
            Run.objects.filter(pk=run.pk).update(status=RunStatus.COMPLETED)
            if i < WARMUP:
                continue
            result.feed.append((changed - committed) * 1000)
            result.fetch.append((done - fetch_start) * 1000)
            result.total.append((done - committed) * 1000 if shown else math.inf)
    return result


def list_latency(user, runs: int) -> None:
    client = Client()
    client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    rng = random.Random(7)
    print(
        f"\nruns-list live update: {runs} new runs each (+{WARMUP} warm-up), 0-{MAX_PAUSE} s "
        f"apart, against an open runs list (its trigger waits {LIST_TRIGGER_DELAY * 1000:.0f} ms)"
    )
    print(
        f"  {'configuration':<32} {'feed':>9} {'fetch':>9} {'total':>9} {'p95':>9} {'lost':>4}"
        f"  target < {LIST_TARGET_MS} ms"
    )
    for label, redis, ring in CONFIGURATIONS:
        if redis and not redis_available():
            print(f"  {label:<32} skipped: no Redis at {REDIS_URL}")
            continue
        with daphne(REDIS_URL if redis else None) as (base, _log):
            measured = measure_list(base, cookie, runs, rng, redis=redis, ring=ring)
        finite = [t for t in measured.total if not math.isinf(t)]
        lost = len(measured.total) - len(finite)
        median = statistics.median(finite) if finite else math.inf
        verdict = "MET" if median < LIST_TARGET_MS else "MISSED"
        print(
            f"  {label:<32} {median_ms(measured.feed)} {median_ms(measured.fetch)}"
            f" {median:>7.1f}ms {p95(finite) if finite else math.inf:>7.1f}ms {lost:>4}  {verdict}"
        )


def median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples):>7.1f}ms" if samples else f"{'-':>9}"


def latency(user, events: int) -> None:
    client = Client()
    client.force_login(user)
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    results = []
    rng = random.Random(42)
    for label, redis, ring in CONFIGURATIONS:
        if redis and not redis_available():
            results.append((label, None, f"skipped: no Redis at {REDIS_URL}"))
            continue
        with daphne(REDIS_URL if redis else None) as (base, log):
            measured = measure(base, cookie, events, rng, redis=redis, ring=ring)
            problems = [
                line
                for line in log.read_text().splitlines()
                if re.search(r"WARNING|ERROR|Traceback", line)
            ]
        results.append((label, measured, "; ".join(problems[:3])))
    print(
        f"\nevent-to-browser latency over the run page's websocket: {events} events each "
        f"(+{WARMUP} warm-up), one at a time, 0-{MAX_PAUSE} s apart"
    )
    print(
        f"  {'configuration':<32} {'median':>9} {'p95':>9} {'max':>9} {'lost':>4}"
        f"  target < {LATENCY_TARGET_MS} ms"
    )
    for label, measured, note in results:
        if measured is None:
            print(f"  {label:<32} {note}")
            continue
        samples = measured.total
        median, high, top = statistics.median(samples), p95(samples), max(samples)
        lost = sum(1 for s in samples if math.isinf(s))
        verdict = "MET" if median < LATENCY_TARGET_MS else "MISSED"
        print(f"  {label:<32} {median:>7.1f}ms {high:>7.1f}ms {top:>7.1f}ms {lost:>4}  {verdict}")
        if note:
            print(f"    server log: {note}")
    print("  where it goes (medians, events carried by a doorbell flush):")
    print(f"  {'configuration':<32} {'events':>6} {'to flush':>9} {'publish':>9} {'delivery':>9}")
    for label, measured, _ in results:
        if measured is not None and measured.to_flush:
            print(
                f"  {label:<32} {len(measured.to_flush):>6} {median_ms(measured.to_flush)}"
                f" {median_ms(measured.publish)} {median_ms(measured.delivery)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--latency-only",
        action="store_true",
        help="skip the 100,000-run fill and the server times; only the websocket latency",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=100_000,
        help="runs in the history (10 events each; a database of its own per size)",
    )
    parser.add_argument(
        "--server-only", action="store_true", help="only the fill and the server times"
    )
    parser.add_argument("--only", default="", help="time only the pages whose label has this")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="fill the runs alone (no steps, events, approvals) and time only the worker's "
        "idle poll and claim: 5,000,000 runs in minutes",
    )
    parser.add_argument(
        "--as-filled",
        action="store_true",
        help="time the history as it stands (a fill stopped part-way), without resuming it",
    )
    parser.add_argument("--events", type=int, default=50, help="events per configuration")
    parser.add_argument("--list-runs", type=int, default=30, help="new runs per configuration")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    user, _ = get_user_model().objects.get_or_create(username="bench", is_superuser=True)
    if args.lean:
        fill(lean=True)
        idle_poll()
        return
    if not args.latency_only:
        if not args.as_filled:
            fill()
        server_times(user, args.only)
        idle_poll()
        if not args.only:
            long_run_page(user)
    if args.server_only:
        return
    latency(user, args.events)
    list_latency(user, args.list_runs)


if __name__ == "__main__":
    main()
