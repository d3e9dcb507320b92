"""Notifications: a webhook or an email when a run fails, is halted, goes over budget or waits
for a person, so nobody has to watch the dashboard.

Every event a channel subscribes to becomes one delivery, held by the database: a sweep (one
worker at a time, every STEPGUARD_NOTIFY_SWEEP_SECONDS) inserts a `NotificationDelivery` row
(`UNIQUE(channel, event)`) with a run of the built-in workflow `stepguard.notify` (run key
`notify:<channel>:<event>`), in one transaction. That run's one step sends the message, so the
engine's guarantees apply to it: a failed attempt is recorded and retried with backoff (long
delays are durable timers), a worker SIGKILLed mid-send is replaced and the step re-sent with
the same `Idempotency-Key` header, which a receiver uses to accept it once.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.mail import EmailMessage
from django.core.validators import validate_email
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from runs import egress
from runs.approvals import links
from runs.engine.chores import Chore as WorkerChore
from runs.engine.chores import ChoreContext, my_turn
from runs.engine.outage import is_disconnect, reconnect
from runs.engine.retry import RetryPolicy
from runs.errors import NotFound, OperationError, StepguardError
from runs.models import (
    NOTIFIABLE,
    RENAMED_EVENTS,
    ChannelKind,
    Event,
    EventType,
    NotificationChannel,
    NotificationDelivery,
    RunStatus,
    Step,
)
from runs.operations import Target, audit, known_scope, require
from runs.sdk import RunContext, start_run, workflow

log = logging.getLogger("stepguard.notifications")

WORKFLOW = "stepguard.notify"
CHORE = "notifications"
#: How far before a channel's last sweep the next one looks again: an event is stamped when it
#: is written and seen when its transaction commits, which may be a little later.
MARGIN = timedelta(seconds=60)
BATCH = 500
TIMEOUT_SECONDS = 10.0
#: The spelling the issue tracker and other tools use, and earlier ones, for Stepguard's own.
ALIASES = {"run.over_budget": EventType.BUDGET_EXCEEDED.value, **RENAMED_EVENTS}
#: 408, 409, 425, 429 and 5xx are worth trying again; other answers will not change.
RETRYABLE_STATUS = {408, 409, 425, 429}
APPROVAL_ASKED = EventType.APPROVAL_REQUESTED.value


def delivery_retry() -> RetryPolicy:
    """Up to 10 attempts over about half an hour (from STEPGUARD_NOTIFY_RETRY_SECONDS, doubling
    to at most 10 minutes); delays of 5 s and more hold no worker thread."""
    return RetryPolicy(
        max_attempts=10,
        initial_interval=timedelta(seconds=settings.STEPGUARD_NOTIFY_RETRY_SECONDS),
        max_interval=timedelta(minutes=10),
    )


class DeliveryFailed(StepguardError):
    """The receiver did not take the notification (its answer, or why there was none)."""

    code = "delivery_failed"

    def __init__(self, message: str, *, retryable: bool, headers=None):
        super().__init__(message)
        self.retryable = retryable
        # Read by the retry policy for a receiver's Retry-After (runs.engine.llm.retry_after).
        self.response = type("Answer", (), {"headers": headers})() if headers else None


# -- channels: what the CLI, the API and the dashboard call -------------------------------------


def event_types(names: list[str] | str) -> list[str]:
    """Event type names checked against what can be notified (aliases spelt Stepguard's way)."""
    if isinstance(names, str):
        names = [n for n in (part.strip() for part in names.split(",")) if n]
    if not names:
        raise OperationError("name at least one event type to notify of")
    known = [t.value for t in NOTIFIABLE]
    chosen = []
    for name in names:
        name = ALIASES.get(name, name)
        if name not in known:
            raise OperationError(
                f"cannot notify of {name!r}: the event types are {', '.join(known)}"
            )
        if name not in chosen:
            chosen.append(name)
    return chosen


def _target(kind: str, target: str) -> str:
    target = target.strip()
    if kind == ChannelKind.WEBHOOK:
        try:
            return egress.check_url(target)
        except ValueError as exc:
            raise OperationError(str(exc)) from None
    if kind == ChannelKind.EMAIL:
        addresses = [a.strip() for a in target.split(",") if a.strip()]
        for address in addresses:
            try:
                validate_email(address)
            except ValidationError:
                raise OperationError(f"not an email address: {address!r}") from None
        if not addresses:
            raise OperationError("name at least one email address")
        return ", ".join(addresses)
    raise OperationError(f"a channel is a webhook or an email, not {kind!r}")


def add_channel(
    user, kind: str, target: str, events: list[str] | str, *, workflow: str = "", secret: str = ""
) -> NotificationChannel:
    """A new channel, told of events from now on (not of earlier ones). `user` None: the CLI,
    whose authority is the shell it runs in."""
    actor = _actor(user, "runs.add_notificationchannel", "add notification channels")
    target = _target(kind, target)
    types = event_types(events)
    if len(target) > 2000 or len(workflow) > 200 or len(secret) > 200:
        raise OperationError("a target is at most 2,000 characters, a workflow and a secret 200")
    if secret and kind != ChannelKind.WEBHOOK:
        raise OperationError("only webhooks are signed: an email channel takes no secret")
    if workflow.strip():
        _known_workflow(workflow.strip())
    now = timezone.now()
    with transaction.atomic():
        channel = NotificationChannel.objects.create(
            kind=kind, target=target, events=types, workflow=workflow.strip(), secret=secret,
            created_by=actor, created_at=now, scanned_until=now,
        )  # fmt: skip
        audit(actor, EventType.NOTIFICATIONS_CHANGED, added=describe(channel))
    return channel


def _known_workflow(name: str) -> None:
    """A channel filtered to a workflow that does not exist (a typo) would never say a word,
    and nobody would know: refused, as a halt or a budget of one is."""
    if name == WORKFLOW:
        raise OperationError(f"{WORKFLOW} is the deliveries' own workflow: it is never notified")
    try:
        known_scope(Target("workflow", name))
    except NotFound:
        raise OperationError(
            f"no workflow named {name!r}: it is not registered and has no runs, so the channel"
            " would never notify"
        ) from None


def remove_channel(user, channel_id: int) -> NotificationChannel:
    """Stop a channel: no new deliveries; those under way finish, and the history stays."""
    actor = _actor(user, "runs.delete_notificationchannel", "remove notification channels")
    with transaction.atomic():
        channel = _live_channel(channel_id)
        channel.removed_at, channel.removed_by = timezone.now(), actor
        channel.save(update_fields=["removed_at", "removed_by"])
        audit(actor, EventType.NOTIFICATIONS_CHANGED, removed=describe(channel))
    return channel


def pause_channel(user, channel_id: int, reason: str = "") -> NotificationChannel:
    """Stop sending on a channel (a receiver down for maintenance, a noisy one): its events
    meanwhile are not delivered, later either, and its deliveries under way stop retrying."""
    actor = _actor(user, "runs.add_notificationchannel", "pause notification channels")
    reason = reason.strip()
    if len(reason) > 500:
        raise OperationError("a reason is at most 500 characters")
    with transaction.atomic():
        channel = _live_channel(channel_id)
        if channel.paused_at is not None:
            raise OperationError(
                f"channel #{channel_id} is already paused (by {channel.paused_by})"
            )
        channel.paused_at, channel.paused_by, channel.pause_reason = timezone.now(), actor, reason
        channel.save(update_fields=["paused_at", "paused_by", "pause_reason"])
        audit(actor, EventType.NOTIFICATIONS_CHANGED, paused=describe(channel), reason=reason)
    return channel


def resume_channel(user, channel_id: int) -> NotificationChannel:
    """Send on a paused channel again, from now on: what happened while it was paused is not
    sent (a backlog of stale alerts would bury the live ones)."""
    actor = _actor(user, "runs.add_notificationchannel", "resume notification channels")
    with transaction.atomic():
        channel = _live_channel(channel_id)
        if channel.paused_at is None:
            raise OperationError(f"channel #{channel_id} is not paused")
        channel.paused_at, channel.paused_by, channel.pause_reason = None, "", ""
        channel.scanned_until = channel.resumed_at = timezone.now()
        fields = ["paused_at", "paused_by", "pause_reason", "scanned_until", "resumed_at"]
        channel.save(update_fields=fields)
        audit(actor, EventType.NOTIFICATIONS_CHANGED, resumed=describe(channel))
    return channel


def send_test(user, channel_id: int) -> NotificationDelivery:
    """Send a test message on a channel, the way every notification goes (a delivery run:
    signed, keyed, retried), so its result shows with the channel's deliveries."""
    actor = _actor(user, "runs.add_notificationchannel", "test notification channels")
    with transaction.atomic():
        channel = _live_channel(channel_id)
        if channel.paused_at is not None:
            raise OperationError(f"channel #{channel_id} is paused: resume it to test it")
        event = Event.objects.create(
            run=None, seq=0, type=EventType.NOTIFICATION_TEST, actor=actor,
            payload={"target": f"channel #{channel.pk}", "reason": f"a test sent by {actor}"},
            created_at=timezone.now(),
        )  # fmt: skip
        if not _start_delivery(channel, event.pk, event.type):
            raise OperationError(f"channel #{channel_id}: the test could not be started")
    return NotificationDelivery.objects.get(channel=channel, event_id=event.pk)


def _live_channel(channel_id: int) -> NotificationChannel:
    """The channel, locked for the change, unless removed."""
    channel = NotificationChannel.objects.select_for_update().filter(pk=channel_id).first()
    if channel is None or channel.removed_at is not None:
        raise NotFound(f"no notification channel #{channel_id}")
    return channel


def _actor(user, permission: str, action: str) -> str:
    if user is None:
        return "cli"
    return require(user, permission, action).get_username()


def shown_target(channel: NotificationChannel, user=None, *, full: bool = False) -> str:
    """A channel's target as `user` may read it: a webhook's scheme and host only (a Slack
    webhook's URL is its secret), unless `full` or `user` may add channels (who could point
    one anywhere anyway). Email addresses are shown as they are."""
    if channel.kind != ChannelKind.WEBHOOK or full:
        return channel.target
    if user is not None and user.has_perm("runs.add_notificationchannel"):
        return channel.target
    return egress.redact(channel.target)


def describe(channel: NotificationChannel, user=None) -> dict:
    """A channel as the API and the audit show it: the secret only as whether set, a webhook's
    URL redacted for `user` (and in the audit, which viewers read) as `shown_target` says."""
    return {
        "id": channel.pk,
        "kind": channel.kind,
        "target": shown_target(channel, user),
        "events": channel.events,
        "workflow": channel.workflow or None,
        "signed": bool(channel.secret),
        "created_by": channel.created_by,
        "created_at": channel.created_at.isoformat(),
        "paused_at": channel.paused_at.isoformat() if channel.paused_at else None,
        "paused_by": channel.paused_by or None,
        "pause_reason": channel.pause_reason or None,
    }


# -- the sweep: events to deliveries -------------------------------------------------------------


def sweep(now=None) -> int:
    """Start a delivery for every event a live channel subscribes to and has none yet; return
    how many were started. Safe to run anywhere at any time: the unique constraint makes a
    second delivery of one event to one channel impossible."""
    now = now or timezone.now()
    started = 0
    for channel in NotificationChannel.objects.filter(removed_at__isnull=True, paused_at=None):
        events = Event.objects.filter(
            type__in=channel.events,
            created_at__gte=max(
                channel.scanned_until - MARGIN, channel.resumed_at or channel.created_at
            ),
            created_at__lte=now,
        ).exclude(pk__in=NotificationDelivery.objects.filter(channel=channel).values("event_id"))
        # A delivery's own events are never notified: a failing webhook would feed itself.
        # Nor a pruned run's, left in its month's partition (runs/partitions.py).
        events = events.exclude(run__workflow=WORKFLOW)
        # One alert per crossing: a pause the same budget repeats (lifecycle._crossed_before)
        # is recorded with `repeat`. (A key absent is NULL, which an exclude() would drop.)
        once = ~Q(type=EventType.BUDGET_EXCEEDED) | Q(payload__repeat__isnull=True)
        events = events.filter(once).filter(
            Q(run_id__isnull=True) | Q(run__created_at__isnull=False)
        )
        if channel.workflow:
            events = events.filter(run__workflow=channel.workflow)
        rows = events.order_by("created_at", "id").values_list("id", "type", "created_at")
        batch = list(rows[:BATCH])  # LIMIT in the query: a backlog is read a batch at a time
        for event_id, type_, _ in batch:
            started += _start_delivery(channel, event_id, type_)
        until = batch[-1][2] if len(batch) == BATCH else now
        NotificationChannel.objects.filter(pk=channel.pk, scanned_until__lt=until).update(
            scanned_until=until
        )
    return started


def _start_delivery(channel: NotificationChannel, event_id: int, type_: str) -> int:
    try:
        with transaction.atomic():
            run = start_run(
                WORKFLOW,
                {"channel": channel.pk, "event": event_id},
                key=f"notify:{channel.pk}:{event_id}",
                max_attempts=1,  # the step retries; a run retry would only repeat that
                engine=True,
            )
            if not run.was_created:
                return 0
            NotificationDelivery.objects.create(
                channel=channel, event_id=event_id, event_type=type_, run=run,
                created_at=timezone.now(),
            )  # fmt: skip
    except IntegrityError:
        return 0  # another sweep got there first
    except ValueError as exc:
        # A run of another workflow holds the key (planted before keys were reserved): this
        # event goes undelivered, said once; the channel's later events go on.
        log.error("channel %s: event %s not delivered: %s", channel.pk, event_id, exc)
        return 0
    return 1


def sweep_if_due(worker: str) -> int:
    """The sweep, by the one worker whose conditional UPDATE moves the chore's due time on."""
    if not NotificationChannel.objects.filter(removed_at__isnull=True).exists():
        return 0
    now = my_turn(CHORE, worker, settings.STEPGUARD_NOTIFY_SWEEP_SECONDS)
    return 0 if now is None else sweep(now)


def sweep_round(context: ChoreContext) -> None:
    """One look of a worker's notification chore: sweep when due."""
    try:
        sweep_if_due(context.worker)
    except Exception as exc:
        if is_disconnect(exc):  # a database restart: said once, by whichever thread sees it
            with contextlib.suppress(Exception):
                reconnect("sweeping notifications")
        else:
            log.exception("notifications: the sweep failed; trying again")
            close_old_connections()


def chore() -> WorkerChore:
    """The notification sweep, on a thread of every worker's own, every
    STEPGUARD_NOTIFY_SWEEP_SECONDS (one worker at a time sweeps: `sweep_if_due`)."""
    return WorkerChore(
        "sweeping notifications", settings.STEPGUARD_NOTIFY_SWEEP_SECONDS, sweep_round
    )


# -- delivery: the built-in workflow ---------------------------------------------------------------


@workflow(WORKFLOW, version="1")
def deliver(ctx: RunContext, input: dict) -> dict:
    """Send one event to one channel: one step, retried, re-sent with its key after a crash."""
    return ctx.step(
        "send",
        lambda: send(input["channel"], input["event"], ctx.idempotency_key),
        retry=delivery_retry(),
    )


def slack_escape(text: str) -> str:
    """`text` with the three characters Slack reads as markup escaped, as Slack requires: a
    reason cannot ping `<!channel>`, disguise a link or break the message's own link."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def summary(event: Event) -> str:
    """What happened, in plain text (workflow names and reasons as people wrote them)."""
    run = event.run
    what = EventType(event.type).label if event.type in EventType.values else event.type
    if run is not None:
        subject = f"run {run.workflow} {str(run.pk)[:8]}"
        reason = event.payload.get("reason") or event.payload.get("error", {})
        if isinstance(reason, dict):
            reason = reason.get("message", "")
        return f"Stepguard: {subject}: {what}" + (f": {reason}" if reason else "")
    target, reason = event.payload.get("target", ""), event.payload.get("reason", "")
    return f"Stepguard: {what}: {target} {reason}"


def message(event: Event) -> dict:
    """The notification's JSON: `text` for Slack-compatible receivers (markup in names and
    reasons escaped), `event` for programs."""
    run = event.run
    text = slack_escape(summary(event))
    base = settings.STEPGUARD_PUBLIC_URL
    link = f"{base.rstrip('/')}/runs/{run.pk}" if base and run is not None else None
    if link:
        text += f" <{link}>"
    return {
        "text": text.strip(),
        "event": {
            "id": event.pk,
            "type": event.type,
            "run_id": str(run.pk) if run is not None else None,
            "workflow": run.workflow if run is not None else None,
            "run_status": run.status if run is not None else None,
            "step_key": event.step_key or None,
            "actor": event.actor,
            "payload": event.payload,
            "created_at": event.created_at.isoformat(),
        },
        "url": link,
    }


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """`sha256=` and the hex HMAC-SHA256 of `<timestamp>.<body>` under the channel's secret."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def send(channel_id: int, event_id: int, key: str) -> dict:
    """Deliver, or raise DeliveryFailed saying whether trying again could help."""
    channel = NotificationChannel.objects.get(pk=channel_id)
    if channel.paused_at is not None:  # a retry of a dead receiver's delivery stops here too
        return {"skipped": f"the channel was paused by {channel.paused_by}"}
    event = Event.objects.select_related("run").filter(pk=event_id).first()
    if event is None or (event.run_id is not None and event.run is None):  # left in its month
        return {"skipped": "the event is gone (its run was pruned)"}
    body = message(event)
    approval = event.payload.get("approval_id") if event.type == APPROVAL_ASKED else None
    if channel.kind == ChannelKind.EMAIL:
        addresses = [a.strip() for a in channel.target.split(",")]
        each = links.for_email(approval, key, addresses) if approval else None
        if each is not None:  # one mail per address, with its approver's own links
            sent = [_email(channel, event, {**body, **each[a]}, f"{key}|{a}", [a]) for a in each]
            return {"sent_to": channel.target, "message_ids": [m["message_id"] for m in sent]}
        return _email(channel, event, body, key, addresses)
    if approval:  # every approver's links, for a chat tool's bot to post buttons
        body.update(links.for_webhook(approval, key))
    return _post(channel, event, body, key)


