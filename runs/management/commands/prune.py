from datetime import timedelta
from pathlib import Path

from django.core.management.base import CommandError
from django.utils import timezone

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.operations import require
from runs.retention import BATCH_SIZE, prune

# Pruning deletes runs: the person it is recorded as must be allowed to (superusers are).
PERMISSION = "runs.delete_run"


def days(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(text)
    return value


class Command(StepguardCommand):
    help = (
        "Delete runs that ended more than DAYS ago, with their steps, events, signals and "
        "approvals, in short batches (safe while workers run). Audited with the counts."
    )

    def add_arguments(self, parser):
        parser.add_argument("--finished-before", type=days, required=True, metavar="DAYS")
        parser.add_argument("--dry-run", action="store_true", help="count, delete nothing")
        parser.add_argument("--archive", type=Path, metavar="DIR", help="write <run>.jsonl first")
        parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, metavar="RUNS")
        parser.add_argument(
            "--user",
            default="",
            help=f"recorded as the actor, who must hold {PERMISSION} (default: system)",
        )

    def handle(self, *args, **options):
        try:
            actor = (
                require(options["user"], PERMISSION, "prune runs").get_username()
                if options["user"]
                else "system"
            )
            before = timezone.now() - timedelta(days=options["finished_before"])
            result = prune(
                finished_before=before,
                dry_run=options["dry_run"],
                archive=options["archive"],
                batch_size=max(1, options["batch_size"]),
                actor=actor,
            )
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        verb = "would delete" if options["dry_run"] else "deleted"
        counts = ", ".join(f"{n} {name}" for name, n in sorted(result.counts.items()))
        self.stdout.write(f"{verb} {result.runs} runs ended before {before:%Y-%m-%d %H:%M} UTC"
                          + (f" ({counts})" if counts else ""))  # fmt: skip
