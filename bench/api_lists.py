"""What a heavy API list costs the web process: GET /api/approvals?limit=500 (issue 50 §3).

    .venv/bin/python bench/api_lists.py          # ~1 minute

Seeds 2,000 approval requests (most decided, as production's are) of one run, whose payloads
are 42,000 small objects each for the newest 20 (an agent that asks about a whole table) and a
small dict for the rest, so the page fills to the API's byte cap (STEPGUARD_API_MAX_RESPONSE,
8 MiB). Then, in the same invocation on the same database, 7 times each, alternating:

- baseline: the page as the API built it before: every payload parsed from `jsonb` into Python,
  validated by the schema and printed again by ninja's encoder;
- relayed: the route as it is (runs.bounded.relay): the payloads' stored text written out as it
  is, the other fields shaped by the schema.

Prints medians, the ratio, the bytes sent and the peak Python memory of one request
(tracemalloc). Uses bench/steps.py's database (DATABASE_URL, default stepguard_bench) on
PostgreSQL; deletes its rows at the start and the end, so it runs twice in a row.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from bench.steps import prepare_database, progress, table
from runs import bounded
from runs.approvals.api import PAYLOAD, ApprovalOut, whole_approval
from runs.approvals.models import ApprovalRequest
from runs.models import Run

WORKFLOW, USER = "bench.api-lists", "bench-api-lists"
REQUESTS, HEAVY, ROUNDS = 2000, 20, 7


def clean() -> None:
    Run.objects.filter(workflow=WORKFLOW).delete()
    get_user_model().objects.filter(username=USER).delete()


def seed() -> None:
    run = Run.objects.create(workflow=WORKFLOW, version="1", input={}, status="waiting")
    heavy = {"rows": [{"id": i, "ok": True} for i in range(42_000)]}
    now = timezone.now()
    ApprovalRequest.objects.bulk_create(
        ApprovalRequest(
            run=run, step_key=f"ask-{i}", action="pay", summary="an invoice",
            payload=heavy if i >= REQUESTS - HEAVY else {"amount": i, "to": "vendor"},
            status="approved" if i < REQUESTS - HEAVY else "pending",
            decided_at=now if i < REQUESTS - HEAVY else None,
        )
        for i in range(REQUESTS)
    )  # fmt: skip


def baseline() -> bytes:
    """The list as the route built it before relaying: parse, validate, print."""
    from ninja.responses import NinjaJSONEncoder  # reads settings: after bench.steps

    rows = bounded.sized(ApprovalRequest.objects.select_related("decided_by"), PAYLOAD)
    pending = list(rows.filter(status="pending").order_by("created_at")[:500])
    rest = list(rows.exclude(status="pending").order_by("-created_at")[: 500 - len(pending)])
    page = pending + rest
    bounded.fill(page, PAYLOAD, settings.STEPGUARD_API_MAX_RESPONSE, whole_approval)
    items = [ApprovalOut.model_validate(ApprovalOut.of(r)).model_dump() for r in page]
    return json.dumps(items, cls=NinjaJSONEncoder).encode()


def timed(fn) -> tuple[float, int]:
    started = time.perf_counter()
    body = fn()
    return time.perf_counter() - started, len(body)


def peak_memory(fn) -> int:
    """Python's peak allocation during one call (tracemalloc slows it: measured apart)."""
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def main() -> None:
    error = prepare_database()
    if error:
        sys.exit(error)
    clean()
    progress(f"seed {REQUESTS} approvals, {HEAVY} with 42,000-object payloads")
    seed()
    user = get_user_model().objects.create_superuser(USER, "bench@example.com", "pw")
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]  # the in-process client
    client = Client()
    client.force_login(user)

    def relayed() -> bytes:
        response = client.get("/api/approvals", {"limit": 500}, secure=True)
        assert response.status_code == 200, response.content[:200]
        return response.content

    assert json.loads(relayed()) == json.loads(baseline())  # the same list, both ways
    figures: dict[str, list] = {"baseline": [], "relayed": []}
    for i in range(ROUNDS):
        progress(f"round {i + 1}/{ROUNDS}")
        figures["baseline"].append(timed(baseline))
        figures["relayed"].append(timed(relayed))
    peaks = {"baseline": peak_memory(baseline), "relayed": peak_memory(relayed)}
    medians = {k: statistics.median(t for t, _ in v) for k, v in figures.items()}
    rows = [
        [name, f"{medians[name] * 1000:.0f} ms", f"{v[0][1] / 2**20:.1f} MiB",
         f"{peaks[name] / 2**20:.0f} MiB"]
        for name, v in figures.items()
    ]  # fmt: skip
    print(f"GET /api/approvals?limit=500, {REQUESTS} requests ({HEAVY} heavy), median of {ROUNDS}")
    print(table(["path", "median", "sent", "peak Python memory"], rows))
    print(f"  relayed / baseline: {medians['relayed'] / medians['baseline']:.2f}x")
    clean()


if __name__ == "__main__":
    main()
