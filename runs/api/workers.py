"""Workers over REST: their heartbeats and the runs they hold."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from ninja import Schema

from runs.api.common import ERRORS_422, Router, viewer
from runs.models import Run, Worker

router = Router(tags=["runs"])


class WorkerOut(Schema):
    id: UUID
    host: str
    pid: int
    concurrency: int
    workflows: list[str]
    started_at: datetime
    heartbeat_at: datetime
    stopped_at: datetime | None
    runs: list[UUID]


@router.get("/workers", response={200: list[WorkerOut], **ERRORS_422}, tags=["workers"])
def list_workers(request, include_stopped: bool = False):
    """Workers with their last heartbeat and the runs they hold now."""
    viewer(request)
    workers = Worker.objects.all() if include_stopped else Worker.objects.filter(stopped_at=None)
    held: dict = {}
    for run_id, worker_id in Run.objects.filter(worker__in=workers).values_list("id", "worker_id"):
        held.setdefault(worker_id, []).append(run_id)
    return [
        {**{f.name: getattr(w, f.name) for f in Worker._meta.fields}, "runs": held.get(w.pk, [])}
        for w in workers[:500]
    ]
