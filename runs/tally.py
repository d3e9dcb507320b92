"""Running totals for /metrics on PostgreSQL (runs.models.Tally): runs by workflow and
status, runs held (a hold of their own), approval requests by status, and the steps of
finished runs by outcome, duration, spend and tokens, kept by triggers (migration 0032) so
that no scrape and no chore reads the runs, approvals or steps tables to sum them.

What the totals hold, and the one invariant the triggers keep: every run counted under its
workflow and status (and as held, if it is), every approval request under its status, every
step of a *finished* run (completed, failed, cancelled) in the step families. So a step
writes nothing extra (a worker's step stays one statement): a run's steps are added when it
finishes, in the statement that finishes it (one read of its steps through the (run, seq)
index), taken off again if it leaves a finished status (a resumed run) or when they are
deleted while it is finished (a prune deletes the steps before the runs). A step changed
after its run finished is not seen (nothing in the engine does).

No counter row is updated by two writers: each trigger appends signed rows (`folded` false),
and one worker per period folds them into one row per key (`fold`, in runs/summary.py's
chore). A scrape sums both in one statement (`read`): exact, current, and as cheap as the
number of keys plus the rows appended since the last fold.
"""

from __future__ import annotations

from collections import defaultdict

from django.db import connection

#: The buckets of stepguard_step_duration_seconds, in seconds (a bucket is stored by position).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
FINISHED = "('completed', 'failed', 'cancelled')"  # runs.models.TERMINAL_STATUSES
_INSERT = "INSERT INTO runs_tally (family, a, b, n, folded)"
_FOLDED = " ON CONFLICT (family, a, b) WHERE folded DO UPDATE SET n = runs_tally.n + excluded.n"


def steps_sql(source: str, sign: str, folded: str = "false") -> str:
    """Signed rows for the steps `source` yields (runs_step's columns and `workflow`)."""
    buckets = ", ".join(str(b) for b in BUCKETS)
    return f"""{_INSERT}
SELECT d.family, d.a, d.b, {sign} * SUM(d.n), {folded}
FROM (SELECT x.*,
        CASE WHEN x.kind = 'llm' THEN COALESCE(x.input -> 0 ->> 'model', '') ELSE '' END AS model,
        CASE WHEN x.status = 'completed'
             THEN EXTRACT(EPOCH FROM x.finished_at - x.started_at) END AS took
      FROM ({source}) x) s
CROSS JOIN LATERAL (
    VALUES ('steps', '', 'completed', (s.status = 'completed')::int::bigint),
           ('steps', '', 'failed', (s.status = 'failed')::int),
           ('steps', '', 'retried', GREATEST(s.attempt - 1, 0)),
           ('steps', '', 'resent', (s.recovered = 'resent')::int),
           ('steps', '', 'reconciled', (s.recovered = 'reconciled')::int),
           ('usd_micros', s.workflow, s.model, s.cost_micros),
           ('tokens_in', s.workflow, s.model, s.tokens_in),
           ('tokens_out', s.workflow, s.model, s.tokens_out),
           ('duration', s.kind, '+Inf', (s.took IS NOT NULL)::int),
           ('duration_us', s.kind, '', COALESCE(round(s.took * 1e6), 0)::bigint)
    UNION ALL
    SELECT 'duration', s.kind, (b.i - 1)::text, 1
    FROM unnest(ARRAY[{buckets}]::float8[]) WITH ORDINALITY b(le, i) WHERE s.took <= b.le
) d(family, a, b, n)
GROUP BY d.family, d.a, d.b HAVING SUM(d.n) <> 0"""


# The triggers that keep the totals are migration 0032's (frozen there, as a migration must be;
# a change to them is a new migration). REBUILD and FOLD below are this module's.
#: The totals made again from the tables (the migration's backfill; a bench fill written
#: with triggers off). Whole-table reads: never on a request's path.
REBUILD = [
    "DELETE FROM runs_tally",
    f"{_INSERT} SELECT 'runs', workflow, status, COUNT(*), true FROM runs_run GROUP BY 2, 3",
    f"{_INSERT} SELECT 'held', '', '', COUNT(*), true FROM runs_run WHERE halted_at IS NOT NULL",
    f"{_INSERT} SELECT 'approvals', '', status, COUNT(*), true FROM approvals_approvalrequest "
    "GROUP BY 3",
    steps_sql(
        "SELECT s.*, r.workflow FROM runs_step s JOIN runs_run r ON r.id = s.run_id "
        f"WHERE r.status IN {FINISHED}",
        "1",
        folded="true",
    ),
]
FOLD = f"""
WITH moved AS (DELETE FROM runs_tally WHERE NOT folded RETURNING family, a, b, n)
{_INSERT} SELECT family, a, b, SUM(n), true FROM moved GROUP BY 1, 2, 3{_FOLDED}"""


def kept() -> bool:
    """Whether the totals are kept here (PostgreSQL); elsewhere they are summed from the tables."""
    return connection.vendor == "postgresql"


def rebuild() -> None:
    with connection.cursor() as cursor:
        for statement in REBUILD:
            cursor.execute(statement)


def fold() -> None:
    """One row per key again (one worker per period: runs/summary.py)."""
    with connection.cursor() as cursor:
        cursor.execute(FOLD)


def read() -> dict[str, dict[tuple[str, str], int]]:
    """The totals, by family then (a, b): one statement over the folded rows and those since."""
    out: dict[str, dict[tuple[str, str], int]] = defaultdict(dict)
    with connection.cursor() as cursor:
        cursor.execute("SELECT family, a, b, SUM(n) FROM runs_tally GROUP BY 1, 2, 3")
        for family, a, b, n in cursor.fetchall():
            out[family][(a, b)] = int(n)
    return out
