from django.core.management.base import BaseCommand, CommandError

from runs.errors import StepguardError
from runs.operations import fork_preview, fork_run


class Command(BaseCommand):
    help = (
        "Fork a run from a step: a new run that reuses the recorded outputs before it and runs "
        "the rest again. Prints the steps that will run again; --yes to create the fork."
    )

    def add_arguments(self, parser):
        parser.add_argument("run_id")
        parser.add_argument("--from-step", required=True, help="a step key, or a position")
        parser.add_argument("--user", required=True)
        parser.add_argument("--reason", required=True)
        parser.add_argument("--yes", action="store_true", help="create it (default: preview)")

    def handle(self, *args, run_id, from_step, user, reason, yes, **options):
        step = int(from_step) if from_step.isdigit() else from_step
        try:
            again = fork_preview(run_id, step)
            for s in again:
                self.stdout.write(f"  will run again: #{s['seq']} {s['key']} ({s['kind']})")
            if not yes:
                self.stdout.write("preview only: add --yes to create the fork")
                return
            fork = fork_run(run_id, step, user, reason)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(str(fork.pk))
