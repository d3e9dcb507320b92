from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """Human approvals: of side-effecting steps, and of what happened to an ambiguous one."""

    name = "approvals"
    default_auto_field = "django.db.models.BigAutoField"
