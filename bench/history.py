"""A production-shaped history for bench/ui.py: statuses follow age, many tenants, priced steps,
approvals (mostly decided) and workers, written set-based (generate_series) in chunks.

Shape, for run g of N (g = 1 is the oldest; created over SPAN_DAYS, evenly):

- the oldest 60 % are finished: completed, failed (g % 25 = 0), cancelled (g % 100 = 1);
- the newest 40 % are mixed and live: by g % 20, running 10 %, waiting 40 % (half with a timer
  a week ahead, half waiting on an approval or a signal), pending 10 % (due), over budget 5 %,
  halted 5 %, finished 30 % (failures as above);
- workflow `bench-<(g / 7) % 20>`, except 1 % notification deliveries (`stepguard.notify`, the
  engine's own runs every list leaves out);
- label `tenant=t-<g % 200>`: failures fall on g % 25 = 0, so tenants t-0, t-25, ..., t-175
  carry every failure and the other 192 (t-7 among them) none;
- two steps per run (an `llm` step priced by its tokens, on one of three models, and a free
  `tool` step), EVENTS events per run (4 by default: lean, said beside every figure);
- an approval on every tenth run (g % 10 = 3): pending on waiting runs, else decided
  (approved, one in ten rejected);
- WORKERS workers, a fifth of them heartbeating, the rest stopped.

Each chunk of CHUNK runs is one transaction, so an interrupted fill resumes at the first chunk
not committed. Triggers and foreign-key checks are off while a chunk is written
(`session_replication_role = replica`, as pg_restore does): the spend triggers would cost one
row-by-row booking per step, so each chunk books its days' spend (runs_spendday,
runs_spendrun) itself, set-based, as those triggers would have, and the /metrics totals
(runs_tally) are made again from the tables once the last chunk is in.
"""

from __future__ import annotations

import time

SPAN_DAYS = 90
CHUNK = 50_000
TENANTS = 200
WORKERS = 50

_RUNS_SQL = """
    INSERT INTO runs_run (id, workflow, version, input, status, key, lease_epoch, attempt,
        max_attempts, recoveries, event_seq, tokens_in, tokens_out, cost_micros,
        reserved_micros, reserved_tokens, budget_warned, halted_at, halted_by, halt_reason,
        cancel_requested_by, cancel_reason, concurrency_key, priority, possibly_spent_micros,
        possibly_spent_tokens, labels, created_at, started_at, finished_at, wake_at,
        lease_until, worker_id)
    SELECT gen_random_uuid(), x.workflow, '1', '{{}}'::json, x.status, 'k-' || x.g,
        1, 1, 3, 0, %(events)s, 100 + x.g %% 1000, 50 + x.g %% 500,
        3 * (100 + x.g %% 1000) + 15 * (50 + x.g %% 500), 0, 0, false,
        CASE WHEN x.status = 'halted' THEN x.created_at END,
        CASE WHEN x.status = 'halted' THEN 'ops' ELSE '' END, '', '', '', '', 0, 0, 0,
        jsonb_build_object('tenant', 't-' || x.g %% {tenants}), x.created_at,
        CASE WHEN x.status <> 'pending' THEN x.created_at + interval '1 second' END,
        CASE WHEN x.status IN ('completed', 'failed', 'cancelled')
             THEN x.created_at + interval '30 seconds' END,
        CASE WHEN x.status IN ('pending', 'over_budget') THEN x.created_at
             WHEN x.status = 'waiting' AND x.g %% 2 = 0 THEN %(anchor)s + interval '7 days' END,
        CASE WHEN x.status = 'running' THEN %(anchor)s + interval '30 days' END,
        CASE WHEN x.status = 'running' THEN %(worker)s::uuid END
    FROM (
        SELECT g, %(anchor)s - (%(n)s - g) * interval '{span} days' / %(n)s AS created_at,
            CASE WHEN g %% 100 = 99 THEN 'stepguard.notify'
                 ELSE 'bench-' || (g / 7) %% 20 END AS workflow,
            CASE WHEN g %% 25 = 0 THEN 'failed'
                 WHEN g %% 100 = 1 THEN 'cancelled'
                 WHEN g <= %(n)s * 0.6 THEN 'completed'
                 ELSE (ARRAY['running', 'running', 'waiting', 'waiting', 'waiting', 'waiting',
                             'waiting', 'waiting', 'waiting', 'waiting', 'pending', 'pending',
                             'over_budget', 'halted', 'completed', 'completed', 'completed',
                             'completed', 'completed', 'completed'])[1 + g %% 20]
            END AS status
        FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) g
    ) x
"""

