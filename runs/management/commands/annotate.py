from django.core.management.base import CommandError

from runs.annotations import annotate
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import run_arg


class Command(StepguardCommand):
    help = (
        "Mark a run, or one of its steps, good or bad, or leave a note: as the dashboard and "
        "POST /api/runs/{id}/annotations do (needs runs.annotate_run: operators, approvers)."
    )

    def add_arguments(self, parser):
        parser.add_argument("run_id", type=run_arg, help="a run id, or its first characters")
        parser.add_argument("--user", required=True, help="who marks it")
        verdict = parser.add_mutually_exclusive_group(required=True)
        verdict.add_argument("--good", dest="verdict", action="store_const", const="good")
        verdict.add_argument("--bad", dest="verdict", action="store_const", const="bad")
        verdict.add_argument(
            "--note-only", dest="verdict", action="store_const", const="note",
            help="a note without a verdict (give --note)",
        )  # fmt: skip
        parser.add_argument("--note", default="", help="what the person noticed")
        parser.add_argument("--step", help="the step's key or position (default: the run)")

    def handle(self, *args, run_id, user, verdict, note, step, **options):
        try:
            made = annotate(run_id, user, verdict=verdict, note=note, step=step)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        where = f"step {made.step_key} ({made.step_seq})" if made.step_key else "the run"
        self.stdout.write(f"run {run_id}: {where} marked {made.verdict} by {made.by_name}")
