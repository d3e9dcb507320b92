"""The engine's pure pieces, each with the invariant it carries; no database (pytest-django
refuses one to a test not marked for it).

The budget and cancel conditions of a fenced write exist twice, as SQL (the check) and as
Python over the run row (the explanation of a refusal): here both are evaluated over the same
rows, in an in-memory SQLite of the Python standard library, and must agree on every one.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import itertools
import re
import sqlite3
import threading
import uuid
from dataclasses import FrozenInstanceError
from datetime import UTC, datetime
from pathlib import Path

import pytest

from runs.engine import deltas
from runs.engine.aio.host import AsyncHost, wait_for
from runs.engine.aio.turnstile import Turnstile, TurnstileState
from runs.engine.budget import NOTHING, Amount
from runs.engine.calls import ModelCalls
from runs.engine.context import Engine, RunContext
from runs.engine.fences import (
    CONDITIONS,
    Fence,
    Lease,
    Spend,
    _in_budget,
    _not_cancelled,
    fence_statement,
)
from runs.engine.history import History
from runs.engine.outcomes import Completed, Failed, Position
from runs.engine.recorded import Recorded
from runs.engine.retry import RetryPolicy
from runs.engine.step_starts import StepOptions
from runs.engine.steps import Steps
from runs.engine.waits import Waits
from runs.errors import NonDeterminismError, StepFailed, StepMisuse
from runs.models import Run, Step
from tests.conftest import assert_acyclic, wait_until

DEADLINE = 10.0

# --- Amount -----------------------------------------------------------------------------------


def test_an_amount_adds_only_amounts():
    assert Amount(3, 5) + Amount(1, 2) == Amount(4, 7)
    with pytest.raises(TypeError):
        Amount(3, 5) + (1, 2)  # type: ignore[operator]  # noqa: RUF005
    with pytest.raises(TypeError):
        Amount(3, 5) + 1  # type: ignore[operator]


def test_an_amount_is_a_value():
    amount = Amount(3, 5)
    with pytest.raises(FrozenInstanceError):
        amount.micros = 4  # type: ignore[misc]
    assert amount == Amount(micros=3, tokens=5) and hash(amount) == hash(Amount(3, 5))
    assert Amount() == NOTHING


def test_an_amount_is_true_when_it_counts_anything():
    assert not NOTHING
    assert Amount(1, 0) and Amount(0, 1)


def test_beyond_is_what_is_needed_on_top_and_never_negative():
    assert Amount(10, 10).beyond(Amount(4, 20)) == Amount(6, 0)
    assert Amount(1, 1).beyond(NOTHING) == Amount(1, 1)
    for a, b in itertools.product([NOTHING, Amount(2, 7), Amount(9, 1)], repeat=2):
        # held + what is reserved on top covers what is wanted, and never more than needed
        wanted, held = a, b
        reserved = held + wanted.beyond(held)
        assert reserved.micros == max(wanted.micros, held.micros)
        assert reserved.tokens == max(wanted.tokens, held.tokens)


# --- fence_statement --------------------------------------------------------------------------


def _lease() -> Lease:
    return Lease(run_id=uuid.uuid4(), epoch=7)


def _placeholders(sql: str) -> set[str]:
    return set(re.findall(r"%\((\w+)\)s", sql))


@pytest.mark.parametrize(
    "checks",
    [
        Fence(),
        Fence(events=3, progress=True),
        Fence(starting=True),
        Fence(starting=True, compensating=True),
        Fence(starting=True, estimate=Amount(5, 6), held=Amount(1, 2), possibly=Amount(3, 4)),
        Fence(spend=Spend(10, 2, 3, Amount(4, 5))),
        Fence(possibly=Amount(1, 1)),
    ],
)
def test_fence_statement_binds_one_parameter_per_placeholder(checks):
    sql, params = fence_statement(_lease(), checks)
    assert "%s" not in sql and _placeholders(sql) == set(params)
    assert sql.startswith("UPDATE ") and sql.endswith(" RETURNING event_seq, created_at")
    assert params["events"] == checks.events


def test_every_fenced_write_checks_the_lease_and_only_a_start_checks_more():
    lease = _lease()
    sql, params = fence_statement(lease, Fence(spend=Spend(1, 1, 1), progress=True))
    assert sql.split(" WHERE ", 1)[1] == (
        "id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s"
        " RETURNING event_seq, created_at"
    )
    assert (params["epoch"], params["running"]) == (7, "running")
    started, _ = fence_statement(lease, Fence(starting=True))
    assert "cancel_requested_at IS NULL" in started
    assert "halted_at" in started and "budget_micros" in started


def test_a_compensation_is_checked_against_holds_only():
    sql, _ = fence_statement(_lease(), Fence(starting=True, compensating=True))
    assert "cancel_requested_at" not in sql and "budget_micros" not in sql
    assert "halted_at" in sql  # halts stop everything, undoing included


def test_a_start_reserves_its_estimate_and_a_finish_gives_back_what_it_held():
    sql, params = fence_statement(_lease(), Fence(starting=True, estimate=Amount(5, 6)))
    assert "reserved_micros = reserved_micros + %(reserve_micros)s" in sql
    assert (params["reserve_micros"], params["reserve_tokens"]) == (5, 6)
    sql, params = fence_statement(_lease(), Fence(spend=Spend(10, 2, 3, Amount(4, 5))))
    assert "cost_micros = cost_micros + %(spent_micros)s" in sql
    assert [params[name] for name in ("spent_micros", "tokens_in", "tokens_out")] == [10, 2, 3]
    assert (params["given_micros"], params["given_tokens"]) == (4, 5)


# --- the SQL and refusal pairs ----------------------------------------------------------------

_COLUMNS = (
    "budget_micros",
    "budget_tokens",
    "cost_micros",
    "tokens_in",
    "tokens_out",
    "reserved_micros",
    "reserved_tokens",
    "possibly_spent_micros",
    "possibly_spent_tokens",
    "cancel_requested_at",
)


def _sql_accepts(db: sqlite3.Connection, row: dict, condition, checks: Fence) -> bool:
    db.execute("DELETE FROM runs_run")
    db.execute(
        f"INSERT INTO runs_run ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
        list(row.values()),
    )
    more, params = condition.sql(checks)
    named = re.sub(r"%\((\w+)\)s", r":\1", more)  # sqlite3's named style, as Django's backend
    found = db.execute("SELECT 1 FROM runs_run WHERE 1 = 1" + named, params)
    return found.fetchone() is not None


def _rows():
    limits = [None, 0, 10]
    for budget, cost, reserved, possibly in itertools.product(limits, [0, 4, 10], [0, 3], [0, 2]):
        yield {
            "budget_micros": budget,
            "budget_tokens": None,
            "cost_micros": cost,
            "tokens_in": 0,
            "tokens_out": 0,
            "reserved_micros": reserved,
            "reserved_tokens": 0,
            "possibly_spent_micros": possibly,
            "possibly_spent_tokens": 0,
            "cancel_requested_at": None,
        }
        yield {
            "budget_micros": None,
            "budget_tokens": budget,
            "cost_micros": 0,
            "tokens_in": cost // 2,
            "tokens_out": cost - cost // 2,
            "reserved_micros": 0,
            "reserved_tokens": reserved,
            "possibly_spent_micros": 0,
            "possibly_spent_tokens": possibly,
            "cancel_requested_at": None,
        }


def _fences():
    for estimate, held, possibly in itertools.product([0, 1, 6], [0, 3], [0, 1]):
        yield Fence(
            starting=True,
            estimate=Amount(estimate, estimate),
            held=Amount(held, held),
            possibly=Amount(possibly, possibly),
        )


@pytest.fixture
def runs_table():
    db = sqlite3.connect(":memory:")
    db.execute(f"CREATE TABLE runs_run ({', '.join(_COLUMNS)})")
    yield db
    db.close()


def test_the_budget_check_and_its_explanation_agree(runs_table):
    (budget,) = [c for c in CONDITIONS if c.refusal is _in_budget]
    seen = {True: 0, False: 0}
    for row, checks in itertools.product(_rows(), _fences()):
        accepted = _sql_accepts(runs_table, row, budget, checks)
        explained = _in_budget(Run(**row), checks)
        assert accepted == (explained is None), (row, checks, explained)
        seen[accepted] += 1
    assert seen[True] and seen[False]  # both sides of the line were crossed


def test_the_cancel_check_and_its_explanation_agree(runs_table):
    (cancel,) = [c for c in CONDITIONS if c.refusal is _not_cancelled]
    row = dict.fromkeys(_COLUMNS, 0) | {"budget_micros": None, "budget_tokens": None}
    for at in (None, datetime(2026, 1, 1, tzinfo=UTC)):
        row["cancel_requested_at"] = at and at.isoformat()
        accepted = _sql_accepts(runs_table, row, cancel, Fence(starting=True))
        explained = _not_cancelled(Run(cancel_requested_at=at), Fence(starting=True))
        assert accepted == (explained is None)


def test_each_condition_applies_to_starts_only():
    for condition in CONDITIONS:
        assert not condition.applies(Fence())
        assert not condition.applies(Fence(spend=Spend(1), progress=True))
        assert condition.applies(Fence(starting=True))


# --- the turnstile ----------------------------------------------------------------------------


def _enter_in_threads(turnstile: Turnstile, tickets: list[int], order: list[int]) -> list:
    def call(ticket: int) -> None:
        if turnstile.enter(ticket, releasable=False):
            order.append(ticket)
            turnstile.leave()

    threads = [threading.Thread(target=call, args=(t,)) for t in tickets]
    for thread in threads:
        thread.start()
    return threads


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(DEADLINE)
        assert not thread.is_alive()


def test_the_turnstile_lets_calls_in_in_ticket_order_whatever_the_threads_do():
    turnstile = Turnstile()
    tickets = [turnstile.ticket() for _ in range(8)]
    order: list[int] = []
    _join(_enter_in_threads(turnstile, list(reversed(tickets)), order))
    assert order == tickets


def test_an_abandoned_ticket_holds_no_one_up():
    turnstile = Turnstile()
    tickets = [turnstile.ticket() for _ in range(4)]
    turnstile.abandon(tickets[1])
    order: list[int] = []
    threads = _enter_in_threads(turnstile, [t for t in tickets if t != 1], order)
    _join(threads)
    assert order == [0, 2, 3]
    assert turnstile.enter(tickets[1], releasable=False) is False


def test_a_released_context_is_taken_by_the_next_ticket_and_given_back():
    turnstile = Turnstile()
    first, second = turnstile.ticket(), turnstile.ticket()
    assert turnstile.enter(first, releasable=True)
    assert turnstile.releasable() and not turnstile.released()
    order: list[int] = []
    threads = _enter_in_threads(turnstile, [second], order)
    turnstile.release()  # first waits (its async call) while second goes in
    assert turnstile.released()
    _join(threads)
    assert order == [second]
    turnstile.reacquire()
    assert not turnstile.released()
    turnstile.leave()


# --- the async runtime: steps interleaved on a controlled loop (docs/async.md) ----------------


@pytest.fixture
def controlled_loop():
    """An event loop of the test's own, on a thread of its own: the calls' async answers are
    futures on it that the test resolves, in the order it chooses."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(DEADLINE)
    loop.close()