_CHUNK_SQL = (
    "WITH r AS ("
    + _RUNS_SQL
    + """
    RETURNING id, workflow, status, labels, created_at, finished_at, tokens_in, tokens_out,
        cost_micros, substr(key, 3)::bigint AS g
), steps AS (
    INSERT INTO runs_step (run_id, seq, key, kind, status, input, idempotency_key, attempt,
        run_attempt, recovered, tokens_in, tokens_out, cost_micros, reserved_micros,
        possibly_spent_micros, possibly_spent_tokens, reserved_tokens, reserved_scopes,
        inherited, started_at, finished_at)
    SELECT r.id, s, CASE s WHEN 0 THEN 'model' ELSE 'lookup' END,
        CASE s WHEN 0 THEN 'llm' ELSE 'tool' END,
        CASE WHEN s = 1 AND r.status = 'failed' THEN 'failed'
             WHEN s = 1 AND r.finished_at IS NULL THEN 'started' ELSE 'completed' END,
        CASE s WHEN 0 THEN jsonb_build_array(jsonb_build_object(
            'model', (ARRAY['gpt-4o-mini', 'gpt-4o', 'claude-haiku'])[1 + r.g %% 3]))
            ELSE '[]'::jsonb END,
        r.id || ':' || s, 1, 1, '', CASE s WHEN 0 THEN r.tokens_in ELSE 0 END,
        CASE s WHEN 0 THEN r.tokens_out ELSE 0 END, CASE s WHEN 0 THEN r.cost_micros ELSE 0 END,
        0, 0, 0, 0, '[]'::jsonb, false, r.created_at + s * interval '5 seconds',
        CASE WHEN s = 0 OR r.finished_at IS NOT NULL
             THEN r.created_at + (s + 1) * interval '5 seconds' END
    FROM r, generate_series(0, 1) s
), events AS (
    INSERT INTO runs_event (run_id, seq, type, step_key, actor, payload, created_at,
        run_created_at)
    SELECT r.id, e, CASE e WHEN 1 THEN 'run.created' WHEN %(events)s THEN 'run.completed'
                    ELSE 'step.completed' END,
        CASE WHEN e IN (1, %(events)s) THEN '' ELSE 's' || e END, 'system', '{{}}'::jsonb,
        r.created_at + e * interval '1 second', r.created_at
    FROM r, generate_series(1, %(events)s) e
), approvals AS (
    INSERT INTO approvals_approvalrequest (run_id, step_key, kind, action, summary, payload,
        status, resolution, decided_at, comment, created_at, decided_by_id, sha256)
    SELECT r.id, 'approve', 'action', 'refund', 'Refund the order', '{{}}'::jsonb,
        CASE WHEN r.status = 'waiting' THEN 'pending'
             WHEN r.g %% 100 = 13 THEN 'rejected' ELSE 'approved' END, '',
        CASE WHEN r.status <> 'waiting' THEN r.created_at + interval '5 minutes' END, '',
        r.created_at + interval '10 seconds',
        CASE WHEN r.status <> 'waiting' THEN %(approver)s END, ''
    FROM r WHERE r.g %% 10 = 3
), spent AS (
    INSERT INTO runs_spendrun (run_id, day)
    SELECT r.id, ((r.created_at + interval '5 seconds') AT TIME ZONE 'UTC')::date FROM r
)
INSERT INTO runs_spendday (day, workflow, labels, micros, tokens, possibly_micros, runs)
SELECT ((created_at + interval '5 seconds') AT TIME ZONE 'UTC')::date AS d, workflow, labels,
    SUM(cost_micros), SUM(tokens_in + tokens_out), 0, COUNT(*)
FROM r GROUP BY d, workflow, labels
ON CONFLICT (day, workflow, md5(labels::text)) DO UPDATE SET
    micros = runs_spendday.micros + excluded.micros,
    tokens = runs_spendday.tokens + excluded.tokens,
    runs = runs_spendday.runs + excluded.runs
"""
)


