import json

from django.core.management.base import CommandError
from django.core.serializers.json import DjangoJSONEncoder

from runs import annotations
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import run_arg


class Command(StepguardCommand):
    help = (
        "Export annotations, newest first, as CSV or JSON lines: filter by verdict, workflow, "
        "run, person and time (as GET /api/annotations does)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--verdict", choices=["good", "bad", "note"])
        parser.add_argument("--workflow")
        parser.add_argument("--run", type=run_arg, help="one run's (an id or its start)")
        parser.add_argument("--by", help="made by this user")
        parser.add_argument("--since", help="made at or after (ISO date and time)")
        parser.add_argument("--until", help="made before (ISO date and time)")
        parser.add_argument("--format", choices=["csv", "json"], default="csv")
        parser.add_argument("--limit", type=int, default=10_000)

    def handle(self, *args, format, limit, **options):
        if limit < 1:
            raise CommandError(f"--limit is a positive number, not {limit}")
        wanted = {k: options.get(k) for k in ("verdict", "workflow", "run", "by", "since", "until")}
        try:
            rows = list(annotations.matching(wanted)[:limit])
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        if format == "csv":
            self.stdout.write(annotations.to_csv(rows), ending="")
            return
        for a in rows:
            self.stdout.write(json.dumps(annotations.as_row(a), cls=DjangoJSONEncoder))
