from django.core.management.base import BaseCommand, CommandError

from runs.apikeys import create_key, revoke_key
from runs.errors import StepguardError
from runs.models import ApiKey


class Command(BaseCommand):
    help = "Manage REST API keys: create (shown once), list, revoke."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="create a key for a user")
        create.add_argument("--user", required=True)
        create.add_argument("--name", default="")
        sub.add_parser("list", help="list keys (prefix, user, last use)")
        revoke = sub.add_parser("revoke", help="revoke a key by its prefix")
        revoke.add_argument("prefix")

    def handle(self, *args, action, **options):
        try:
            if action == "create":
                key, text = create_key(options["user"], options["name"])
                self.stderr.write(f"API key {key.prefix} for {key.user}: shown once, keep it safe")
                self.stdout.write(text)
            elif action == "list":
                for key in ApiKey.objects.select_related("user"):
                    state = "revoked" if key.revoked_at else "active"
                    used = key.last_used_at.isoformat() if key.last_used_at else "never"
                    self.stdout.write(f"sg_{key.prefix}  {key.user}  {state}  last used {used}")
            else:
                key = revoke_key(options["prefix"])
                self.stdout.write(f"API key {key.prefix} revoked")
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
