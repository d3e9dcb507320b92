"""The /metrics totals kept by triggers (runs.models.Tally, runs/tally.py), and made once
from the tables already there: the one whole-table read, here rather than in every scrape.
Creating the triggers locks runs_run and runs_step against writes until the backfill
commits, so no write is counted twice or missed. With them, the flow page's index of keyed
live runs (its per-workflow counts are these totals)."""

from django.db import migrations, models

from runs import tally


def keep(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # elsewhere (SQLite, the embedded engine) the totals are summed from the tables
    schema_editor.execute(tally.TRIGGERS, params=None)
    for statement in tally.REBUILD:
        schema_editor.execute(statement, params=None)


def stop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(tally.DROP, params=None)


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
