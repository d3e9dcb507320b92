"""The engine's own workflows and run keys are not for people to start or take.

Before, `POST /api/runs` took any key and the built-in `stepguard.notify`: a run planted at
`notify:<channel>:<event>` made every sweep fail (an uncaught ValueError, every second), so
that channel and every later one delivered nothing; `stepguard.notify` itself sent any event to
any channel; a `schedule:<name>:<tick>` key ran a tick with another person's input.
"""

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from runs import notifications
from runs.apikeys import create_key
from runs.engine.store import create_run
from runs.models import Event, NotificationDelivery, Run
from runs.sdk import start_run
from tests.test_notifications import fail_a_run, receiver  # noqa: F401  (a fixture)

RESERVED = [
    ({"workflow": "stepguard.notify", "input": {"channel": 1, "event": 1}}, "Stepguard's own"),
    ({"workflow": "loop", "input": {"queries": []}, "key": "notify:1:2"}, "'notify:'"),
    ({"workflow": "loop", "input": {"queries": []}, "key": "schedule:x:2026"}, "'schedule:'"),
]


@pytest.mark.parametrize(("body", "says"), RESERVED)
def test_the_api_refuses_the_engines_workflows_and_keys(client, cast, body, says):
    token = create_key(cast["otto"], "ops")[1]
    answer = client.post(
        "/api/runs", json.dumps(body), content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )  # fmt: skip
    assert answer.status_code == 400, answer.content
    assert says in answer.json()["error"]["message"]
    assert not Run.objects.exists()


def test_the_cli_refuses_them_too(db):
    with pytest.raises(CommandError, match="Stepguard's own"):
        call_command("startrun", "loop", "--input", '{"queries": []}', "--key", "notify:1:1",
                     stdout=StringIO())  # fmt: skip
    with pytest.raises(CommandError, match="Stepguard's own"):
        call_command("startrun", "stepguard.notify", stdout=StringIO())


def test_a_sweep_that_meets_a_foreign_run_on_its_key_skips_it_and_delivers_the_rest(
    drive,
    receiver,  # noqa: F811
):
    hook = receiver()
    channel = notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    first, second = fail_a_run(), fail_a_run()
    drive()
    failed = Event.objects.filter(type="run.failed").order_by("id")
    # Planted before keys were reserved: another workflow's run on the first event's key.
    from django.db import transaction

    with transaction.atomic():
        create_run(workflow="loop", version="1", input={"queries": []},
                   key=f"notify:{channel.pk}:{failed[0].pk}")  # fmt: skip
    assert notifications.sweep() == 1  # the second event; the first is skipped, said
    drive()
    (request,) = hook.requests
    assert json.loads(request["body"])["event"]["run_id"] == str(second.pk)
    assert NotificationDelivery.objects.count() == 1
    assert start_run("loop", {"queries": []}, key="anything-else").was_created
    assert first.pk != second.pk