class _Workflow:
    """What the engine does for `ctx.llm` / `ctx.step`, reduced to positions and turns: a step
    takes its position (History, the replay cursor), waits for its async answer through
    `wait_for` (giving its turn up meanwhile) and writes its checkpoint on return. Each
    milestone is logged with the turnstile's (serving, busy) at that moment."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.host = AsyncHost(owner=0, loop=loop, threads=4)
        self.history = History({}, attempt=1, failed_step=None)
        self.log: list[tuple] = []
        self.answers: dict[str, asyncio.Future] = {}

    def _note(self, what: str, key: str, seq: int) -> None:
        state = self.host.turnstile.state()
        self.log.append((what, key, seq, state.serving, state.busy))

    def step(self, key: str):
        async def call():
            return await self.answers[key]

        def run():  # on a database thread, in its turn
            _, seq, _ = self.history.take(key)
            self._note("start", key, seq)
            answer = wait_for(call(), self.host)  # the turn is given up while this waits
            self._note("finish", key, seq)
            return seq, answer

        return run

    def hold(self, key: str, until: threading.Event):
        """A call that is not a step (a wait, a child): it keeps its turn until it returns."""

        def run():
            _, seq, _ = self.history.take(key)
            self._note("start", key, seq)
            assert until.wait(DEADLINE)
            return seq

        return run

    def start(self, *calls) -> concurrent.futures.Future:
        """`asyncio.gather(*calls)` as an async workflow's coroutine on the loop; `calls` are
        (releasable, function) and each call's task is kept (`tasks`) to be cancelled."""

        async def workflow():
            for key in ("a", "b", "c", "d"):
                self.answers[key] = self.loop.create_future()
            self.tasks = [asyncio.ensure_future(self.host.enter(r, fn)) for r, fn in calls]
            try:
                return await asyncio.gather(*self.tasks, return_exceptions=True)
            finally:
                await self.host.drain()

        return asyncio.run_coroutine_threadsafe(workflow(), self.loop)

    def answer(self, key: str) -> None:
        self.loop.call_soon_threadsafe(self.answers[key].set_result, f"answer {key}")

    def end(self, *holds: threading.Event) -> None:
        """Whatever happened: every call answered and let go, then the threads ended."""
        for hold in holds:
            hold.set()
        for future in self.answers.values():
            self.loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))
        self.host.close()

    def at(self, state: TurnstileState, log: int) -> None:
        wait_until(
            lambda: self.host.turnstile.state() == state and len(self.log) == log,
            timeout=DEADLINE,
            what=lambda: f"{state}, {log} logged; at {self.host.turnstile.state()}, {self.log}",
        )


