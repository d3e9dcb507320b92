"""`stepguard serve`: the dashboard, the API and the live feed, served by daphne."""

import os

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Serve the dashboard, the API and the websocket feed with daphne (ASGI)."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("STEPGUARD_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8000)))
        parser.add_argument(
            "--no-static",
            action="store_true",
            help="leave /static/ to a proxy in front (after collectstatic); by default it is "
            "served from the installed packages",
        )
        parser.add_argument("--access-log", metavar="FILE", help="one line per request, here")
        parser.add_argument(
            "--proxy-headers",
            action="store_true",
            help="take the client address from X-Forwarded-For (behind a proxy that sets it)",
        )

    def handle(self, *args, host, port, no_static, access_log, proxy_headers, **options):
        # Read when the ASGI application is built, which daphne does below.
        settings.SERVE_STATIC = not no_static
        from daphne.cli import CommandLineInterface

        argv = ["-b", host, "-p", str(port), "-v", str(options["verbosity"])]
        if access_log:
            argv += ["--access-log", access_log]
        if proxy_headers:
            argv += ["--proxy-headers"]
        CommandLineInterface().run([*argv, "controlplane.asgi:application"])
