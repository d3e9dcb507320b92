"""The workers page: each worker's heartbeat and the runs it holds."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import Count
from django.shortcuts import render
from django.utils import timezone

from runs.models import Run, Worker
from runs.views.common import viewer_required

#: Runs of a worker its row names (the rest are counted).
HELD_SHOWN = 20


@viewer_required
def workers_page(request):
    """Workers with their last heartbeat and the runs each holds."""

    workers = list(Worker.objects.order_by("-heartbeat_at")[:200])
    holding = dict(
        Run.objects.filter(worker__in=workers)
        .values_list("worker_id")
        .annotate(n=Count("id"))
        .order_by()
    )
    rows = [
        {
            "worker": w,
            # The newest HELD_SHOWN of its runs, and how many it holds: a list of every one
            # (40,000 on one worker of the bench's fill) took 15 s to render.
            "runs": list(
                Run.objects.filter(worker=w).only("id", "workflow", "worker_id")[:HELD_SHOWN]
            )
            if holding.get(w.pk)
            else [],
            "held": holding.get(w.pk, 0),
        }
        for w in workers
    ]
    silent_since = timezone.now() - timedelta(seconds=settings.STEPGUARD_LEASE_SECONDS)
    return render(request, "runs/workers.html", {"rows": rows, "silent_since": silent_since})