def test_gathered_steps_take_positions_in_call_order_and_write_as_their_answers_come(
    controlled_loop,
):
    """`asyncio.gather(ctx.llm("a", ...), ctx.llm("b", ...))`, b answered first: positions
    follow the order of the calls (a 0, b 1, as a sequential replay takes them), each step
    gives its turn up while it waits, and b writes its checkpoint, at its own position, while
    a still waits."""
    flow = _Workflow(controlled_loop)
    try:
        gathered = flow.start((True, flow.step("a")), (True, flow.step("b")))
        # Both started in ticket order, then gave their turn up: nobody holds the context.
        flow.at(TurnstileState(issued=2, serving=2, busy=False, abandoned=frozenset()), log=2)
        assert flow.log == [("start", "a", 0, 1, True), ("start", "b", 1, 2, True)]
        flow.answer("b")
        flow.at(TurnstileState(2, 2, False, frozenset()), log=3)
        assert flow.log[2] == ("finish", "b", 1, 2, True)  # b took its turn back to write
        assert not gathered.done()  # a still waits for its answer
        flow.answer("a")
        assert gathered.result(DEADLINE) == [(0, "answer a"), (1, "answer b")]
        assert flow.log[3] == ("finish", "a", 0, 2, True)
        assert flow.host.turnstile.state() == TurnstileState(2, 2, False, frozenset())
        assert flow.history.next_seq == 2
    finally:
        flow.end()
    assert flow.host.threads.started() == 2  # one per call in flight at once, all ended


