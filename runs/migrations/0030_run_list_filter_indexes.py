import logging

from django.db import DatabaseError, migrations, models, transaction

log = logging.getLogger("stepguard.migrations")

# A label and a status together (`label=tenant=acme&status=failed`), the list's page and each
# status's capped count: one GIN index over both (btree_gin gives text a GIN operator class),
# so a pair that matches nothing is an index probe, not a walk of the newest-first index
# (503 ms at a million runs: `Rows Removed by Filter: 1000951`). It serves a label alone as the
# labels' index did, so that one goes.
LABELS_STATUS = (
    "CREATE INDEX IF NOT EXISTS runs_run_labels_status_gin_idx ON runs_run "
    "USING gin (labels jsonb_path_ops, status)"
)
#: The same, run by hand on a live database (docs/deploy.md): the table stays writable. Two
#: statements, each on its own (CONCURRENTLY refuses a transaction block).
BY_HAND = (
    LABELS_STATUS.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY")
    + ";\nDROP INDEX CONCURRENTLY IF EXISTS runs_run_labels_gin_idx;"
)


def labels_status(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # SQLite, the embedded engine: its histories are small enough to read
    try:
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute("CREATE EXTENSION IF NOT EXISTS btree_gin")
    except DatabaseError as exc:  # btree_gin not installed, or this role may not create it
        log.warning(
            "btree_gin is not available (%s): a label and a status together are found through "
            "the labels' index alone; have an administrator run CREATE EXTENSION btree_gin in "
            "this database, then run these, each on its own:\n%s", exc, BY_HAND,
        )
        return
    schema_editor.execute(LABELS_STATUS)
    schema_editor.execute("DROP INDEX IF EXISTS runs_run_labels_gin_idx")


def labels_only(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            "CREATE INDEX IF NOT EXISTS runs_run_labels_gin_idx ON runs_run "
            "USING gin (labels jsonb_path_ops)"
        )
        schema_editor.execute("DROP INDEX IF EXISTS runs_run_labels_status_gin_idx")


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0029_run_published_events'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='run',
            index=models.Index(models.F('status'), models.F('created_at').desc(), models.F('id').desc(), condition=models.Q(('workflow__startswith', 'stepguard.'), _negated=True), name='runs_run_listed_status_idx'),
        ),
        migrations.RunPython(labels_status, labels_only),
    ]
