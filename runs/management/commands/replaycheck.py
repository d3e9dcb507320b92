import argparse
import json
import re
from datetime import datetime, timedelta

from django.core.management.base import CommandError
from django.utils import timezone

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.replaycheck import check

AGO = re.compile(r"^(\d+)([mhd])$")
UNITS = {"m": "minutes", "h": "hours", "d": "days"}


def since(text: str) -> datetime:
    """`2h`, `30m`, `7d` ago, or an ISO 8601 time (UTC unless it says otherwise)."""
    if match := AGO.match(text):
        return timezone.now() - timedelta(**{UNITS[match[2]]: int(match[1])})
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a time ago (30m, 2h, 7d) nor an ISO 8601 time"
        ) from None
    return when if timezone.is_aware(when) else timezone.make_aware(when, timezone.UTC)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


class Command(StepguardCommand):
    help = (
        "Replay the histories of live runs (and of runs finished in the last day) against the "
        "workflow code this process imports, writing nothing and calling nothing: which would "
        "diverge if this code took them over. Exit status 1 if any would (for CI)."
    )

    def add_arguments(self, parser):
        self.add_import_option(parser)
        parser.add_argument("--workflow", metavar="NAME", help="check only this workflow")
        which = parser.add_mutually_exclusive_group()
        which.add_argument(
            "--runs", type=positive, metavar="N", help="the N most recent runs, live or not"
        )
        which.add_argument(
            "--since",
            type=since,
            metavar="T",
            help="live runs and runs finished since T (30m, 2h, 7d, or an ISO time); 24h default",
        )
        parser.add_argument(
            "--json", dest="as_json", action="store_true", help="print the report as JSON"
        )

    def handle(self, *args, modules, workflow, runs, since, as_json: bool, **options):
        try:
            self.import_workflows(modules)
            report = check(workflow=workflow, runs=runs, since=since)
        except (ImportError, StepguardError) as exc:
            raise CommandError(str(exc)) from None
        if as_json:
            self.stdout.write(json.dumps(report.as_json(), indent=2))
        else:
            for line in report.lines():
                self.stdout.write(line)
        if not report.ok:
            raise CommandError(
                f"{report.diverging} run(s) would diverge under this code", returncode=1
            )
