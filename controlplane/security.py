"""What the server enforces beyond Django's defaults: sessions that end, a Permissions-Policy,
throttled API keys, and an audit event for every lockout. Login throttling itself is
django-axes; the Content-Security-Policy is django-csp (Django's own on Django 6)."""

from __future__ import annotations

import logging
import time

from axes.handlers.proxy import AxesProxyHandler
from axes.signals import user_locked_out
from django.conf import settings
from django.contrib.auth import logout
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect

from runs.models import EventType

log = logging.getLogger("stepguard.security")

LOGIN_AT, SEEN_AT = "stepguard_login_at", "stepguard_seen_at"
#: Activity is written to the session at most this often (not on every request).
TOUCH_SECONDS = 60


def session_expired(data, now: float | None = None) -> bool:
    """Past the idle timeout since the last request, or past the absolute one since login."""
    now = time.time() if now is None else now
    login_at, seen_at = data.get(LOGIN_AT), data.get(SEEN_AT)
    if login_at is not None and now - login_at > settings.STEPGUARD_SESSION_MAX_SECONDS:
        return True
    return seen_at is not None and now - seen_at > settings.STEPGUARD_SESSION_IDLE_SECONDS


@receiver(user_logged_in)
def _stamp_login(sender, request, user, **kwargs) -> None:
    if request is not None and hasattr(request, "session"):
        now = time.time()
        request.session[LOGIN_AT] = request.session[SEEN_AT] = now


class SessionTimeouts:
    """Logs a session out after STEPGUARD_SESSION_IDLE_SECONDS without a request, or
    STEPGUARD_SESSION_MAX_SECONDS after login, whichever comes first. The live feed checks the
    same (runs.consumers.still_allowed)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        session = request.session
        if session.get("_auth_user_id") is not None:
            now = time.time()
            if session_expired(session, now):
                logout(request)
                if request.path.startswith("/api/"):
                    return JsonResponse(
                        {"error": {"code": "session_expired", "message": "log in again"}},
                        status=401,
                    )
                return redirect(f"{settings.LOGIN_URL}?next={request.path}")
            if now - session.get(SEEN_AT, 0) > TOUCH_SECONDS:
                session[SEEN_AT] = now
                session.setdefault(LOGIN_AT, now)
        return self.get_response(request)


class PermissionsPolicy:
    """No page of a control plane needs a camera, a microphone, a location or payments."""

    VALUE = "camera=(), microphone=(), geolocation=(), payment=(), usb=(), interest-cohort=()"

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        response.setdefault("Permissions-Policy", self.VALUE)
        return response


API_KEY_CREDENTIALS = {"username": "api-key"}


def api_key_allowed(request: HttpRequest) -> bool:
    """False once this address has sent too many bad API keys (AXES_FAILURE_LIMIT), until
    AXES_COOLOFF_TIME passes: a key cannot be guessed at API speed."""
    return AxesProxyHandler.is_allowed(request, API_KEY_CREDENTIALS)


def bad_api_key(request: HttpRequest) -> None:
    user_login_failed.send(sender=__name__, credentials=API_KEY_CREDENTIALS, request=request)


def locked_out(request, credentials, *args, **kwargs) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: a clear answer, in the API's shape under /api/."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    message = (
        f"too many failed attempts from this address: try again in {minutes} minutes "
        "or ask an administrator to unlock it (manage.py axes_reset)"
    )
    if request.path.startswith("/api/"):
        return JsonResponse({"error": {"code": "locked_out", "message": message}}, status=429)
    return HttpResponse(message, status=429, content_type="text/plain; charset=utf-8")


@receiver(user_locked_out)
def _audit_lockout(sender, request, username, ip_address, **kwargs) -> None:
    from runs.operations import audit

    log.warning("login locked out: %s from %s", username, ip_address)
    audit(
        "system", EventType.LOGIN_LOCKED_OUT, username=username or "", ip_address=ip_address or ""
    )
