from django.core.management.base import BaseCommand, CommandError

from runs.errors import StepguardError
from runs.operations import retry_run


class Command(BaseCommand):
    help = "Retry a failed run from the top: completed steps are reused, the failed one runs."

    def add_arguments(self, parser):
        parser.add_argument("run_id")
        parser.add_argument("--user", required=True)
        parser.add_argument("--reason", required=True)

    def handle(self, *args, run_id, user, reason, **options):
        try:
            run = retry_run(run_id, user, reason)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"run {run.pk}: attempt {run.attempt} scheduled")
