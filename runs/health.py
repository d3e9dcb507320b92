"""Health, for load balancers and uptime checks: anonymous, so statuses and numbers only.

503 when the database does not answer (this web process can do nothing useful); 200 otherwise,
with `status: degraded` when Redis does not answer or no worker is alive (a load balancer
should keep serving pages then: taking web processes out would not bring a worker back).

A database that hangs instead of refusing (a stopped server, a network partition) is down too:
the queries run on a thread of their own and the answer is 503 when they have not answered
within STEPGUARD_HEALTH_TIMEOUT, whatever the connection does (a new one gives up after
DB_CONNECT_TIMEOUT, but one already open waits as long as the server does). One such thread
at most: checks that come while it runs wait for its answer (within the same timeout) rather
than start another, so a hung database leaves one stuck thread behind, not one per check.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import timedelta

from django.conf import settings
from django.db import Error as DatabaseError
from django.db import connections
from django.db.models import Min
from django.http import HttpRequest, JsonResponse
from django.utils import timezone

from runs.engine.worker import WAKEABLE
from runs.models import Run, RunStatus, Worker

#: A worker is alive when it heartbeat within this many lease periods (it beats 3 per lease).
LIVE_LEASES = 3


def _redis() -> str:
    if not settings.REDIS_URL:
        return "off"
    import redis

    client = redis.Redis.from_url(
        settings.REDIS_URL, socket_connect_timeout=1.0, socket_timeout=1.0
    )
    try:
        client.ping()
        return "ok"
    except (redis.RedisError, OSError):
        return "down"
    finally:
        client.close()


def _age(since) -> float | None:
    return None if since is None else round((timezone.now() - since).total_seconds(), 3)


def _database(now) -> dict:
    """The database's part of the report. Three queries, each on an index."""
    live = now - timedelta(seconds=LIVE_LEASES * settings.STEPGUARD_LEASE_SECONDS)
    body: dict = {
        "workers": Worker.objects.filter(stopped_at__isnull=True, heartbeat_at__gte=live).count()
    }
    # Runnable: due pending/waiting runs (since wake_at), and running runs whose worker
    # stopped heartbeating (since their lease lapsed): see runs.engine.worker.
    due = Run.objects.filter(status__in=WAKEABLE, wake_at__lte=now).aggregate(m=Min("wake_at"))
    lapsed = Run.objects.filter(status=RunStatus.RUNNING, lease_until__lt=now).aggregate(
        m=Min("lease_until")
    )
    oldest = min((t for t in (due["m"], lapsed["m"]) if t is not None), default=None)
    body["oldest_runnable_seconds"] = _age(oldest)
    return body


_probe_lock = threading.Lock()
_probe: Future | None = None  # the check still running on its thread, if one is


def _probe_database(now) -> dict:
    """`_database(now)` on a thread of its own, within STEPGUARD_HEALTH_TIMEOUT (TimeoutError
    past it). The thread opens its own connection and closes it when done. Inside a transaction
    (a test's) the checks run here: another connection would not see what it wrote."""
    global _probe
    if connections["default"].in_atomic_block:
        return _database(now)
    with _probe_lock:
        running = _probe if _probe is not None and not _probe.done() else None
        if running is None:
            _probe = future = Future()
    if running is not None:  # checks that come while one runs share its answer
        return running.result(timeout=settings.STEPGUARD_HEALTH_TIMEOUT)

    def check() -> None:
        try:
            future.set_result(_database(now))
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            connections.close_all()

    threading.Thread(target=check, name="stepguard-health", daemon=True).start()
    return future.result(timeout=settings.STEPGUARD_HEALTH_TIMEOUT)


def report() -> tuple[int, dict]:
    """The status code and the report."""
    now = timezone.now()
    body: dict = {"status": "ok", "database": "ok", "redis": _redis()}
    try:
        body.update(_probe_database(now))
    except TimeoutError:
        body.update(status="down", database="timeout", workers=None, oldest_runnable_seconds=None)
        return 503, body
    except DatabaseError:
        body.update(status="down", database="down", workers=None, oldest_runnable_seconds=None)
        return 503, body
    if body["redis"] == "down" or not body["workers"]:
        body["status"] = "degraded"
    return 200, body


def health(request: HttpRequest) -> JsonResponse:
    """GET /health and /api/health."""
    status, body = report()
    response = JsonResponse(body, status=status)
    response["Cache-Control"] = "no-store"
    return response
