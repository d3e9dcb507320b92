"""`manage.py ratelimit set|list|remove`: rate limits on models and other resources."""

from django.core.management.base import CommandError
from django.utils import timezone

from runs import operations
from runs.engine import rates
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.models import RateLimit


class Command(StepguardCommand):
    help = "Set, list and remove rate limits (calls and tokens per window) on resources."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        put = sub.add_parser("set", help="at most N calls and T tokens per window")
        put.add_argument("resource", help="a model's name, or a step's resource=")
        put.add_argument("--requests", type=int, help="calls per window")
        put.add_argument("--tokens", type=int, help="tokens per window")
        put.add_argument("--per", type=int, default=60, help="the window, seconds (default 60)")
        sub.add_parser("list", help="every limit and what its window holds now")
        remove = sub.add_parser("remove")
        remove.add_argument("resource")
        for one in (put, remove):
            one.add_argument("--user", required=True, help="the person acting")
            one.add_argument("--reason", required=True)

    def handle(self, *args, action, **options):
        try:
            getattr(self, f"_{action}")(options)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None

    def _set(self, options):
        if options["requests"] is None and options["tokens"] is None:
            raise CommandError("give --requests, --tokens or both")
        limit = operations.set_rate_limit(
            options["resource"], options["user"], options["reason"],
            requests=options["requests"], tokens=options["tokens"], window_seconds=options["per"],
        )  # fmt: skip
        self.stdout.write(f"set {limit}")

    def _list(self, options):
        found = RateLimit.objects.order_by("resource")
        for limit in found:
            used = rates.usage(limit.resource, timezone.now())
            self.stdout.write(f"{limit} (now {used['requests']} calls, {used['tokens']} tokens)")
        if not found:
            self.stdout.write("no rate limits")

    def _remove(self, options):
        operations.set_rate_limit(options["resource"], options["user"], options["reason"])
        self.stdout.write(f"removed the rate limit on {options['resource']}")
