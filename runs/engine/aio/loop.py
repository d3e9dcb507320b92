"""The process's one event loop: every async call a workflow makes runs on it.

An async client (`AsyncOpenAI`, `AsyncAnthropic`, httpx's `AsyncClient` inside a framework)
keeps pooled connections that belong to the loop that opened them. With a loop per execution,
a client that outlives the execution (a module-level one, a framework's shared one) sends its
next request on a connection of a closed loop: the provider answers in full, the SDK raises
"Event loop is closed", and the step sends it again (paid twice). One loop for the whole
process, never closed, keeps every pooled connection usable by every execution, on every
thread. The price is asyncio's usual rule: async workflow code must not block.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid = 0


def engine_loop() -> asyncio.AbstractEventLoop:
    """The running loop of this process (started on first use, again in a forked child)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _pid != os.getpid() or not _loop.is_running():
            loop = asyncio.new_event_loop()
            started = threading.Event()
            thread = threading.Thread(
                target=_serve, args=(loop, started), name="stepguard-loop", daemon=True
            )
            thread.start()
            started.wait()
            _loop, _pid = loop, os.getpid()
            atexit.register(_stop, loop, thread)
        return _loop


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """At exit: stop the loop before the interpreter finalizes (no daemon thread may wake
    into a dying interpreter)."""
    if loop.is_running():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(1.0)


def _serve(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    while True:
        try:
            loop.run_forever()
            return
        except BaseException:
            # A task raised KeyboardInterrupt or SystemExit (`sys.exit()` in async workflow
            # code): asyncio re-raises it out of the loop after handing it to whoever awaits
            # the task, so the loop goes on serving everyone else.
            continue
