"""Flow control in the claim path: concurrency limits and the order of claims.

A limited workflow's runs are claimed under a lock of that workflow (PostgreSQL: a
transaction-scoped advisory lock; SQLite: every write transaction is serial, IMMEDIATE),
after counting its running runs in the same transaction: two workers can never both see the
last free slot. Limits come from the code (`@workflow(concurrency=..., per_key=...)`) unless
an operator set the workflow's Policy (`max_running`, `max_running_per_key`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Case, Count, F, IntegerField, Q, Value, When

from runs import tally
from runs.engine import registry
from runs.engine.cursors import transaction_lock
from runs.models import GLOBAL, Policy, Run, RunStatus


@dataclass(frozen=True)
class Limit:
    total: int | None
    per_key: int | None


def code_limits(names: set[str]) -> dict[str, Limit]:
    """The limits the code declares for `names` (their newest registered versions)."""
    code: dict[str, Limit] = {}
    for name in names:
        try:
            definition = registry.get(name)
        except registry.UnknownWorkflow:
            continue
        code[name] = Limit(definition.concurrency, definition.per_key)
    return code


def policies(
    names: set[str], code: dict[str, Limit] | None = None
) -> tuple[bool, dict[str, Limit]]:
    """Whether the kill switch stops every run of `names` (never while they include the
    engine's own workflows, which it does not hold: holds.covered_sql), and the limited
    workflows among `names` with their limits in force (`code`: code_limits(names), which a
    worker computes once). One query: a claim asks it every time."""
    code = dict(code_limits(names) if code is None else code)
    rows = Policy.objects.filter(
        Q(scope=GLOBAL, halted_at__isnull=False)
        | Q(scope__in=names) & (Q(max_running__isnull=False) | Q(max_running_per_key__isnull=False))
    ).values_list("scope", "halted_at", "max_running", "max_running_per_key")
    stopped = False
    for scope, halted_at, total, per_key in rows:
        if scope == GLOBAL:
            stopped = halted_at is not None and not any(registry.builtin(n) for n in names)
            continue
        mine = code.get(scope, Limit(None, None))
        code[scope] = Limit(
            total if total is not None else mine.total,
            per_key if per_key is not None else mine.per_key,
        )
    return stopped, {name: limit for name, limit in code.items() if limit != Limit(None, None)}


def lock(workflow: str) -> None:
    """Serialise the claims of one limited workflow until the transaction ends."""
    transaction_lock(f"stepguard.flow:{workflow}")


def running(workflow: str) -> dict[str, int]:
    """How many runs of `workflow` run now, per concurrency key (runs_run_running_key_idx)."""
    rows = (
        Run.objects.filter(workflow=workflow, status=RunStatus.RUNNING)
        .values_list("concurrency_key")
        .annotate(n=Count("id"))
        .order_by()
    )
    return dict(rows)


def aged(now: datetime) -> datetime:
    """Runs due before this are taken before fresher ones whatever their priority: the bound
    on how long a low priority waits while higher ones keep coming."""
    return now - timedelta(seconds=settings.STEPGUARD_PRIORITY_AGING_SECONDS)


def claim_order(now: datetime) -> list:
    """The claim order outside PostgreSQL's statement: runs whose worker died and aged runs
    first (oldest first), then higher priorities, first come first within one."""
    first = Q(status=RunStatus.RUNNING) | Q(wake_at__lt=aged(now))
    rank = Case(When(first, then=Value(0)), default=Value(1), output_field=IntegerField())
    priority = Case(When(first, then=Value(0)), default=F("priority"), output_field=IntegerField())
    return [rank, priority.desc(), "wake_at"]


#: The flow page's columns, by the status they count.
COLUMNS: dict[str, str] = {
    RunStatus.RUNNING: "running",
    RunStatus.PENDING: "queued",
    RunStatus.WAITING: "waiting",
    RunStatus.OVER_BUDGET: "waiting",
}


def _load() -> dict[str, dict]:
    """Runs running, queued and waiting per workflow, and per concurrency key the keyed ones
    running or queued. The per-workflow counts are the /metrics totals (runs/tally.py: one
    small statement, whatever the number of live runs); off PostgreSQL, a grouped count. The
    keys are an index-only read of the keyed runs alone (runs_run_live_key_idx)."""
    counts: dict[str, dict] = {}

    def entry(workflow: str) -> dict:
        return counts.setdefault(workflow, {"running": 0, "queued": 0, "waiting": 0, "keys": {}})

    live = Run.objects.filter(status__in=list(COLUMNS))
    if tally.kept():
        by_status = [(w, st, n) for (w, st), n in tally.read()["runs"].items()]
    else:
        by_status = list(live.values_list("workflow", "status").annotate(n=Count("id")).order_by())
    for workflow, status, n in by_status:
        if status in COLUMNS and n > 0:
            entry(workflow)[COLUMNS[status]] += n
    keyed = (
        live.filter(status__in=[RunStatus.RUNNING, RunStatus.PENDING])
        .exclude(concurrency_key="")
        .values_list("workflow", "concurrency_key", "status")
        .annotate(n=Count("id"))
        .order_by()
    )
    for workflow, key, status, n in keyed:
        per = entry(workflow)["keys"].setdefault(key, {"key": key, "running": 0, "queued": 0})
        per[COLUMNS[status]] += n
    return counts


def overview(keys: int = 20) -> list[dict]:
    """Per workflow with runs in flight or a limit: runs running, queued (due or not) and
    waiting, its limits (the code's and the operator's), and its busiest concurrency keys."""
    registry.load_configured()
    counts = _load()
    policies = {
        p.scope: p
        for p in Policy.objects.filter(
            Q(max_running__isnull=False) | Q(max_running_per_key__isnull=False)
        )
    }
    names = set(counts) | set(policies)
    for definition in registry.all_workflows():
        if definition.concurrency or definition.per_key:
            names.add(definition.name)
    out = []
    for name in sorted(names):
        entry = counts.get(name, {"running": 0, "queued": 0, "waiting": 0, "keys": {}})
        try:
            definition = registry.get(name)
            code = {
                "max_running": definition.concurrency,
                "max_running_per_key": definition.per_key,
            }
        except registry.UnknownWorkflow:
            code = {"max_running": None, "max_running_per_key": None}
        policy = policies.get(name)
        operator = {
            "max_running": policy.max_running if policy else None,
            "max_running_per_key": policy.max_running_per_key if policy else None,
        }
        busiest = sorted(
            entry["keys"].values(), key=lambda k: (-k["running"], -k["queued"], k["key"])
        )
        out.append({
            "workflow": name, "running": entry["running"], "queued": entry["queued"],
            "waiting": entry["waiting"], "code_limits": code, "operator_limits": operator,
            "keys": busiest[:keys],
        })  # fmt: skip
    return out
