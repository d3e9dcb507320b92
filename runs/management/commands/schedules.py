"""`manage.py schedules add|list|pause|resume|remove`: cron schedules (docs/flow-control.md)."""

import json

from django.core.management.base import CommandError
from django.utils import timezone

from runs import operations
from runs.errors import StepguardError
from runs.management.base import StepguardCommand
from runs.models import Catchup, Overlap, Schedule


class Command(StepguardCommand):
    help = "Add, list, pause, resume and remove cron schedules: one run per tick."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add", help="create or replace a schedule")
        add.add_argument("name")
        add.add_argument("--workflow", required=True)
        add.add_argument("--cron", required=True, help="5 fields, or 6 with seconds first")
        add.add_argument("--timezone", default="UTC", help="an IANA name (default UTC)")
        add.add_argument("--input", default="null", help="JSON given to each run")
        add.add_argument("--catchup", choices=Catchup.values, default=Catchup.SKIP)
        add.add_argument("--catchup-limit", type=int, default=10, help="for --catchup all")
        add.add_argument("--catchup-window", type=int, default=None,
                         help="seconds a tick may be late and still fire")  # fmt: skip
        add.add_argument("--overlap", choices=Overlap.values, default=Overlap.SKIP,
                         help="a tick while the last run is open (default skip)")  # fmt: skip
        add.add_argument("--paused", action="store_true")
        self.add_import_option(add)
        sub.add_parser("list", help="every schedule with its next fire time")
        for action in ("pause", "resume", "remove"):
            one = sub.add_parser(action)
            one.add_argument("name")
        for one in sub.choices.values():
            if one.prog.split()[-1] != "list":
                one.add_argument("--user", required=True, help="the person acting")

    def handle(self, *args, action, **options):
        try:
            getattr(self, f"_{action}")(options)
        except (ImportError, StepguardError) as exc:
            raise CommandError(str(exc)) from None

    def _add(self, options):
        self.import_workflows(options["modules"])
        try:
            data = json.loads(options["input"])
        except json.JSONDecodeError as exc:
            raise CommandError(f"--input is not JSON: {exc}") from None
        schedule = operations.save_schedule(
            options["user"], options["name"], workflow=options["workflow"],
            cron=options["cron"], timezone_name=options["timezone"], input=data,
            catchup=options["catchup"], catchup_limit=options["catchup_limit"],
            catchup_window=options["catchup_window"], overlap=options["overlap"],
            paused=options["paused"],
        )  # fmt: skip
        self.stdout.write(f"saved {self._line(schedule)}")

    def _list(self, options):
        found = Schedule.objects.order_by("name")
        for schedule in found:
            self.stdout.write(self._line(schedule))
        if not found:
            self.stdout.write("no schedules")

    def _pause(self, options):
        schedule = operations.pause_schedule(options["user"], options["name"], True)
        self.stdout.write(f"paused {self._line(schedule)}")

    def _resume(self, options):
        schedule = operations.pause_schedule(options["user"], options["name"], False)
        self.stdout.write(f"resumed {self._line(schedule)}")

    def _remove(self, options):
        operations.remove_schedule(options["user"], options["name"])
        self.stdout.write(f"removed schedule {options['name']}")

    @staticmethod
    def _line(s: Schedule) -> str:
        state = (
            "paused"
            if s.paused
            else f"next {timezone.localtime(s.next_fire_at):%Y-%m-%d %H:%M:%S %Z}"
        )
        return (
            f"{s.name}: {s.workflow} at '{s.cron}' ({s.timezone}), catch-up {s.catchup}, "
            f"overlap {s.overlap}, "
            f"{state} [{s.source}]"
        )
