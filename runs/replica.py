"""Reads on a replica (DATABASE_REPLICA_URL, docs/deploy.md): the pages and the API's GETs read
Stepguard's tables from a streaming standby, so a primary's cores go to the engine.

Only what shows goes there. Everything that decides stays on the primary: claims, fences and
every other write of the engine (workers never route through here), operator actions and
approvals (unsafe methods), and the models that say who may do what (users, groups, sessions,
API keys: a revoked key or a removed role must not live on for a replica's lag). The routing
is per request, through a context variable the middleware sets, so a worker, a management
command or a live feed in the same process reads the primary whatever it imports.

A replica lags. A page says so when it is more than a second behind, and the person who just
acted reads the primary for a few seconds (a cookie the action sets), so an operator never
sees the run they just halted still running. A replica that does not answer is skipped, with
a line on the page, rather than failing every page.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import DatabaseError, connections
from django.urls import Resolver404, ResolverMatch, resolve

log = logging.getLogger(__name__)

ALIAS = "replica"
#: The apps whose models may be read from the replica, less the models of `PRIMARY_ONLY`.
REPLICA_APPS = frozenset({"runs", "approvals"})
PRIMARY_ONLY = frozenset({"apikey"})
#: The cookie an action sets: this browser (or API client with a cookie jar) reads the primary.
STICKY_COOKIE = "stepguard_primary"

_reading = contextvars.ContextVar("stepguard_replica_reads", default=False)


def configured() -> bool:
    return ALIAS in settings.DATABASES


class ReplicaRouter:
    """Sends reads of Stepguard's display models to the replica while a request reads there."""

    def db_for_read(self, model, **hints):
        if not _reading.get() or model._meta.app_label not in REPLICA_APPS:
            return None
        return None if model._meta.model_name in PRIMARY_ONLY else ALIAS

    def db_for_write(self, model, **hints):
        return "default"

    def allow_relation(self, obj1, obj2, **hints):
        return True  # the same rows, one of them behind

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        return db != ALIAS  # a standby is read-only: it gets its schema by replication


@dataclass(frozen=True)
class Lag:
    """How far behind the replica is, as last measured (`seconds` is None: it did not answer)."""

    seconds: float | None
    measured_at: float

    @property
    def usable(self) -> bool:
        return self.seconds is not None

    @property
    def shown(self) -> bool:
        """Worth a line on the page: down, or more than a second behind."""
        return self.seconds is None or self.seconds > 1.0


_last: Lag | None = None


def lag() -> Lag:
    """The replica's lag, measured at most once a second per process (a down replica is tried
    again after STEPGUARD_REPLICA_RETRY seconds). Two small statements: the primary's WAL
    position, and the replica's replayed position and last replayed commit time. A replica that
    has replayed all the primary wrote is 0 behind, however long ago that commit was."""
    global _last
    now = time.monotonic()
    if _last is not None:
        wait = 1.0 if _last.usable else settings.STEPGUARD_REPLICA_RETRY
        if now - _last.measured_at < wait:
            return _last
    try:
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn()")
            (primary_lsn,) = cursor.fetchone()
        with connections[ALIAS].cursor() as cursor:
            cursor.execute(
                "SELECT pg_is_in_recovery(), pg_last_wal_replay_lsn() >= %s::pg_lsn,"
                " EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp())",
                [primary_lsn],
            )
            recovering, caught_up, behind = cursor.fetchone()
        seconds = 0.0 if not recovering or caught_up else max(float(behind or 0.0), 0.0)
    except DatabaseError as exc:
        if _last is None or _last.usable:
            log.warning("replica: %s; reading from the primary until it answers", exc)
        connections[ALIAS].close()
        seconds = None
    _last = Lag(seconds, time.monotonic())
    return _last


def forget() -> None:
    """Measure again on the next request (tests)."""
    global _last
    _last = None


class ReadsOnReplica:
    """Middleware: a GET or HEAD reads the replica, unless it is the admin's (its forms edit
    what they show), this client acted in the last STEPGUARD_REPLICA_STICKY seconds, or the
    replica does not answer; an unsafe request that succeeded sets that client's cookie."""

    PRIMARY_NAMESPACES = frozenset({"admin"})

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.replica_lag = None
        if request.method not in ("GET", "HEAD"):
            response = self.get_response(request)
            if configured() and response.status_code < 400 and not self.signs_in(request):
                sticky = settings.STEPGUARD_REPLICA_STICKY
                response.set_cookie(
                    STICKY_COOKIE, "1", max_age=sticky, httponly=True, samesite="Lax",
                    secure=settings.SESSION_COOKIE_SECURE,
                )  # fmt: skip
            return response
        if not configured() or STICKY_COOKIE in request.COOKIES or self.edits(request):
            return self.get_response(request)
        measured = request.replica_lag = lag()
        if not measured.usable:
            return self.get_response(request)
        token = _reading.set(True)
        try:
            response = self.get_response(request)
        finally:
            _reading.reset(token)
        if response.status_code in (500, 503):
            # The replica may have gone since it was last measured: measure again, and if it
            # is gone, read this request again from the primary (a GET or HEAD changes nothing).
            forget()
            measured = request.replica_lag = lag()
            if not measured.usable:
                request.__dict__.pop("stepguard_database_down", None)
                return self.get_response(request)
        response["X-Stepguard-Replica-Lag"] = f"{measured.seconds:.1f}"
        return response

    @staticmethod
    def _match(request) -> ResolverMatch | None:
        try:
            return resolve(request.path_info)
        except Resolver404:
            return None

    def edits(self, request) -> bool:
        match = self._match(request)
        return match is not None and not self.PRIMARY_NAMESPACES.isdisjoint(match.namespaces)

    def signs_in(self, request) -> bool:
        """Logging in or out changes nothing a page shows: it is no action to read back."""
        match = self._match(request)
        return match is not None and match.url_name in ("login", "logout")
