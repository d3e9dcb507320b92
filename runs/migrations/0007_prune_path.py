"""Retention: the history stays append-only, except for the prune path.

On PostgreSQL the append-only trigger now lets a DELETE through when the transaction has set
`stepguard.prune` to 'on' (`SET LOCAL`, so it ends with the transaction); runs/retention.py is
the one place that sets it. UPDATEs stay refused. SQLite keeps refusing UPDATEs only (see
0002: the test suite flushes its tables with DELETE); there only runs/retention.py deletes.

`Chore` holds the due time of the daily prune, so one worker at a time does it. Two indexes:
finished root runs for the prune, lease losses for /metrics.
"""

from django.db import migrations, models

PG_PRUNABLE = """
CREATE OR REPLACE FUNCTION runs_event_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('stepguard.prune', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'runs_event is append-only: events are never %d (only a prune deletes)',
        lower(TG_OP);
END;
$$ LANGUAGE plpgsql;
"""
PG_STRICT = """
CREATE OR REPLACE FUNCTION runs_event_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'runs_event is append-only: events are never %d', lower(TG_OP);
END;
$$ LANGUAGE plpgsql;
"""


def prunable(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_PRUNABLE, params=None)


def strict(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PG_STRICT, params=None)


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0006_run_started_by"),
    ]

    operations = [
        migrations.CreateModel(
            name="Chore",
            fields=[
                ("name", models.CharField(max_length=50, primary_key=True, serialize=False)),
                ("due_at", models.DateTimeField()),
                ("claimed_by", models.CharField(blank=True, default="", max_length=255)),
                ("claimed_at", models.DateTimeField(blank=True, null=True)),
            ],
        ),
        migrations.AddIndex(
            model_name="run",
            index=models.Index(
                condition=models.Q(("finished_at__isnull", False), ("parent__isnull", True)),
                fields=["finished_at", "id"],
                name="runs_run_finished_root_idx",
            ),
        ),
        migrations.AddIndex(
            model_name="event",
            index=models.Index(
                condition=models.Q(("type", "run.recovered")),
                fields=["created_at"],
                name="runs_event_recovered_idx",
            ),
        ),
        migrations.RunPython(prunable, strict),
    ]
