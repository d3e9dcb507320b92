"""How a failing step is tried again in place: the policy, and what is worth retrying."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

from runs.engine.llm import retry_after
from runs.errors import StepguardError

#: The engine's own generator for jitter, not the `random` module's (see recorded._RANDOM).
_JITTER = random.Random()

#: The longest a provider's Retry-After is honoured: a day (a delay of at least
#: STEPGUARD_DURABLE_RETRY_SECONDS is a timer that holds no worker thread).
MAX_RETRY_AFTER = 86_400.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often a step is re-attempted in place when its function raises.

    Delays grow as `initial_interval * backoff ** (n - 1)`, capped at `max_interval`, each
    spread by +/- `jitter` (a fraction). `max_attempts` counts the first call and is bounded.
    """

    max_attempts: int = 3
    initial_interval: timedelta = timedelta(seconds=1)
    backoff: float = 2.0
    max_interval: timedelta = timedelta(seconds=30)
    jitter: float = 0.2
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    non_retryable: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_attempts <= 100:
            raise ValueError("RetryPolicy.max_attempts must be between 1 and 100")
        if self.initial_interval < timedelta(0) or self.max_interval < timedelta(0):
            raise ValueError("RetryPolicy intervals cannot be negative")
        if self.backoff < 1 or not 0 <= self.jitter < 1:
            raise ValueError("RetryPolicy needs backoff >= 1 and 0 <= jitter < 1")

    def retries(self, exc: BaseException) -> bool:
        if not retryable(exc):
            return False
        return isinstance(exc, self.retry_on) and not isinstance(exc, self.non_retryable)

    def delay(self, failures: int) -> float:
        base = self.initial_interval.total_seconds() * self.backoff ** (failures - 1)
        base = min(base, self.max_interval.total_seconds())
        return max(0.0, base * (1 + _JITTER.uniform(-self.jitter, self.jitter)))

    def next_delay(self, exc: BaseException, tries: int) -> float | None:
        """Seconds to wait before try `tries + 1`, or None if `exc` after `tries` tries is final.
        A provider's Retry-After (on the exception's response) wins over the backoff."""
        if not self.retries(exc) or tries >= self.max_attempts:
            return None
        asked = retry_after(exc)
        return self.delay(tries) if asked is None else min(asked, MAX_RETRY_AFTER)


DEFAULT_RETRY = RetryPolicy()


def retryable(exc: BaseException) -> bool:
    """Whether an error may be tried again at all (a run retry too): Stepguard's own errors
    say so themselves (a non-determinism, an output that is not JSON, a refused request...)."""
    return not (isinstance(exc, StepguardError) and not exc.retryable)
