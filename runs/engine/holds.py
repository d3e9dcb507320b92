"""Holds: what stops a run, kept as state and never inferred from text.

A hold is placed by a person (or automation acting for one) on a run (`Run.halted_at`), on a
workflow or on everything (`Policy.halted_at`, scope `*`). A run is covered, and may not start
a step, while any of these holds: its own, an ancestor's (parent chain), its workflow's or an
ancestor's workflow's, or the kill switch. Lifting one hold lifts no other; a run resumes only
when none covers it.

The same predicate, `covered_sql`, is used by every statement that decides whether a run may
go on: the step start (fences.fence_statement), the claim, and every write that pauses,
releases or requeues a run, so a hold placed or lifted concurrently is never lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db import connection
from django.db.models import BooleanField
from django.db.models.expressions import RawSQL

from runs import labels as run_labels
from runs.engine.cursors import in_list, transaction_lock
from runs.models import GLOBAL, Policy, Run

RUN_TABLE = Run._meta.db_table
POLICY_TABLE = Policy._meta.db_table
# The engine's own workflows (registry.builtin): no LIKE, whose % the ORM would read as a
# parameter marker.
ENGINE_PREFIX = "stepguard."


def covered_sql(alias: str = RUN_TABLE) -> str:
    """SQL that is true when a hold covers the run row `alias`.

    The run's own hold is read from the row itself (so a statement that waited for the row
    lock re-checks it on the newest version); ancestors are walked with a recursive query
    that root runs, having no parent, never start. The kill switch and workflow holds do not
    cover the engine's own runs (`stepguard.*`, notification deliveries): an incident must
    still alert, so only a hold on the delivery run itself stops one.
    """
    return (
        f"({alias}.halted_at IS NOT NULL"
        f" OR (substr({alias}.workflow, 1, {len(ENGINE_PREFIX)}) <> '{ENGINE_PREFIX}'"
        f" AND EXISTS (SELECT 1 FROM {POLICY_TABLE} hp WHERE hp.halted_at IS NOT NULL"
        f" AND (hp.scope = '{GLOBAL}' OR hp.scope = {alias}.workflow)))"
        f" OR ({alias}.parent_id IS NOT NULL AND EXISTS ("
        "WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS ("
        f"SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM {RUN_TABLE} ha"
        f" WHERE ha.id = {alias}.parent_id"
        " UNION ALL"
        f" SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM {RUN_TABLE} ha"
        " JOIN up ON ha.id = up.parent_id)"
        " SELECT 1 FROM up WHERE up.halted_at IS NOT NULL"
        f" OR EXISTS (SELECT 1 FROM {POLICY_TABLE} hq WHERE hq.halted_at IS NOT NULL"
        " AND hq.scope = up.workflow))))"
    )


def covered(negate: bool = False) -> RawSQL:
    """`covered_sql` as an ORM condition: `Run.objects.filter(covered())`."""
    sql = covered_sql(f'"{RUN_TABLE}"')
    return RawSQL(f"NOT {sql}" if negate else sql, [], output_field=BooleanField())


def uncovered() -> RawSQL:
    return covered(negate=True)


@dataclass(frozen=True)
class Hold:
    """One hold covering a run, as people read it."""

    kind: str  # "run", "ancestor", "workflow" or "global"
    scope: str  # "run <id>", "parent run <id>", "workflow <name>", "everything"
    by: str
    at: datetime | None
    reason: str

    def as_json(self) -> dict:
        return {"kind": self.kind, "scope": self.scope, "by": self.by, "reason": self.reason}


def lineage(run: Run) -> list[Run]:
    """The run and its ancestors, nearest first (one query per level; trees are shallow)."""
    chain, current = [run], run
    while current.parent_id is not None:
        current = Run.objects.only(
            "id", "parent_id", "workflow", "halted_at", "halted_by", "halt_reason"
        ).get(pk=current.parent_id)
        chain.append(current)
    return chain


def holds_on(run: Run) -> list[Hold]:
    """Every hold covering `run`: its own first, then its ancestors', workflows', global."""
    chain = lineage(run)
    found = []
    for member in chain:
        if member.halted_at is not None:
            own = member.pk == run.pk
            found.append(
                Hold(
                    "run" if own else "ancestor",
                    f"run {member.pk}" if own else f"parent run {member.pk}",
                    member.halted_by,
                    member.halted_at,
                    member.halt_reason,
                )
            )
    if run.workflow.startswith(ENGINE_PREFIX):
        return found  # the kill switch and workflow holds do not cover the engine's own runs
    workflows = list(dict.fromkeys(m.workflow for m in chain))
    policies = {
        p.scope: p
        for p in Policy.objects.filter(scope__in=[*workflows, GLOBAL], halted_at__isnull=False)
    }
    for name in workflows:
        if (p := policies.get(name)) is not None:
            found.append(
                Hold("workflow", f"workflow {name}", p.halted_by, p.halted_at, p.halt_reason)
            )
    if (p := policies.get(GLOBAL)) is not None:
        found.append(Hold("global", "everything", p.halted_by, p.halted_at, p.halt_reason))
    return found


def lock_policies(chain: list[Run], also: tuple[str, ...] = ()) -> None:
    """Share-lock the policy rows whose holds (and budgets) cover the runs of `chain` (a run
    and its ancestors), those of the workflows `also` (a child about to be created) and the
    label budgets of the run itself (`label:tenant=acme`, those that exist), in scope order.

    The first of a worker's locks in a transaction that pauses a run or enters a durable wait,
    taken before the run row (docs/architecture.md, *lock order*): an operator's halt, unhalt
    or budget change locks the same rows to update them first, so one of the two waits for the
    other wholly and neither holds what the other needs. SQLite needs nothing: its writers are
    serialised.
    """
    if connection.vendor != "postgresql":
        return
    made = sorted(set([GLOBAL, *(m.workflow for m in chain), *also]))
    # A label's budget that refused the step has a row; one with none has no budget to raise
    # (and labels hold no halts), so no row is made for it.
    labels = run_labels.scopes(chain[0].labels or {}) if chain else []
    scopes = sorted({*made, *labels})
    with connection.cursor() as cursor:
        found = _share_lock_scopes(cursor, scopes)
        missing = [scope for scope in made if scope not in found]
        if not missing:
            return
        # A scope never halted nor budgeted has no row to lock yet: made here (committed with
        # this transaction), so the first halt of a workflow is ordered against us too. Locked
        # after the others, out of scope order: harmless, as no transaction locks two policy
        # rows but with shared locks (an operator's action updates the one it changes).
        cursor.execute(
            f"INSERT INTO {POLICY_TABLE} (scope, halted_by, halt_reason, updated_at)"
            f" SELECT s, '', '', now() FROM unnest(%(scopes)s::text[]) AS s"
            " ON CONFLICT (scope) DO NOTHING",
            {"scopes": missing},
        )
        _share_lock_scopes(cursor, missing)


def _share_lock_scopes(cursor, scopes: list[str]) -> set[str]:
    """Share-lock the policy rows of `scopes` that exist (in scope order); their scopes. One
    statement whether they all exist or not: a start or a wait pays one, not an insert too."""
    marks, params = in_list("scope", scopes)
    cursor.execute(
        f"SELECT scope FROM {POLICY_TABLE} WHERE scope IN ({marks}) ORDER BY scope FOR SHARE",
        params,
    )
    return {scope for (scope,) in cursor.fetchall()}


def lock_ancestors(chain: list[Run]) -> None:
    """Share-lock the ancestors of `chain[0]` (after its own row: children before parents)."""
    share_lock_runs(chain[1:])


def share_lock_runs(runs: list[Run]) -> None:
    if connection.vendor != "postgresql" or not runs:
        return
    ids = [Run._meta.pk.get_db_prep_value(m.pk, connection) for m in runs]
    marks, params = in_list("run", ids)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {RUN_TABLE} WHERE id IN ({marks}) FOR SHARE", params)


def chain_of(run_id) -> list[Run]:
    """The run and its ancestors, read without locks, for `lock_policies` and
    `lock_ancestors`."""
    fields = ("id", "parent_id", "workflow", "labels", "halted_at", "halted_by", "halt_reason")
    return lineage(Run.objects.only(*fields).get(pk=run_id))


def descendants(run_id) -> list:
    """Ids of the run's descendants, deepest first (read without locks)."""
    levels, frontier = [], [run_id]
    while frontier:
        frontier = list(Run.objects.filter(parent_id__in=frontier).values_list("id", flat=True))
        levels.append(frontier)
    return [run for level in reversed(levels) for run in level]


