"""The turnstile an async execution's calls take turns at (see docs/async.md)."""

from __future__ import annotations

import threading
from typing import NamedTuple


class TurnstileState(NamedTuple):
    """Where a turnstile stands: what a test or a debugger reads, all at once."""

    issued: int  # tickets taken so far (the next call's ticket)
    serving: int  # the next ticket to be let in
    busy: bool  # a call holds the run's context
    abandoned: frozenset[int]  # tickets cancelled before their turn


class Turnstile:
    """Lets an async workflow's steps run concurrently while its context stays one-at-a-time.

    Each call from the workflow takes a ticket on the event loop, in the order the workflow
    made the calls (asyncio.gather starts its awaitables in order), and enters the context in
    ticket order: so step positions are assigned exactly as in a sequential replay, whatever
    the threads do. A step leaves the context while it only waits for its async call (or a
    retry delay) and comes back to write its checkpoint; calls that are not steps (waits,
    children, the agent loop) keep it until they return.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0
        self._busy = False
        self._abandoned: set[int] = set()
        self._local = threading.local()

    def ticket(self) -> int:
        self._issued += 1  # on the event loop's thread only
        return self._issued - 1

    def enter(self, ticket: int, releasable: bool) -> bool:
        """Wait for `ticket`'s turn and take the context; False if the call was abandoned."""
        with self._cond:
            self._cond.wait_for(
                lambda: ticket in self._abandoned or (self._serving == ticket and not self._busy)
            )
            if ticket in self._abandoned:
                return False
            self._serving += 1
            self._skip()
            self._busy = True
        self._local.releasable = releasable
        return True

    def abandon(self, ticket: int) -> None:
        """The call was cancelled before its turn (asyncio.wait_for, a cancelled task): later
        tickets must not wait for it."""
        with self._cond:
            if ticket >= self._serving:
                self._abandoned.add(ticket)
                self._skip()
                self._cond.notify_all()

    def state(self) -> TurnstileState:
        with self._cond:
            return TurnstileState(
                self._issued, self._serving, self._busy, frozenset(self._abandoned)
            )

    def _skip(self) -> None:
        while self._serving in self._abandoned:
            self._serving += 1

    def releasable(self) -> bool:
        return getattr(self._local, "releasable", False)

    def released(self) -> bool:
        return getattr(self._local, "released", False)

    def leave(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def release(self) -> None:
        """Give the context up while this thread only waits; `reacquire` takes it back."""
        self._local.released = True
        self.leave()

    def reacquire(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)
            self._busy = True
        self._local.released = False
