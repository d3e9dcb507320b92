"""What runs spent per day, per workflow and label set, kept by triggers on the steps table
(runs.models.SpendDay), and filled from the steps already there."""

import django.db.models.deletion
from django.db import migrations, models

# A step's spend changes (its cost, tokens or possibly spent, whichever code writes them): the
# change is booked on the UTC day of the step's finish, or of the change while it runs, under
# its run's workflow and labels; a run's first spend of a day counts it once in `runs`.
CONTRIBUTES = (
    "NEW.cost_micros <> 0 OR NEW.tokens_in <> 0 OR NEW.tokens_out <> 0"
    " OR NEW.possibly_spent_micros <> 0"
)
CHANGED = (
    "OLD.cost_micros <> NEW.cost_micros OR OLD.tokens_in <> NEW.tokens_in"
    " OR OLD.tokens_out <> NEW.tokens_out OR OLD.possibly_spent_micros <> NEW.possibly_spent_micros"
)
COLUMNS = "cost_micros, tokens_in, tokens_out, possibly_spent_micros"


def _add(target: str) -> str:
    return f"""
    ON CONFLICT ({target}) DO UPDATE SET
        micros = runs_spendday.micros + excluded.micros,
        tokens = runs_spendday.tokens + excluded.tokens,
        possibly_micros = runs_spendday.possibly_micros + excluded.possibly_micros,
        runs = runs_spendday.runs + excluded.runs
"""


# One row per day, workflow and label set. On PostgreSQL the index keys the labels by their
# md5: a jsonb of ten long labels passes a btree entry's size limit (about 2.7 kB).
PG_KEY = "day, workflow, md5(labels::text)"
SQLITE_KEY = "day, workflow, labels"
# Constraint triggers, deferred: the day's row is locked at commit, after everything else the
# transaction locks (run rows, ledgers), so two steps booking on one row never deadlock.
PG_TRIGGERS = f"""
CREATE UNIQUE INDEX runs_spendday_unique ON runs_spendday ({PG_KEY});
CREATE OR REPLACE FUNCTION runs_spend_book() RETURNS trigger AS $$
DECLARE
    spent_on date := (COALESCE(NEW.finished_at, now()) AT TIME ZONE 'UTC')::date;
    add_micros bigint := NEW.cost_micros;
    add_tokens bigint := NEW.tokens_in + NEW.tokens_out;
    add_possibly bigint := NEW.possibly_spent_micros;
    first_today integer;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        add_micros := add_micros - OLD.cost_micros;
        add_tokens := add_tokens - OLD.tokens_in - OLD.tokens_out;
        add_possibly := add_possibly - OLD.possibly_spent_micros;
    END IF;
    INSERT INTO runs_spendrun (run_id, day) VALUES (NEW.run_id, spent_on) ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS first_today = ROW_COUNT;
    INSERT INTO runs_spendday (day, workflow, labels, micros, tokens, possibly_micros, runs)
    SELECT spent_on, r.workflow, r.labels, add_micros, add_tokens, add_possibly, first_today
    FROM runs_run r WHERE r.id = NEW.run_id
    {_add(PG_KEY)};
    RETURN NULL;
END;
$$ LANGUAGE plpgsql;
CREATE CONSTRAINT TRIGGER runs_spend_insert AFTER INSERT ON runs_step
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN ({CONTRIBUTES}) EXECUTE FUNCTION runs_spend_book();
CREATE CONSTRAINT TRIGGER runs_spend_update AFTER UPDATE OF {COLUMNS} ON runs_step
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    WHEN ({CHANGED}) EXECUTE FUNCTION runs_spend_book();
"""
PG_DROP = """
DROP TRIGGER IF EXISTS runs_spend_insert ON runs_step;
DROP TRIGGER IF EXISTS runs_spend_update ON runs_step;
DROP FUNCTION IF EXISTS runs_spend_book();
"""


