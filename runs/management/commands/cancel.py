from django.core.management.base import BaseCommand, CommandError

from runs.errors import StepguardError
from runs.operations import cancel_run


class Command(BaseCommand):
    help = "Cancel a run: it stops at its next step, its compensations run, it ends cancelled."

    def add_arguments(self, parser):
        parser.add_argument("run_id")
        parser.add_argument("--user", required=True)
        parser.add_argument("--reason", required=True)

    def handle(self, *args, run_id, user, reason, **options):
        try:
            run = cancel_run(run_id, user, reason)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        state = "cancelled" if run.status == "cancelled" else "cancel requested"
        self.stdout.write(f"run {run.pk}: {state}")
