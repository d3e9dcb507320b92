import logging

from django.db import DatabaseError, migrations, models, transaction

log = logging.getLogger("stepguard.migrations")

# The runs list's search (`runs.queries.runs_matching`) asks `UPPER(key::text) LIKE UPPER('%q%')`
# (Django's icontains) OR an id range: with trigrams of the key that is two index probes, not a
# read of every key (430 ms at a million runs).
TRIGRAMS = "CREATE INDEX IF NOT EXISTS runs_run_key_trgm_idx ON runs_run USING gin (UPPER(key::text) gin_trgm_ops)"
#: The same, run by hand on a live database (docs/deploy.md): the table stays writable.
BY_HAND = TRIGRAMS.replace("CREATE INDEX", "CREATE INDEX CONCURRENTLY") + ";"


def key_trigrams(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # SQLite, the embedded engine: its histories are small enough to read
    try:
        with transaction.atomic(using=schema_editor.connection.alias):
            schema_editor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    except DatabaseError as exc:  # pg_trgm not installed, or this role may not create it
        # Not "migrate back and forth": going back to 0020 would also undo what came after
        # (0022 drops every run's labels). The index is one statement to run once, any time.
        log.warning(
            "pg_trgm is not available (%s): searching runs by part of a key reads every key; "
            "have an administrator run CREATE EXTENSION pg_trgm in this database, then run "
            "this (as the role that migrates, or the administrator): %s", exc, BY_HAND,
        )
        return
    schema_editor.execute(TRIGRAMS)


def drop_key_trigrams(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS runs_run_key_trgm_idx")


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0020_channel_pause'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='run',
            index=models.Index(fields=['workflow', 'status', '-created_at'], name='runs_run_wf_status_created_idx'),
        ),
        migrations.RunPython(key_trigrams, drop_key_trigrams),
    ]