def test_a_wait_keeps_its_turn_and_a_call_cancelled_before_its_turn_takes_no_position(
    controlled_loop,
):
    """A wait keeps the context until it returns: the steps gathered beside it queue behind it.
    One of them cancelled before its turn (asyncio.wait_for, a cancelled task) is abandoned:
    it never runs, takes no position, and holds no one up."""
    flow = _Workflow(controlled_loop)
    release = threading.Event()
    try:
        gathered = flow.start(
            (False, flow.hold("w", release)), (True, flow.step("c")), (True, flow.step("d"))
        )
        flow.at(TurnstileState(issued=3, serving=1, busy=True, abandoned=frozenset()), log=1)
        controlled_loop.call_soon_threadsafe(flow.tasks[1].cancel)
        flow.at(TurnstileState(3, 2, True, frozenset({1})), log=1)  # c skipped, w still in
        release.set()
        flow.at(TurnstileState(3, 3, False, frozenset({1})), log=2)  # d in, then waiting
        assert flow.log == [("start", "w", 0, 1, True), ("start", "d", 1, 3, True)]
        flow.answer("d")
        w, c, d = gathered.result(DEADLINE)
        assert (w, type(c), d) == (0, asyncio.CancelledError, (1, "answer d"))
        assert flow.log[2] == ("finish", "d", 1, 3, True)
        assert flow.history.next_seq == 2  # c took no position
    finally:
        flow.end(release)


