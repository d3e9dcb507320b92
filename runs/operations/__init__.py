"""Operator actions on runs, shared by the CLI, the dashboard and the API.

Each action resolves the acting user, checks the matching permission, locks the run row, and
records an event with the actor, so the same action taken anywhere is the same function with
the same check and the same audit entry. One module per concern (common: what they all share;
run_actions, halts, budgets, forking, flow, bulk); the names callers use are re-exported here.
"""

from runs.errors import OperationError
from runs.operations.budgets import set_budget
from runs.operations.bulk import BULK_MAX, BulkResult, Outcome, bulk_action
from runs.operations.common import (
    KEEP,
    audit,
    find_run,
    in_utc,
    lock_run,
    needs_reason,
    require,
    resolve_user,
    retried_on_deadlock,
)
from runs.operations.flow import (
    pause_schedule,
    remove_schedule,
    save_schedule,
    set_limits,
    set_rate_limit,
)
from runs.operations.forking import fork_edits, fork_preview, fork_run, fork_summary
from runs.operations.halts import PARKABLE, Target, halt, known_scope, parse_target, unhalt
from runs.operations.run_actions import cancel_run, compensated, retry_run, unserved_reason

__all__ = [
    "BULK_MAX",
    "KEEP",
    "PARKABLE",
    "BulkResult",
    "OperationError",
    "Outcome",
    "Target",
    "audit",
    "bulk_action",
    "cancel_run",
    "compensated",
    "find_run",
    "fork_edits",
    "fork_preview",
    "fork_run",
    "fork_summary",
    "halt",
    "in_utc",
    "known_scope",
    "lock_run",
    "needs_reason",
    "parse_target",
    "pause_schedule",
    "remove_schedule",
    "require",
    "resolve_user",
    "retried_on_deadlock",
    "retry_run",
    "save_schedule",
    "set_budget",
    "set_limits",
    "set_rate_limit",
    "unhalt",
    "unserved_reason",
]
