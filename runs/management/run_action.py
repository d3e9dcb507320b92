"""The shape shared by the commands that act on one run with a user and a reason."""

from django.core.management.base import CommandError

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import run_arg


class RunActionCommand(StepguardCommand):
    def add_arguments(self, parser):
        parser.add_argument("run_id", type=run_arg, help="a run id, or its first characters")
        parser.add_argument("--user", required=True)
        parser.add_argument("--reason", required=True)

    def act(self, run_id, user, reason):  # pragma: no cover - each command defines it
        raise NotImplementedError

    def done(self, run) -> str:
        return f"run {run.pk}: {run.status}"

    def handle(self, *args, run_id, user, reason, **options):
        try:
            run = self.act(run_id, user, reason)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(self.done(run))
