# ruff: noqa: E501  (frozen SQL, kept as it was generated)
"""The /metrics totals kept by triggers (runs.models.Tally, runs/tally.py), and made once
from the tables already there: the one whole-table read, here rather than in every scrape.
Creating the triggers locks runs_run and runs_step against writes until the backfill
commits, so no write is counted twice or missed. With them, the flow page's index of keyed
live runs (its per-workflow counts are these totals)."""

from django.db import migrations, models

# The SQL as it was when this migration was written (runs/tally.py may change later; a
# migration must not): the triggers, their removal, and the first fill of the totals.
# The run's own row: its status and its hold counted; its steps added or taken off as it
# enters or leaves a finished status. Row triggers, fired only by an insert or a change of
# status, workflow or hold (a lease renewal or an event's sequence number fires nothing).
TRIGGERS = """
CREATE OR REPLACE FUNCTION runs_tally_steps(p_run uuid, p_wf text, p_sign int) RETURNS void
AS $$
INSERT INTO runs_tally (family, a, b, n, folded)
SELECT d.family, d.a, d.b, p_sign * SUM(d.n), false
FROM (SELECT x.*,
        CASE WHEN x.kind = 'llm' THEN COALESCE(x.input -> 0 ->> 'model', '') ELSE '' END AS model,
        CASE WHEN x.status = 'completed'
             THEN EXTRACT(EPOCH FROM x.finished_at - x.started_at) END AS took
      FROM (SELECT s.*, p_wf AS workflow FROM runs_step s WHERE s.run_id = p_run) x) s
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
    FROM unnest(ARRAY[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]::float8[]) WITH ORDINALITY b(le, i) WHERE s.took <= b.le
) d(family, a, b, n)
GROUP BY d.family, d.a, d.b HAVING SUM(d.n) <> 0
$$ LANGUAGE sql;
CREATE OR REPLACE FUNCTION runs_tally_run() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO runs_tally (family, a, b, n, folded) VALUES ('runs', NEW.workflow, NEW.status, 1, false);
        IF NEW.halted_at IS NOT NULL THEN
            INSERT INTO runs_tally (family, a, b, n, folded) VALUES ('held', '', '', 1, false);
        END IF;
        RETURN NULL;
    END IF;
    IF OLD.status IS DISTINCT FROM NEW.status OR OLD.workflow IS DISTINCT FROM NEW.workflow THEN
        INSERT INTO runs_tally (family, a, b, n, folded) VALUES ('runs', OLD.workflow, OLD.status, -1, false),
            ('runs', NEW.workflow, NEW.status, 1, false);
        IF OLD.status IN ('completed', 'failed', 'cancelled') THEN
            PERFORM runs_tally_steps(OLD.id, OLD.workflow, -1);
        END IF;
        IF NEW.status IN ('completed', 'failed', 'cancelled') THEN
            PERFORM runs_tally_steps(NEW.id, NEW.workflow, 1);
        END IF;
    END IF;
    IF (OLD.halted_at IS NULL) <> (NEW.halted_at IS NULL) THEN
        INSERT INTO runs_tally (family, a, b, n, folded)
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
    INSERT INTO runs_tally (family, a, b, n, folded) SELECT 'runs', workflow, status, -COUNT(*), false FROM gone GROUP BY 2, 3;
    INSERT INTO runs_tally (family, a, b, n, folded) SELECT 'held', '', '', -COUNT(*), false FROM gone WHERE halted_at IS NOT NULL
        HAVING COUNT(*) > 0;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_tally_runs_delete AFTER DELETE ON runs_run
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION runs_tally_runs_gone();
CREATE OR REPLACE FUNCTION runs_tally_steps_gone() RETURNS trigger AS $$
BEGIN
    INSERT INTO runs_tally (family, a, b, n, folded)
SELECT d.family, d.a, d.b, -1 * SUM(d.n), false
FROM (SELECT x.*,
        CASE WHEN x.kind = 'llm' THEN COALESCE(x.input -> 0 ->> 'model', '') ELSE '' END AS model,
        CASE WHEN x.status = 'completed'
             THEN EXTRACT(EPOCH FROM x.finished_at - x.started_at) END AS took
      FROM (SELECT s.*, r.workflow FROM gone s JOIN runs_run r ON r.id = s.run_id WHERE r.status IN ('completed', 'failed', 'cancelled')) x) s
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
    FROM unnest(ARRAY[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]::float8[]) WITH ORDINALITY b(le, i) WHERE s.took <= b.le
) d(family, a, b, n)
GROUP BY d.family, d.a, d.b HAVING SUM(d.n) <> 0;
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_tally_steps_delete AFTER DELETE ON runs_step
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION runs_tally_steps_gone();
CREATE OR REPLACE FUNCTION runs_tally_approval() RETURNS trigger AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        INSERT INTO runs_tally (family, a, b, n, folded) VALUES ('approvals', '', OLD.status, -1, false);
    END IF;
    IF TG_OP <> 'DELETE' THEN
        INSERT INTO runs_tally (family, a, b, n, folded) VALUES ('approvals', '', NEW.status, 1, false);
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

REBUILD = [
    """DELETE FROM runs_tally""",
    """INSERT INTO runs_tally (family, a, b, n, folded) SELECT 'runs', workflow, status, COUNT(*), true FROM runs_run GROUP BY 2, 3""",
    """INSERT INTO runs_tally (family, a, b, n, folded) SELECT 'held', '', '', COUNT(*), true FROM runs_run WHERE halted_at IS NOT NULL""",
    """INSERT INTO runs_tally (family, a, b, n, folded) SELECT 'approvals', '', status, COUNT(*), true FROM approvals_approvalrequest GROUP BY 3""",
    """INSERT INTO runs_tally (family, a, b, n, folded)
