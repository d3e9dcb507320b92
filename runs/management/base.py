"""The base of Stepguard's own commands."""

from django.core.management.base import BaseCommand


class StepguardCommand(BaseCommand):
    """Without Django's system checks before each command: they import every URLconf, view and
    API schema, 0.3 s of a one-second `showrun`, and 0.4 s of a worker's start, for pages these
    commands never serve. `manage.py check --deploy`, `migrate` and the web server run them."""

    requires_system_checks: list[str] = []
