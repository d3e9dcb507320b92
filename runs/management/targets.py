"""What the operator commands share: a run named by its id or the start of it (`run_arg`), and
the `--run ID | --workflow NAME | --all` choice."""

import argparse
from uuid import UUID

from django.core.management.base import CommandError

from runs.models import Run
from runs.operations import Target
from runs.queries import id_prefix


def run_arg(value: str) -> str:
    """An argparse type: a run's whole id, or the start of it (the 8 characters the pages and
    the dashboard's search use) if that names exactly one run, found by index."""
    try:
        return str(UUID(value))
    except ValueError:
        pass
    found = list(Run.objects.filter(id_prefix(value)).values_list("pk", flat=True)[:2])
    if len(found) == 1:
        return str(found[0])
    if found:
        raise argparse.ArgumentTypeError(f"more than one run's id starts with {value!r}")
    raise argparse.ArgumentTypeError(f"no run with id {value!r}")


def add_target_arguments(parser, *, labels: bool = False) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--run", metavar="ID", type=run_arg, help="a run id, or its start")
    group.add_argument("--workflow", metavar="NAME")
    if labels:
        group.add_argument(
            "--label", metavar="NAME=VALUE", help="the runs of one label value (tenant=acme)"
        )
    group.add_argument("--all", action="store_true", help="everything (the kill switch)")
    parser.add_argument("--user", required=True, help="the person acting (a username)")
    parser.add_argument("--reason", required=True)


def target_from(options) -> Target:
    if options["run"]:
        return Target("run", options["run"])
    if options["workflow"]:
        return Target("workflow", options["workflow"])
    if options.get("label"):
        return Target("label", options["label"])
    if options["all"]:
        return Target("all")
    raise CommandError("name a target: --run ID, --workflow NAME or --all")
