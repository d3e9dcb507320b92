import json

from django.core.management.base import CommandError

from runs.labels import parse as parse_labels
from runs.management.base import StepguardCommand
from runs.sdk import StepguardError, start_run


class Command(StepguardCommand):
    help = "Start a run of a workflow and print its id (idempotent with --key)."

    def add_arguments(self, parser):
        parser.add_argument("name", help="workflow name")
        parser.add_argument("--input", default="null", help="input as JSON (default null)")
        parser.add_argument("--key", default=None, help="idempotency key for the run")
        parser.add_argument(
            "--label", dest="labels", action="append", default=[], metavar="NAME=VALUE",
            help="who the run is for (tenant=acme); repeat for more",
        )  # fmt: skip
        parser.add_argument("--workflow-version", dest="wf_version", default=None)
        self.add_import_option(parser)

    def handle(self, *args, name, input, key, wf_version, modules, labels, **options):
        try:
            data = json.loads(input)
        except json.JSONDecodeError as exc:
            raise CommandError(f"--input is not valid JSON: {exc}") from None
        try:
            self.import_workflows(modules)
            run = start_run(name, data, key=key, version=wf_version, labels=parse_labels(labels))
        except (ImportError, StepguardError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        if not run.was_created:
            self.stderr.write(f"a run with key {key!r} already exists; not starting another")
        self.stdout.write(str(run.id))
