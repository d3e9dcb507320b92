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


# The run's own row: its status and its hold counted; its steps added or taken off as it
# enters or leaves a finished status. Row triggers, fired only by an insert or a change of
# status, workflow or hold (a lease renewal or an event's sequence number fires nothing).
TRIGGERS = f"""
CREATE OR REPLACE FUNCTION runs_tally_steps(p_run uuid, p_wf text, p_sign int) RETURNS void
AS $$
{steps_sql("SELECT s.*, p_wf AS workflow FROM runs_step s WHERE s.run_id = p_run", "p_sign")}
$$ LANGUAGE sql;
CREATE OR REPLACE FUNCTION runs_tally_run() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        {_INSERT} VALUES ('runs', NEW.workflow, NEW.status, 1, false);
        IF NEW.halted_at IS NOT NULL THEN
            {_INSERT} VALUES ('held', '', '', 1, false);
        END IF;
        RETURN NULL;
    END IF;
    IF OLD.status IS DISTINCT FROM NEW.status OR OLD.workflow IS DISTINCT FROM NEW.workflow THEN
        {_INSERT} VALUES ('runs', OLD.workflow, OLD.status, -1, false),
            ('runs', NEW.workflow, NEW.status, 1, false);
        IF OLD.status IN {FINISHED} THEN
            PERFORM runs_tally_steps(OLD.id, OLD.workflow, -1);
        END IF;
        IF NEW.status IN {FINISHED} THEN
            PERFORM runs_tally_steps(NEW.id, NEW.workflow, 1);
        END IF;
    END IF;
    IF (OLD.halted_at IS NULL) <> (NEW.halted_at IS NULL) THEN
        {_INSERT}
            VALUES ('held', '', '', CASE WHEN NEW.halted_at IS NULL THEN -1 ELSE 1 END, false);
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_tally_insert AFTER INSERT ON runs_run
    FOR EACH ROW EXECUTE FUNCTION runs_tally_run();
CREATE TRIGGER runs_tally_update AFTER UPDATE OF status, workflow, halted_at ON runs_run
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status
        OR OLD.workflow IS DISTINCT FROM NEW.workflow
        OR (OLD.halted_at IS NULL) <> (NEW.halted_at IS NULL))
    EXECUTE FUNCTION runs_tally_run();
CREATE OR REPLACE FUNCTION runs_tally_runs_gone() RETURNS trigger AS $$
BEGIN
    {_INSERT} SELECT 'runs', workflow, status, -COUNT(*), false FROM gone GROUP BY 2, 3;
    {_INSERT} SELECT 'held', '', '', -COUNT(*), false FROM gone WHERE halted_at IS NOT NULL
        HAVING COUNT(*) > 0;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_tally_runs_delete AFTER DELETE ON runs_run
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION runs_tally_runs_gone();
CREATE OR REPLACE FUNCTION runs_tally_steps_gone() RETURNS trigger AS $$
BEGIN
    {
    steps_sql(
        f"SELECT s.*, r.workflow FROM gone s JOIN runs_run r ON r.id = s.run_id "
        f"WHERE r.status IN {FINISHED}",
        "-1",
    )
};
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_tally_steps_delete AFTER DELETE ON runs_step
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION runs_tally_steps_gone();
CREATE OR REPLACE FUNCTION runs_tally_approval() RETURNS trigger AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        {_INSERT} VALUES ('approvals', '', OLD.status, -1, false);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        {_INSERT} VALUES ('approvals', '', NEW.status, 1, false);
    END IF;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_tally_approvals AFTER INSERT OR DELETE OR UPDATE OF status
    ON approvals_approvalrequest FOR EACH ROW EXECUTE FUNCTION runs_tally_approval();
"""
DROP = """
DROP TRIGGER IF EXISTS runs_tally_insert ON runs_run;
DROP TRIGGER IF EXISTS runs_tally_update ON runs_run;
DROP TRIGGER IF EXISTS runs_tally_runs_delete ON runs_run;
DROP TRIGGER IF EXISTS runs_tally_steps_delete ON runs_step;
DROP TRIGGER IF EXISTS runs_tally_approvals ON approvals_approvalrequest;
DROP FUNCTION IF EXISTS runs_tally_approval();
DROP FUNCTION IF EXISTS runs_tally_run();
DROP FUNCTION IF EXISTS runs_tally_runs_gone();
DROP FUNCTION IF EXISTS runs_tally_steps_gone();
DROP FUNCTION IF EXISTS runs_tally_steps(uuid, text, int);
"""
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
