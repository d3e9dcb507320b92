"""What the app enforces beyond Django's defaults, wherever it is installed: sessions that end
(SessionTimeouts, which the live feed honours too), no NUL in a parameter (RefuseNul),
throttled API keys, and an audit event for every lockout. Login throttling itself is
django-axes. A host project lists the middleware it wants (docs/install.md); stand-alone
Stepguard lists them all (controlplane/settings.py)."""

from __future__ import annotations

import logging
import time

from axes.handlers.proxy import AxesProxyHandler
from axes.signals import user_locked_out
from django.conf import settings
from django.contrib.auth import logout
from django.contrib.auth.signals import user_logged_in, user_login_failed
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, JsonResponse
from django.shortcuts import redirect
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from runs.models import ApiKey, EventType

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


def api_request(request: HttpRequest) -> bool:
    """Whether the path is under the REST API's mount (/api/ here, agents/api/ in a project
    that includes runs.urls at agents/), as the URLconf says: every path under it resolves
    into the API (runs.rest.api_urls), so its refusals answer in the API's JSON shape."""
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return False
    return match.app_names[-2:] == ["stepguard", "ninja"]


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
                if api_request(request):
                    return JsonResponse(
                        {"error": {"code": "session_expired", "message": "log in again"}},
                        status=401,
                    )
                return redirect(f"{settings.LOGIN_URL}?next={request.path}")
            if now - session.get(SEEN_AT, 0) > TOUCH_SECONDS:
                session[SEEN_AT] = now
                session.setdefault(LOGIN_AT, now)
        return self.get_response(request)


def sessions_end() -> bool:
    """Whether pages end sessions on their timeouts: SessionTimeouts (or a subclass) is in
    MIDDLEWARE, under whichever path the settings name it. A host project embedding Stepguard
    may leave it out; then the live feed does not end them either."""
    return any(
        isinstance(found := import_string(path), type) and issubclass(found, SessionTimeouts)
        for path in settings.MIDDLEWARE
    )


class RefuseNul:
    """400 for a NUL character in a query parameter or a form field (name or value), whatever
    the route: PostgreSQL cannot store or compare text holding one, so every lookup or filter
    made of it raised a DataError (a 500) there, and nothing legitimate sends one. Form bodies
    are read as CsrfViewMiddleware reads them on the dashboard; under the API's mount only
    urlencoded ones, so an API view still gets its raw body."""

    MESSAGE = "a parameter holds a NUL character"

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        params = [request.GET]
        form = request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data")
        if (
            request.method == "POST"
            and form
            and (
                not api_request(request)
                or request.content_type == "application/x-www-form-urlencoded"
            )
        ):
            params.append(request.POST)
        if any("\x00" in key or any("\x00" in value for value in query.getlist(key))
               for query in params for key in query):  # fmt: skip
            if api_request(request):
                return JsonResponse({"error": {"code": "bad_request", "message": self.MESSAGE}},
                                    status=400)  # fmt: skip
            return HttpResponseBadRequest(self.MESSAGE, content_type="text/plain")
        return self.get_response(request)


API_KEY_CREDENTIALS = {"username": "api-key"}


def _key_credentials(request: HttpRequest) -> dict[str, str]:
    """What a bad key counts against, with the address (AXES_LOCKOUT_PARAMETERS): the key it
    claims (`api-key:<prefix>`) when its prefix is a real key's, else every key that matches
    none (`api-key`). Counting all bad keys per address alone let a guesser behind a NAT, a
    proxy or a shared CI runner lock out the valid keys and Prometheus of everyone there;
    this way guessing a secret stays throttled per key, guessing keys per address, and
    another key from that address keeps working. Prefixes are not secret (lists, logs)."""
    cached = getattr(request, "_stepguard_key_credentials", None)
    if cached is not None:
        return cached
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    parts = token.strip().split("_", 2)
    credentials = API_KEY_CREDENTIALS
    if (
        scheme.lower() == "bearer"
        and len(parts) == 3
        and parts[0] == "sg"
        and ApiKey.objects.filter(prefix=parts[1]).exists()
    ):
        credentials = {"username": f"api-key:{parts[1]}"}
    request._stepguard_key_credentials = credentials  # type: ignore[attr-defined]
    return credentials


def api_key_allowed(request: HttpRequest) -> bool:
    """False once this address has sent too many bad keys claiming the same key, or too many
    matching no key (AXES_FAILURE_LIMIT), until AXES_COOLOFF_TIME passes: a key cannot be
    guessed at API speed, and one guesser does not lock out the other keys from its address."""
    return AxesProxyHandler.is_allowed(request, _key_credentials(request))


def bad_api_key(request: HttpRequest) -> None:
    credentials = _key_credentials(request)
    user_login_failed.send(sender=__name__, credentials=credentials, request=request)


def locked_out(request, credentials, *args, **kwargs) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: a clear answer, in the API's shape under the API's mount."""
    minutes = int(settings.AXES_COOLOFF_TIME.total_seconds() // 60)
    message = (
        f"too many failed attempts from this address: try again in {minutes} minutes "
        "or ask an administrator to unlock it (manage.py axes_reset)"
    )
    if api_request(request):
        return JsonResponse({"error": {"code": "locked_out", "message": message}}, status=429)
    return HttpResponse(message, status=429, content_type="text/plain; charset=utf-8")


@receiver(user_locked_out)
def _audit_lockout(sender, request, username, ip_address, **kwargs) -> None:
    from runs.operations import audit

    log.warning("login locked out: %s from %s", username, ip_address)
    audit(
        "system", EventType.LOGIN_LOCKED_OUT, username=username or "", ip_address=ip_address or ""
    )
