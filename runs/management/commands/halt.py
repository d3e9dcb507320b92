from django.core.management.base import CommandError

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import add_target_arguments, target_from
from runs.operations import halt


class Command(StepguardCommand):
    help = "Halt a run (and its children), a workflow, or everything. Only unhalt clears it."
    action = staticmethod(halt)
    verb = "halted"

    def add_arguments(self, parser):
        add_target_arguments(parser)

    def handle(self, *args, **options):
        try:
            target = self.action(target_from(options), options["user"], options["reason"])
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{target.label}: {self.verb} by {options['user']}")
