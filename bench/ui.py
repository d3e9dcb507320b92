"""Dashboard server times with a large history: 100,000 runs and 1,000,000 events.

    .venv/bin/python bench/ui.py        (local PostgreSQL; DATABASE_URL overrides)

Fills its own database (`stepguard_bench_ui`) once with generate_series, then times the runs
list (first page, a filtered page, a deep keyset page) and a run page through Django's test
client, and prints medians and p95. Target: under 200 ms median. The event-to-browser latency
of the live feed is not measured here yet.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
NAME = "stepguard_bench_ui"
os.environ.setdefault("DATABASE_URL", f"postgres://postgres@127.0.0.1:5432/{NAME}")
os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
os.environ.setdefault("SECRET_KEY", "bench-only-not-a-secret")
os.environ["DEBUG"] = "0"
os.environ.setdefault("ALLOWED_HOSTS", "testserver")
os.environ["SECURE_SSL_REDIRECT"] = "0"

import psycopg  # noqa: E402

RUNS, EVENTS_PER_RUN, REPEATS = 100_000, 10, 15


def ensure_database() -> None:
    with psycopg.connect("postgres://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [NAME]).fetchone():
            conn.execute(f'CREATE DATABASE "{NAME}"')


ensure_database()

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402

from runs.models import Run  # noqa: E402

FILL = f"""
INSERT INTO runs_run (id, workflow, version, input, status, key, lease_epoch, attempt,
    max_attempts, recoveries, event_seq, tokens_in, tokens_out, cost_micros, reserved_micros,
    reserved_tokens, budget_warned, halted_by, halt_reason, cancel_requested_by, cancel_reason,
    created_at, wake_at)
SELECT gen_random_uuid(), 'bench-' || (g % 20), '1', '{{}}'::jsonb,
       (ARRAY['completed','failed','waiting','pending','halted'])[1 + g % 5], 'k-' || g, 1, 1,
       3, 0, {EVENTS_PER_RUN}, g % 1000, g % 500, g * 7, 0, 0, false, '', '', '', '',
       now() - (g || ' seconds')::interval, now()
FROM generate_series(1, {RUNS}) g;
INSERT INTO runs_event (run_id, seq, type, step_key, actor, payload, created_at)
SELECT r.id, s, 'step.completed', 's' || s, 'system', '{{}}'::jsonb, r.created_at
FROM runs_run r, generate_series(1, {EVENTS_PER_RUN}) s;
"""


def fill() -> None:
    if Run.objects.count() >= RUNS:
        return
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute(FILL)
        cursor.execute("ANALYZE")
    took = time.monotonic() - started
    print(f"filled {RUNS:,} runs and {RUNS * EVENTS_PER_RUN:,} events in {took:.0f} s")


def timed(client: Client, path: str, **params) -> tuple[float, float]:
    samples = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        response = client.get(path, params)
        samples.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95) - 1]


def main() -> None:
    call_command("migrate", verbosity=0)
    fill()
    user, _ = get_user_model().objects.get_or_create(username="bench", is_superuser=True)
    client = Client()
    client.force_login(user)
    oldest = Run.objects.order_by("created_at").first()
    middle = Run.objects.order_by("-created_at")[RUNS // 2]
    marker = f"{middle.created_at.isoformat()}_{middle.pk}"
    rows = [
        ("runs list, first page", "/", {}),
        ("runs list, status=failed", "/", {"status": "failed"}),
        ("runs list, workflow=bench-7", "/", {"workflow": "bench-7"}),
        ("runs list, key search", "/", {"q": "k-4242"}),
        ("runs list, page 1,000 (keyset)", "/", {"before": marker}),
        ("run page (10 events)", f"/runs/{oldest.pk}", {}),
    ]
    print(
        f"\n{RUNS:,} runs, {Run.objects.count() * EVENTS_PER_RUN:,} events; {REPEATS} requests each"
    )
    print(f"  {'page':<34} {'median':>9} {'p95':>9}  target < 200 ms")
    for label, path, params in rows:
        median, p95 = timed(client, path, **params)
        verdict = "MET" if median < 200 else "MISSED"
        print(f"  {label:<34} {median:>7.1f}ms {p95:>7.1f}ms  {verdict}")


if __name__ == "__main__":
    main()
