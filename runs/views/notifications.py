"""The notifications page: the channels (added, paused, resumed, tested, removed from it) and
recent deliveries with their attempts."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required, permission_required
from django.http import Http404
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs import notifications
from runs.models import NOTIFIABLE, NotificationChannel
from runs.views.common import do_action


def _channel_row(channel: NotificationChannel, user) -> dict:
    """What the page reads of a channel, its target as this person may see it (a viewer reads
    a webhook's scheme and host: a Slack webhook's URL is its secret)."""
    return {
        "pk": channel.pk,
        "kind": channel.kind,
        "target": notifications.shown_target(channel, user),
        "events": channel.events,
        "workflow": channel.workflow,
        "secret": bool(channel.secret),
        "created_by": channel.created_by,
        "created_at": channel.created_at,
        "paused_at": channel.paused_at,
        "paused_by": channel.paused_by,
        "pause_reason": channel.pause_reason,
    }


@login_required
@permission_required("runs.view_notificationchannel", raise_exception=True)
def notifications_page(request):
    """Notification channels, and recent deliveries with their attempts and errors."""
    failed = request.GET.get("failed") == "1"
    return render(
        request,
        "runs/notifications.html",
        {
            "channels": [
                _channel_row(c, request.user)
                for c in NotificationChannel.objects.filter(removed_at__isnull=True)
            ],
            "deliveries": notifications.deliveries(failing=failed, limit=100),
            "failed_only": failed,
            "event_types": [t.value for t in NOTIFIABLE],
            "can_add": request.user.has_perm("runs.add_notificationchannel"),
            "can_remove": request.user.has_perm("runs.delete_notificationchannel"),
        },
    )


@login_required
@require_POST
def notifications_add(request):
    """Add a channel from the form: kind, target, event types (checkboxes), workflow, secret."""
    post = request.POST
    return do_action(
        request,
        lambda: notifications.add_channel(
            request.user,
            post.get("kind", ""),
            post.get("target", ""),
            post.getlist("events"),
            workflow=post.get("workflow", ""),
            secret=post.get("secret", ""),
        ),
        reverse("stepguard:notifications"),
        lambda channel: (
            f"Channel {channel.pk} added: {channel.kind} of {', '.join(channel.events)}."
        ),
    )


@login_required
@require_POST
def notifications_remove(request, channel_id: int):
    return do_action(
        request,
        lambda: notifications.remove_channel(request.user, channel_id),
        reverse("stepguard:notifications"),
        f"Channel {channel_id} removed.",
    )


@login_required
@require_POST
def notifications_channel(request, channel_id: int, action: str):
    """Pause, resume or test a channel."""
    reason = request.POST.get("reason", "")
    actions = {
        "pause": (
            lambda: notifications.pause_channel(request.user, channel_id, reason),
            f"Channel {channel_id} paused: nothing is sent on it until it is resumed.",
        ),
        "resume": (
            lambda: notifications.resume_channel(request.user, channel_id),
            f"Channel {channel_id} resumed: its events are sent from now on.",
        ),
        "test": (
            lambda: notifications.send_test(request.user, channel_id),
            f"Test sent to channel {channel_id}: its delivery is the newest below.",
        ),
    }
    if action not in actions:
        raise Http404(f"no action {action!r}")
    perform, done = actions[action]
    return do_action(request, perform, reverse("stepguard:notifications"), done)