# --- deltas -----------------------------------------------------------------------------------


def _expanded(stored_by_seq: dict[int, dict], seq: int) -> dict:
    conversations = deltas.Conversations(run_id=None)
    conversations._stored = {s: [v] for s, v in stored_by_seq.items()}  # the rows it would load
    return conversations.expanded(seq, [stored_by_seq[seq]])[0]


def test_a_request_stored_against_the_one_before_reads_back_whole():
    first = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "system": "be brief"}
    second = {
        "model": "m",
        "messages": [*first["messages"], {"role": "assistant", "content": "hello"}],
        "system": "be brief",
    }
    stored_first = deltas.against(first, None)
    stored_second = deltas.against(second, (3, first))
    assert stored_second["messages"] == {"$after": 3, "$keep": 1, "$new": second["messages"][1:]}
    assert stored_second["system"] == {"$after": 3}
    assert stored_second[deltas.HASH] == deltas.fingerprint(second)
    assert _expanded({3: stored_first, 8: stored_second}, 8) == second


def test_a_delta_never_points_forward_or_at_a_request_it_was_not_made_against():
    request = {"messages": [1, 2, 3]}
    stored = deltas.against(request, (5, {"messages": [9]}))
    assert stored["messages"] == [1, 2, 3]  # nothing in common: stored whole
    forged = {"messages": {"$after": 9, "$keep": 1, "$new": []}, deltas.HASH: "x"}
    assert _expanded({4: forged}, 4)["messages"] == forged["messages"]  # 9 is not before 4


def test_the_fingerprint_does_not_depend_on_key_order():
    assert deltas.fingerprint({"a": 1, "b": [2]}) == deltas.fingerprint({"b": [2], "a": 1})
    assert deltas.fingerprint({"a": 1}) != deltas.fingerprint({"a": 2})


# --- History: the replay cursor ----------------------------------------------------------------


def _recorded(*steps: tuple[str, str, int]) -> dict[int, Step]:
    return {
        seq: Step(seq=seq, key=key, status=status, run_attempt=attempt, error={"message": key})
        for seq, (key, status, attempt) in enumerate(steps)
    }


def test_each_call_takes_the_next_position_and_a_repeated_key_is_numbered():
    history = History(_recorded(("a", "completed", 1)), attempt=1, failed_step=None)
    assert history.peek() is not None and history.peek().key == "a"
    assert history.take("a")[:2] == ("a", 0)
    assert history.take("a") == ("a#2", 1, None)
    history.skip()  # a patch marker's position
    assert history.take("b") == ("b", 3, None)
    assert history.next_seq == 4
    for bad in ("", "x#2", "k" * 201, 42):
        with pytest.raises(StepMisuse, match="invalid step key"):
            history.take(bad)  # type: ignore[arg-type]
    assert history.take("undo:x#2", internal=True)[0] == "undo:x#2"


def test_a_completed_record_replays_and_a_failure_is_raised_again_unless_it_ended_the_attempt():
    steps = _recorded(
        ("done", "completed", 1),
        ("caught", "failed", 1),  # failed, caught by the code, which went on
        ("ended-it", "failed", 1),  # the failure that ended attempt 1
    )
    retried = History(steps, attempt=2, failed_step="ended-it")
    assert [retried.take(key) for key in ("done", "caught", "ended-it")]
    assert retried.replays("done", 0, steps[0]) is True
    with pytest.raises(StepFailed):
        retried.replays("caught", 1, steps[1])
    assert retried.replays("ended-it", 2, steps[2]) is False  # attempted afresh
    assert retried.replays("other", 0, steps[0]) is False  # a different step: not the cursor's call
    same_attempt = History(steps, attempt=1, failed_step="ended-it")
    with pytest.raises(StepFailed):
        same_attempt.replays("ended-it", 2, steps[2])  # in its own attempt it replays as itself


