import logging
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from runs import logcontext
from runs.engine import registry
from runs.engine.worker import WorkerProcess

log = logging.getLogger("stepguard.worker")


class Command(BaseCommand):
    help = "Run a worker: claim runnable runs, execute their steps, heartbeat their leases."

    def add_arguments(self, parser):
        parser.add_argument(
            "--import",
            dest="modules",
            action="append",
            default=[],
            metavar="MODULE",
            help="workflow module to import (repeatable; STEPGUARD_WORKFLOW_MODULES adds more)",
        )
        parser.add_argument("--concurrency", type=int, default=4, help="runs executed at once")
        parser.add_argument("--lease-seconds", type=float, default=None)
        parser.add_argument("--poll-interval", type=float, default=None)
        parser.add_argument("--grace", type=float, default=None, help="SIGTERM grace, seconds")

    def handle(self, *args, modules, concurrency, lease_seconds, poll_interval, grace, **options):
        if concurrency < 1:
            raise CommandError("--concurrency must be at least 1")
        if lease_seconds is not None and lease_seconds < 1:
            raise CommandError("--lease-seconds must be at least 1")
        try:
            registry.import_modules([*settings.STEPGUARD_WORKFLOW_MODULES, *modules])
            worker = WorkerProcess(
                concurrency=concurrency,
                lease_seconds=lease_seconds,
                poll_interval=poll_interval,
                grace=grace,
            )
        except (ImportError, registry.UnknownWorkflow) as exc:
            raise CommandError(str(exc)) from None
        if options["verbosity"] > 0:
            logging.getLogger("stepguard").setLevel(logging.INFO)

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
            f"worker {worker.id} pid {__import__('os').getpid()} serving "
            f"{', '.join(worker.workflows)} (concurrency {concurrency})"
        )
        self.stdout.flush()
        worker.run_forever()
        say(f"worker {worker.id} stopped")
