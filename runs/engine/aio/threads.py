"""The threads an async execution's calls run on (see docs/async.md).

Two kinds: the database threads (`DatabaseThreads`), on which each call of an async workflow
runs, since a checkpoint blocks and the event loop must not; and a step's own thread lent to
its coroutine (`StepThread`), on which what the coroutine asks of the database is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

from django.db import connection

#: A call and the future its caller awaits; None tells a thread to end.
_Work = tuple[concurrent.futures.Future, Callable[[], Any]] | None


class DatabaseThreads:
    """Up to `size` threads, started as calls need them (a call finding none idle starts one)
    and reused, each with its own Django connection (they are per thread). `close` ends them:
    each closes its connection as it ends, and is joined. The pool knows every thread it
    started, so none is left holding a connection."""

    def __init__(self, size: int, name: str = "stepguard-db"):
        self._size, self._name = size, name
        self._work: queue.SimpleQueue[_Work] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count per thread waiting for work
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._close_errors: list[BaseException] = []

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """`fn()` on one of the threads; its future (cancelled before it starts, it never
        runs, as a ThreadPoolExecutor's)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the execution's database threads are closed")
            self._work.put((future, fn))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._serve,
                    name=f"{self._name}_{len(self._threads)}",
                    daemon=False,  # joined at the interpreter's exit, as an executor's are
                )
                thread.start()
                self._threads.append(thread)
        return future

    def started(self) -> int:
        """How many threads were started (at most `size`)."""
        with self._lock:
            return len(self._threads)

    def close(self) -> None:
        """End every thread once the calls queued before are done; each closes its
        connection. Waits for them; raises what a connection's close raised."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._work.put(None)
        for thread in threads:
            thread.join()
        if self._close_errors:
            raise self._close_errors[0]

    def _serve(self) -> None:
        try:
            while (work := self._work.get()) is not None:
                future, fn = work
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # the awaiting task raises it
                        future.set_exception(exc)
                del work, future, fn  # hold no result while idle
                self._idle.release()
        finally:
            try:
                connection.close()
            except BaseException as exc:  # raised by close(), on the thread that ends them
                self._close_errors.append(exc)


class StepThread:
    """Work a step's coroutine asks of the thread that runs the step, done there while that
    thread waits for the coroutine: the event loop may not touch the database, and the step's
    thread is the one whose writes are the step's (a reservation a chat model makes before it
    is sent, runs/adapters/chat_models.py)."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()

    async def run(self, fn: Callable[[], Any]) -> Any:
        """On the event loop: `fn()` run on the step's thread; its result or its error."""
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((fn, reply))
        return await asyncio.wrap_future(reply)

    def serve_until(self, future: concurrent.futures.Future) -> Any:
        """On the step's thread: do what is asked until `future` is done; its result."""
        future.add_done_callback(lambda _: self._requests.put(None))
        while (request := self._requests.get()) is not None:
            fn, reply = request
            try:
                reply.set_result(fn())
            except BaseException as exc:  # the asker raises it, where it belongs
                reply.set_exception(exc)
        return future.result()
