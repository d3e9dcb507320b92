"""The `--run ID | --workflow NAME | --all` choice shared by the operator commands."""

from django.core.management.base import CommandError

from runs.operations import Target


def add_target_arguments(parser) -> None:
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--run", metavar="ID")
    group.add_argument("--workflow", metavar="NAME")
    group.add_argument("--all", action="store_true", help="everything (the kill switch)")
    parser.add_argument("--user", required=True, help="the person acting (a username)")
    parser.add_argument("--reason", required=True)


def target_from(options) -> Target:
    if options["run"]:
        return Target("run", options["run"])
    if options["workflow"]:
        return Target("workflow", options["workflow"])
    if options["all"]:
        return Target("all")
    raise CommandError("name a target: --run ID, --workflow NAME or --all")
