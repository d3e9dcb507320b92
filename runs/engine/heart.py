"""The worker's heart: a process of its own that keeps the worker's leases and writes the
completions of its steps, so that workflow code cannot starve either.

Workflow code runs on the worker's threads, and one C call (a `sorted()` of millions of
floats, a regex, a parse, a local model) can hold the GIL for seconds: no other thread of the
process runs meanwhile. A heartbeat thread then lets the lease lapse (another worker takes the
run and sends the step again while it still runs here), and a completion writer thread leaves a
returned step unrecorded until the call ends. The heart holds no GIL the workflow can take.

The worker (`Heart`, its side) tells it over a pipe, as they happen, which leases it holds and
drops and, when a step returns and before control goes back to workflow code, the step's
completion (a pickle and a `write(2)`, a few microseconds). The heart (`Beat`, a process
started with `python -c`, Django set up, its own connections, no workflow module imported)
renews the leases every third of a lease with the same compare-and-swap on the epoch, and
writes a completion that no write of its execution carried within STEPGUARD_COMPLETION_WINDOW,
fenced by the lease, and only while the step is still `started` (fences.carrying_statement: of the
heart's write and the execution's, the second writes nothing). After a database outage it
writes them as soon as the database answers. It exits when the pipe closes (the worker died,
SIGKILL included: its pending completions are written first, its leases expire) and skips
renewals while the worker is stopped (SIGSTOP: a paused worker loses its leases, as before).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from django.conf import settings

if TYPE_CHECKING:
    from runs.engine.fences import Completion, Lease

log = logging.getLogger("stepguard.worker")

#: How long a worker waits for its heart's first word: a Python process setting Django up.
START_TIMEOUT = 120.0
#: How long a heart whose worker stopped or died goes on trying to write what it holds.
LAST_WRITES_SECONDS = 10.0

_BOOT = (
    "import json, os, sys; sys.path[:0] = json.loads(os.environ.pop('STEPGUARD_HEART_PATH')); "
    "from runs.engine.heart import main; main(sys.argv[1:])"
)


class Heart:
    """The worker's side of its heart: starts the process, tells it what happens, hears which
    leases were lost (`on_lost(run_id, epoch)`), and starts another if it dies."""

    def __init__(
        self,
        worker_id: uuid.UUID,
        lease_seconds: float,
        on_lost: Callable[[uuid.UUID, int], None],
        held: Callable[[], list[Lease]],
        renew: Callable[[], None] | None = None,
    ):
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        self.on_lost = on_lost
        self.held = held  # the leases held now: told again to a heart started anew
        self.renew = renew  # renews them from this process while a new heart starts
        self.proc: subprocess.Popen | None = None
        self._out: Connection | None = None
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._stopping = False

    # -- what the worker tells it ---------------------------------------------------------------

    def hold(self, lease: Lease) -> None:
        self._send(("hold", str(lease.run_id), lease.epoch))

    def drop(self, lease: Lease) -> None:
        self._send(("drop", str(lease.run_id), lease.epoch))

    def completion(self, lease: Lease, completion: Completion) -> bool:
        """Hand the heart a returned step's completion; False if it could not take it (the
        caller then keeps it in this process)."""
        message = ("completion", str(lease.run_id), lease.epoch, lease.pending_at, completion)
        return self._send(message)

    def carried(self, step_id: int) -> None:
        """The execution wrote this completion itself: the heart forgets it."""
        self._send(("carried", step_id))

    def _send(self, message: tuple) -> bool:
        out = self._out
        if out is None:
            return False
        try:
            with self._send_lock:
                out.send(message)
        except Exception as exc:  # a dead heart (its listener starts another), or no pickle
            log.debug("could not tell the heart %s: %s", message[0], exc)
            return False
        return True

    # -- its life -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the process (returns at once; `wait_ready` waits for its first word)."""
        to_heart, out = os.pipe()
        inbox, from_heart = os.pipe()
        env = {**os.environ, "STEPGUARD_HEART_PATH": json.dumps([p for p in sys.path if p])}
        if settings.SETTINGS_MODULE:
            env.setdefault("DJANGO_SETTINGS_MODULE", settings.SETTINGS_MODULE)
        argv = [sys.executable, "-c", _BOOT, str(to_heart), str(from_heart), str(self.worker_id),
                str(self.lease_seconds)]  # fmt: skip
        try:
            self.proc = subprocess.Popen(
                argv, pass_fds=(to_heart, from_heart), stdin=subprocess.DEVNULL, env=env
            )
        finally:
            os.close(to_heart)
            os.close(from_heart)
        self._ready.clear()
        self._out = Connection(out, readable=False)
        threading.Thread(
            target=self._listen, args=(Connection(inbox, writable=False), self.proc),
            name="stepguard-heart", daemon=True,
        ).start()  # fmt: skip

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc is not None and (code := self.proc.poll()) is not None:
                raise RuntimeError(f"the worker's heart process exited with {code} at start")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker's heart process did not start in {timeout:.0f} s")

    def stop(self, timeout: float = LAST_WRITES_SECONDS + 5) -> None:
        """Let the heart write what it still holds and exit (the worker is stopping)."""
        self._stopping = True
        self._send(("stop",))
        if self.proc is not None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _listen(self, inbox: Connection, proc: subprocess.Popen) -> None:
        ready = False
        while True:
            try:
                message = inbox.recv()
            except (EOFError, OSError):
                break
            if message[0] == "ready":
                ready = True
                self._ready.set()
            elif message[0] == "lost":
                self.on_lost(uuid.UUID(message[1]), message[2])
        inbox.close()
        code = proc.wait()
        if self._stopping or proc is not self.proc or not ready:
            return  # stopping; or it never started, which wait_ready says
        # Its leases are kept by nothing now: start another at once and tell it everything.
        log.error("the worker's heart (pid %s) ended with %s; starting another", proc.pid, code)
        self._out = None
        self.start()
        # Setting Django up takes a second or more: longer than a short lease.
        while self.renew is not None and self.proc.poll() is None:
            try:
                self.renew()
            except Exception:
                log.exception("could not renew the leases while the heart starts")
            if self._ready.wait(self.lease_seconds / 3):
                break
        self.wait_ready()
        for lease in self.held():
            self.hold(lease)
            pending = lease.pending
            if pending is not None:
                self.completion(lease, pending)


