"""The async runtime: how an `async def` workflow, and an async step of any workflow, runs.

    loop.py       the process's one event loop, on a thread of its own, never closed
    turnstile.py  Turnstile: the order in which an async execution's calls take the run's
                  context (positions as in a sequential replay)
    threads.py    DatabaseThreads, on which an async execution's calls run (owned, closed,
                  each closing its connection); StepThread, a step's thread lent to its
                  coroutine for the database work it asks
    host.py       AsyncHost, one async execution's runtime (loop, turnstile, threads, calls
                  in flight) and its one entrance, `enter`; `concurrently` (steps started
                  from engine code), `released` and `wait_for` (how an execution's thread
                  waits on the loop)
    bridge.py     AsyncRunContext, the awaited calls workflow code sees, and run_async, the
                  host's lifecycle (open, set on the execution, drain, close)

docs/async.md walks through `asyncio.gather(ctx.llm(...), ctx.llm(...))`. This module
imports nothing: the execution imports host.py, and bridge.py imports the execution, so a
re-export here would be an import cycle.
"""
