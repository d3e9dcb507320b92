"""Health, for load balancers and uptime checks: anonymous, so statuses and numbers only.

503 when the database does not answer (this web process can do nothing useful); 200 otherwise,
with `status: degraded` when Redis does not answer or no worker is alive (a load balancer
should keep serving pages then: taking web processes out would not bring a worker back).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import Error as DatabaseError
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


def report() -> tuple[int, dict]:
    """The status code and the report. Three queries, each on an index."""
    now = timezone.now()
    body: dict = {"status": "ok", "database": "ok", "redis": _redis()}
    try:
        live = now - timedelta(seconds=LIVE_LEASES * settings.STEPGUARD_LEASE_SECONDS)
        body["workers"] = Worker.objects.filter(
            stopped_at__isnull=True, heartbeat_at__gte=live
        ).count()
        # Runnable: due pending/waiting runs (since wake_at), and running runs whose worker
        # stopped heartbeating (since their lease lapsed): see runs.engine.worker.
        due = Run.objects.filter(status__in=WAKEABLE, wake_at__lte=now).aggregate(m=Min("wake_at"))
        lapsed = Run.objects.filter(status=RunStatus.RUNNING, lease_until__lt=now).aggregate(
            m=Min("lease_until")
        )
        oldest = min((t for t in (due["m"], lapsed["m"]) if t is not None), default=None)
        body["oldest_runnable_seconds"] = _age(oldest)
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
