from django.apps import AppConfig


class ExamplesConfig(AppConfig):
    """Demo agents and the stand-in outside world they talk to (an airline, a notifier)."""

    name = "examples"
    default_auto_field = "django.db.models.BigAutoField"
