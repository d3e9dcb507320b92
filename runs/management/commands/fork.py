import json

from django.core.management.base import CommandError

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import run_arg
from runs.operations import fork_preview, fork_run


class Command(StepguardCommand):
    help = (
        "Fork a run from a step: a new run that reuses the recorded outputs before it and runs "
        "the rest again. Prints the steps that will run again; --yes to create the fork."
    )

    def add_arguments(self, parser):
        parser.add_argument("run_id", type=run_arg, help="a run id, or its first characters")
        parser.add_argument("--from-step", required=True, help="a step key, or a position")
        parser.add_argument("--user", required=True)
        parser.add_argument("--reason", required=True)
        parser.add_argument("--input", help="a replacement run input, as JSON")
        parser.add_argument(
            "--output",
            action="append",
            default=[],
            metavar="STEP=JSON",
            help="replace the recorded output of a step before the fork point (repeatable)",
        )
        parser.add_argument("--yes", action="store_true", help="create it (default: preview)")

    def handle(self, *args, run_id, from_step, user, reason, yes, input, output, **options):
        step = int(from_step) if from_step.isdigit() else from_step
        edits = {} if input is None else {"input": parse(input, "--input")}
        outputs = {}
        for item in output:
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise CommandError(f"--output takes STEP=JSON, not {item!r}")
            outputs[key] = parse(text, f"--output {key}")
        try:
            again = fork_preview(run_id, step, outputs=outputs or None, **edits)
            for s in again:
                if s["asked_again"]:
                    why = f"#{s['seq']} {s['key']}: {s['asked_again']}"
                    self.stdout.write(f"  asks approval again: {why}")
                else:
                    self.stdout.write(f"  will run again: #{s['seq']} {s['key']} ({s['kind']})")
            if not yes:
                self.stdout.write("preview only: add --yes to create the fork")
                return
            fork = fork_run(run_id, step, user, reason, outputs=outputs or None, **edits)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(str(fork.pk))


def parse(text: str, option: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CommandError(f"{option} is not JSON: {exc}") from None
