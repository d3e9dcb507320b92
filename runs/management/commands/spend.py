import argparse
from datetime import UTC, date, timedelta

from django.core.management.base import CommandError
from django.utils import timezone

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.queries import spend_by_label


def day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:  # argparse's usage error: a CommandError here was a traceback
        raise argparse.ArgumentTypeError(f"{text!r} is not a day (YYYY-MM-DD)") from None


class Command(StepguardCommand):
    help = (
        "What runs spent per value of a label (--label tenant), per UTC day: the steps that "
        "finished that day, and apart what crashes may have spent. The last 7 days by default."
    )

    def add_arguments(self, parser):
        parser.add_argument("--label", required=True, metavar="NAME", help="a label name")
        parser.add_argument("--since", type=day, help="first day (YYYY-MM-DD)")
        parser.add_argument("--until", type=day, help="last day (YYYY-MM-DD), today by default")

    def handle(self, *args, label, since, until, **options):
        until = until or timezone.now().astimezone(UTC).date()
        since = since or until - timedelta(days=6)
        try:
            rows = spend_by_label(label, since, until)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        if not rows:
            self.stdout.write(f"nothing spent from {since} to {until}")
            return
        self.stdout.write(f"{'day':<10}  {label:<24}  {'usd':>12}  {'tokens':>10}  possibly  runs")
        for row in rows:
            value = row["value"] if row["value"] is not None else "(no label)"
            self.stdout.write(
                f"{row['day']!s:<10}  {value:<24}  {row['usd']!s:>12}  {row['tokens']:>10}  "
                f"{row['possibly_spent_usd']!s:>8}  {row['runs']:>4}"
            )
