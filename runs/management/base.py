"""The base of Stepguard's own commands."""

import argparse

from django.conf import settings
from django.core.management.base import BaseCommand

from runs.engine import registry


class StepguardCommand(BaseCommand):
    """Without Django's system checks before each command: they import every URLconf, view and
    API schema, 0.3 s of a one-second `showrun`, and 0.4 s of a worker's start, for pages these
    commands never serve. `manage.py check --deploy`, `migrate` and the web server run them."""

    requires_system_checks: list[str] = []

    @staticmethod
    def add_import_option(parser: argparse.ArgumentParser) -> None:
        """`--import M`, repeatable: the commands that run or replay workflow code load it the
        same way a worker does."""
        parser.add_argument(
            "--import",
            dest="modules",
            action="append",
            default=[],
            metavar="MODULE",
            help="workflow module to import (repeatable; STEPGUARD_WORKFLOW_MODULES adds more)",
        )

    @staticmethod
    def import_workflows(modules: list[str]) -> None:
        """The configured workflow modules, then those named on the command line; an
        ImportError names the module that failed."""
        registry.import_modules([*settings.STEPGUARD_WORKFLOW_MODULES, *modules])