def test_returning_before_every_recorded_position_is_a_changed_workflow():
    history = History(_recorded(("a", "completed", 1), ("b", "completed", 1)), attempt=1,
                      failed_step=None)  # fmt: skip
    history.take("a")
    with pytest.raises(NonDeterminismError, match="'b'"):
        history.check_all_replayed()
    history.take("b")
    history.check_all_replayed()


def test_an_undo_goes_where_it_was_recorded_else_past_everything_recorded():
    steps = _recorded(("a", "completed", 1), ("b", "completed", 1), ("undo:b", "completed", 1))
    history = History(steps, attempt=1, failed_step=None)
    history.take("a")
    history.seek_undo("b")
    assert history.next_seq == 2
    history.seek_undo("a")
    assert history.next_seq == 3


# --- Outage: said once --------------------------------------------------------------------------


def test_an_outage_is_said_once_and_a_straggler_of_the_last_one_opens_no_new_one(caplog):
    import time

    from runs.engine.outage import Outage

    outage, lost = Outage(), ConnectionError("server closed the connection")
    with caplog.at_level("DEBUG", logger="stepguard.database"):
        began = time.monotonic()  # an attempt that fails after the outage is over
        outage.failed(lost, "claiming", time.monotonic())
        outage.failed(lost, "heartbeat", time.monotonic())
        outage.ok()
        outage.ok()
        outage.failed(lost, "a run thread reconnecting", began)
        assert [r.levelname for r in caplog.records] == ["ERROR", "DEBUG", "WARNING", "DEBUG"]
        outage.failed(lost, "claiming", time.monotonic())  # begun after: a new outage
    assert caplog.records[-1].levelname == "ERROR"
    assert "database unreachable (claiming: server closed the connection)" in caplog.text


# --- the façade ------------------------------------------------------------------------------


def test_workflow_code_sees_the_public_calls_and_the_runs_identity_and_nothing_of_the_engine():
    calls = {
        "step", "transaction", "llm", "tool", "agent_loop", "approval", "approvals", "child",
        "children", "sleep", "sleep_until", "wait_for_event", "now", "random", "uuid", "patched",
        "set_event", "idempotency_key",
    }  # fmt: skip
    identity = {
        "run_id", "workflow", "version", "input", "attempt", "worker_id", "labels", "scheduled_at",
    }  # fmt: skip
    assert {name for name in dir(RunContext) if not name.startswith("_")} == calls | identity
    private = {n for n in vars(RunContext) if n.startswith("_") and not n.startswith("__")}
    assert private == {"_engine"}
    # Each call is the engine's own, signature and docstring included (one-line delegations).
    for name in calls - {"idempotency_key"}:
        delegate = getattr(RunContext, name)
        owner = {"steps": Steps, "waits": Waits, "calls": ModelCalls, "recorded": Recorded}
        assert delegate.part in Engine.__slots__, name
        assert delegate.__doc__ == getattr(owner[delegate.part], name).__doc__, name


# --- One writer -------------------------------------------------------------------------------

ENGINE = Path(__file__).resolve().parent.parent / "runs" / "engine"
WRITES = {"create", "update", "bulk_create", "delete", "get_or_create", "update_or_create"}


def _modules() -> list[Path]:
    """Every module of the engine, its subpackages' (runs/engine/aio/) included."""
    return sorted(ENGINE.rglob("*.py"))


def _file(module: Path) -> str:
    """`checkpoints.py`, `aio/host.py`: a module's path in the engine."""
    return module.relative_to(ENGINE).as_posix()


def _name(module: Path) -> str:
    """`checkpoints`, `aio.host`, `aio` (a package's __init__): its name under runs.engine."""
    parts = module.relative_to(ENGINE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _calls(module: Path):
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Call):
            yield node


def _writes_steps(call: ast.Call) -> bool:
    """`Step.objects....update(...)` and the like, however long the chain."""
    if not (isinstance(call.func, ast.Attribute) and call.func.attr in WRITES):
        return False
    node = call.func.value
    while isinstance(node, ast.Call | ast.Attribute):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id == "Step"


def test_step_rows_are_written_by_checkpoints_alone():
    """docs/architecture.md: checkpoints.py writes step rows (with store.py's fenced write
    beneath it), so a check every step write needs is added in one place."""
    writers = {_file(m) for m in _modules() if any(_writes_steps(c) for c in _calls(m))}
    assert writers == {"checkpoints.py", "store.py"}


