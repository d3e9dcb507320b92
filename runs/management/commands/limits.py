"""`manage.py limits WORKFLOW`: show or set a workflow's concurrency limits."""

from django.core.management.base import CommandError

from runs import operations
from runs.engine import flow
from runs.errors import StepguardError
from runs.management.base import StepguardCommand


def limit(text: str) -> int | str:
    """A positive integer, or "code" to go back to the code's limit."""
    return text if text == "code" else int(text)


def shown(*values) -> str:
    return str(next((v for v in values if v is not None), "unlimited"))


class Command(StepguardCommand):
    help = "Show a workflow's load and limits, or set an operator's limits over the code's."

    def add_arguments(self, parser):
        parser.add_argument("workflow")
        parser.add_argument("--max-running", type=limit, help='N, or "code" for the code\'s')
        parser.add_argument("--per-key", type=limit, help='N, or "code" for the code\'s')
        parser.add_argument("--user", help="the person acting (needed to set)")
        parser.add_argument("--reason", default="", help="why (needed to set)")

    def handle(self, *args, workflow, max_running, per_key, user, reason, **options):
        given = {"max_running": max_running, "max_running_per_key": per_key}
        changes = {k: None if v == "code" else v for k, v in given.items() if v is not None}
        try:
            if changes:
                if not user:
                    raise CommandError("--user is needed to set limits")
                operations.set_limits(workflow, user, reason, **changes)
        except StepguardError as exc:
            raise CommandError(str(exc)) from None
        row = next((r for r in flow.overview() if r["workflow"] == workflow), None)
        if row is None:
            self.stdout.write(f"{workflow}: nothing in flight, no limits")
            return
        code, mine = row["code_limits"], row["operator_limits"]
        most = shown(mine["max_running"], code["max_running"])
        per = shown(mine["max_running_per_key"], code["max_running_per_key"])
        self.stdout.write(
            f"{workflow}: {row['running']} running, {row['queued']} queued, "
            f"{row['waiting']} waiting; at most {most} running, {per} per key"
        )
        for key in row["keys"]:
            self.stdout.write(f"  {key['key']}: {key['running']} running, {key['queued']} queued")
