"""Bulk actions: halt, cancel or retry many runs at once, named by id or by the runs list's
filter. The dashboard's runs list, `POST /api/runs/bulk` and `manage.py bulk` all call this.

Each run goes through the same operation as one run alone (its permission, its checks, its
audit event): one run refused (already finished, not failed...) is reported with its reason and
the others go on. The permission is checked before anything is counted, so who may not act
learns nothing about what matches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from runs.errors import OperationError, StepguardError
from runs.models import Run
from runs.operations.common import require
from runs.operations.halts import halt
from runs.operations.run_actions import cancel_run, retry_run
from runs.queries import RUN_FILTERS, BadFilter, filtered_runs

log = logging.getLogger("stepguard.operations")

#: What each bulk action does to one run, and the permission it needs (that operation's own).
ACTIONS: dict[str, Callable[..., Any]] = {"halt": halt, "cancel": cancel_run, "retry": retry_run}
PERMISSIONS = {
    "halt": ("runs.halt_run", "halt runs"),
    "cancel": ("runs.cancel_run", "cancel runs"),
    "retry": ("runs.retry_run", "retry runs"),
}
#: At most this many runs in one bulk action (queries.EXACT_UP_TO counts that far); above
#: CONFIRM_ABOVE the page asks for the count typed, the command for --yes.
CONFIRM_ABOVE = 10
BULK_MAX = 1000
#: The filters a bulk action takes: the runs list's (RUN_FILTERS), and `engine=1`.
FILTERS = (*RUN_FILTERS, "engine")


@dataclass(frozen=True)
class Outcome:
    """What became of one run: done, or refused with the error's code and message."""

    run_id: UUID
    ok: bool
    code: str = ""
    message: str = ""


@dataclass(frozen=True)
class BulkResult:
    action: str
    outcomes: list[Outcome]

    @property
    def done(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def refused(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


def allowed(action: str, user):
    """The acting user, once the action is known and they may take it (Forbidden if not)."""
    if action not in ACTIONS:
        raise OperationError(f"no bulk action {action!r} (halt, cancel or retry)")
    permission, verb = PERMISSIONS[action]
    return require(user, permission, verb)


def select(
    *, ids: Iterable[str | UUID] | None = None, filters: Mapping[str, Any] | None = None
) -> list[UUID]:
    """The runs named by `ids` or matching `filters` (exactly one of them), oldest first; an
    OperationError (BadFilter for a filter) that names the problem if they are none, too many,
    or not runs."""
    if (ids is None) == (filters is None):
        raise OperationError("name the runs: ids, or a filter (not both)")
    if filters is not None:
        unknown = sorted(set(filters) - set(FILTERS))
        if unknown:
            raise BadFilter(f"no filter {unknown[0]!r} (one of {', '.join(FILTERS)})")
        runs, _ = filtered_runs(filters)
    else:
        try:
            wanted = [v if isinstance(v, UUID) else UUID(str(v)) for v in ids or ()]
        except ValueError:
            raise OperationError("a selected run is not a run id") from None
        runs = Run.objects.filter(pk__in=wanted)
    found = list(runs.order_by("created_at").values_list("pk", flat=True)[: BULK_MAX + 1])
    if not found:
        raise OperationError("no runs are selected")
    if len(found) > BULK_MAX:
        raise OperationError(f"more than {BULK_MAX} runs match: narrow the filter")
    return found


def apply(action: str, run_ids: Iterable[UUID], user, reason: str) -> BulkResult:
    """`action` on each run, each in its own transaction; the outcome of each."""
    user = allowed(action, user)
    if not reason or not reason.strip():
        raise OperationError(f"a bulk {action} needs a reason")
    outcomes = []
    for run_id in run_ids:
        try:
            ACTIONS[action](str(run_id), user, reason)
        except StepguardError as exc:
            outcomes.append(Outcome(run_id, False, exc.code, str(exc)))
        except Exception as exc:  # a database error on one run: report it, go on with the rest
            log.exception("bulk %s of run %s failed", action, run_id)
            outcomes.append(Outcome(run_id, False, "error", exc.__class__.__name__))
        else:
            outcomes.append(Outcome(run_id, True))
    return BulkResult(action, outcomes)


def bulk_action(
    action: str,
    user,
    reason: str,
    *,
    ids: Iterable[str | UUID] | None = None,
    filters: Mapping[str, Any] | None = None,
) -> BulkResult:
    """Halt, cancel or retry the runs `ids` names or `filters` matches (the runs list's
    filters: status, workflow, label...), at most BULK_MAX of them."""
    allowed(action, user)
    run_ids = select(ids=ids, filters=filters)
    return apply(action, run_ids, user, reason)
