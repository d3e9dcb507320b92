"""Notifications: channels, the sweep that turns events into deliveries, and delivery by the
engine itself (retries, a re-send with the same Idempotency-Key after a SIGKILL), checked by a
real HTTP receiver on 127.0.0.1."""

import hmac
import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import django
import pytest
from django.core import mail
from django.core.management import call_command
from django.core.management.base import CommandError

from runs import notifications
from runs.errors import Forbidden, OperationError
from runs.models import Event, EventType, NotificationDelivery, Run, RunStatus, Step
from runs.sdk import start_run
from tests.conftest import wait_until

SECRET = "s3cret"


class Receiver:
    """A webhook receiver that accepts each Idempotency-Key once, as the docs tell receivers
    to. `answers` are the status codes of the first requests (then 200); `hold` keeps the next
    request waiting until it is set."""

    def __init__(self, answers=(), *, retry_after: str | None = None):
        self.requests: list[dict] = []
        self.accepted: dict[str, dict] = {}
        self.answers = list(answers)
        self.retry_after = retry_after
        self.hold: threading.Event | None = None
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append({"headers": dict(self.headers), "body": body})
                receiver.arrived.set()
                if receiver.hold is not None:
                    hold, receiver.hold = receiver.hold, None
                    hold.wait(30)
                status = receiver.answers.pop(0) if receiver.answers else 200
                if status == 200:
                    receiver.accepted.setdefault(self.headers["Idempotency-Key"], json.loads(body))
                self.send_response(status)
                if status != 200 and receiver.retry_after:
                    self.send_header("Retry-After", receiver.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        if self.hold is not None:
            self.hold.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def _make(*args, **kwargs):
        made.append(Receiver(*args, **kwargs))
        return made[-1]

    yield _make
    for r in made:
        r.close()


def valid(request: dict) -> bool:
    headers = request["headers"]
    expected = notifications.signature(SECRET, headers["X-Stepguard-Timestamp"], request["body"])
    return hmac.compare_digest(headers["X-Stepguard-Signature"], expected)


def fail_a_run(workflow="bad-output") -> Run:
    return start_run(workflow, {})


def test_a_failed_run_is_delivered_once_signed_slack_compatible_and_idempotent(drive, receiver):
    hook = receiver()
    channel = notifications.add_channel(
        None, "webhook", hook.url, "run.failed,run.halted", secret=SECRET
    )
    run = fail_a_run()
    assert drive() == ["failed"]

    assert notifications.sweep() == 1
    assert notifications.sweep() == 0  # one delivery per event and channel, however often
    assert drive() == ["completed"]

    (request,) = hook.requests
    assert valid(request)
    headers, body = request["headers"], json.loads(request["body"])
    assert headers["X-Stepguard-Event"] == "run.failed"
    delivery = NotificationDelivery.objects.get()
    assert headers["Idempotency-Key"] == delivery.run.steps.get().idempotency_key
    assert body["text"].startswith(f"Stepguard: run bad-output {str(run.pk)[:8]}: the run failed")
    assert body["event"]["run_id"] == str(run.pk)
    assert body["event"]["type"] == "run.failed" and body["event"]["run_status"] == "failed"
    assert (
        delivery.channel == channel
        and delivery.run.key == f"notify:{channel.pk}:{body['event']['id']}"
    )


def test_a_tampered_body_does_not_verify(drive, receiver):
    hook = receiver()
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"], secret=SECRET)
    fail_a_run()
    drive()
    notifications.sweep()
    drive()
    (request,) = hook.requests
    assert valid(request)
    assert not valid({**request, "body": request["body"].replace(b"failed", b"passed")})


def test_only_subscribed_events_of_the_chosen_workflow_after_the_channel_was_added(drive, receiver):
    before = fail_a_run()
    drive()
    hook = receiver()
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"], workflow="nul-output")
    fail_a_run("bad-output")  # another workflow
    start_run("loop", {"queries": ["a"]})  # completes: run.completed is not subscribed
    mine = fail_a_run("nul-output")
    assert sorted(drive()) == ["completed", "failed", "failed"]
    assert notifications.sweep() == 1
    drive()
    (request,) = hook.requests
    assert json.loads(request["body"])["event"]["run_id"] == str(mine.pk)
    assert Event.objects.filter(run=before, type=EventType.RUN_FAILED).exists()  # not sent


def test_a_receiver_that_fails_is_retried_with_the_same_key_until_it_accepts(drive, receiver):
    hook = receiver([500, 503])
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    fail_a_run()
    drive()
    notifications.sweep()
    assert drive() == ["completed"]
    assert len(hook.requests) == 3
    assert len({r["headers"]["Idempotency-Key"] for r in hook.requests}) == 1
    assert len(hook.accepted) == 1
    step = Step.objects.get(run=NotificationDelivery.objects.get().run)
    assert step.attempt == 3


def test_a_receiver_that_refuses_fails_the_delivery_at_once_and_it_shows(
    drive, receiver, client, cast
):
    hook = receiver([404])
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    fail_a_run()
    drive()
    notifications.sweep()
    assert drive() == ["failed"]
    assert len(hook.requests) == 1  # a 404 will not change: no retry
    delivery = NotificationDelivery.objects.get()
    assert "answered 404" in delivery.run.steps.get().error["message"]
    assert notifications.sweep() == 0  # a delivery's own failure is never notified

    client.force_login(cast["vera"])
    page = client.get("/notifications?failed=1").content.decode()
    assert "answered 404" in page and ">failed<" in page
    metrics = client.get("/metrics").content.decode()
    assert 'stepguard_notification_deliveries{kind="webhook",result="failed"} 1.0' in metrics


def test_a_receiver_s_retry_after_becomes_a_durable_wait(drive, receiver):
    hook = receiver([429], retry_after="3600")
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    fail_a_run()
    drive()
    notifications.sweep()
    assert drive() == ["waiting"]  # the thread is given back for the hour
    delivery = NotificationDelivery.objects.get()
    step = delivery.run.steps.get()
    assert step.status == "waiting" and (step.wake_at - step.started_at).total_seconds() > 3000


def test_email_channels_send_one_message_with_the_key_as_message_id(drive, settings):
    locmem = "django.core.mail.backends.locmem.EmailBackend"
    if django.VERSION >= (6, 1):
        settings.MAILERS = {"default": {"BACKEND": locmem, "OPTIONS": {}}}
    else:
        settings.EMAIL_BACKEND = locmem
    notifications.add_channel(None, "email", "ops@example.com, oncall@example.com", "run.failed")
    run = fail_a_run()
    drive()
    notifications.sweep()
    assert drive() == ["completed"]
    (message,) = mail.outbox
    assert message.to == ["ops@example.com", "oncall@example.com"]
    assert message.subject.startswith(f"Stepguard: run bad-output {str(run.pk)[:8]}")
    assert message.extra_headers["Message-ID"].endswith("@stepguard>")
    assert json.loads(message.body)["event"]["type"] == "run.failed"


@pytest.mark.parametrize(
    ("kind", "target", "events", "says"),
    [
        ("webhook", "ftp://x", ["run.failed"], "http:// or https:// URL"),
        ("webhook", "https://u:p@x.example", ["run.failed"], "credentials"),
        ("webhook", "https://x.example", ["run.fialed"], "cannot notify of 'run.fialed'"),
        ("webhook", "https://x.example", [], "at least one event"),
        ("email", "not-an-address", ["run.failed"], "not an email address"),
        ("sms", "123", ["run.failed"], "webhook or an email"),
    ],
)
def test_bad_channels_are_refused_naming_the_problem(db, kind, target, events, says):
    with pytest.raises(OperationError, match=says):
        notifications.add_channel(None, kind, target, events)


def test_the_cli_adds_lists_and_removes_channels_as_the_docs_print(db, capsys):
    call_command(
        "notifications", "add", "webhook", "https://hooks.example.com/x",
        "--events", "run.failed,run.halted,run.over_budget,budget.warning,approval.requested",
        "--workflow", "research", "--secret", "k",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert out.startswith("added channel #")
    assert "budget.exceeded" in out and "signed" in out  # run.over_budget, spelt our way
    call_command("notifications", "list")
    listed = capsys.readouterr().out
    assert "webhook https://hooks.example.com/x (workflow research)" in listed
    channel_id = listed.split()[0].lstrip("#")
    call_command("notifications", "remove", channel_id)
    call_command("notifications", "list")
    assert capsys.readouterr().out.splitlines()[-1] == "no notification channels"
    with pytest.raises(CommandError, match="no notification channel"):
        call_command("notifications", "remove", channel_id)
    audit = Event.objects.filter(type=EventType.NOTIFICATIONS_CHANGED, actor="cli")
    assert audit.count() == 2


def test_only_operators_manage_channels_and_viewers_see_them(client, cast):
    with pytest.raises(Forbidden):
        notifications.add_channel(cast["vera"], "webhook", "https://x.example", ["run.failed"])
    client.force_login(cast["vera"])
    answer = client.post(
        "/api/notifications/channels",
        {"kind": "webhook", "target": "https://x.example", "events": ["run.failed"]},
        content_type="application/json",
    )
    assert answer.status_code == 403
    page = client.get("/notifications").content.decode()
    assert "Add a channel" not in page

    client.force_login(cast["otto"])
    answer = client.post(
        "/api/notifications/channels",
        {"kind": "webhook", "target": "https://x.example", "events": ["run.failed"],
         "secret": "k"},
        content_type="application/json",
    )  # fmt: skip
    assert answer.status_code == 201, answer.content
    created = answer.json()
    assert created["signed"] is True and "secret" not in created
    client.force_login(cast["vera"])
    assert [c["id"] for c in client.get("/api/notifications/channels").json()] == [created["id"]]
    assert client.delete(f"/api/notifications/channels/{created['id']}").status_code == 403
    client.force_login(cast["otto"])
    assert client.delete(f"/api/notifications/channels/{created['id']}").status_code == 200
    assert client.get("/api/notifications/channels").json() == []


def test_the_dashboard_form_adds_a_channel(client, cast):
    client.force_login(cast["otto"])
    page = client.get("/notifications").content.decode()
    assert "Add a channel" in page
    answer = client.post(
        "/notifications/add",
        {"kind": "email", "target": "ops@example.com", "events": ["run.failed", "run.halted"]},
    )
    assert answer.status_code == 302
    page = client.get("/notifications").content.decode()
    assert "ops@example.com" in page and "run.failed, run.halted" in page


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_mid_delivery_is_replaced_and_the_receiver_accepts_once(
    spawn_worker, receiver
):
    """The receiver takes the first request and holds its answer while the worker is
    SIGKILLed; the next worker re-sends with the same key, and the receiver accepts it once."""
    hook = receiver()
    gate = hook.hold = threading.Event()
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"], secret=SECRET)
    first = spawn_worker()
    runs = [fail_a_run() for _ in range(3)]

    def delivered() -> int:
        return NotificationDelivery.objects.filter(run__status=RunStatus.COMPLETED).count()

    # One request held, the other two answered and recorded: then the worker dies.
    wait_until(
        lambda: len(hook.requests) == 3 and delivered() == 2,
        timeout=30,
        what=lambda: f"3 requests and 2 deliveries, not {len(hook.requests)} and {delivered()}",
    )
    first.signal(signal.SIGKILL)
    first.kill()
    gate.set()  # the receiver takes the held request: the worker never hears its answer
    spawn_worker()
    wait_until(lambda: delivered() == 3, timeout=60, what="the third delivery after the kill")

    assert len(hook.accepted) == 3
    assert {b["event"]["run_id"] for b in hook.accepted.values()} == {str(r.pk) for r in runs}
    assert all(valid(r) for r in hook.requests)  # the re-send is signed too
    keys = [r["headers"]["Idempotency-Key"] for r in hook.requests]
    assert len(keys) == 4 and len(set(keys)) == 3  # one sent twice, with the same key
    (resent,) = {k for k in keys if keys.count(k) > 1}
    assert Step.objects.get(idempotency_key=resent).recovered == "resent"


def test_a_backlog_is_swept_a_batch_at_a_time_and_nothing_is_left_behind(
    drive, receiver, monkeypatch
):
    hook = receiver()
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    for _ in range(3):
        fail_a_run()
    drive()
    monkeypatch.setattr(notifications, "BATCH", 2)
    assert [notifications.sweep() for _ in range(3)] == [2, 1, 0]
    drive()
    assert len(hook.accepted) == 3
