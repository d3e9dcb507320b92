"""What the stand-alone server enforces beyond Django's defaults and the app's own
(runs/security.py): HTTPS, except for someone at this host, and a Permissions-Policy. The
Content-Security-Policy is django-csp (Django's own on Django 6)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.middleware.security import SecurityMiddleware as DjangoSecurityMiddleware

# Where these lived before they moved into the app: a host's settings may still name them so.
from runs.security import RefuseNul, SessionTimeouts, locked_out  # noqa: F401

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "[::1]"}


def on_loopback(request: HttpRequest) -> bool:
    """A request from this very host to a loopback name of it: someone at the machine."""
    peer = request.META.get("REMOTE_ADDR", "")
    host = request.META.get("HTTP_HOST", "").lower()
    name = host.partition("]")[0] + "]" if host.startswith("[") else host.partition(":")[0]
    return peer in ("127.0.0.1", "::1") and name in _LOOPBACK_HOSTS


class SecurityMiddleware(DjangoSecurityMiddleware):
    """Django's, but plain HTTP from this host to 127.0.0.1 or localhost is not sent to
    https:// (SECURE_SSL_REDIRECT): `stepguard serve` tried on the machine it runs on met a
    redirect to a TLS nobody serves. Browsers keep Secure cookies for loopback origins, so
    logging in works there. Anyone else, or a proxy passing another Host, is redirected."""

    def process_request(self, request):
        if on_loopback(request):
            return None
        return super().process_request(request)


class PermissionsPolicy:
    """No page of a control plane needs a camera, a microphone, a location or payments."""

    VALUE = "camera=(), microphone=(), geolocation=(), payment=(), usb=(), interest-cohort=()"

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.setdefault("Permissions-Policy", self.VALUE)
        return response
