from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """Human approvals: of side-effecting steps, and of what happened to an ambiguous one.

    Part of the `runs` package, since the engine writes approval requests in the transaction
    that enters a wait and an approval's decision locks and wakes its run: one component, not
    two packages importing each other. Its label stays `approvals`: its tables
    (`approvals_approvalrequest`), migrations and permissions
    (`approvals.decide_approvalrequest`) are those it always had."""

    name = "runs.approvals"
    label = "approvals"
    default_auto_field = "django.db.models.BigAutoField"
