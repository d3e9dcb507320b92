"""`manage.py notifications add|list|remove|pause|resume|test`: where Stepguard tells people
what happened."""

import os

from django.core.management.base import CommandError

from runs import notifications
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.models import NOTIFIABLE, NotificationChannel


class Command(StepguardCommand):
    help = "Add, list, remove, pause, resume and test notification channels (webhooks, email)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="a webhook URL or email addresses, for some events")
        add.add_argument("kind", choices=["webhook", "email"])
        add.add_argument("target", help="the URL, or comma-separated email addresses")
        add.add_argument(
            "--events",
            required=True,
            help="comma-separated event types: " + ", ".join(t.value for t in NOTIFIABLE),
        )
        add.add_argument("--workflow", default="", help="only runs of this workflow")
        secret = add.add_mutually_exclusive_group()
        secret.add_argument("--secret", default="", help="HMAC key that signs webhook bodies")
        secret.add_argument("--secret-env", metavar="VAR", help="read the secret from $VAR")
        add.add_argument("--user", help="the person acting (checked for the permission)")
        sub.add_parser("list", help="the channels in use")
        remove = sub.add_parser("remove", help="stop a channel (its deliveries stay listed)")
        pause = sub.add_parser("pause", help="stop sending on a channel until it is resumed")
        pause.add_argument("--reason", default="", help="why (shown on the page, audited)")
        resume = sub.add_parser("resume", help="send on a paused channel again, from now on")
        test = sub.add_parser("test", help="send a notification.test the way every one goes")
        for each in (remove, pause, resume, test):
            each.add_argument("id", type=int)
            each.add_argument("--user", help="the person acting (checked for the permission)")

    def handle(self, *args, action, **options):
        try:
            getattr(self, f"_{action}")(options)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None

    def _add(self, options):
        secret = options["secret"]
        if options["secret_env"]:
            secret = os.environ.get(options["secret_env"], "")
            if not secret:
                raise CommandError(f"${options['secret_env']} is not set or empty")
        channel = notifications.add_channel(
            options["user"], options["kind"], options["target"], options["events"],
            workflow=options["workflow"], secret=secret,
        )  # fmt: skip
        self.stdout.write(f"added channel #{channel.pk}: {self._line(channel)}")

    def _list(self, options):
        channels = NotificationChannel.objects.filter(removed_at__isnull=True)
        for channel in channels:
            self.stdout.write(f"#{channel.pk} {self._line(channel)}")
        if not channels:
            self.stdout.write("no notification channels")

    def _remove(self, options):
        channel = notifications.remove_channel(options["user"], options["id"])
        self.stdout.write(f"removed channel #{channel.pk}: {self._line(channel)}")

    def _pause(self, options):
        channel = notifications.pause_channel(options["user"], options["id"], options["reason"])
        self.stdout.write(f"paused channel #{channel.pk}: {self._line(channel)}")

    def _resume(self, options):
        channel = notifications.resume_channel(options["user"], options["id"])
        self.stdout.write(f"resumed channel #{channel.pk}: {self._line(channel)}")

    def _test(self, options):
        delivery = notifications.send_test(options["user"], options["id"])
        self.stdout.write(
            f"test notification queued on channel #{options['id']} (delivery #{delivery.pk}); "
            "its result shows with the channel's deliveries on the Notifications page"
        )

    @staticmethod
    def _line(channel) -> str:
        scope = f" (workflow {channel.workflow})" if channel.workflow else ""
        signed = ", signed" if channel.secret else ""
        paused = f" [paused by {channel.paused_by}]" if channel.paused_at else ""
        events = ", ".join(channel.events)
        return f"{channel.kind} {channel.target}{scope}: {events}{signed}{paused}"
