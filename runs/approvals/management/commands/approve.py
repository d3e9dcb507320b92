from django.core.management.base import CommandError

from runs.approvals.services import decide
from runs.errors import StepguardError
from runs.management.base import StepguardCommand


class Command(StepguardCommand):
    help = "Approve a pending action. The decision is final and recorded with its actor."
    decision = "approve"

    def add_arguments(self, parser):
        parser.add_argument("approval_id")
        parser.add_argument("--user", required=True, help="the person deciding (a username)")
        parser.add_argument("--comment", default="")

    def handle(self, *args, approval_id, user, comment, **options):
        try:
            request = decide(approval_id, self.decision, user, comment, how={"via": "cli"})
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"approval #{request.pk} ({request.action}): {request.status} by {user}")