def test_within_an_execution_events_are_appended_by_checkpoints_alone():
    """The concerns of an execution (steps, waits, model calls, replay...) append their
    events through Checkpoints; only code outside an execution (a claim, the parking of a
    held run, the end or pause of a run, a debounced start) appends a run's event through the
    store."""
    appenders = {
        _file(m)
        for m in _modules()
        if any(isinstance(c.func, ast.Name) and c.func.id == "append_event" for c in _calls(m))
    }
    outside = {"claims.py", "unheld.py", "lifecycle.py", "starts.py"}
    assert appenders == {"checkpoints.py", "store.py", *outside}


def test_within_an_execution_fenced_writes_are_made_by_checkpoints_alone():
    """The fence (`fence`, `fenced_write`) is the write of an execution's lease: its concerns
    reach it through Checkpoints; the run's end (lifecycle) fences its own last write."""
    fencers = {
        _file(m)
        for m in _modules()
        if any(
            isinstance(c.func, ast.Name) and c.func.id in ("fence", "fenced_write")
            for c in _calls(m)
        )
    }
    assert fencers == {"checkpoints.py", "store.py", "lifecycle.py"}


#: The concerns of an execution: what workflow code calls into, and what it is made of.
CONCERNS = (
    "steps.py", "waits.py", "step_starts.py", "step_deadline.py", "recorded.py", "history.py",
    "compensation.py", "agent.py", "llm.py", "flow.py", "context.py", "dry.py",
)  # fmt: skip


def test_the_concerns_of_an_execution_leave_the_write_protocol_to_checkpoints():
    """Issue 52 §1: a wait or a step writes through a unit of work of Checkpoints
    (`parking`, `transaction_step`), which takes the fence, orders the writes and reserves
    the events' seqs: a new wait kind cannot get the order or the count wrong, because it
    neither opens the transaction (`atomic(`) nor sees a seq (`event_seq`)."""
    found = []
    for name in CONCERNS:
        text = (ENGINE / name).read_text()  # a concern renamed: say so here
        found += [f"{name}: {word}" for word in ("atomic(", "event_seq") if word in text]
    assert not found, found


def test_a_position_and_an_outcome_are_values_checkpoints_turns_into_columns():
    """Issue 52 §3: a position names its idempotency key in one place; a completion and a
    failure say what goes on the row and in the event, and nothing else is built by hand."""
    at = Position("r1", 3, "charge#2")
    assert at.idempotency_key == "r1:charge#2"
    with pytest.raises(FrozenInstanceError):
        at.key = "other"  # type: ignore[misc]
    confirmed = Completed(output={"id": 7}, recovered="confirmed", approval_id=9)
    assert confirmed.columns() == {
        "status": "completed",
        "output": {"id": 7},
        "recovered": "confirmed",
    }
    assert confirmed.payload() == {"recovered": "confirmed", "approval_id": 9}
    assert Completed(output=1, attempt=2, kind="llm").columns()["kind"] == "llm"
    answer = Failed(StepMisuse("no"), 1)  # not retryable: an answer, the same next time
    assert (answer.record["retryable"], answer.record["attempts"]) == (False, 1)
    outage = Failed(ConnectionError("down"), 5)
    assert outage.record["retryable"] is True
    assert (
        Failed(ConnectionError("down"), 5, RetryPolicy(retry_on=(KeyError,))).record["retryable"]
        is False
    )


def test_step_options_are_named_and_run_keys_are_formatted_by_the_position_alone():
    """A new `ctx.step` option cannot be passed in the wrong place: StepOptions takes names
    only. `<run id>:<key>` (a step's idempotency key, a child run's key) is Position's."""
    with pytest.raises(TypeError):
        StepOptions(None, None, "resend")  # type: ignore[misc]
    assert StepOptions(on_ambiguous="ask").durable
    formatting = [m.name for m in ENGINE.glob("*.py") if re.search(r"run_id\}:\{", m.read_text())]
    assert formatting == ["outcomes.py"]


