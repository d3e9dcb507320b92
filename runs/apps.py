from django.apps import AppConfig


class RunsConfig(AppConfig):
    name = "runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from controlplane import security  # noqa: F401  (login stamps, lockout audit events)
        from runs import notifications  # noqa: F401  (registers the built-in stepguard.notify)
        from runs.logcontext import log_event

        post_save.connect(log_event, sender="runs.Event", dispatch_uid="stepguard-log-event")
