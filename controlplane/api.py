"""The REST API at /api/: routers from each app, one auth policy, one error shape.

Every route needs a user: an API key (`Authorization: Bearer sg_...`, bound to a user) or a
browser session (with its CSRF token). Only /api/health answers anonymously.
"""

import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, JsonResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer, django_auth

from approvals.api import router as approvals_router
from controlplane import security
from controlplane.health import health as health_view
from runs.api import router as runs_router
from runs.apikeys import check_key
from runs.errors import Conflict, Forbidden, NotFound, StepguardError, UnknownWorkflow

log = logging.getLogger("stepguard.api")


class Throttled(Exception):
    """Too many bad API keys from this address (django-axes counts them like failed logins)."""


class ApiKeyAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        if not security.api_key_allowed(request):
            raise Throttled()
        key = check_key(token)
        if key is None:
            security.bad_api_key(request)
            return None
        request.user = key.user
        request.api_key = key
        return key.user


def docs_for_users(view):
    """The schema and the docs are for users too: a session or an API key."""

    def wrapped(request, *args, **kwargs):
        header = request.headers.get("Authorization", "")
        if request.user.is_authenticated or (
            header.startswith("Bearer ") and check_key(header.removeprefix("Bearer "))
        ):
            return view(request, *args, **kwargs)
        return error(401, "not_authenticated", "log in or send an API key to read the API docs")

    return wrapped


api = NinjaAPI(
    title="Stepguard",
    version="1",
    description=(
        "Start runs, send signals, decide approvals, halt, budget, cancel, retry and fork: "
        "everything an operator can do. Authenticate with `Authorization: Bearer sg_...` "
        "(an API key from `manage.py apikey create`) or a browser session with its CSRF token. "
        f"Request bodies are limited to {settings.STEPGUARD_API_MAX_BODY} bytes."
    ),
    urls_namespace="api",
    auth=[ApiKeyAuth(), django_auth],
    docs_decorator=docs_for_users,
)


def error(status: int, code: str, message: str, details=None) -> JsonResponse:
    body = {"error": {"code": code, "message": message}}
    if details is not None:
        body["error"]["details"] = details
    return JsonResponse(body, status=status)


STATUS = [(NotFound, 404), (UnknownWorkflow, 404), (Forbidden, 403), (Conflict, 409)]


@api.exception_handler(StepguardError)
def stepguard_error(request, exc: StepguardError):
    status = next((code for cls, code in STATUS if isinstance(exc, cls)), 400)
    return error(status, exc.code, str(exc))


@api.exception_handler(ValidationError)
def validation_error(request, exc: ValidationError):
    details = [
        {"loc": list(e.get("loc", [])), "msg": e.get("msg", ""), "type": e.get("type", "")}
        for e in exc.errors
    ]
    first = details[0] if details else {"loc": [], "msg": "invalid input"}
    where = ".".join(str(part) for part in first["loc"])
    return error(422, "validation_error", f"{where}: {first['msg']}", details)


@api.exception_handler(AuthenticationError)
def not_authenticated(request, exc):
    return error(
        401, "not_authenticated", "send an API key (Authorization: Bearer sg_...) or log in"
    )


@api.exception_handler(HttpError)
def http_error(request, exc: HttpError):
    return error(exc.status_code, "http_error", str(exc))


@api.exception_handler(Http404)
def not_found(request, exc):
    return error(404, "not_found", str(exc) or "not found")


@api.exception_handler(RequestDataTooBig)
def too_big(request, exc):
    limit = settings.STEPGUARD_API_MAX_BODY
    return error(413, "payload_too_large", f"request body over the {limit}-byte limit")


@api.exception_handler(Throttled)
def throttled(request, exc):
    return security.locked_out(request, security.API_KEY_CREDENTIALS)


@api.exception_handler(Exception)
def unexpected(request, exc: Exception):
    """A bug, not bad input: logged with its traceback here, answered in the documented shape
    (never a traceback page, even with DEBUG on)."""
    log.exception("API %s %s failed", request.method, request.path)
    return error(500, "server_error", "the server failed to answer; the error was logged")


@api.get("/health", auth=None, tags=["health"])
def health(request):
    """For load balancers, the one route that needs no authentication: 200 while the database
    answers (`status` ok or degraded), 503 when it does not; statuses and numbers only."""
    return health_view(request)


api.add_router("/", runs_router)
api.add_router("/approvals", approvals_router)


class BodyLimitMiddleware:
    """Refuse an oversized API body before anything reads it (Content-Length), with the error
    shape of the API. Bodies without a length are cut off by DATA_UPLOAD_MAX_MEMORY_SIZE."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith("/api/"):
            try:
                length = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return error(400, "bad_request", "Content-Length is not a number")
            if length > settings.STEPGUARD_API_MAX_BODY:
                limit = settings.STEPGUARD_API_MAX_BODY
                return error(413, "payload_too_large", f"request body over the {limit}-byte limit")
        return self.get_response(request)
