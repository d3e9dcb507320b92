import argparse

from django.core.management.base import CommandError

from runs.engine.budget import plain_usd
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.management.targets import add_target_arguments, target_from
from runs.operations import KEEP, set_budget


def amount(text: str):
    """USD as the API and the dashboard take it (runs.engine.budget.plain_usd), or 'none'.
    An ArgumentTypeError is argparse's usage error; anything else was a traceback."""
    if text.lower() == "none":
        return None
    try:
        return plain_usd(text, "the budget")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'none')") from None


def count(text: str):
    if text.lower() == "none":
        return None
    if not (text.isascii() and text.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens (or 'none')")
    return int(text)


class Command(StepguardCommand):
    help = (
        "Set budgets: a run's own (--usd/--tokens), a workflow's, a label value's (--label "
        "tenant=acme) or the global shared daily budget (--usd/--tokens), and a workflow's or "
        "the global default per-run budget (--run-usd/--run-tokens). "
        "'none' removes a limit. Runs paused over budget resume and re-check."
    )

    def add_arguments(self, parser):
        add_target_arguments(parser, labels=True)
        parser.add_argument("--usd", type=amount, default=KEEP)
        parser.add_argument("--tokens", type=count, default=KEEP)
        parser.add_argument("--run-usd", type=amount, default=KEEP)
        parser.add_argument("--run-tokens", type=count, default=KEEP)

    def handle(self, *args, **options):
        limits = {k: options[k] for k in ("usd", "tokens", "run_usd", "run_tokens")}
        if all(v is KEEP for v in limits.values()):
            raise CommandError("give at least one of --usd, --tokens, --run-usd, --run-tokens")
        try:
            target = target_from(options)
            changes = set_budget(target, options["user"], options["reason"], **limits)
        except (StepguardError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{target.label}: budget set {changes}")
