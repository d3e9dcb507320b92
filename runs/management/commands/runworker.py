import logging
import os
import signal
import subprocess
import sys
import time

from django.conf import settings
from django.core.management.base import CommandError

from runs import logcontext, notifications, partitions, retention, schedules, summary
from runs.engine import registry, unheld
from runs.engine.worker import Chore, WorkerProcess
from runs.management.base import StepguardCommand

log = logging.getLogger("stepguard.worker")


def chores() -> list[Chore]:
    """What a worker process does besides its runs, each described by the module that owns it:
    firing schedules (between claims), notification deliveries, on PostgreSQL the coming
    months' history partitions, when STEPGUARD_RETENTION_DAYS is set the daily prune, and the
    sweep that resumes halted runs no hold covers."""
    found = [
        schedules.chore(),
        notifications.chore(),
        partitions.chore(),
        summary.chore(),
        retention.chore(),
        unheld.chore(),
    ]
    return [chore for chore in found if chore is not None]


class Command(StepguardCommand):
    help = "Run a worker: claim runnable runs, execute their steps, heartbeat their leases."

    def add_arguments(self, parser):
        self.add_import_option(parser)
        parser.add_argument("--concurrency", type=int, default=4, help="runs executed at once")
        parser.add_argument("--lease-seconds", type=float, default=None)
        parser.add_argument("--poll-interval", type=float, default=None)
        parser.add_argument("--grace", type=float, default=None, help="SIGTERM grace, seconds")
        parser.add_argument(
            "--processes",
            type=int,
            default=1,
            help="worker processes on this host, each with --concurrency threads (one Python "
            "process uses one core); a supervisor restarts one that dies",
        )

    def handle(
        self, *args, modules, concurrency, lease_seconds, poll_interval, grace, processes, **options
    ):
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        if processes < 1:
            raise CommandError("--processes must be at least 1")
        if lease_seconds is not None and lease_seconds < 1:
            raise CommandError("--lease-seconds must be at least 1")
        try:
            self.import_workflows(modules)
            worker = WorkerProcess(
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                poll_interval=poll_interval,
                grace=grace,
                chores=chores(),
            )
        except (ImportError, registry.UnknownWorkflow) as exc:
            raise CommandError(str(exc)) from None
        if options["verbosity"] > 0:
            logging.getLogger("stepguard").setLevel(logging.INFO)
        if processes > 1:
            raise SystemExit(Supervisor(processes, self.stdout).run())

        def on_signal(signum, frame):
            if worker.stopping.is_set():
                worker.grace = 0  # a second signal: release everything now
            worker.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        logcontext.process_worker = str(worker.id)  # named on every line of this process
        # With LOG_FORMAT=json every line of the process is a JSON object, these two as well.
        say = log.info if settings.LOG_FORMAT == "json" else self.stdout.write
        say(
            f"worker {worker.id} pid {os.getpid()} serving "
            f"{', '.join(worker.workflows)} (concurrency {concurrency})"
        )
        self.stdout.flush()
        worker.run_forever()
        say(f"worker {worker.id} stopped")


#: A child that exits on its own this soon after its start is misconfigured, not unlucky.
EARLY_EXIT_SECONDS = 10.0


def child_argv(argv: list[str]) -> list[str]:
    """This command line for a child: `--processes=1` last, which wins over any earlier (or
    abbreviated) `--processes`."""
    return [sys.executable, *argv, "--processes=1"]


class Supervisor:
    """`runworker --processes N`: N worker processes, so one host uses all its cores.

    Each child is an ordinary worker (its own Worker row, leases, heartbeats); claims are
    exclusive in the database, so they share the queue like workers on different hosts. A
    signal is passed on to every child (a second one still means "release everything now").
    A child that dies is restarted, unless it exits on its own within EARLY_EXIT_SECONDS of
    starting (a bad setting or import): then all stop and its exit status is returned.
    """

    def __init__(self, processes: int, out):
        self.processes = processes
        self.out = out
        self.argv = child_argv(sys.argv)
        self.children: dict[int, tuple[subprocess.Popen, float]] = {}
        self.stopping = False

    def say(self, message: str) -> None:
        self.out.write(message)
        self.out.flush()

    def start_child(self) -> None:
        # A session of its own: a terminal's Ctrl-C (or a service manager signalling the
        # whole group) reaches the children once, through the supervisor, not twice, which
        # they would take as "release everything now".
        child = subprocess.Popen(self.argv, start_new_session=True)
        self.children[child.pid] = (child, time.monotonic())

    def on_signal(self, signum, frame) -> None:
        self.stopping = True
        for child, _ in self.children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.say(f"supervisor pid {os.getpid()}: starting {self.processes} worker processes")
        for _ in range(self.processes):
            self.start_child()
        status = 0
        while self.children:
            try:
                pid, raw = os.wait()
            except ChildProcessError:
                break
            entry = self.children.pop(pid, None)
            if entry is None:
                continue
            code = os.waitstatus_to_exitcode(raw)
            entry[0].returncode = code
            if self.stopping:
                continue
            if code > 0 and time.monotonic() - entry[1] < EARLY_EXIT_SECONDS:
                self.say(f"worker process {pid} exited with {code} at start; stopping all")
                status = code
                self.on_signal(signal.SIGTERM, None)
                continue
            self.say(f"worker process {pid} ended ({code}); starting another")
            self.start_child()
        self.say("supervisor stopped")
        return status
