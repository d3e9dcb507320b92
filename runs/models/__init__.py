"""Runs, their step checkpoints, the append-only event history, and workers.

The database holds the invariants: a step's identity is a row (`UNIQUE(run, key)`,
`UNIQUE(run, seq)`), an event's place in the history is a row (`UNIQUE(run, seq)`), a run key
starts one run, and statuses are checked. Writes that change ownership are compare-and-swap on
`lease_epoch` (see runs/engine/).

One module per concern; every model is imported here, so Django finds them all in the `runs`
app (`runs.models`) and `from runs.models import Run` works wherever the model lives. A new
model goes in the module of its concern and in the lists below.
"""

from runs.models.annotations import Annotation, Verdict
from runs.models.budgets import GLOBAL, BudgetLedger, Policy, SpendDay, SpendRun
from runs.models.events import (
    NO_RUN,
    NOTIFIABLE,
    RENAMED_EVENTS,
    Event,
    EventManager,
    EventQuerySet,
    EventType,
)
from runs.models.keys import ApiKey, ApiKeyScope
from runs.models.notifications import ChannelKind, NotificationChannel, NotificationDelivery
from runs.models.rates import RateGrant, RateLimit
from runs.models.runs import TERMINAL_STATUSES, WAKEABLE_STATUSES, Run, RunShaper, RunStatus, Shaped
from runs.models.schedules import MAX_BUFFERED_TICKS, Catchup, Overlap, Schedule
from runs.models.signals import Published, Signal
from runs.models.steps import Recovery, Step, StepKind, StepStatus, StreamPiece
from runs.models.tallies import Tally
from runs.models.workers import Chore, Worker

__all__ = [
    "GLOBAL",
    "MAX_BUFFERED_TICKS",
    "NOTIFIABLE",
    "NO_RUN",
    "RENAMED_EVENTS",
    "TERMINAL_STATUSES",
    "WAKEABLE_STATUSES",
    "Annotation",
    "ApiKey",
    "ApiKeyScope",
    "BudgetLedger",
    "Catchup",
    "ChannelKind",
    "Chore",
    "Event",
    "EventManager",
    "EventQuerySet",
    "EventType",
    "NotificationChannel",
    "NotificationDelivery",
    "Overlap",
    "Policy",
    "Published",
    "RateGrant",
    "RateLimit",
    "Recovery",
    "Run",
    "RunShaper",
    "RunStatus",
    "Schedule",
    "Shaped",
    "Signal",
    "SpendDay",
    "SpendRun",
    "Step",
    "StepKind",
    "StepStatus",
    "StreamPiece",
    "Tally",
    "Verdict",
    "Worker",
]