def lock_covering(workflow: str, parent_id=None) -> None:
    """Lock, in the lock order, every row whose hold would cover a new run of `workflow`
    under `parent_id`: the policies (shared), then the ancestor runs (shared). Taken by each
    write that decides whether a run it creates or requeues starts `halted` (create_run,
    retry_run, fork_run), before that decision, which is made in a later statement: a hold
    placed or lifted meanwhile either waits for this transaction, and then sees the run, or
    is committed before the decision reads it (READ COMMITTED: each statement sees what was
    committed before it began). A caller holding run rows already has taken these first;
    taking a lock again that the transaction holds waits for nothing.
    """
    if parent_id is None and workflow.startswith(ENGINE_PREFIX):
        return  # only a hold of its own covers an engine's run without a parent
    chain = chain_of(parent_id) if parent_id is not None else []
    lock_policies(chain, (workflow,))
    share_lock_runs(chain)


#: pg_advisory_xact_lock key of `serialise_hold_changes` (flow.py's are `stepguard.flow:*`).
HOLDS_LOCK = "stepguard.holds"


def serialise_hold_changes() -> None:
    """Make the operator actions that change holds or requeue held runs (halt, unhalt, a
    budget change, a cancel) wait for each other: the first lock of their transaction.

    Each locks only the rows it changes, so two of them at once would each decide from a
    snapshot without the other (write skew): an unhalt of a workflow and one of the kill
    switch would each see the other's hold still in force and leave its runs `halted`, with
    no hold left; a halt and an unhalt would leave a run `pending` under the new hold. One
    after the other, the second one's statements (READ COMMITTED) see the first's. Nothing
    else takes this lock, and it is taken before any row, so it closes no circle in the lock
    order (docs/architecture.md). SQLite needs nothing: its writers are serialised.
    """
    transaction_lock(HOLDS_LOCK)
