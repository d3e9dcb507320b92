from django.db import migrations, models
from django.db.models import Value

# A label filter on PostgreSQL is a containment (`labels @> '{"tenant": "acme"}'`), which this
# index serves; SQLite, the embedded engine, compares the key of each run it reads.
LABELS_GIN = (
    "CREATE INDEX IF NOT EXISTS runs_run_labels_gin_idx ON runs_run USING gin (labels jsonb_path_ops)"
)


def labels_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(LABELS_GIN)


def drop_labels_index(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX IF EXISTS runs_run_labels_gin_idx")


class Migration(migrations.Migration):

    dependencies = [
        ("runs", "0021_run_search_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="labels",
            field=models.JSONField(
                blank=True, db_default=Value({}, models.JSONField()), default=dict
            ),
        ),
        migrations.RunPython(labels_index, drop_labels_index),
    ]
