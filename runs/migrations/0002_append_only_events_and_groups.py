"""The history is append-only, enforced by the database; and the three roles as groups."""

from django.db import migrations

from runs.roles import ROLES, ensure_groups

PG_TRIGGER = """
CREATE OR REPLACE FUNCTION runs_event_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'runs_event is append-only: events are never %d', lower(TG_OP);
END;
$$ LANGUAGE plpgsql;
CREATE TRIGGER runs_event_append_only BEFORE UPDATE OR DELETE ON runs_event
    FOR EACH ROW EXECUTE FUNCTION runs_event_append_only();
"""
PG_DROP = """
DROP TRIGGER IF EXISTS runs_event_append_only ON runs_event;
DROP FUNCTION IF EXISTS runs_event_append_only();
"""
# SQLite: updates are refused; deletes stay possible so the test suite can flush tables.
SQLITE_TRIGGER = """
CREATE TRIGGER runs_event_append_only BEFORE UPDATE ON runs_event
BEGIN SELECT RAISE(ABORT, 'runs_event is append-only: events are never updated'); END;
"""
SQLITE_DROP = "DROP TRIGGER IF EXISTS runs_event_append_only;"

def triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(PG_TRIGGER, params=None)
    elif vendor == "sqlite":
        schema_editor.execute(SQLITE_TRIGGER)


def drop_triggers(apps, schema_editor):
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(PG_DROP, params=None)
    elif vendor == "sqlite":
        schema_editor.execute(SQLITE_DROP)


def groups(apps, schema_editor):
    ensure_groups(apps)


def drop_groups(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=ROLES).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0001_initial"),
        ("approvals", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.RunPython(triggers, drop_triggers),
        migrations.RunPython(groups, drop_groups),
    ]