def _post(channel: NotificationChannel, event: Event, body: dict, key: str) -> dict:
    data = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Stepguard-Notifications/1",
        "Idempotency-Key": key,
        "X-Stepguard-Event": event.type,
        "X-Stepguard-Timestamp": timestamp,
    }
    if channel.secret:
        headers["X-Stepguard-Signature"] = signature(channel.secret, timestamp, data)
    # Errors name the scheme and host only: viewers read them, and a Slack URL is a secret.
    shown = egress.redact(channel.target)
    try:  # a channel saved before URLs were checked this strictly is checked now
        egress.check_url(channel.target)
    except ValueError as exc:
        raise DeliveryFailed(f"{shown}: {exc}", retryable=False) from None
    request = urllib.request.Request(channel.target, data=data, headers=headers, method="POST")
    try:
        # Connects only where egress allows, to the address it checked (no DNS rebinding).
        with egress.opener.open(request, timeout=TIMEOUT_SECONDS) as answer:
            return {"status": answer.status}
    except urllib.error.HTTPError as exc:
        status = exc.code
        retry = status in RETRYABLE_STATUS or status >= 500
        raise DeliveryFailed(
            f"{shown} answered {status} {exc.reason}", retryable=retry, headers=exc.headers
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        # Refused at the connection: asking again will not change that.
        retry = not isinstance(reason, egress.Refused) and not isinstance(exc, egress.Refused)
        raise DeliveryFailed(f"{shown}: {reason}", retryable=retry) from None


def _email(channel, event: Event, body: dict, key: str, to: list[str]) -> dict:
    # The Message-ID is the idempotency key: a mail system that sees it twice (a re-send after
    # a crash) can tell, and threads show one message.
    message_id = "<" + hashlib.sha256(key.encode()).hexdigest()[:32] + "@stepguard>"
    mail = EmailMessage(
        # A header holds one line: a reason's newlines (which Django refuses there) become
        # spaces. Plain text, not the Slack-escaped `text`.
        subject=" ".join(summary(event).split())[:200],
        body=links.email_text(body) + json.dumps(body, indent=2, sort_keys=True),
        to=to,
        headers={"Message-ID": message_id, "X-Stepguard-Event": event.type},
    )
    try:
        mail.send()
    except Exception as exc:  # SMTP errors, refused connections...: each worth another try
        raise DeliveryFailed(f"email to {', '.join(to)}: {exc}", retryable=True) from None
    return {"sent_to": ", ".join(to), "message_id": message_id}


def deliveries(
    channel: int | None = None, *, failed: bool = False, failing: bool = False, limit: int = 200
) -> list[NotificationDelivery]:
    """Recent deliveries, newest first, with their runs and their send steps. `failed`: those
    that failed after their retries; `failing`: those too, and those whose receiver refused
    an attempt and that are being retried (a dead webhook is seen before its retries end)."""
    query = NotificationDelivery.objects.select_related("run", "channel")
    if channel is not None:
        query = query.filter(channel_id=channel)
    if failing:
        refused = Step.objects.filter(run_id=OuterRef("run_id"), error__isnull=False)
        query = query.filter(
            Q(run__status=RunStatus.FAILED) | ~Q(run__status=RunStatus.COMPLETED) & Exists(refused)
        )
    elif failed:
        query = query.filter(run__status=RunStatus.FAILED)
    rows = list(query.order_by("-created_at", "-id")[:limit])
    steps = {s.run_id: s for s in Step.objects.filter(run__in=[d.run for d in rows], seq=0)}
    for row in rows:
        row.step = steps.get(row.run_id)
    return rows


def delivery_row(delivery: NotificationDelivery) -> dict:
    """A delivery as the API shows it: its run's status, attempts and last error."""
    step, run = delivery.step, delivery.run
    return {
        "id": delivery.pk,
        "channel_id": delivery.channel_id,
        "event_id": delivery.event_id,
        "event_type": delivery.event_type,
        "run_id": run.pk,
        "status": run.status,
        "attempts": step.attempt if step else 0,
        "error": (step.error if step else None) or run.error,
        "created_at": delivery.created_at,
        "finished_at": run.finished_at,
    }
