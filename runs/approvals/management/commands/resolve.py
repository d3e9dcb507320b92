import json

from django.core.management.base import CommandError

from runs.approvals.services import resolve
from runs.errors import StepguardError
from runs.management.base import StepguardCommand


class Command(StepguardCommand):
    help = (
        "Say what happened to a step whose worker died mid-call: 'happened' (with --output, "
        "recorded as its result), 'resend' (same idempotency key), or 'fail' (the run)."
    )

    def add_arguments(self, parser):
        parser.add_argument("approval_id")
        parser.add_argument("choice", choices=["happened", "resend", "fail"])
        parser.add_argument("--user", required=True)
        parser.add_argument("--output", default="null", help="the step's result, as JSON")
        parser.add_argument("--comment", default="")

    def handle(self, *args, approval_id, choice, user, output, comment, **options):
        try:
            data = json.loads(output)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--output is not valid JSON: {exc}") from None
        try:
            request = resolve(approval_id, choice, user, comment, data)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"approval #{request.pk}: {choice} by {user}")
