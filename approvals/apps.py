from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """Human approvals of side-effecting steps (arrives with durable waits)."""

    name = "approvals"
    default_auto_field = "django.db.models.BigAutoField"
