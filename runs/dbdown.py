"""A request that finds the database down or hung answers 503 at once, saying so.

A stopped or partitioned PostgreSQL fails each new connection after DB_CONNECT_TIMEOUT (the
web process connects per request: controlplane/webdb.py); a restarting one refuses it. Either
way the request can do nothing, and a 500 page ("server error") would send the reader looking
for a bug: this answers 503 with Retry-After and what happened. The API's own handler does the
same in its error shape (runs/rest.py, `database_unavailable`).
"""

from __future__ import annotations

import logging
import sys

from django.core.signals import got_request_exception
from django.http import HttpRequest, HttpResponse

from runs.engine.outage import is_disconnect

log = logging.getLogger("stepguard.web")

MESSAGE = "The database is not answering; try again in a few seconds."
RETRY_AFTER = "5"


def unavailable() -> HttpResponse:
    response = HttpResponse(MESSAGE + "\n", status=503, content_type="text/plain; charset=utf-8")
    response["Retry-After"] = RETRY_AFTER
    return response


def _mark(sender, request=None, **kwargs) -> None:
    """got_request_exception: Django turns an exception into a 500 in the layer it came from
    (a middleware that reads the session, a view), before any outer middleware sees it; the
    request remembers that it was the database's."""
    exc = sys.exc_info()[1]
    if request is not None and exc is not None and is_disconnect(exc):
        request.stepguard_database_down = exc  # type: ignore[attr-defined]


got_request_exception.connect(_mark, dispatch_uid="stepguard.dbdown")


class DatabaseUnavailable:
    """Middleware, outside all that read the database: a request that failed on a lost,
    refused or timed-out database connection, wherever inside, answers 503, not its 500."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        down = getattr(request, "stepguard_database_down", None)
        if down is None or response.status_code != 500:
            return response
        log.warning("%s %s: database unavailable (%s)", request.method, request.path, down)
        return unavailable()
