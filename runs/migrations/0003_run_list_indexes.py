"""Indexes for the runs list: newest first, and per workflow.

`runs_run` is written by every checkpoint, so on PostgreSQL the indexes are built
CONCURRENTLY: a plain CREATE INDEX would block every worker until it finished.
"""

from django.db import migrations, models

INDEXES = {
    "runs_run_created_idx": '"created_at" DESC, "id" DESC',
    "runs_run_workflow_created_idx": '"workflow", "created_at" DESC',
}


def create(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    for name, columns in INDEXES.items():
        schema_editor.execute(
            f'CREATE INDEX {concurrently}IF NOT EXISTS "{name}" ON "runs_run" ({columns})'
        )


def drop(apps, schema_editor):
    concurrently = "CONCURRENTLY " if schema_editor.connection.vendor == "postgresql" else ""
    for name in INDEXES:
        schema_editor.execute(f'DROP INDEX {concurrently}IF EXISTS "{name}"')


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("runs", "0002_append_only_events_and_groups"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name="run",
                    index=models.Index(fields=["-created_at", "-id"], name="runs_run_created_idx"),
                ),
                migrations.AddIndex(
                    model_name="run",
                    index=models.Index(
                        fields=["workflow", "-created_at"], name="runs_run_workflow_created_idx"
                    ),
                ),
            ],
            database_operations=[migrations.RunPython(create, drop)],
        ),
    ]