SELECT d.family, d.a, d.b, 1 * SUM(d.n), true
FROM (SELECT x.*,
        CASE WHEN x.kind = 'llm' THEN COALESCE(x.input -> 0 ->> 'model', '') ELSE '' END AS model,
        CASE WHEN x.status = 'completed'
             THEN EXTRACT(EPOCH FROM x.finished_at - x.started_at) END AS took
      FROM (SELECT s.*, r.workflow FROM runs_step s JOIN runs_run r ON r.id = s.run_id WHERE r.status IN ('completed', 'failed', 'cancelled')) x) s
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
    FROM unnest(ARRAY[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300]::float8[]) WITH ORDINALITY b(le, i) WHERE s.took <= b.le
) d(family, a, b, n)
GROUP BY d.family, d.a, d.b HAVING SUM(d.n) <> 0""",
]


def keep(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # elsewhere (SQLite, the embedded engine) the totals are summed from the tables
    schema_editor.execute(TRIGGERS, params=None)
    for statement in REBUILD:
        schema_editor.execute(statement, params=None)


def stop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP, params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0031_holdable_runs_indexes"),
        ("approvals", "0006_inbox_pending_by_id"),  # its requests are counted too
    ]

    operations = [
        migrations.CreateModel(
            name="Tally",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "family",
                    models.CharField(
                        help_text="runs, steps, usd_micros, duration, ...", max_length=20
                    ),
                ),
                (
                    "a",
                    models.CharField(
                        blank=True, help_text="workflow, or a step's kind", max_length=200
                    ),
                ),
                (
                    "b",
                    models.CharField(
                        blank=True, help_text="status, outcome, model, bucket", max_length=200
                    ),
                ),
                ("n", models.BigIntegerField()),
                ("folded", models.BooleanField(default=False)),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(
                        condition=models.Q(("folded", True)),
                        fields=("family", "a", "b"),
                        name="runs_tally_folded_unique",
                    )
                ],
            },
        ),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(
                    ("status__in", ["running", "pending"]),
                    models.Q(("concurrency_key", ""), _negated=True),
                ),
                fields=["workflow", "concurrency_key", "status"],
                name="runs_run_live_key_idx",
            ),
        ),
        migrations.RunPython(keep, stop),
    ]