def fill(connection, runs: int, events: int, approver_id: int, lean: bool = False) -> None:
    """Fill up to `runs` runs, resuming after the last whole chunk a previous fill left.
    `lean`: the runs alone (no steps, events, approvals or spend), for what reads only runs
    (the claim and the idle poll) at sizes this host fills in minutes."""
    from django.db import transaction

    from runs import partitions, tally

    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS bench_fill (runs bigint PRIMARY KEY, events int, "
            "anchor timestamptz NOT NULL, done bigint NOT NULL DEFAULT 0)"
        )
        cursor.execute("SELECT events, anchor, done FROM bench_fill WHERE runs = %s", [runs])
        row = cursor.fetchone()
        if row is None:
            cursor.execute(
                "INSERT INTO bench_fill (runs, events, anchor) VALUES (%s, %s, now()) "
                "RETURNING events, anchor, done",
                [runs, events],
            )
            row = cursor.fetchone()
        events, anchor, done = row
        if done >= runs:
            return
        from datetime import timedelta

        partitions.ensure(since=anchor - timedelta(days=SPAN_DAYS + 1))
        worker = _workers(cursor, anchor)
        started = time.monotonic()
        sql = (_RUNS_SQL if lean else _CHUNK_SQL).format(tenants=TENANTS, span=SPAN_DAYS)
        while done < runs:
            hi = min(done + CHUNK, runs)
            with connection.cursor() as chunk:
                chunk.execute("BEGIN")
                chunk.execute("SET LOCAL session_replication_role = replica")
                params = {"events": events, "anchor": anchor, "n": runs, "lo": done + 1,
                          "hi": hi, "worker": worker, "approver": approver_id}  # fmt: skip
                chunk.execute(sql, params)
                chunk.execute("UPDATE bench_fill SET done = %s WHERE runs = %s", [hi, runs])
                chunk.execute("COMMIT")
            done = hi
            rate = done / max(time.monotonic() - started, 1e-3)
            print(f"  filled {done:,} of {runs:,} runs ({rate:,.0f} runs/s)", flush=True)
        with transaction.atomic():  # the triggers were off: the /metrics totals again
            tally.rebuild()
        cursor.execute("VACUUM ANALYZE")


def _workers(cursor, anchor) -> str:
    """WORKERS workers (a fifth heartbeating at the anchor); the id running runs are leased to."""
    cursor.execute("SELECT count(*) FROM runs_worker WHERE host LIKE 'bench-host-%%'")
    if not cursor.fetchone()[0]:
        cursor.execute(
            """INSERT INTO runs_worker (id, host, pid, concurrency, workflows, started_at,
                   heartbeat_at, stopped_at)
               SELECT gen_random_uuid(), 'bench-host-' || w, 1000 + w, 8, '["bench-1"]'::jsonb,
                   %(a)s - interval '1 day', %(a)s,
                   CASE WHEN w %% 5 <> 0 THEN %(a)s - interval '1 hour' END
               FROM generate_series(1, %(n)s) w""",
            {"a": anchor, "n": WORKERS},
        )
    cursor.execute("SELECT id FROM runs_worker WHERE host = 'bench-host-5'")
    return str(cursor.fetchone()[0])
