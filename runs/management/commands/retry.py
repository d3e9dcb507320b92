from runs.management.run_action import RunActionCommand
from runs.operations import retry_run


class Command(RunActionCommand):
    help = "Retry a failed run from the top: completed steps are reused, the failed one runs."

    def act(self, run_id, user, reason):
        return retry_run(run_id, user, reason)

    def done(self, run) -> str:
        return f"run {run.pk}: attempt {run.attempt} scheduled"
