from django.core.management.base import CommandError

from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import run_arg
from runs.operations import bulk


def filter_arg(value: str) -> tuple[str, str]:
    name, sep, wanted = value.partition("=")
    if not sep or not name:
        raise CommandError(f"--filter {value!r}: write NAME=VALUE (status=failed)")
    return name.strip(), wanted.strip()


class Command(StepguardCommand):
    help = (
        "Halt, cancel or retry many runs: by id, or every run matching the runs list's filters "
        f"(at most {bulk.BULK_MAX}). Each run is acted on as alone; refused ones say why."
    )

    def add_arguments(self, parser):
        parser.add_argument("action", choices=sorted(bulk.ACTIONS))
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument(
            "--ids", nargs="+", type=run_arg, metavar="ID", help="run ids, or their starts"
        )
        which.add_argument(
            "--filter",
            action="append",
            metavar="NAME=VALUE",
            help=f"a runs list filter ({', '.join(bulk.FILTERS)}); repeat for more",
        )
        parser.add_argument("--user", required=True, help="the person acting (a username)")
        parser.add_argument("--reason", required=True)
        parser.add_argument(
            "--yes",
            action="store_true",
            help=f"act on more than {bulk.CONFIRM_ABOVE} runs (else the count is only shown)",
        )

    def handle(self, *args, action, ids, filter, user, reason, yes, **options):
        filters = dict(filter_arg(f) for f in filter) if filter else None
        try:
            bulk.allowed(action, user)
            run_ids = bulk.select(ids=ids, filters=filters)
            if len(run_ids) > bulk.CONFIRM_ABOVE and not yes:
                raise CommandError(
                    f"{len(run_ids)} runs match: run it again with --yes to {action} them"
                )
            result = bulk.apply(action, run_ids, user, reason)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        for outcome in result.outcomes:
            said = "done" if outcome.ok else f"refused: {outcome.message}"
            self.stdout.write(f"run {outcome.run_id}: {said}")
        self.stdout.write(f"{action}: {result.done} of {len(result.outcomes)} runs")
        if result.refused:
            raise CommandError(f"{len(result.refused)} of {len(result.outcomes)} runs refused")
