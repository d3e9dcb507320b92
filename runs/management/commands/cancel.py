from runs.management.run_action import RunActionCommand
from runs.operations import cancel_run


class Command(RunActionCommand):
    help = "Cancel a run: it stops at its next step, its compensations run, it ends cancelled."

    def act(self, run_id, user, reason):
        return cancel_run(run_id, user, reason)

    def done(self, run) -> str:
        state = "cancelled" if run.status == "cancelled" else "cancel requested"
        return f"run {run.pk}: {state}"
