import json

from django.core.management.base import CommandError

from runs.management.base import StepguardCommand
from runs.management.targets import run_arg
from runs.sdk import StepguardError, send_signal


class Command(StepguardCommand):
    help = "Send a signal to a run; the next ctx.wait_for_event for that name consumes it."

    def add_arguments(self, parser):
        parser.add_argument("run_id", type=run_arg, help="a run id, or its first characters")
        parser.add_argument("name")
        parser.add_argument("--payload", default="null", help="payload as JSON (default null)")
        parser.add_argument("--user", default="cli", help="recorded as the sender")

    def handle(self, *args, run_id, name, payload, user, **options):
        try:
            data = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--payload is not valid JSON: {exc}") from None
        try:
            signal = send_signal(run_id, name, data, sent_by=user)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"signal {signal.pk} {name!r} sent to run {run_id}")
