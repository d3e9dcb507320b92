"""One spelling per event type: a halt of a workflow or of everything is `scope.halted`, its
lift `scope.unhalted` (they were `halt` and `unhalt`, beside `run.halted` for a run).

Existing rows take the new names: events, channel subscriptions, deliveries. The event table
is append-only (a trigger, 0002 and 0007): it is set aside for this one statement and back in
force within the same transaction, so no other writer ever sees it off. The payloads, what was
said at the time, are left as they were. Reversible: the reverse writes the old names back.
"""

from django.db import migrations, models

RENAMED = {"halt": "scope.halted", "unhalt": "scope.unhalted"}

# SQLite has no DISABLE TRIGGER: drop it and make it again, as 0002 made it.
SQLITE_DROP = "DROP TRIGGER IF EXISTS runs_event_append_only;"
SQLITE_TRIGGER = """
CREATE TRIGGER runs_event_append_only BEFORE UPDATE ON runs_event
BEGIN SELECT RAISE(ABORT, 'runs_event is append-only: events are never updated'); END;
"""


def rename(apps, schema_editor, names: dict[str, str]) -> None:
    Event = apps.get_model("runs", "Event")
    Channel = apps.get_model("runs", "NotificationChannel")
    Delivery = apps.get_model("runs", "NotificationDelivery")
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        # ALTER TABLE refuses while deferred foreign key checks are pending: run them now.
        schema_editor.execute("SET CONSTRAINTS ALL IMMEDIATE")
        schema_editor.execute("ALTER TABLE runs_event DISABLE TRIGGER runs_event_append_only")
    elif vendor == "sqlite":
        schema_editor.execute(SQLITE_DROP)
    for old, new in names.items():
        Event.objects.filter(type=old).update(type=new)
        Delivery.objects.filter(event_type=old).update(event_type=new)
    if vendor == "postgresql":
        schema_editor.execute("ALTER TABLE runs_event ENABLE TRIGGER runs_event_append_only")
    elif vendor == "sqlite":
        schema_editor.execute(SQLITE_TRIGGER)
    for channel in Channel.objects.all():  # a handful of rows; each keeps its order, once each
        events = list(dict.fromkeys(names.get(e, e) for e in channel.events))
        if events != channel.events:
            Channel.objects.filter(pk=channel.pk).update(events=events)


def forwards(apps, schema_editor):
    rename(apps, schema_editor, RENAMED)


def backwards(apps, schema_editor):
    rename(apps, schema_editor, {new: old for old, new in RENAMED.items()})


class Migration(migrations.Migration):

    dependencies = [
        ('runs', '0012_flow_control'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='event',
            name='runs_event_notifiable_idx',
        ),
        migrations.AlterField(
            model_name='event',
            name='type',
            field=models.CharField(choices=[('run.created', 'the run was created'), ('run.claimed', 'a worker claimed the run'), ('run.woken', 'a worker took up the run after a wait'), ('run.recovered', 'a worker took over the run of a lost one'), ('run.resumed', 'the run was resumed'), ('run.requeued', 'the run became runnable again'), ('run.released', 'the worker gave the run back'), ('run.completed', 'the run completed'), ('run.failed', 'the run failed'), ('run.cancelled', 'the run was cancelled'), ('run.cancel_requested', 'a cancel was requested'), ('run.retrying', 'the run will be retried from the top'), ('run.retry_requested', 'a retry was requested'), ('run.halted', 'the run was halted'), ('run.halt_requested', 'a halt was requested while the run ran'), ('run.unhalted', 'the run was unhalted'), ('run.forked', 'a fork was made of the run'), ('run.forked_from', 'the run was forked from another'), ('step.started', 'a step started'), ('step.completed', 'a step completed'), ('step.failed', 'a step failed'), ('step.retrying', 'a step will be tried again'), ('timer.set', 'a timer was set'), ('timer.fired', 'a timer fired'), ('signal.waiting', 'the run waits for a signal'), ('signal.received', 'a signal was received'), ('approval.requested', 'an approval was requested'), ('approval.waiting', 'the run waits for an approval'), ('approval.decided', 'an approval was decided'), ('approval.resolved', 'an ambiguous step was resolved'), ('approval.revoked', 'an approval was revoked'), ('children.waiting', 'the run waits for its child runs'), ('child.started', 'a child run was started'), ('child.finished', 'a child run ended'), ('budget.set', 'a budget was set'), ('budget.exceeded', 'the run stopped over budget'), ('budget.warning', 'a budget passed its warning threshold'), ('model.unpriced', 'a model call had no price'), ('login.locked_out', 'a login was locked out'), ('runs.pruned', 'finished runs were pruned'), ('scope.halted', 'a workflow or everything was halted'), ('scope.unhalted', 'a workflow or everything was unhalted'), ('notifications.changed', 'a notification channel was added or removed'), ('limits.set', "a workflow's concurrency limits were set"), ('rate_limit.set', "a resource's rate limit was set or removed"), ('step.throttled', "a step waits for a rate limit's capacity"), ('run.debounced', 'a debounced run took a newer input and waits again'), ('schedule.changed', 'a schedule was added, changed, paused or removed')], max_length=64),
        ),
        migrations.AddIndex(
            model_name='event',
            index=models.Index(condition=models.Q(('type__in', ['run.completed', 'run.failed', 'run.cancelled', 'run.halted', 'run.unhalted', 'budget.exceeded', 'budget.warning', 'approval.requested', 'model.unpriced', 'scope.halted', 'scope.unhalted'])), fields=['created_at'], name='runs_event_notifiable_idx'),
        ),
        migrations.RunPython(forwards, backwards),
    ]
