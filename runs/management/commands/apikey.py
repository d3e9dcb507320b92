from django.core.management.base import CommandError

from runs.apikeys import create_key, parse_expiry, revoke_key
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.models import ApiKey, ApiKeyScope


class Command(StepguardCommand):
    help = "Manage REST API keys: create (shown once), list, revoke."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a key for a user")
        create.add_argument("--user", required=True)
        create.add_argument("--name", default="")
        create.add_argument(
            "--scope",
            choices=ApiKeyScope.values,
            default=ApiKeyScope.FULL,
            help="full (whatever the user may do), read (GET only), start (start runs, signals)",
        )
        create.add_argument(
            "--expires", help="ISO date or date-time (UTC unless it says), e.g. 2027-01-31"
        )
        sub.add_parser("list", help="list keys (prefix, user, last use)")
        revoke = sub.add_parser("revoke", help="revoke a key by its prefix (audited)")
        revoke.add_argument("prefix")
        revoke.add_argument("--user", help="the person acting (checked for the permission)")

    def handle(self, *args, action, **options):
        try:
            if action == "create":
                expires = options["expires"]
                key, text = create_key(
                    options["user"], options["name"], scope=options["scope"],
                    expires_at=parse_expiry(expires) if expires else None,
                )  # fmt: skip
                self.stderr.write(
                    f"API key {key.prefix} ({key.scope}) for {key.user}: shown once, keep it safe"
                )
                self.stdout.write(text)
            elif action == "list":
                for key in ApiKey.objects.select_related("user"):
                    state = (
                        "revoked" if key.revoked_at else "expired" if key.expired() else "active"
                    )
                    used = key.last_used_at.isoformat() if key.last_used_at else "never"
                    until = key.expires_at.isoformat() if key.expires_at else "never"
                    self.stdout.write(
                        f"sg_{key.prefix}  {key.user}  {key.scope}  {state}  expires {until}  "
                        f"last used {used}"
                    )
            else:
                key = revoke_key(options["prefix"], options["user"])
                self.stdout.write(f"API key {key.prefix} revoked")
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