def _sqlite_trigger(name: str, event: str, when: str, delta: str) -> str:
    day = "date(COALESCE(NEW.finished_at, CURRENT_TIMESTAMP))"
    return f"""
CREATE TRIGGER {name} AFTER {event} ON runs_step WHEN {when}
BEGIN
    INSERT INTO runs_spendday (day, workflow, labels, micros, tokens, possibly_micros, runs)
    SELECT {day}, r.workflow, r.labels, {delta},
        NOT EXISTS (SELECT 1 FROM runs_spendrun s WHERE s.run_id = NEW.run_id AND s.day = {day})
    FROM runs_run r WHERE r.id = NEW.run_id
    {_add(SQLITE_KEY)};
    INSERT OR IGNORE INTO runs_spendrun (run_id, day) VALUES (NEW.run_id, {day});
END;
"""


SQLITE_TRIGGERS = [
    f"CREATE UNIQUE INDEX runs_spendday_unique ON runs_spendday ({SQLITE_KEY});",
    _sqlite_trigger(
        "runs_spend_insert", "INSERT", CONTRIBUTES,
        "NEW.cost_micros, NEW.tokens_in + NEW.tokens_out, NEW.possibly_spent_micros",
    ),
    _sqlite_trigger(
        "runs_spend_update", f"UPDATE OF {COLUMNS}", CHANGED,
        "NEW.cost_micros - OLD.cost_micros,"
        " NEW.tokens_in + NEW.tokens_out - OLD.tokens_in - OLD.tokens_out,"
        " NEW.possibly_spent_micros - OLD.possibly_spent_micros",
    ),
]  # fmt: skip
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS runs_spend_insert;",
    "DROP TRIGGER IF EXISTS runs_spend_update;",
]


def _backfill(day: str) -> list[str]:
    """The steps already there, each booked on the day it finished (or started)."""
    spent = (
        "s.cost_micros <> 0 OR s.tokens_in <> 0 OR s.tokens_out <> 0"
        " OR s.possibly_spent_micros <> 0"
    )
    return [
        f"""INSERT INTO runs_spendrun (run_id, day)
            SELECT DISTINCT s.run_id, {day} FROM runs_step s WHERE {spent}""",
        f"""INSERT INTO runs_spendday (day, workflow, labels, micros, tokens, possibly_micros, runs)
            SELECT {day} AS spent_on, r.workflow, r.labels, SUM(s.cost_micros),
                SUM(s.tokens_in + s.tokens_out), SUM(s.possibly_spent_micros),
                COUNT(DISTINCT s.run_id)
            FROM runs_step s JOIN runs_run r ON r.id = s.run_id
            WHERE {spent}
            GROUP BY spent_on, r.workflow, r.labels""",
    ]


def book_spend(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        statements = [PG_TRIGGERS]
        statements += _backfill("(COALESCE(s.finished_at, s.started_at) AT TIME ZONE 'UTC')::date")
    elif vendor == "sqlite":
        statements = [*SQLITE_TRIGGERS, *_backfill("date(COALESCE(s.finished_at, s.started_at))")]
    else:
        return
    for statement in statements:
        schema_editor.execute(statement, params=None)


def drop_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    statements = {"postgresql": [PG_DROP], "sqlite": SQLITE_DROP}.get(vendor, [])
    for statement in statements:
        schema_editor.execute(statement, params=None)


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0022_run_labels"),
    ]

    operations = [
        migrations.CreateModel(
            name="SpendDay",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("day", models.DateField()),
                ("workflow", models.CharField(max_length=200)),
                ("labels", models.JSONField(default=dict)),
                (
                    "micros",
                    models.BigIntegerField(default=0, help_text="USD recorded, in 1e-6 USD"),
                ),
                ("tokens", models.BigIntegerField(default=0)),
                (
                    "possibly_micros",
                    models.BigIntegerField(
                        default=0,
                        help_text="estimates of model calls cut off in flight: maybe paid",
                    ),
                ),
                (
                    "runs",
                    models.PositiveIntegerField(default=0, help_text="runs that spent that day"),
                ),
            ],
        ),
        migrations.CreateModel(
            name="SpendRun",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("day", models.DateField()),
                (
                    "run",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="spend_days",
                        to="runs.run",
                    ),
                ),
            ],
            options={
                "constraints": [
                    models.UniqueConstraint(fields=("run", "day"), name="runs_spendrun_unique")
                ],
            },
        ),
        migrations.RunPython(book_spend, drop_triggers),
    ]
