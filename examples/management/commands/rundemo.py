"""`make run`: the web server, a worker, the demo model and the demo agents, in one process
group. Ctrl-C stops everything it started."""

import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from controlplane import devenv
from examples.models import Booking, Effect
from runs.approvals.models import ApprovalRequest, ApprovalStatus
from runs.errors import Conflict
from runs.management.commands.showrun import describe
from runs.models import Event, Run, Step, StepStatus
from runs.operations import halt
from runs.sdk import start_run

ROOT = Path(settings.BASE_DIR)
DEMO_USER = "demo"


class Command(BaseCommand):
    help = "Run the demo: web server, worker, demo model and agents (make run)."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
        parser.add_argument("--no-agents", action="store_true", help="start no demo runs")

    def handle(self, *args, port: int, no_agents: bool, **options):
        call_command("migrate", verbosity=0)
        # A second terminal's manage.py reads these, so the commands printed below work there.
        devenv.write({"DJANGO_SETTINGS_MODULE": os.environ["DJANGO_SETTINGS_MODULE"], "DEBUG": "1"})
        password = self.demo_operator()
        self.model_server()
        self.logs = Path(settings.VAR_DIR) / "log"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.children: list[subprocess.Popen] = [self.web(port), self.worker()]
        self.names = ["the web server (daphne)", "the worker"]
        port = self.port = self.served()
        self.stdout.write(
            self.style.SUCCESS(f"\nStepguard is up on http://127.0.0.1:{port}/")
            + f"\n  dashboard: http://127.0.0.1:{port}/  (admin: /admin/, API: /api/docs)"
            + f"\n  server and access logs: {self.logs}/"
            + f"\n  demo operator: {DEMO_USER} / {password}"
            + f"\n  model: {os.environ['STEPGUARD_MODEL_BASE_URL']}"
            + (" (the scripted demo model, not a language model)" if self.demo else "")
            + "\n  Ctrl-C stops everything.\n"
        )
        try:
            if not no_agents:
                self.demo_agents()
            while all(child.poll() is None for child in self.children):
                time.sleep(0.5)
            self.stderr.write(self.exited())
        except KeyboardInterrupt:
            self.stdout.write("\nstopping...")
        finally:
            self.stop()

    # -- processes -------------------------------------------------------------------------------

    def demo_operator(self) -> str:
        """The demo operator's password, the same on every start with this database (a browser
        that saved it keeps working): kept in VAR_DIR (mode 0600) and reused while it still
        logs the account in; otherwise a new one. The account is a superuser for the demo."""
        user, _ = get_user_model().objects.get_or_create(username=DEMO_USER)
        kept = Path(settings.VAR_DIR) / "demo-operator-password"
        password = kept.read_text().strip() if kept.exists() else ""
        if not (password and user.check_password(password)):
            password = secrets.token_urlsafe(12)
            user.set_password(password)
            kept.parent.mkdir(parents=True, exist_ok=True)
            kept.touch(mode=0o600)
            kept.write_text(password + "\n")
        user.is_staff = user.is_superuser = True
        user.save()
        return password

    def model_server(self) -> None:
        self.demo = not os.environ.get("STEPGUARD_MODEL_BASE_URL")
        if self.demo:
            from examples.model_server import serve

            server, _ = serve()
            os.environ["STEPGUARD_MODEL_BASE_URL"] = f"http://127.0.0.1:{server.server_port}/v1"

    def web(self, port: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port)]
        command += ["--access-log", str(self.logs / "access.log")]
        env = {**os.environ, "SERVE_STATIC": "1"}
        self.web_log = self.logs / "web.log"
        with self.web_log.open("w") as out:
            return subprocess.Popen(
                [*command, "controlplane.asgi:application"], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def url(self, run: Run) -> str:
        return f"http://127.0.0.1:{self.port}/runs/{run.pk}"

    def served(self) -> int:
        """The port the web server listens on, once it answers (the summary waits for it)."""
        deadline = time.monotonic() + 60
        port = None
        while time.monotonic() < deadline and self.children[0].poll() is None:
            if port is None:
                found = re.search(r"Listening on TCP address 127\.0\.0\.1:(\d+)",
                                  self.web_log.read_text())  # fmt: skip
                port = int(found.group(1)) if found else None
            if port is not None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/login/", timeout=2):
                        return port
                except urllib.error.HTTPError:
                    return port  # it answers (with settings that refuse this host, say)
                except OSError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise CommandError(f"the web server did not answer; its log: {self.web_log}")

    def exited(self) -> str:
        """Which child ended, how, and where to look."""
        for name, child in zip(self.names, self.children, strict=True):
            code = child.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                where = f" (its log: {self.web_log})" if child is self.children[0] else ""
                return f"{name} {how}{where}; stopping the rest"
        return "a child process exited; stopping the rest"

    def worker(self) -> subprocess.Popen:
        command = [sys.executable, "manage.py", "runworker", "--import", "examples.demo"]
        options = ["--poll-interval", "0.25", "--lease-seconds", "3", "--verbosity", "0"]
        return subprocess.Popen([*command, *options], cwd=ROOT, env={**os.environ})

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()

    # -- the demo --------------------------------------------------------------------------------

    def wait(self, condition, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.2)
        self.stdout.write(self.style.WARNING(f"demo: gave up after {timeout:.0f} s on {what}"))
        return None

    def demo_agents(self) -> None:
        import examples.demo  # noqa: F401  (registers the demo workflows here too)

        earlier = Run.objects.filter(key__startswith="demo:", parent__isnull=True)
        if earlier.exists():  # a second `make run`: the first one's runs, not a second set
            self.stdout.write(
                "The demo runs of an earlier `make run` are kept (delete var/ for new ones):"
            )
            for run in earlier.order_by("created_at"):
                name = f"{run.workflow}@{run.version}"
                self.stdout.write(f"  {run.status:<12} {name:<18} {self.url(run)}")
            # Still waiting for a person: the hint the first `make run` printed, again.
            waiting = ApprovalRequest.objects.filter(
                run__key__startswith="demo:", status=ApprovalStatus.PENDING
            ).order_by("pk")
            for request in waiting:
                approve = f"python manage.py approve {request.pk} --user {DEMO_USER}"
                self.stdout.write(f"\n  approve '{request.action}':  {approve}")
            return
        flight = {"from": "LIS", "to": "BER", "date": "2026-12-24", "passenger": "Ada Lovelace"}
        booking = self.demo_flight(flight)
        agent = start_run("flight-booking", flight, version="2", key="demo:agent")
        research = start_run(
            "research", {"topic": "durable execution for AI agents", "delay": 0.15},
            key="demo:research",
        )  # fmt: skip
        orchestrator = start_run(
            "orchestrator", {"subtopics": ["checkpoints", "leases", "budgets"], "pages": 2},
            key="demo:orchestrator",
        )  # fmt: skip
        capped = start_run(
            "outreach",
            {"prospects": [f"lead{i}@example.com" for i in range(6)]},
            budget_usd="0.001",
            key="demo:capped",
        )
        stopped = start_run(
            "outreach",
            key="demo:halted",
            input={"prospects": [f"vip{i}@example.com" for i in range(6)], "pause_seconds": 1},
        )
        # The operator stops the campaign after its first e-mail, before the crash below, which
        # takes long enough on a busy host for the campaign to finish first.
        sent = Step.objects.filter(run=stopped, key__startswith="send", status=StepStatus.COMPLETED)
        if self.wait(sent.exists, "the campaign's first e-mail"):
            try:
                halt(stopped, DEMO_USER, "demo: an operator stops the outreach campaign")
            except Conflict as exc:  # it ended first: say so, the summary shows how it ended
                self.stdout.write(self.style.WARNING(f"demo: could not halt the campaign: {exc}"))
        crash = self.demo_crash(research)
        # Two endings an operator meets: a step that needed three tries, and a failed run to
        # fork (its card expired: the payments API refuses the refund, a final answer). Started
        # after the crash, so the attempts shown are the retry policy's alone.
        retried = start_run("refund", {"order": "A-1001"}, key="demo:refund")
        refused = start_run("refund", {"order": "A-1002"}, key="demo:refused")
        self.wait(
            lambda: (
                all(
                    Run.objects.get(pk=r.pk).status not in ("pending", "running")
                    for r in (agent, orchestrator, capped, stopped, research, retried, refused)
                )
                and Run.objects.get(pk=research.pk).is_terminal
            ),
            "the demo runs to stop running",
            timeout=120,
        )
        rows = [
            (booking, "notify failed once and was retried; booked once"),
            (agent, "the model wants to book: approve it, or reject it (below)"),
            (research, crash),
            (orchestrator, "three research subagents as child runs, then a synthesis"),
            (capped, "paused before the draft that would exceed its $0.001 budget"),
            (stopped, "halted by an operator; only `unhalt` resumes it"),
            (retried, "the mail gateway was down twice; notify went through on attempt 3"),
            (refused, "failed at once: the payments API refused the refund; fork it"),
        ]
        pending = ApprovalRequest.objects.filter(run=agent, status=ApprovalStatus.PENDING)
        request = self.wait(pending.first, "the booking agent's approval request", timeout=60)
        self.stdout.write(self.style.SUCCESS("\nThe demo runs:"))
        for run, note in rows:
            run.refresh_from_db()
            name = f"{run.workflow}@{run.version}"
            self.stdout.write(f"  {run.status:<12} {name:<18} {self.url(run)}  {note}")
        if request:
            approve = f"python manage.py approve {request.pk} --user {DEMO_USER}"
            reject = f"python manage.py reject {request.pk} --user {DEMO_USER} --comment why"
            follow = f"python manage.py showrun {research.pk} --follow"
            self.stdout.write(
                f"\n  approve the booking:  {approve}"
                f"\n  or reject it (the run ends, failed with ApprovalRejected):  {reject}"
                f"\n  follow a run:  {follow}"
            )

    def demo_flight(self, flight: dict) -> Run:
        run = start_run("flight-booking", flight, version="1", key="demo:booking")
        self.stdout.write(f"demo: flight-booking run {run.id}")
        after = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for event in Event.objects.filter(run=run, seq__gt=after).order_by("seq"):
                self.stdout.write("  " + describe(event))
                after = event.seq
            run.refresh_from_db()
            if run.is_terminal:
                break
            time.sleep(0.2)
        if run.status != "completed":
            self.stdout.write(self.style.WARNING(f"demo run is {run.status}: {run.error}"))
            return run
        key = run.steps.get(key="book").idempotency_key
        bookings = Booking.objects.filter(idempotency_key=key).count()
        notify_key = run.steps.get(key="notify").idempotency_key
        notify_calls = Effect.objects.filter(label="notify", idempotency_key=notify_key).count()
        self.stdout.write(
            self.style.SUCCESS(
                f"demo: notify failed on its first attempt and succeeded on attempt "
                f"{notify_calls}; the run completed with {bookings} booking "
                f"({run.output['booking']['reference']}), not booked twice."
            )
        )
        return run

    def demo_crash(self, research: Run) -> str:
        """Kill the worker with SIGKILL in the middle of the research run and start another."""

        def done() -> int:
            return Step.objects.filter(run=research, status=StepStatus.COMPLETED).count()

        if not self.wait(lambda: done() >= 10, "10 research steps", timeout=60):
            return "did not get far enough to crash"
        at = done()
        self.children[1].kill()
        self.children[1].wait()
        self.stdout.write(f"demo: killed the worker (SIGKILL) after step {at} of the research run")
        self.children[1] = self.worker()
        self.wait(
            lambda: Run.objects.get(pk=research.pk).is_terminal,
            "the research run to end after the crash",
            timeout=120,
        )
        resent = Step.objects.filter(run=research, recovered="resent").count()
        self.stdout.write(
            self.style.SUCCESS(
                f"demo: a new worker resumed the research run: {at} completed steps reused, "
                f"{resent} in-flight step re-sent with its idempotency key"
            )
        )
        return f"recovered from a worker crash at step {at}; no completed step ran twice"
