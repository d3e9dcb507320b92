"""Notifications: channels, the sweep that turns events into deliveries, and delivery by the
engine itself (retries, a re-send with the same Idempotency-Key after a SIGKILL), checked by a
real HTTP receiver on 127.0.0.1."""

import hmac
import json
import re
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import django
import pytest
from django.core import mail
from django.core.management import call_command
from django.core.management.base import CommandError

from runs import notifications
from runs.errors import Forbidden, OperationError
from runs.models import (
    Event,
    EventType,
    NotificationChannel,
    NotificationDelivery,
    Run,
    RunStatus,
    Step,
)
from runs.sdk import start_run
from tests.conftest import wait_until

SECRET = "s3cret"


class Receiver:
    """A webhook receiver that accepts each Idempotency-Key once, as the docs tell receivers
    to. `answers` are the status codes of the first requests (then 200); `hold` keeps the next
    request waiting until it is set."""

    def __init__(self, answers=(), *, retry_after: str | None = None, host: str = "127.0.0.1"):
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

        server = ThreadingHTTPServer
        if ":" in host:
            server = type("Server6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        self.server = server((host, 0), Handler)
        self.port = self.server.server_port
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.port}/hook"
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


def cancelled_with(reason: str) -> Event:
    from django.utils import timezone

    run = fail_a_run()
    return Event.objects.create(
        run=run, seq=10_000, type=EventType.RUN_CANCELLED, payload={"reason": reason},
        actor="otto", created_at=timezone.now(),
    )  # fmt: skip


def test_slack_markup_in_a_reason_is_escaped_and_the_run_link_kept(db, settings):
    """Issue 31 item 8: a reason could ping <!channel> or pass off a link as Stepguard's."""
    settings.STEPGUARD_PUBLIC_URL = "https://sg.example"
    event = cancelled_with("<!channel> pay <https://evil.example|the run> & go")
    text = notifications.message(event)["text"]
    assert "&lt;!channel&gt; pay &lt;https://evil.example|the run&gt; &amp; go" in text
    assert text.endswith(f" <https://sg.example/runs/{event.run.pk}>")
    assert text.count("<") == 1  # only the run's own link is markup


def test_a_newline_in_a_reason_does_not_stop_the_email(db, settings):
    """Issue 31 item 8: a header cannot hold a newline, so such a reason failed every try."""
    locmem = "django.core.mail.backends.locmem.EmailBackend"
    if django.VERSION >= (6, 1):
        settings.MAILERS = {"default": {"BACKEND": locmem, "OPTIONS": {}}}
    else:
        settings.EMAIL_BACKEND = locmem
    channel = notifications.add_channel(None, "email", "ops@example.com", "run.cancelled")
    event = cancelled_with("bad input\r\nBcc: everyone@example.com & <more>")
    notifications.send(channel.pk, event.pk, "key-1")
    (message,) = mail.outbox
    assert "\n" not in message.subject and "\r" not in message.subject
    assert message.subject.endswith("bad input Bcc: everyone@example.com & <more>")
    assert message.to == ["ops@example.com"]


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


# -- webhooks cannot reach inside the network (issue 31, item 2) ----------------------------------

ALLOW = "STEPGUARD_WEBHOOK_ALLOW"


@pytest.fixture
def default_allowlist(settings):
    """The default: no internal receiver allowed (the suite's settings allow 127.0.0.1)."""
    settings.STEPGUARD_WEBHOOK_ALLOW = []
    return settings


