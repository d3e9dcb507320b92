"""Rate limits on named resources (a model, a payment API), shared by every worker.

A step that declares a resource takes a grant before each call: one request and its
estimated tokens. A grant counts from the moment it is taken until a window after its call
returned. The provider saw the request at some moment in between, so no span of
`window_seconds` at the provider holds more requests than the limit, whatever the delays
between taking a grant and sending (counting from the grant alone would not hold: a grant
taken late in one window and sent early lands beside the next window's). A grant whose call
never returned (its worker died) counts until STEPGUARD_RATE_GRANT_STALE_SECONDS have passed.

Grants are counted under the limit row's lock (SELECT FOR UPDATE; SQLite writes are serial),
so two workers never both take the last one. Without capacity, `acquire` says when it
returns, and the step waits durably until then: the run is released, no worker thread waits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from runs.errors import TooLargeForRateLimit
from runs.models import RateGrant, RateLimit


def _live(resource: str, now: datetime, window: timedelta) -> Q:
    stale = now - timedelta(seconds=settings.STEPGUARD_RATE_GRANT_STALE_SECONDS)
    return Q(resource=resource) & (
        Q(ended_at__isnull=True, at__gt=stale) | Q(ended_at__gt=now - window)
    )


def acquire(resource: str, tokens: int, now: datetime) -> tuple[int | None, datetime | None]:
    """Take a grant of one request and `tokens` for `resource`: returns (its id, None), or
    (None, when capacity could return), or (None, None) for a resource without a limit.
    Raises TooLargeForRateLimit for a call that needs more tokens than a whole window
    allows. One query for a resource without a limit."""
    with transaction.atomic():
        limit = RateLimit.objects.select_for_update().filter(resource=resource).first()
        if limit is None:
            return None, None
        if limit.tokens is not None and tokens > limit.tokens:
            raise TooLargeForRateLimit(
                f"a call to {resource} needs about {tokens} tokens; its rate limit lets "
                f"{limit.tokens} through per {limit.window_seconds} s"
            )
        window = timedelta(seconds=limit.window_seconds)
        live = _live(resource, now, window)
        RateGrant.objects.filter(Q(resource=resource) & ~live).delete()
        # When each live grant stops counting: a window after it ended (one still in flight
        # ends now at the earliest), soonest first.
        frees = sorted(
            ((ended or now) + window, taken)
            for ended, taken in RateGrant.objects.filter(live).values_list("ended_at", "tokens")
        )
        waits = []
        if limit.requests is not None and len(frees) >= limit.requests:
            waits.append(frees[len(frees) - limit.requests][0])
        if limit.tokens is not None:
            excess = sum(taken for _, taken in frees) + tokens - limit.tokens
            for free_at, taken in frees:
                if excess <= 0:
                    break
                excess -= taken
                waits.append(free_at)
        if waits:
            return None, max(waits)
        return RateGrant.objects.create(resource=resource, at=now, tokens=tokens).pk, None


def end(grant: int | None, now: datetime) -> None:
    """The call of `grant` returned (or failed): its window starts now."""
    if grant is not None:
        RateGrant.objects.filter(pk=grant, ended_at__isnull=True).update(ended_at=now)


def usage(resource: str, now: datetime) -> dict:
    """What counts against the limit now: requests and tokens, for the API and the CLI."""
    limit = RateLimit.objects.filter(resource=resource).first()
    window = timedelta(seconds=limit.window_seconds if limit else 60)
    grants = RateGrant.objects.filter(_live(resource, now, window))
    return {"requests": grants.count(), "tokens": sum(grants.values_list("tokens", flat=True))}


@dataclass
class Grant:
    """A step's grant: taken before each call of its function, ended when the call returns."""

    resource: str
    tokens: int
    id: int | None = None

    def take(self, at: datetime) -> datetime | None:
        """Take a grant for a call at `at`; None if taken, else when capacity could return."""
        self.id, until = acquire(self.resource, self.tokens, at)
        return until

    def finish(self) -> None:
        grant, self.id = self.id, None
        end(grant, timezone.now())

    @contextmanager
    def ended_on_error(self) -> Iterator[None]:
        """A step that fails to start (a halt, a budget) never calls: its grant ends now."""
        try:
            yield
        except BaseException:
            self.finish()
            raise