def _engine_imports(module: Path, modules: set[str]) -> set[str]:
    """The engine modules `module` imports anywhere: at the top, in a function, or for type
    checking only (each of those dodges a cycle rather than removing it). Importing
    `runs.engine.aio.host` runs the package's `aio/__init__.py` first: an edge to `aio` too."""
    found = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert not node.level, f"{_file(module)}: a relative import (the engine's are absolute)"
            if node.module == "runs.engine" or (node.module or "").startswith("runs.engine."):
                base = node.module.removeprefix("runs.engine").removeprefix(".")
                found.add(base)
                found |= {f"{base}.{a.name}".lstrip(".") for a in node.names} & modules
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("runs.engine.")
                for a in node.names
                if a.name.startswith("runs.engine.")
            }

    def packages(name: str) -> set[str]:
        return {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}

    # A module's own packages are initialised before it: no edge (the package may import it).
    own = {"", _name(module), *packages(_name(module))}
    return {p for n in found for p in {n, *packages(n)}} - own


def test_the_engines_modules_import_each_other_in_one_direction():
    """No import cycle in runs/engine, lazy and type-checking imports included: each module
    can be read (and type-checked) knowing only those it imports."""
    modules = {_name(m) for m in _modules()}
    graph = {_name(m): _engine_imports(m, modules) for m in _modules()}
    assert {"aio", "aio.host", "aio.bridge", "execution"} <= set(graph)
    assert_acyclic(graph)


def test_the_approvals_app_is_part_of_the_runs_package_and_nothing_imports_the_old_name():
    """runs and approvals are one component (docs/architecture.md): the app lives in
    runs/approvals/; the top-level `approvals` module only tells an old setting its new name."""
    root = ENGINE.parent.parent
    old = re.compile(r"^\s*(from approvals[ .]|import approvals\b)", re.M)
    found = [
        str(path.relative_to(root))
        for package in ("runs", "controlplane", "examples", "tests")
        for path in (root / package).rglob("*.py")
        if old.search(path.read_text())
    ]
    assert not found, found


def test_the_runs_app_imports_nothing_from_the_project_package():
    """runs is a reusable app (docs/install.md): a host project has no `controlplane`. What the
    app needs (its settings' parsers, its security middleware, health, the database-down
    answer) lives in the app, and the project imports it from there, never the reverse. Lazy
    and type-checking imports count."""
    root = ENGINE.parent.parent
    found = []
    for path in sorted((root / "runs").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [
                f"{path.relative_to(root)}:{node.lineno} {name}"
                for name in names
                if name == "controlplane" or name.startswith("controlplane.")
            ]
    assert not found, found


def test_a_re_sent_stream_is_shown_once_and_cut_back_where_it_differs():
    """Issue 49 §4: what the readers were shown is not written again; where a re-sent answer
    parts from it, the first piece cuts back to that offset; a shorter one cuts the rest."""
    from runs.engine.streaming import Relay, fold

    def resend(shown: str, pieces: list[str]) -> tuple[list, list]:
        shared, handed = [], []
        relay = Relay(
            step="ask", seq=0, attempt=2, shown=shown, share=lambda *p: shared.append(p),
            on_delta=handed.append,
        )  # fmt: skip
        for piece in pieces:
            relay(piece)
        relay.close()
        return shared, handed

    shared, handed = resend("hello wor", ["hello ", "world", "!"])
    assert shared == [(9, "text", "ld"), (11, "text", "!")]  # the rest, once
    assert fold([(0, "hello wor"), *((o, t) for o, _, t in shared)]) == "hello world!"
    assert [(d.offset, d.restart, d.attempt) for d in handed] == [(0, True, 2), (6, False, 2),
                                                                 (11, False, 2)]  # fmt: skip
    shared, _ = resend("hello world", ["hello ", "there"])
    assert shared == [(6, "text", "there")]  # cut back to where they part
    assert fold([(0, "hello world"), *((o, t) for o, _, t in shared)]) == "hello there"
    shared, _ = resend("hello world", ["hello"])
    assert shared == [(5, "text", "")]  # a shorter answer cuts the rest
    shared, _ = resend("", ["a", "b"])
    assert shared == [(0, "text", "a"), (1, "text", "b")]
