"""`stepguard serve`: the dashboard, the API and the live feed, served by daphne."""

import os

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Serve the dashboard, the API and the websocket feed with daphne (ASGI)."
    # Run by handle() once the options are known good: a wrong option is said before anything
    # touches the database (on SQLite, the checks wait on a writer holding the file).
    requires_system_checks: list[str] = []

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
            help="behind a reverse proxy: take the client's address from X-Forwarded-For, "
            "believed only from the proxies in STEPGUARD_TRUSTED_PROXIES (required)",
        )

    def handle(self, *args, host, port, no_static, access_log, proxy_headers, **options):
        # Read when the ASGI application is built, which daphne does below.
        settings.SERVE_STATIC = not no_static
        from daphne.cli import CommandLineInterface

        argv = ["-b", host, "-p", str(port), "-v", str(options["verbosity"])]
        if access_log:
            argv += ["--access-log", access_log]
        # Not daphne's own --proxy-headers: it believes the left-most X-Forwarded-For entry,
        # which the client writes, from anyone. The application reads the header itself, from
        # the proxies in STEPGUARD_TRUSTED_PROXIES only (stand-alone: controlplane/proxy.py).
        if proxy_headers and not settings.STEPGUARD_TRUSTED_PROXIES:
            raise CommandError(
                "--proxy-headers needs STEPGUARD_TRUSTED_PROXIES: the addresses or networks of "
                "the proxies in front (e.g. 127.0.0.1 or 10.0.0.0/8), whose X-Forwarded-For "
                "is believed; anyone else's is the client's own writing"
            )
        application = getattr(settings, "ASGI_APPLICATION", None)
        if not application:
            raise CommandError("serve needs ASGI_APPLICATION: the project's ASGI application")
        self.check()
        self.stdout.write(f"Serving http://{host}:{port}/ (daphne)")
        if settings.SECURE_SSL_REDIRECT:
            # What a first try on a laptop meets: a redirect to an https:// nobody serves.
            self.stdout.write(
                "Production settings: cookies are Secure and plain HTTP is redirected to HTTPS, "
                "but from this host to http://127.0.0.1 or http://localhost (add them to "
                "ALLOWED_HOSTS); from elsewhere, open it through the TLS proxy in front "
                "(docs/deploy.md)."
            )
        self.stdout.flush()
        # The project's application (controlplane.asgi in stand-alone Stepguard), as daphne
        # names it: module:attribute.
        module, _, name = application.rpartition(".")
        CommandLineInterface().run([*argv, f"{module}:{name}"])
