from django.core.management.base import CommandError

from runs.approvals import links
from runs.errors import StepguardError
from runs.management.base import StepguardCommand


class Command(StepguardCommand):
    help = (
        "Revoke unused approval decision links: one (--link), an approval's (--approval), a "
        "person's (--user), with a reason. A revoked link is refused, and says who revoked it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--link", type=int, help="a link's id")
        parser.add_argument("--approval", type=int, help="every link to this approval")
        parser.add_argument("--user", default="", help="every link sent to this person")
        parser.add_argument("--reason", required=True)

    def handle(self, *args, link, approval, user, reason, **options):
        try:
            count = links.revoke(None, reason, link_id=link, approval_id=approval, username=user)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"revoked {count} unused link{'s' if count != 1 else ''}")