# -- the heart process --------------------------------------------------------------------------


@dataclass
class _Pending:
    run_id: str
    epoch: int
    at: float  # time.monotonic() (system-wide) when the step returned, in the worker
    completion: Completion


def worker_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger): read from /proc where there is
    one; elsewhere never (a stopped worker then keeps its leases while its heart lives)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


class Beat:
    """The heart process's work: the leases it renews, the completions it holds, two threads
    that write them, each on its own connection."""

    def __init__(self, worker_id: str, worker_pid: int, lease_seconds: float, out: Connection):
        self.worker_id = worker_id
        self.worker_pid = worker_pid
        self.lease = timedelta(seconds=lease_seconds)
        self.out = out
        self.cond = threading.Condition()
        self.leases: dict[str, int] = {}  # run id -> epoch
        self.pending: dict[int, _Pending] = {}  # step id -> its completion
        self.ending = threading.Event()  # the worker stopped or died: write what is held, exit
        self.give_up_at = float("inf")  # monotonic: when, once ending, the last writes stop
        self.done = threading.Event()

    def tell(self, message: tuple) -> None:
        with contextlib.suppress(OSError):  # the worker is gone
            self.out.send(message)

    def handle(self, message: tuple) -> None:
        kind = message[0]
        with self.cond:
            if kind == "hold":
                self.leases[message[1]] = message[2]
            elif kind == "drop":
                if self.leases.get(message[1]) == message[2]:
                    del self.leases[message[1]]
            elif kind == "completion":
                run_id, epoch, at, completion = message[1:]
                self.pending[completion.step_id] = _Pending(run_id, epoch, at, completion)
                self.cond.notify_all()
            elif kind == "carried":
                self.pending.pop(message[1], None)
            elif kind == "stop":
                self.end()

    def end(self) -> None:
        with self.cond:
            if not self.ending.is_set():
                self.give_up_at = time.monotonic() + LAST_WRITES_SECONDS
            self.ending.set()
            self.leases.clear()
            self.cond.notify_all()

    # -- leases ---------------------------------------------------------------------------------

    def renew_loop(self) -> None:
        from django.db import close_old_connections, connection

        from runs.engine.outage import is_disconnect, outage, reconnect

        interval = self.lease.total_seconds() / 3
        # The first soon: a heart started anew renews at once the leases it is then told.
        wait = min(interval, 0.2)
        while not self.ending.wait(wait):
            wait = interval
            if worker_stopped(self.worker_pid):
                continue  # paused: its leases lapse, as the worker's own thread's would
            for _ in range(2):  # again on a new connection if a restart broke the old one
                try:
                    self.renew()
                    outage.ok()
                except Exception as exc:
                    if is_disconnect(exc) and reconnect("heartbeat"):
                        continue
                    if not is_disconnect(exc):
                        log.exception("heartbeat failed; retrying next interval")
                        close_old_connections()
                break
        connection.close()

    def renew(self) -> None:
        """Extend every held lease (compare-and-swap on its epoch) and the worker's heartbeat;
        tell the worker which are no longer its own."""
        from django.utils import timezone

        from runs.models import Run, RunStatus, Worker

        now = timezone.now()
        with self.cond:
            held = list(self.leases.items())
        for run_id, epoch in held:
            extended = Run.objects.filter(
                pk=run_id, lease_epoch=epoch, status=RunStatus.RUNNING
            ).update(lease_until=now + self.lease)
            if not extended:
                with self.cond:
                    if self.leases.get(run_id) == epoch:
                        del self.leases[run_id]
                self.tell(("lost", run_id, epoch))
        Worker.objects.filter(pk=self.worker_id).update(heartbeat_at=now)

    # -- completions ----------------------------------------------------------------------------

    def write_loop(self) -> None:
        """Write each completion not carried within the window; at the end, all at once."""
        from django.db import connection

        window = settings.STEPGUARD_COMPLETION_WINDOW
        while True:
            with self.cond:
                if not self.pending and not self.ending.is_set():
                    self.cond.wait()
                if not self.pending and self.ending.is_set():
                    break
                self.cond.wait(window / 10)
                now = time.monotonic()
                ending = self.ending.is_set()
                due = [p for p in self.pending.values() if ending or now - p.at >= window]
            if ending and now > self.give_up_at:
                log.warning("%d completions not written; their steps will be re-sent",
                            len(self.pending))  # fmt: skip
                break
            for pending in due:
                self.write(pending, window)
        connection.close()
        self.done.set()

    def write(self, pending: _Pending, window: float) -> None:
        """Write one completion, fenced by its lease, if its step is still `started`."""
        from django.db import Error, connection

        from runs.engine.fences import Lease
        from runs.engine.outage import is_disconnect, outage, reconnect
        from runs.engine.store import flush
        from runs.errors import ControlFlow, StepguardError

        lease = Lease(uuid.UUID(pending.run_id), pending.epoch)
        lease.pending = pending.completion
        attempted = time.monotonic()
        try:
            # One transaction: the lock bound, then the fence carrying the completion, which
            # writes it only if the step is still `started` (if the worker's write took it
            # past the window, that seq of the run's events stays unused).
            flush(lease, lock_wait=window)
            outage.ok()
        except (ControlFlow, StepguardError):
            pass  # the lease is no longer ours: the next owner re-sends the step
        except Error as exc:  # InterfaceError too: a connection a restart closed
            if is_disconnect(exc):
                outage.failed(exc, "writing a completion", attempted)
                # Tried again as soon as the database answers (the loop comes back at once).
                pause = 0.05
                while not reconnect("writing a completion"):
                    if self.ending.is_set() and time.monotonic() > self.give_up_at:
                        return
                    time.sleep(pause)
                    pause = min(pause * 2, 0.5)
            else:  # a lock held past the window: tried again at the next look
                log.debug("run %s: a completion not written yet: %s", pending.run_id, exc)
                connection.close_if_unusable_or_obsolete()
            return
        with self.cond:
            if self.pending.get(pending.completion.step_id) is pending:
                del self.pending[pending.completion.step_id]


def main(argv: list[str]) -> None:
    """The heart process: `to_heart from_heart worker_id lease_seconds` (pipe fds first)."""
    # The worker decides when to stop: a terminal's Ctrl-C reaches the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import django

    django.setup()
    from runs import logcontext
    from runs.engine import outage as outages

    # Its outages under a name of its own: the worker says each outage once, and so does
    # its heart, in the same output (a reader, or a test, tells the two apart).
    outages.log = logging.getLogger("stepguard.heart.database")

    inbox, out = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    logcontext.process_worker = argv[2]
    beat = Beat(argv[2], os.getppid(), float(argv[3]), out)
    threads = [
        threading.Thread(target=beat.renew_loop, name="stepguard-renew", daemon=True),
        threading.Thread(target=beat.write_loop, name="stepguard-completions", daemon=True),
    ]
    for thread in threads:
        thread.start()
    beat.tell(("ready",))
    while not beat.ending.is_set():
        try:
            message: Any = inbox.recv()
        except (EOFError, OSError):
            break  # the worker died (or closed its end): write what is held, then go
        beat.handle(message)
    beat.end()
    beat.done.wait(LAST_WRITES_SECONDS + 5)
    os._exit(0)
