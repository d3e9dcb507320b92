"""Notification channels and their deliveries over REST (runs/notifications.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from ninja import Field, Path, Query, Schema, Status

from runs import notifications
from runs.api.common import ERRORS, ERRORS_422, TEXT, In, Router, may
from runs.models import NotificationChannel

router = Router(tags=["runs"])


class ChannelIn(In):
    kind: str = Field(..., pattern="^(webhook|email)$")
    target: str = Field(..., max_length=2000, pattern=TEXT)
    events: list[str] = Field(..., min_length=1, max_length=20)
    workflow: str = Field("", max_length=200, pattern=TEXT)
    secret: str = Field("", max_length=200, pattern=TEXT, description="signs webhook bodies")


class ChannelOut(Schema):
    id: int
    kind: str
    target: str
    events: list[str]
    workflow: str | None
    signed: bool
    created_by: str
    created_at: datetime
    paused_at: datetime | None = None
    paused_by: str | None = None
    pause_reason: str | None = None


class PauseIn(In):
    reason: str = Field("", max_length=500, pattern=TEXT, examples=["receiver down for upgrade"])


class DeliveryOut(Schema):
    id: int
    channel_id: int
    event_id: int
    event_type: str
    run_id: UUID
    status: str
    attempts: int
    error: Any
    created_at: datetime
    finished_at: datetime | None


@router.get(
    "/notifications/channels", response={200: list[ChannelOut], **ERRORS}, tags=["notifications"]
)
def list_channels(request):
    """The channels in use (removed ones are kept for their deliveries, not listed)."""
    may(request, "runs.view_notificationchannel", "view notification channels")
    channels = NotificationChannel.objects.filter(removed_at__isnull=True)
    return [notifications.describe(c, request.user) for c in channels]


@router.post(
    "/notifications/channels", response={201: ChannelOut, **ERRORS_422}, tags=["notifications"]
)
def add_channel(request, body: ChannelIn):
    """A webhook (Slack-compatible JSON, signed with `secret` if given) or email addresses,
    told of `events` (of runs of `workflow`, if given) from now on."""
    channel = notifications.add_channel(
        request.user, body.kind, body.target, body.events, workflow=body.workflow,
        secret=body.secret,
    )  # fmt: skip
    return Status(201, notifications.describe(channel, request.user))


@router.delete(
    "/notifications/channels/{channel_id}",
    response={200: ChannelOut, **ERRORS_422},
    tags=["notifications"],
)
def remove_channel(request, channel_id: int = Path(..., ge=1, le=2**62)):
    """Stop a channel: no new deliveries; its past ones stay listed."""
    channel = notifications.remove_channel(request.user, channel_id)
    return notifications.describe(channel, request.user)


@router.post(
    "/notifications/channels/{channel_id}/pause",
    response={200: ChannelOut, **ERRORS_422},
    tags=["notifications"],
)
def pause_channel(request, body: PauseIn, channel_id: int = Path(..., ge=1, le=2**62)):
    """Send nothing on a channel until it is resumed: its events meanwhile are not delivered,
    later either, and its deliveries under way stop retrying. Audited."""
    channel = notifications.pause_channel(request.user, channel_id, body.reason)
    return notifications.describe(channel, request.user)


@router.post(
    "/notifications/channels/{channel_id}/resume",
    response={200: ChannelOut, **ERRORS_422},
    tags=["notifications"],
)
def resume_channel(request, channel_id: int = Path(..., ge=1, le=2**62)):
    """Send on a paused channel again, from now on. Audited."""
    channel = notifications.resume_channel(request.user, channel_id)
    return notifications.describe(channel, request.user)


@router.post(
    "/notifications/channels/{channel_id}/test",
    response={201: DeliveryOut, **ERRORS_422},
    tags=["notifications"],
)
def test_channel(request, channel_id: int = Path(..., ge=1, le=2**62)):
    """Send a test message on a channel as every notification is sent (signed, keyed,
    retried): the delivery returned shows how it went (`GET /notifications/deliveries`)."""
    delivery = notifications.send_test(request.user, channel_id)
    delivery.step = None
    return Status(201, notifications.delivery_row(delivery))


@router.get(
    "/notifications/deliveries",
    response={200: list[DeliveryOut], **ERRORS_422},
    tags=["notifications"],
)
def list_deliveries(
    request, channel: int | None = Query(None, ge=1, le=2**62), failed: bool = False
):
    """Recent deliveries, newest first: each is a run of `stepguard.notify` (its attempts and
    last error are its step's)."""
    may(request, "runs.view_notificationdelivery", "view notification deliveries")
    return [notifications.delivery_row(d) for d in notifications.deliveries(channel, failed=failed)]
