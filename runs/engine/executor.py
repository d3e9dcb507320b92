"""Executing one claimed run: replay from checkpoints, write new ones, fenced by lease_epoch.

A worker runs the workflow function from the top. Each step takes the next `seq`; a completed
checkpoint hands back its stored output and the function never runs. Every write goes through
`store.fence`, one UPDATE of the run row that checks the lease epoch, allocates event sequence
numbers and row-locks the run for the rest of the transaction, so a worker whose lease was
taken over can never write again.

The engine lives in one module per concern (see docs/architecture.md); this module is the
entry point the worker, the SDK and the tests import.
"""

from runs.engine.context import RunContext
from runs.engine.lifecycle import Outcome, execute, release
from runs.engine.records import NOT_FOUND, Decision
from runs.engine.retry import RetryPolicy
from runs.engine.store import Lease

__all__ = [
    "NOT_FOUND", "Decision", "Lease", "Outcome", "RetryPolicy", "RunContext", "execute", "release",
]  # fmt: skip
