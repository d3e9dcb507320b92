"""The REST API: routers from each app, one auth policy, one error shape. runs.urls mounts it
at `api/` under the pages (/api/ in stand-alone Stepguard, agents/api/ in a project that
includes runs.urls at agents/), so a project embedding Stepguard imports nothing for it.

Every route needs a user: an API key (`Authorization: Bearer sg_...`, bound to a user) or a
browser session (with its CSRF token). Only /api/health answers anonymously. A key's scope
(full, read, start) narrows what its user may do on every route (`scoped`); an expired key is
a 401 that names its expiry.
"""

import functools
import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import DatabaseError
from django.http import Http404, HttpRequest, JsonResponse
from django.urls import include, path, re_path
from django.views.decorators.csrf import csrf_exempt
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.security import HttpBearer, django_auth

from runs import dbdown, security
from runs.api import create_run, signal_run
from runs.api import router as runs_router
from runs.api.annotations import router as annotations_router
from runs.api.bulk import router as bulk_router
from runs.api.stream import router as stream_router
from runs.api.versions import router as versions_router
from runs.apikeys import check_key, match_key
from runs.approvals.api import router as approvals_router
from runs.errors import Conflict, Forbidden, NotFound, StepguardError, UnknownWorkflow
from runs.health import health as health_view
from runs.models import ApiKey, ApiKeyScope

log = logging.getLogger("stepguard.api")


class Throttled(Exception):
    """Too many bad API keys from this address (django-axes counts them like failed logins)."""


class KeyExpired(Exception):
    """A real key past its expiry: refused with a 401 that says so (not a bad guess)."""

    def __init__(self, key: ApiKey):
        super().__init__(key)
        self.key = key


class ApiKeyAuth(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str):
        # The right secret (256 random bits) is never throttled: failures counted against a
        # key's prefix, which lists and events show, let anyone at the same address lock the
        # key out for its holder there. Only wrong keys are counted and refused with a 429.
        key = match_key(token)
        if key is None:
            if not security.api_key_allowed(request):
                raise Throttled()
            security.bad_api_key(request)
            return None
        if key.expired():
            raise KeyExpired(key)
        may_call(key, request)
        request.user = key.user
        request.api_key = key
        return key.user


#: The routes a "start" key may call: what a CI job or another service needs to start work.
START_ROUTES = frozenset({create_run, signal_run})
SCOPE_SAYS = {
    ApiKeyScope.READ: "only read (GET)",
    ApiKeyScope.START: "only start runs and send signals",
}


def may_call(key: ApiKey, request: HttpRequest) -> None:
    """A key's scope, checked before the route validates or does anything: a "read" key may
    only GET, a "start" key only call START_ROUTES, a "full" key whatever its user may do.
    Which route is being called comes from `scoped`, on every operation: a route added later
    is covered by itself (a write route is full-only unless START_ROUTES lists it)."""
    scope = key.scope
    if (
        scope == ApiKeyScope.FULL
        or (scope == ApiKeyScope.READ and request.method in ("GET", "HEAD"))
        or (scope == ApiKeyScope.START and getattr(request, "stepguard_view", None) in START_ROUTES)
    ):
        return
    says = SCOPE_SAYS.get(scope, "nothing")  # type: ignore[call-overload]
    raise Forbidden(
        f"API key sg_{key.prefix} is scoped {scope}: it may {says}, not {request.method} "
        f"{request.path}"
    )


def scoped(run):
    """Tells the auth which route a request is for (`request.stepguard_view`), before ninja
    authenticates it. A "view" decorator of the whole API (api.add_decorator), so every
    operation has it; ninja hands it the operation's bound `run`."""
    view = run.__self__.view_func

    @functools.wraps(run)
    def routed(request, *args, **kwargs):
        request.stepguard_view = view
        return run(request, *args, **kwargs)

    return routed


def docs_for_users(view):
    """The schema and the docs are for users too: a session or an API key."""

    def wrapped(request, *args, **kwargs):
        header = request.headers.get("Authorization", "")
        if request.user.is_authenticated or (
            header.startswith("Bearer ") and check_key(header.removeprefix("Bearer "))
        ):  # any live key, whatever its scope: the schema is no secret from a key's holder
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
    urls_namespace="stepguard:api",  # inside runs.urls' namespace
    auth=[ApiKeyAuth(), django_auth],
    docs_decorator=docs_for_users,
)
api.add_decorator(scoped, mode="view")  # before the routers are bound: every operation has it


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


@api.exception_handler(KeyExpired)
def key_expired(request, exc: KeyExpired):
    at = exc.key.expires_at.isoformat() if exc.key.expires_at else "?"
    return error(
        401, "api_key_expired", f"API key sg_{exc.key.prefix} expired at {at}: create a new one"
    )


@api.exception_handler(Throttled)
def throttled(request, exc):
    return security.locked_out(request, security.API_KEY_CREDENTIALS)


@api.exception_handler(DatabaseError)
def database_error(request, exc: DatabaseError):
    """The database down, restarting or not answering within DB_CONNECT_TIMEOUT: a 503 to
    retry, not a bug (runs/dbdown.py); any other database error is one."""
    if not dbdown.is_disconnect(exc):
        return unexpected(request, exc)
    response = error(503, "database_unavailable", dbdown.MESSAGE)
    response["Retry-After"] = dbdown.RETRY_AFTER
    return response


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


api.add_router("/", bulk_router)  # before runs_router: /runs/bulk is no run id
api.add_router("/", runs_router)
api.add_router("/", versions_router)
api.add_router("/", annotations_router)
api.add_router("/", stream_router)
api.add_router("/approvals", approvals_router)


@csrf_exempt  # it changes nothing; a POST without a token gets the 404 too, not the pages' 403
def unmatched(request: HttpRequest, *args, **kwargs) -> JsonResponse:
    """Any path under the API's mount that no route takes (`/api/nothing`, a name with a
    newline): the API's JSON 404, not the pages' HTML one, wherever the API is mounted."""
    return error(404, "not_found", "no API route at this path (see openapi.json)")


def api_urls():
    """The API's routes for runs.urls, then `unmatched` for every other path under them."""
    patterns, app_name, namespace = api.urls
    # The mount itself is ninja's "api-root" (a plain Http404, so the pages' HTML 404); ninja
    # reverses that name to know where the API is mounted, so it stays, answered here.
    root = path("", unmatched, name="api-root")
    patterns = [root if getattr(p, "name", None) == "api-root" else p for p in patterns]
    catch_all = re_path(r"", unmatched, name="unmatched")
    return include(([*patterns, catch_all], app_name), namespace=namespace)
