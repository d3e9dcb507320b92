"""`make run`: one process group with the web server, a worker and the demo agents.

Ctrl-C stops everything it started.
"""

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from examples.models import Booking, Effect
from runs.management.commands.showrun import describe
from runs.models import Event
from runs.sdk import start_run

ROOT = Path(settings.BASE_DIR)
DEMO_USER = "demo"


class Command(BaseCommand):
    help = "Run the demo: migrate, create a demo operator, start the web server, a worker, agents."

    def add_arguments(self, parser):
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
        parser.add_argument("--no-agents", action="store_true", help="start no demo runs")

    def handle(self, *args, port: int, no_agents: bool, **options):
        call_command("migrate", verbosity=0)
        password = self.demo_operator()
        children = self.start_children(port)
        self.stdout.write(
            self.style.SUCCESS(f"\nStepguard is up on http://127.0.0.1:{port}/admin/")
            + f"\n  demo operator: {DEMO_USER} / {password}\n  Ctrl-C stops everything.\n"
        )
        try:
            if not no_agents:
                self.demo_flight()
            while all(child.poll() is None for child in children):
                time.sleep(0.5)
            self.stderr.write("a child process exited; stopping the rest")
        except KeyboardInterrupt:
            self.stdout.write("\nstopping...")
        finally:
            self.stop(children)

    def demo_operator(self) -> str:
        """A fresh password each start, printed once; the account is a superuser for the demo."""
        user, _ = get_user_model().objects.get_or_create(username=DEMO_USER)
        password = secrets.token_urlsafe(12)
        user.set_password(password)
        user.is_staff = user.is_superuser = True
        user.save()
        return password

    def start_children(self, port: int) -> list[subprocess.Popen]:
        env = {**os.environ, "SERVE_STATIC": "1"}
        python = sys.executable
        web = [python, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port)]
        worker = [python, "manage.py", "runworker", "--import", "examples.flight_booking"]
        return [
            subprocess.Popen([*web, "controlplane.asgi:application"], cwd=ROOT, env=env),
            subprocess.Popen([*worker, "--poll-interval", "0.25"], cwd=ROOT, env=env),
        ]

    def stop(self, children: list[subprocess.Popen]) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()

    def demo_flight(self) -> None:
        import examples.flight_booking  # noqa: F401  (registers the workflow here too)

        run = start_run(
            "flight-booking",
            {"from": "LIS", "to": "BER", "date": "2026-12-24", "passenger": "Ada Lovelace"},
        )
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
            return
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
        self.stdout.write(f"  see it: python manage.py showrun {run.id}   (or the admin)")