@pytest.fixture
def resolver(monkeypatch):
    """DNS answers of our own for some names (the one edge that cannot run here); the others
    resolve for real. Counts the lookups of each name."""
    answers: dict[str, list[str]] = {}
    lookups: dict[str, int] = {}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in answers:
            return real(host, port, *args, **kwargs)
        lookups[host] = lookups.get(host, 0) + 1
        address = answers[host][min(lookups[host], len(answers[host])) - 1]
        return real(address, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers, lookups


@pytest.fixture
def failed_event(drive):
    fail_a_run()
    drive()
    return Event.objects.get(type=EventType.RUN_FAILED)


def a_channel(target: str) -> NotificationChannel:
    """A webhook saved as it is, the way rows saved before URLs were checked are."""
    from django.utils import timezone

    now = timezone.now()
    return NotificationChannel.objects.create(
        kind="webhook", target=target, events=["run.failed"], created_by="cli",
        created_at=now, scanned_until=now,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("http://hooks.example.com/x\r\nX-Injected: 1", "the character '\\r'"),
        ("http://hooks.example.com/a b", "the character ' '"),
        ("http://hooks.example.com/\tx", "the character '\\t'"),
        ("https://hooks.exämple.com/", "non-ASCII characters"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("https://@hooks.example.com/", "credentials"),
        ("http:///hook", "needs a host"),
        ("http://hooks.example.com:99999/", "Port out of range"),
        ("http://10.0.0.300/", "'10.0.0.300' is not a host name or an address"),
        ("http://localhost/hook", "localhost resolves to an address inside the network"),
        ("http://0x7f000001/", "0x7f000001 is 127.0.0.1, a loopback address"),
        ("http://2130706433/", "2130706433 is 127.0.0.1, a loopback address"),
        ("http://0177.0.0.1/", "0177.0.0.1 is 127.0.0.1, a loopback address"),
        ("http://127.1:8080/", "127.1 is 127.0.0.1, a loopback address"),
        ("http://[::1]/", "::1 is a loopback address"),
        ("http://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1 is 127.0.0.1, a loopback address"),
        ("http://[2002:7f00:1::]/", "is 127.0.0.1, a loopback address"),  # 6to4
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
        ("http://[fe80::1]/", "fe80::1 is a link-local address"),
        ("http://[64:ff9b::a9fe:a9fe]/", "is 169.254.169.254, a link-local address"),  # NAT64
        ("http://10.0.0.8/", "10.0.0.8 is a private address"),
        ("http://172.16.5.4/", "a private address"),
        ("http://192.168.1.1/", "a private address"),
        ("http://[fd00::1]/", "fd00::1 is a private address"),
        ("http://[fec0::1]/", "fec0::1 is a site-local address"),
        ("http://0.0.0.0:8000/", "0.0.0.0 is an unspecified address"),
        ("http://[::]/", ":: is an unspecified address"),
        ("http://224.0.0.251/", "a multicast address"),
        ("http://240.0.0.1/", "a reserved address"),
        ("http://100.64.0.1/", "100.64.0.1 is not a public address"),
    ],
)
def test_webhook_urls_are_checked_strictly_when_saved(db, default_allowlist, target, says):
    with pytest.raises(OperationError, match=re.escape(says)) as refused:
        notifications.add_channel(None, "webhook", target, ["run.failed"])
    if str(refused.value).startswith("refused"):
        assert ALLOW in str(refused.value)  # and says how to let an internal receiver through
    assert not NotificationChannel.objects.exists()


def test_every_spelling_of_this_host_is_refused_when_a_delivery_connects(
    default_allowlist, receiver, resolver, failed_event
):
    """Channels saved before the check (or names that resolve inside): each delivery is refused
    as it connects, at once and for good, and nothing reaches the receivers listening there."""
    v4, v6 = receiver(), receiver(host="::1")
    answers, _ = resolver
    answers["hooks.inside.test"] = ["127.0.0.1"]
    answers["metadata.inside.test"] = ["169.254.169.254"]
    targets = {
        f"http://localhost:{v4.port}/secret-path": "localhost resolves to an address inside the",
        f"http://127.0.0.1:{v4.port}/secret-path": "127.0.0.1 is a loopback address",
        f"http://0x7f000001:{v4.port}/secret-path": "0x7f000001 is 127.0.0.1, a loopback address",
        f"http://2130706433:{v4.port}/secret-path": "2130706433 is 127.0.0.1, a loopback address",
        f"http://0177.0.0.1:{v4.port}/secret-path": "0177.0.0.1 is 127.0.0.1, a loopback address",
        f"http://127.1:{v4.port}/secret-path": "127.1 is 127.0.0.1, a loopback address",
        f"http://0.0.0.0:{v4.port}/secret-path": "0.0.0.0 is an unspecified address",
        f"http://[::ffff:127.0.0.1]:{v4.port}/secret-path": "is 127.0.0.1, a loopback address",
        f"http://[::1]:{v6.port}/secret-path": "::1 is a loopback address",
        f"http://hooks.inside.test:{v4.port}/secret-path": "inside.test resolves to an address in",
        "http://metadata.inside.test/latest/meta-data/": "metadata.inside.test resolves to an",
        "http://169.254.169.254/latest/meta-data/": "169.254.169.254 is a link-local address",
    }
    for target, says in targets.items():
        channel = a_channel(target)
        with pytest.raises(notifications.DeliveryFailed, match=re.escape(says)) as refused:
            notifications.send(channel.pk, failed_event.pk, "key")
        assert refused.value.retryable is False, target  # it will not change by itself
        assert "secret-path" not in str(refused.value) and "meta-data" not in str(refused.value)
        if "inside.test" in target:  # a name: what it resolves to inside is not told
            assert "127.0.0.1" not in str(refused.value) and "169.254" not in str(refused.value)
    assert v4.requests == [] and v6.requests == []


def test_a_refused_delivery_fails_at_once_and_says_why(drive, receiver, settings):
    """A channel added while its receiver was allowed, then the allowlist emptied: the
    delivery run fails on its first attempt, and the receiver hears nothing."""
    hook = receiver()
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    settings.STEPGUARD_WEBHOOK_ALLOW = []
    fail_a_run()
    drive()
    notifications.sweep()
    assert drive() == ["failed"]
    step = NotificationDelivery.objects.get().run.steps.get()
    assert step.attempt == 1 and hook.requests == []
    assert step.error["message"] == (
        f"http://127.0.0.1:{hook.port}: refused: 127.0.0.1 is a loopback address; webhooks "
        f"reach only public addresses unless {ALLOW} lists the address, its network or the host"
    )


def test_a_name_is_resolved_once_and_the_address_checked_is_the_one_connected(
    settings, receiver, resolver, failed_event
):
    """DNS rebinding: the name answers an allowed address to the first lookup and a refused
    one to any later lookup. The delivery resolves once, connects to the address it checked,
    and still names the host in its Host header."""
    settings.STEPGUARD_WEBHOOK_ALLOW = ["127.0.0.1"]
    hook = receiver()
    answers, lookups = resolver
    answers["rebind.test"] = ["127.0.0.1", "127.0.0.2"]  # 127.0.0.2: nobody listens, refused
    channel = a_channel(f"http://rebind.test:{hook.port}/hook")
    assert notifications.send(channel.pk, failed_event.pk, "key") == {"status": 200}
    (request,) = hook.requests
    assert request["headers"]["Host"] == f"rebind.test:{hook.port}"
    assert lookups == {"rebind.test": 1}

    answers["turns.test"] = ["127.0.0.2"]
    channel = a_channel(f"http://turns.test:{hook.port}/hook")
    with pytest.raises(
        notifications.DeliveryFailed, match=re.escape("turns.test resolves to an address inside")
    ):
        notifications.send(channel.pk, failed_event.pk, "key")


def test_the_allowlist_lets_internal_receivers_through_by_network_or_host_name(
    settings, receiver, failed_event
):
    hook = receiver()
    settings.STEPGUARD_WEBHOOK_ALLOW = ["127.0.0.0/8"]
    spelled = a_channel(f"http://0x7f000001:{hook.port}/hook")
    assert notifications.send(spelled.pk, failed_event.pk, "key") == {"status": 200}

    settings.STEPGUARD_WEBHOOK_ALLOW = ["10.0.0.0/8", "LOCALHOST."]  # a name, not its address
    by_name = notifications.add_channel(
        None, "webhook", f"http://localhost:{hook.port}/hook", "run.failed"
    )
    assert notifications.send(by_name.pk, failed_event.pk, "key") == {"status": 200}
    by_address = a_channel(f"http://127.0.0.1:{hook.port}/hook")
    with pytest.raises(
        notifications.DeliveryFailed, match=re.escape("127.0.0.1 is a loopback address")
    ):
        notifications.send(by_address.pk, failed_event.pk, "key")
    assert len(hook.requests) == 2


@pytest.mark.parametrize(
    "entry", ["10.0.0.0/33", "http://hooks.internal", "*.internal", "hooks internal", "0x7f000001"]
)
def test_an_allowlist_entry_that_is_no_address_network_or_host_name_is_refused(entry):
    from runs.egress import parse_allow

    with pytest.raises(ValueError, match=f"{ALLOW}: {re.escape(repr(entry))} is not an address"):
        parse_allow(["10.0.0.0/8", entry])


def test_viewers_see_a_webhook_s_scheme_and_host_only(client, cast, drive, receiver):
    slack = "https://hooks.slack.com/services/T0/B0/xoxsecret"
    client.force_login(cast["otto"])
    answer = client.post(
        "/api/notifications/channels",
        {"kind": "webhook", "target": slack, "events": ["run.failed"]},
        content_type="application/json",
    )
    assert answer.status_code == 201 and answer.json()["target"] == slack  # who may add one
    hook = receiver([404])
    notifications.add_channel(None, "webhook", hook.url + "/xoxsecret", ["run.failed"])
    fail_a_run()
    drive()
    notifications.sweep()
    drive()

    client.force_login(cast["vera"])
    listed = client.get("/api/notifications/channels").json()
    assert {c["target"] for c in listed} == {
        "https://hooks.slack.com",
        f"http://127.0.0.1:{hook.port}",
    }
    page = client.get("/notifications").content.decode()
    assert f"127.0.0.1:{hook.port} answered 404" in page and "https://hooks.slack.com" in page
    audit = Event.objects.filter(type=EventType.NOTIFICATIONS_CHANGED)
    seen = [page, json.dumps(listed), *(json.dumps(e.payload) for e in audit)]
    seen += [json.dumps(s.error) for s in Step.objects.filter(run__workflow=notifications.WORKFLOW)]
    assert not any("xoxsecret" in text for text in seen)


def test_an_https_webhook_keeps_its_host_name_for_sni_and_the_certificate_check(
    settings, resolver, failed_event, tmp_path, monkeypatch
):
    """The connection goes to the address checked, and TLS still speaks to the host named in
    the URL: SNI and the certificate are the name's, as without the check."""
    import datetime
    import ssl

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "hooks.test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("hooks.test")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "cert.pem"))  # trust it, and only it
    hook = Receiver()
    names = []
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    tls.sni_callback = lambda sock, server_name, context: names.append(server_name)
    hook.server.socket = tls.wrap_socket(hook.server.socket, server_side=True)
    answers, _ = resolver
    answers["hooks.test"] = answers["other.test"] = ["127.0.0.1"]
    settings.STEPGUARD_WEBHOOK_ALLOW = ["127.0.0.1"]
    try:
        channel = a_channel(f"https://hooks.test:{hook.port}/hook")
        assert notifications.send(channel.pk, failed_event.pk, "key") == {"status": 200}
        assert names == ["hooks.test"]
        assert hook.requests[0]["headers"]["Host"] == f"hooks.test:{hook.port}"
        other = a_channel(f"https://other.test:{hook.port}/hook")  # same address, wrong name
        with pytest.raises(
            notifications.DeliveryFailed, match=re.escape("not valid for 'other.test'")
        ):
            notifications.send(other.pk, failed_event.pk, "key")
    finally:
        hook.close()


def test_a_paused_channel_sends_nothing_and_resumed_sends_from_then_on_audited(drive, receiver):
    hook = receiver()
    channel = notifications.add_channel(None, "webhook", hook.url, ["run.failed"], secret=SECRET)
    fail_a_run()
    drive()
    assert notifications.sweep() == 1  # a delivery under way when the channel is paused ...
    notifications.pause_channel(None, channel.pk, "receiver down for an upgrade")
    assert drive() == ["completed"]
    assert hook.requests == []  # ... sends nothing (nor retries a dead receiver)
    assert NotificationDelivery.objects.get().run.output == {
        "skipped": "the channel was paused by cli"
    }
    with pytest.raises(OperationError, match="already paused"):
        notifications.pause_channel(None, channel.pk)

    fail_a_run()  # while paused: never sent, not even after the resume
    drive()
    assert notifications.sweep() == 0
    notifications.resume_channel(None, channel.pk)
    assert notifications.sweep() == 0
    with pytest.raises(OperationError, match="not paused"):
        notifications.resume_channel(None, channel.pk)

    after = fail_a_run()
    drive()
    assert notifications.sweep() == 1
    drive()
    (request,) = hook.requests
    assert valid(request) and json.loads(request["body"])["event"]["run_id"] == str(after.pk)
    changes = Event.objects.filter(type=EventType.NOTIFICATIONS_CHANGED).order_by("id")
    said = [sorted(set(e.payload) - {"added"}) for e in changes]
    assert said == [[], ["paused", "reason"], ["resumed"]]
    assert changes[1].payload["reason"] == "receiver down for an upgrade"


def test_send_a_test_from_the_page_delivers_a_signed_test_and_viewers_may_not(
    drive, receiver, client, cast
):
    hook = receiver()
    channel = notifications.add_channel(None, "webhook", hook.url, ["run.failed"], secret=SECRET)
    client.force_login(cast["vera"])
    refused = client.post(f"/notifications/{channel.pk}/test")
    assert refused.status_code == 403 and "may not test" in refused.content.decode()
    assert not NotificationDelivery.objects.exists()

    client.force_login(cast["otto"])
    page = client.get("/notifications").content.decode()
    assert f'aria-label="Send a test to channel {channel.pk}"' in page
    answer = client.post(f"/notifications/{channel.pk}/test", follow=True)
    assert f"Test sent to channel {channel.pk}" in answer.content.decode()
    assert drive() == ["completed"]
    (request,) = hook.requests
    body = json.loads(request["body"])
    assert valid(request) and request["headers"]["X-Stepguard-Event"] == "notification.test"
    assert body["text"] == (
        f"Stepguard: a test notification was sent to a channel: channel #{channel.pk} "
        "a test sent by otto"
    )
    assert notifications.sweep() == 0  # a test goes to its one channel only

    answer = client.post(f"/notifications/{channel.pk}/pause", {"reason": "noisy"}, follow=True)
    page = answer.content.decode()
    assert f"Channel {channel.pk} paused" in page and "noisy" in page
    answer = client.post(f"/notifications/{channel.pk}/test", follow=True)
    assert "is paused: resume it to test it" in answer.content.decode()
    client.post(f"/notifications/{channel.pk}/resume")
    assert NotificationChannel.objects.get(pk=channel.pk).paused_at is None


def test_the_api_pauses_resumes_and_tests_a_channel_for_operators_only(client, cast, drive):
    channel = notifications.add_channel(None, "email", "ops@example.com", ["run.failed"])
    base = f"/api/notifications/channels/{channel.pk}"
    client.force_login(cast["vera"])
    assert client.post(f"{base}/pause", {}, content_type="application/json").status_code == 403
    client.force_login(cast["otto"])
    answer = client.post(f"{base}/pause", {"reason": "mail relay moved"}, "application/json")
    assert answer.status_code == 200, answer.content
    shown = answer.json()
    assert shown["paused_by"] == "otto" and shown["pause_reason"] == "mail relay moved"
    again = client.post(f"{base}/pause", {}, content_type="application/json")
    assert again.status_code >= 400 and "already paused" in again.content.decode()
    assert client.post(f"{base}/resume").json()["paused_at"] is None
    answer = client.post(f"{base}/test")
    assert answer.status_code == 201, answer.content
    assert answer.json()["event_type"] == "notification.test"
    assert drive() == ["completed"]
    (sent,) = mail.outbox
    assert "a test notification was sent to a channel" in sent.subject


def test_the_cli_pauses_resumes_and_tests_a_channel(drive, capsys):
    channel = notifications.add_channel(None, "email", "ops@example.com", ["run.failed"])
    call_command("notifications", "pause", str(channel.pk), "--reason", "relay moved")
    assert capsys.readouterr().out.startswith(f"paused channel #{channel.pk}")
    call_command("notifications", "list")
    assert "[paused by cli]" in capsys.readouterr().out
    with pytest.raises(CommandError, match="is paused: resume it to test it"):
        call_command("notifications", "test", str(channel.pk))
    call_command("notifications", "resume", str(channel.pk))
    assert capsys.readouterr().out.startswith(f"resumed channel #{channel.pk}")
    call_command("notifications", "test", str(channel.pk))
    assert "test notification queued" in capsys.readouterr().out
    assert drive() == ["completed"]
    (sent,) = mail.outbox
    assert "a test notification was sent to a channel" in sent.subject


def test_an_over_budget_run_is_alerted_once_per_crossing_not_after_every_unhalt(drive, cast):
    """A run over its workflow's daily budget is halted and unhalted three times by an
    operator storm: each unhalt requeues it, and each time its next step is refused again by
    the same budget, and recorded. Before, each of those pauses sent its alert again (4
    alerts for one crossing); now one, and a new crossing (a lower limit) alerts again."""
    from decimal import Decimal

    from runs.operations import halt, set_budget, unhalt
    from tests import workflows  # noqa: F401  (registers the workflows)

    notifications.add_channel(None, "email", "ops@example.com", "budget.exceeded")
    set_budget("workflow:metered", cast["otto"], "a cap", usd=Decimal("1"))
    run = start_run("metered", {"steps": 3})
    assert drive() == ["over_budget"]
    for _ in range(3):
        halt("all", cast["otto"], "incident")
        unhalt("all", cast["otto"], "all clear")
        assert Run.objects.get(pk=run.pk).status == RunStatus.PENDING
        assert drive() == ["over_budget"]
    exceeded = Event.objects.filter(run_id=run.pk, type="budget.exceeded")
    assert exceeded.count() == 4  # every refusal is in the run's history
    notifications.sweep()
    assert NotificationDelivery.objects.filter(event_type="budget.exceeded").count() == 1
    set_budget("workflow:metered", cast["otto"], "lower", usd=Decimal("0.5"))
    drive()  # the run, and the first alert's delivery
    assert Run.objects.get(pk=run.pk).status == RunStatus.OVER_BUDGET
    notifications.sweep()
    assert NotificationDelivery.objects.filter(event_type="budget.exceeded").count() == 2
