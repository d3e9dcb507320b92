"""The history is outside the admin's reach, and each event type has one spelling.

The Django admin shows runs, steps, events, workers, signals, policies, budget ledgers and
approval requests read-only, to a superuser too: those rows change only through the engine and
runs.operations, with a permission check and an event. And a halt of a workflow or of
everything is `scope.halted` (it was `halt`), its lift `scope.unhalted`; the old names are
still accepted where a person or a script subscribes to events.
"""

import importlib
import json
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.db import DatabaseError, connection, transaction
from django.forms.models import model_to_dict
from django.urls import reverse
from django.utils import timezone

from runs import notifications
from runs.approvals.models import ApprovalRequest
from runs.models import (
    BudgetLedger,
    Event,
    EventType,
    NotificationChannel,
    NotificationDelivery,
    Policy,
    Run,
    Signal,
    Step,
    Worker,
)
from runs.operations import halt, unhalt
from runs.sdk import start_run
from tests.test_notifications import Receiver

HISTORY = [Run, Step, Event, Worker, Signal, Policy, BudgetLedger, ApprovalRequest]


@pytest.fixture
def admin_client(client, django_user_model):
    root = django_user_model.objects.create_superuser("root", "root@example.com", "x")
    client.force_login(root)
    client.user = root
    return client


@pytest.fixture
def history(drive, admin_client):
    """One row of each history model (`drive` registered the worker)."""
    run = start_run("ledger", {"steps": 1})
    now = timezone.now()
    Step.objects.create(
        run=run,
        seq=0,
        key="s0",
        status="completed",
        idempotency_key="k",
        started_at=now,
        finished_at=now,
    )
    halt("workflow:ledger", admin_client.user, "freeze")  # a Policy row and a scope event
    Signal.objects.create(run=run, name="poke", created_at=now)
    BudgetLedger.objects.create(scope="*", day=now.date(), spent_micros=5)
    ApprovalRequest.objects.create(
        run=run, step_key="pay", action="refund", status="approved",
        decided_by=admin_client.user, decided_at=now,
    )  # fmt: skip
    return {model: model.objects.order_by("pk").first() for model in HISTORY}


def url(model, view: str, *args) -> str:
    return reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_{view}", args=args)


@pytest.mark.parametrize("model", HISTORY, ids=lambda m: m.__name__)
def test_a_superuser_sees_history_in_the_admin_but_cannot_add_change_or_delete_it(
    admin_client, history, model
):
    row = history[model]
    before = model_to_dict(row)

    listing = admin_client.get(url(model, "changelist"))
    assert listing.status_code == 200
    assert b'value="delete_selected"' not in listing.content  # no bulk delete action

    page = admin_client.get(url(model, "change", row.pk))
    assert page.status_code == 200
    for button in (b'name="_save"', b'name="_continue"', b'class="deletelink"'):
        assert button not in page.content

    edit = {name: "changed" for name in before if isinstance(before[name], str)}
    assert (
        admin_client.post(url(model, "change", row.pk), {**edit, "_save": "Save"}).status_code
        == 403
    )
    assert admin_client.get(url(model, "delete", row.pk)).status_code == 403
    assert admin_client.post(url(model, "delete", row.pk), {"post": "yes"}).status_code == 403
    admin_client.post(
        url(model, "changelist"),
        {"action": "delete_selected", "_selected_action": [row.pk], "post": "yes"},
    )
    assert admin_client.get(url(model, "add")).status_code == 403
    assert admin_client.post(url(model, "add"), edit).status_code == 403

    row.refresh_from_db()
    assert model_to_dict(row) == before


def test_staff_with_only_the_view_permission_still_see_the_history(
    client, django_user_model, history
):
    from django.contrib.auth.models import Permission

    staff = django_user_model.objects.create_user("sam", password="x", is_staff=True)
    staff.user_permissions.add(*Permission.objects.filter(codename__startswith="view_"))
    client.force_login(staff)
    for model, row in history.items():
        assert client.get(url(model, "changelist")).status_code == 200
        assert client.get(url(model, "change", row.pk)).status_code == 200


# -- one spelling per event type ------------------------------------------------------------------


def scope_events():
    return list(Event.objects.filter(run=None).order_by("id").values_list("type", "payload"))


def test_a_workflow_halt_and_its_lift_are_scope_halted_and_scope_unhalted(cast):
    halt("workflow:ledger", cast["otto"], "bad deploy")
    unhalt("workflow:ledger", cast["otto"], "fixed")
    assert [(t, p["target"]) for t, p in scope_events()] == [
        ("scope.halted", "workflow ledger"),
        ("scope.unhalted", "workflow ledger"),
    ]


def test_the_kill_switch_and_its_lift_are_scope_halted_and_scope_unhalted(cast):
    halt("all", cast["otto"], "incident 42")
    unhalt("all", cast["otto"], "over")
    assert [t for t, _ in scope_events()] == ["scope.halted", "scope.unhalted"]
    assert not Event.objects.filter(type__in=["halt", "unhalt"]).exists()


def test_a_channel_subscribed_with_the_old_name_halt_is_told_of_scope_halts(drive, cast):
    hook = Receiver()
    try:
        channel = notifications.add_channel(None, "webhook", hook.url, "halt,unhalt,scope.halted")
        assert channel.events == ["scope.halted", "scope.unhalted"]
        # Not the kill switch: it would hold the delivery's own run until it is lifted.
        halt("workflow:ledger", cast["otto"], "bad deploy")
        assert notifications.sweep() == 1
        assert drive() == ["completed"]
        (request,) = hook.requests
    finally:
        hook.close()
    assert request["headers"]["X-Stepguard-Event"] == "scope.halted"
    assert json.loads(request["body"])["event"]["type"] == "scope.halted"
    assert NotificationDelivery.objects.get().event_type == "scope.halted"


def test_an_api_client_may_still_subscribe_with_the_old_names(client, cast):
    client.force_login(cast["otto"])
    answer = client.post(
        "/api/notifications/channels",
        {"kind": "webhook", "target": "https://x.example", "events": ["halt", "unhalt"]},
        content_type="application/json",
    )
    assert answer.status_code == 201, answer.content
    assert answer.json()["events"] == ["scope.halted", "scope.unhalted"]


def test_the_migration_renames_stored_events_and_subscriptions_both_ways(db):
    """Through the append-only trigger, which is in force again afterwards."""
    migration = importlib.import_module("runs.migrations.0013_event_type_spelling")
    editor = SimpleNamespace(
        connection=connection, execute=lambda sql: connection.cursor().execute(sql)
    )
    now = timezone.now()
    event = Event.objects.create(run=None, seq=0, type="halt", actor="otto", created_at=now)
    channel = NotificationChannel.objects.create(
        kind="webhook", target="https://x.example", events=["run.failed", "halt", "unhalt"],
        created_at=now, scanned_until=now,
    )  # fmt: skip

    migration.forwards(apps, editor)
    event.refresh_from_db(), channel.refresh_from_db()
    assert event.type == "scope.halted"
    assert channel.events == ["run.failed", "scope.halted", "scope.unhalted"]

    migration.backwards(apps, editor)
    event.refresh_from_db(), channel.refresh_from_db()
    assert event.type == "halt"
    assert channel.events == ["run.failed", "halt", "unhalt"]

    with pytest.raises(DatabaseError), transaction.atomic():
        Event.objects.filter(pk=event.pk).update(type=EventType.SCOPE_HALTED)
