"""Workflows the tests run, in-process and in real worker subprocesses.

Side effects go to tests.testapp.models.Effect (one row per call, keyed by idempotency key),
so a test can count how often each step's function really ran.
"""

import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from runs.sdk import NOT_FOUND, ModelRequestRejected, RetryPolicy, RunContext, workflow
from tests.testapp.models import Effect

NO_RETRY = RetryPolicy(max_attempts=1)

#: Calls per step key made in this process (for in-process tests).
calls: dict[str, int] = {}
#: Set by in-process tests to make a step raise as if the process died mid-call.
crash_at: set[str] = set()
#: Set by in-process tests to change a workflow's code under a running run.
variant: dict[str, str] = {}
#: Set by in-process tests: called inside the step of that label, as if from elsewhere.
hooks: dict[str, object] = {}


class Crash(KeyboardInterrupt):
    """Stands in for the process dying: the one exception the engine never records (any other,
    `BaseException`s included, is the run's error)."""


def effect(ctx: RunContext, label: str, value=None, sleep: float = 0.0):
    calls[label] = calls.get(label, 0) + 1
    Effect.objects.create(idempotency_key=ctx.idempotency_key, label=label, pid=os.getpid())
    if sleep:
        time.sleep(sleep)
    if label in hooks:
        hooks.pop(label)()
    if label in crash_at:
        crash_at.discard(label)
        raise Crash(label)
    return value if value is not None else label


def find_effect(idempotency_key: str):
    found = Effect.objects.filter(idempotency_key=idempotency_key).first()
    return NOT_FOUND if found is None else {"found": found.label}


@workflow("ledger")
def ledger(ctx: RunContext, input: dict):
    """`steps` steps: `slow` ones sleep `slow_seconds`, `reconcile` ones reconcile."""
    total = 0
    for i in range(input["steps"]):
        sleep = (
            input.get("slow_seconds", 0) if i in input.get("slow", []) else input.get("sleep", 0)
        )
        reconcile = find_effect if i in input.get("reconcile", []) else None
        out = ctx.step(f"s{i}", effect, ctx, f"s{i}", i, sleep, reconcile=reconcile)
        total += out if isinstance(out, int) else i
    return total


def file_effect(ctx: RunContext, directory: str, label: str, value: int, sleep: float) -> int:
    """A side effect kept outside the database, so no database crash can take its record back."""
    line = {"key": ctx.idempotency_key, "label": label, "value": value, "pid": os.getpid()}
    with (Path(directory) / f"effects-{os.getpid()}.jsonl").open("a") as ledger:
        ledger.write(json.dumps({**line, "at": time.time()}) + "\n")
    if sleep:
        time.sleep(sleep)
    return value


def file_effects(directory: str, pattern: str = "effects-*.jsonl") -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(Path(directory).glob(pattern))
        for line in path.read_text().splitlines()
    ]


def find_file_effect(directory: str):
    """A `reconcile=` function for `file_effect`: looks the key up, and notes that it was asked."""

    def reconcile(idempotency_key: str):
        found = [e for e in file_effects(directory) if e["key"] == idempotency_key]
        with (Path(directory) / f"asked-{os.getpid()}.jsonl").open("a") as asked:
            asked.write(json.dumps({"key": idempotency_key, "found": bool(found)}) + "\n")
        return found[0]["value"] if found else NOT_FOUND

    return reconcile


@workflow("file_ledger")
def file_ledger(ctx: RunContext, input: dict):
    """Like `ledger`, with its effects in files under `dir`; `reconcile` looks them up there."""
    directory = input["dir"]
    reconcile = find_file_effect(directory) if input.get("reconcile") else None
    total = 0
    for i in range(input["steps"]):
        label, sleep = f"s{i}", input.get("sleep", 0)
        total += ctx.step(label, file_effect, ctx, directory, label, i, sleep, reconcile=reconcile)
    return total


@workflow("txn")
def txn(ctx: RunContext, input: dict):
    def write():
        Effect.objects.create(idempotency_key=ctx.idempotency_key, label="txn", pid=os.getpid())
        if not Path(input["release_flag"]).exists():
            Path(input["entered_flag"]).touch()
            time.sleep(60)
        return "written"

    before = ctx.step("before", effect, ctx, "before")
    return [before, ctx.transaction("write", write)]


@workflow("shapes")
def shapes(ctx: RunContext, input: dict):
    """Control flow that tests flip through `variant`, to change code under a running run."""
    first = ctx.step("a", effect, ctx, "a")
    second = ctx.step(variant.get("second", "b"), effect, ctx, variant.get("second", "b"))
    return [first, second]


@workflow("loop")
def loop(ctx: RunContext, input: dict):
    return [ctx.step("search", lambda q=q: f"results for {q}") for q in input["queries"]]


@workflow("bad-output")
def bad_output(ctx: RunContext, input):
    return ctx.step("make", lambda: {"when": object()})


@workflow("nul-output")
def nul_output(ctx: RunContext, input):
    return ctx.step("make", lambda: "a\x00b")


@workflow("flaky")
def flaky(ctx: RunContext, input: dict):
    def attempt():
        calls["flaky"] = calls.get("flaky", 0) + 1
        if "flaky" in hooks:
            hooks.pop("flaky")()
        if calls["flaky"] <= input["failures"]:
            raise ConnectionError(f"failure {calls['flaky']}")
        return calls["flaky"]

    policy = RetryPolicy(max_attempts=input["attempts"], initial_interval=timedelta(0))
    return ctx.step("call", attempt, retry=policy)


@workflow("catches")
def catches(ctx: RunContext, input):
    from runs.sdk import StepFailed

    def boom():
        calls["boom"] = calls.get("boom", 0) + 1
        raise ValueError("no such flight")

    try:
        ctx.step("boom", boom, retry=NO_RETRY)
    except StepFailed as exc:
        message = exc.error["message"]
        handled = ctx.step("handled", lambda: f"told the model: {message}")
    ctx.step("after", effect, ctx, "after")
    return handled


@workflow("deterministic")
def deterministic(ctx: RunContext, input):
    values = {"now": ctx.now().isoformat(), "random": ctx.random(), "uuid": str(ctx.uuid())}
    ctx.step("last", effect, ctx, "last")
    return values


@workflow("misuse")
def misuse(ctx: RunContext, input):
    if input == "nested":
        return ctx.step("outer", lambda: ctx.step("inner", lambda: 1))
    return ctx.idempotency_key


@workflow("many")
def many(ctx: RunContext, input: dict):
    for i in range(input["steps"]):
        ctx.step(f"s{i}", int, i)
    if input.get("crash"):
        raise Crash("after all steps")
    return input["steps"]


# -- durable waits ---------------------------------------------------------------------------


@workflow("sleeper")
def sleeper(ctx: RunContext, input: dict):
    ctx.step("before", effect, ctx, "before")
    ctx.sleep("nap", input["seconds"])
    return ctx.step("after", effect, ctx, "after")


@workflow("waiter")
def waiter(ctx: RunContext, input: dict):
    from runs.sdk import WaitTimeout

    try:
        payload = ctx.wait_for_event("wait", "go", timeout=input.get("timeout"))
    except WaitTimeout:
        payload = "timed out"
    ctx.step("after", effect, ctx, "after")
    return payload


@workflow("two-waits")
def two_waits(ctx: RunContext, input):
    return [ctx.wait_for_event("first", "item"), ctx.wait_for_event("second", "item")]


@workflow("approver")
def approver(ctx: RunContext, input: dict):
    from runs.sdk import ApprovalExpired, ApprovalRejected

    try:
        decision = ctx.approval(
            "ok",
            action="charge card",
            summary=f"charge {input['amount']} EUR",
            # What it approves may be nested (the flight and its price, inside the booking).
            payload={k: v for k, v in input.items() if k in ("amount", "booking")},
            timeout=input.get("timeout"),
        )
    except (ApprovalRejected, ApprovalExpired) as exc:
        return f"refused: {exc}"
    if input.get("cooling_off"):
        ctx.sleep("cooling-off", input["cooling_off"])
    ctx.step("charge", effect, ctx, "charge", approval=decision)
    return {"approved_by": decision.decided_by, "comment": decision.comment}


@workflow("asker")
def asker(ctx: RunContext, input):
    booked = ctx.step("book", effect, ctx, "book", {"ref": "B1"}, on_ambiguous="ask")
    return booked


@workflow("parent")
def parent(ctx: RunContext, input: dict):
    from runs.sdk import ChildFailed

    try:
        results = ctx.children(
            [(f"c{i}", input.get("child", "ledger"),
              {"steps": input.get("steps", 2), "sleep": input.get("sleep", 0)})
             for i in range(input["n"])]
        )  # fmt: skip
    except ChildFailed as exc:
        return f"child failed: {exc}"
    ctx.step("after", effect, ctx, "after")
    return results


@workflow("saga")
def saga(ctx: RunContext, input: dict):
    def undo(label):
        def compensate(output):
            if input.get("idempotent_undo"):  # a service that dedupes on the idempotency key
                Effect.objects.get_or_create(
                    idempotency_key=ctx.idempotency_key,
                    defaults={"label": f"undo-{label}", "pid": os.getpid()},
                )
                time.sleep(input.get("undo_sleep", 0))
                return label
            return effect(ctx, f"undo-{label}", sleep=input.get("undo_sleep", 0))

        return compensate

    ctx.step("reserve", effect, ctx, "reserve", compensate=undo("reserve"))
    ctx.step("charge", effect, ctx, "charge", compensate=undo("charge"))
    ctx.step("email", effect, ctx, "email")  # nothing to undo
    if input.get("fail"):
        ctx.step("ship", lambda: 1 / 0, retry=NO_RETRY)
    return ctx.wait_for_event("wait", "confirm")


@workflow("patchy")
def patchy(ctx: RunContext, input):
    first = ctx.step("a", effect, ctx, "a")
    if variant.get("patched") and ctx.patched("better-b"):
        second = ctx.step("b2", effect, ctx, "b2")
    else:
        second = ctx.step("b", effect, ctx, "b")
    return [first, second]


@workflow("undo-loop")
def undo_loop(ctx: RunContext, input):
    for i in range(3):
        ctx.step(
            "hold", effect, ctx, f"hold-{i}", compensate=lambda out: effect(ctx, f"undo-{out}")
        )
    return ctx.wait_for_event("wait", "never")


@workflow("fan-then-nap")
def fan_then_nap(ctx: RunContext, input):
    from runs.sdk import ChildFailed

    with contextlib.suppress(ChildFailed):
        ctx.children([("bad", "bad-output", None), ("good", "ledger", {"steps": 1})])
    ctx.sleep("nap", 0.2)
    return "napped"


@workflow("fallback")
def fallback(ctx: RunContext, input):
    def primary():
        calls["primary"] = calls.get("primary", 0) + 1
        raise ConnectionError("primary down")

    def last():
        calls["last"] = calls.get("last", 0) + 1
        if calls["last"] == 1:
            raise ConnectionError("transient")
        return "done"

    try:
        ctx.step("primary", primary, retry=NO_RETRY)
    except Exception:
        ctx.step("fallback", lambda: "fallback used")
    return ctx.step("last", last, retry=NO_RETRY)


@workflow("double-patch")
def double_patch(ctx: RunContext, input):
    first = ctx.patched("p")
    second = ctx.patched("p")
    return [first, second, ctx.step("after", lambda: 1)]


@workflow("metered")
def metered(ctx: RunContext, input: dict):
    """`steps` model-like calls costing `usd` each, declared up front when `estimate` (as
    `estimate_usd` if given)."""
    from decimal import Decimal

    from runs.sdk import Metered, Usage

    cost = Usage(tokens_in=100, tokens_out=50, usd=Decimal(input.get("usd", "1")))
    guess = Usage(tokens_in=100, tokens_out=50, usd=Decimal(input.get("estimate_usd", cost.usd)))
    total = 0
    for i in range(input["steps"]):
        label = f"call-{i}"

        def call(label=label):
            effect(ctx, label, sleep=input.get("sleep", 0))
            return Metered(label, cost)

        ctx.step("call", call, estimate=guess if input.get("estimate", True) else None)
        total += 1
    return total


@workflow("halt-then-fail")
def halt_then_fail(ctx: RunContext, input):
    def call():
        calls["call"] = calls.get("call", 0) + 1
        if "call" in hooks:
            hooks.pop("call")()
        raise ConnectionError("flaky")

    return ctx.step("call", call, retry=RetryPolicy(max_attempts=3, initial_interval=timedelta(0)))


# -- model calls --------------------------------------------------------------------------------


def _openai():
    from openai import OpenAI

    return OpenAI(base_url=os.environ["STEPGUARD_MODEL_BASE_URL"], api_key="k", max_retries=0)


@workflow("llm-chat")
def llm_chat(ctx: RunContext, input):
    response = ctx.llm(
        "ask",
        _openai().chat.completions.create,
        model=input.get("model", "gpt-4o-mini"),
        messages=[{"role": "user", "content": input["prompt"]}],
        max_tokens=50,
    )
    return response["choices"][0]["message"]["content"]


@workflow("llm-responses")
def llm_responses(ctx: RunContext, input):
    response = ctx.llm(
        "ask", _openai().responses.create, model="gpt-4.1-mini", input=input["prompt"]
    )
    return response["output"][0]["content"][0]["text"]


@workflow("llm-anthropic")
def llm_anthropic(ctx: RunContext, input):
    from anthropic import Anthropic

    base = os.environ["STEPGUARD_MODEL_BASE_URL"].removesuffix("/v1")
    client = Anthropic(base_url=base, api_key="k", max_retries=0)
    response = ctx.llm(
        "ask",
        client.messages.create,
        model="claude-3-5-haiku-20241022",
        max_tokens=64,
        messages=[{"role": "user", "content": input["prompt"]}],
    )
    return response["content"][0]["text"]


@workflow("llm-async")
async def llm_async(ctx, input):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=os.environ["STEPGUARD_MODEL_BASE_URL"], api_key="k", max_retries=0
    )

    async def fetch(n):
        calls["async-tool"] = calls.get("async-tool", 0) + 1
        return n * 2

    doubled = await ctx.step("fetch", fetch, 21)
    response = await ctx.llm(
        "ask",
        client.chat.completions.create,
        model="gpt-4o",
        messages=[{"role": "user", "content": f"the number is {doubled}"}],
    )
    await ctx.step("after", effect, ctx, "after-async")
    return [doubled, response["choices"][0]["message"]["content"]]


def pay(amount: int, idempotency_key: str) -> dict:
    Effect.objects.create(idempotency_key=idempotency_key, label=f"pay-{amount}", pid=os.getpid())
    return {"paid": amount}


@workflow("payer")
def payer(ctx: RunContext, input: dict):
    return [
        ctx.tool(
            f"pay-{a}", pay, {"amount": a}, requires_approval=lambda args: args["amount"] > 100
        )
        for a in input["amounts"]
    ]


@workflow("chatty")
def chatty(ctx: RunContext, input):
    """A model that keeps calling tools: the loop must stop at max_turns."""
    from runs.sdk import Tool

    def ping():
        return {"pong": True}

    return ctx.agent_loop(
        client=_openai(),
        model="gpt-4o-mini",
        messages=[{"role": "system", "content": "SCRIPT: ping, ping2, ping3"}],
        tools={"ping": Tool(ping), "ping2": Tool(ping), "ping3": Tool(ping)},
        max_turns=2,
    )


@workflow("breaks-after-effects")
def breaks_after_effects(ctx: RunContext, input: dict):
    """Two side-effecting steps, then a delivery that fails while the file `broken` exists."""

    def deliver():
        effect(ctx, "deliver")
        if Path(input["broken"]).exists():
            raise ValueError("the delivery service is down")
        return "delivered"

    reserved = ctx.step("reserve", effect, ctx, "reserve", {"seat": "12A"})
    charged = ctx.step("charge", effect, ctx, "charge", {"charged": 40})
    return [reserved, charged, ctx.step("deliver", deliver, retry=NO_RETRY)]


# -- replay exactness ---------------------------------------------------------------------------

#: What workflow code was handed, in order, across every execution (replays included).
seen: list = []


@workflow("json-echo")
def json_echo(ctx: RunContext, input: dict):
    """Hands the same JSON through a step, a signal and a child; records what the code got."""
    seen.append(("input", ctx.input))
    made = ctx.step("make", lambda: input["value"])
    seen.append(("make", made))
    signalled = ctx.wait_for_event("go", "go")
    seen.append(("signal", signalled))
    ctx.wait_for_event("end", "end")
    return made


@workflow("city-loop")
def city_loop(ctx: RunContext, input: dict):
    """Books each city of a step's dict output, in its order, one step per position."""
    plan = ctx.step("plan", lambda: input["plan"])
    for i, city in enumerate(plan):
        ctx.step(f"book-{i}", effect, ctx, f"book-{city}")
    return list(plan)


# -- correctness regressions ---------------------------------------------------------------------


def _undo(ctx: RunContext, label: str):
    return lambda output: effect(ctx, f"undo-{label}")


@workflow("catch-saga")
def catch_saga(ctx: RunContext, input):
    """Compensated steps around a failure the code catches, then a wait."""
    from runs.sdk import StepFailed

    ctx.step("reserve", effect, ctx, "reserve", compensate=_undo(ctx, "reserve"))
    with contextlib.suppress(StepFailed):
        ctx.step("flaky", lambda: 1 / 0, retry=NO_RETRY)
    ctx.step("charge", effect, ctx, "charge", compensate=_undo(ctx, "charge"))
    return ctx.wait_for_event("wait", "confirm")


@workflow("metered-ambiguous")
def metered_ambiguous(ctx: RunContext, input: dict):
    """One step with an estimate whose outcome, after a crash, is reconciled or asked."""
    from decimal import Decimal

    from runs.sdk import Metered, Usage

    cost = Usage(tokens_in=10, tokens_out=10, usd=Decimal("1"))

    def call():
        effect(ctx, "paid")
        return Metered("paid", cost)

    options = {"reconcile": find_effect} if input["policy"] == "reconcile" else {}
    if input["policy"] == "ask":
        options = {"on_ambiguous": "ask"}
    return ctx.step("pay", call, estimate=cost, **options)


@workflow("tail")
def tail(ctx: RunContext, input):
    """a, b, c; `variant["tail"] = "short"` removes b and c from the end of the code."""
    first = ctx.step("a", effect, ctx, "a")
    if variant.get("tail") == "short":
        return [first]
    return [first, ctx.step("b", effect, ctx, "b"), ctx.step("c", effect, ctx, "c")]


@workflow("spend-then-patch")
def spend_then_patch(ctx: RunContext, input):
    """Spends exactly its budget, then reaches a patch marker (which costs nothing)."""
    from decimal import Decimal

    from runs.sdk import Metered, Usage

    cost = Usage(usd=Decimal("1"))
    ctx.step("spend", lambda: Metered("spent", cost), estimate=cost)
    return ctx.patched("after-spend")


@workflow("fails-once")
def fails_once(ctx: RunContext, input):
    """A step that fails without step retries, calling a hook first; the workflow raises an
    error of its own from it (so the run is retried from the top, and the step runs again:
    its error is an outage, not final)."""
    from runs.sdk import StepFailed

    def call():
        calls["fails-once"] = calls.get("fails-once", 0) + 1
        if "fails-once" in hooks:
            hooks.pop("fails-once")()
        if calls["fails-once"] == 1:
            raise ConnectionError("down once")
        return "ok"

    try:
        return ctx.step("call", call, retry=NO_RETRY)
    except StepFailed as exc:
        raise RuntimeError("the call failed: try the run again") from exc


@workflow("txn-only")
def txn_only(ctx: RunContext, input):
    def write():
        Effect.objects.create(idempotency_key=ctx.idempotency_key, label="txn", pid=os.getpid())
        return "written"

    return ctx.transaction("write", write)


@workflow("gap")
def gap(ctx: RunContext, input):
    """Step `a`, then `gap` seconds of work outside any step, then step `b`. With `undo`,
    `a` has a compensation; with `step_sleep`, `a` sleeps after its effect (a kill lands in
    the step, after its side effect); with `undo_sleep`, its undo does after its own."""

    def once(label, sleep):
        # Like a service that honours the idempotency key: a re-send gets the first answer.
        if Effect.objects.filter(idempotency_key=ctx.idempotency_key).exists():
            return label
        return effect(ctx, label, None, sleep)

    def charge():
        return once("a", input.get("step_sleep", 0))

    compensate = (
        (lambda out: once("undo-a", input.get("undo_sleep", 0))) if input.get("undo") else None
    )

    ctx.step("a", charge, compensate=compensate)
    if input.get("returned"):  # a flag file: step a has returned (no database needed to see it)
        Path(input["returned"]).touch()
    deadline = time.monotonic() + input.get("gap", 0)
    while time.monotonic() < deadline:  # parsing, a local computation, a time.sleep
        time.sleep(0.01)
    return ctx.step("b", effect, ctx, "b")


def random_floats(n: int) -> list[float]:
    import random

    return [random.random() for _ in range(n)]


@workflow("gil")
def gil(ctx: RunContext, input):
    """Step `hold` holds the GIL for seconds: one `sorted()` of `floats` floats, a single C call
    that holds it from start to end (a parse, a local model); with `between`, step `a` returns
    and the workflow holds the GIL so between it and step `b`. The list is built first, in
    Python, which lets other threads run."""
    data = random_floats(input["floats"])
    if input.get("between"):
        ctx.step("a", effect, ctx, "a")
        sorted(data)
        return ctx.step("b", effect, ctx, "b")

    def hold():
        Effect.objects.create(idempotency_key=ctx.idempotency_key, label="hold", pid=os.getpid())
        sorted(data)
        return "held"

    return ctx.step("hold", hold)


@workflow("raises-odd")
def raises_odd(ctx: RunContext, input):
    """Errors that do not fit a database column, or are not Exceptions at all."""
    ctx.step("before", effect, ctx, "before")
    if input == "text":
        raise ValueError("bad \x00 byte and a lone \ud800 surrogate")
    if input == "exit":
        raise SystemExit(3)
    if input == "exit-in-step":
        ctx.step("quits", lambda: sys.exit("the step called sys.exit"), retry=NO_RETRY)
    if input == "broken-str":

        class Unprintable(Exception):
            def __str__(self):
                raise RuntimeError("no")

        raise Unprintable()
    return "ok"


@workflow("gather-fails")
async def gather_fails(ctx, input: dict):
    """gather(a step that fails after `fail_after` s, a slow one of `slow` s): the failure
    leaves the workflow while the slow sibling is still in flight. `catch` catches it."""
    import asyncio

    async def fails():
        await asyncio.sleep(input.get("fail_after", 0.2))
        calls["fails"] = calls.get("fails", 0) + 1
        raise ConnectionError("down")

    async def slow():
        calls["slow"] = calls.get("slow", 0) + 1
        await asyncio.sleep(input.get("slow", 1.0))
        return "slow"

    try:
        return await asyncio.gather(
            ctx.step("fails", fails, retry=NO_RETRY), ctx.step("slow", slow, retry=NO_RETRY)
        )
    except Exception:
        if not input.get("catch"):
            raise
        return "caught"


_shared: dict[str, object] = {}


def shared_client():
    """A client made once per process and kept, as a module-level `AsyncOpenAI` is (made on
    first use only because the demo model's address is known then)."""
    from openai import AsyncOpenAI

    url = os.environ["STEPGUARD_MODEL_BASE_URL"]
    if _shared.get("url") != url:
        _shared.update(url=url, client=AsyncOpenAI(base_url=url, api_key="k", max_retries=0))
    return _shared["client"]


@workflow("shared-client")
def shared_client_sync(ctx: RunContext, input):
    return [
        ctx.llm(f"ask-{i}", shared_client().chat.completions.create, model="gpt-4o",
                messages=[{"role": "user", "content": f"question {i}"}])["id"]
        for i in range(input["turns"])
    ]  # fmt: skip


@workflow("shared-client-async")
async def shared_client_async(ctx, input):
    answers = []
    for i in range(input["turns"]):
        response = await ctx.llm(
            f"ask-{i}", shared_client().chat.completions.create, model="gpt-4o",
            messages=[{"role": "user", "content": f"question {i}"}],
        )  # fmt: skip
        answers.append(response["id"])
    return answers


@workflow("shared-client-streamed-async")
async def shared_client_streamed_async(ctx, input):
    """shared-client-async, each answer streamed (`stream=True`) to a chat UI."""
    pieces: list[str] = []
    for i in range(input["turns"]):
        await ctx.llm(
            f"ask-{i}", shared_client().chat.completions.create, model="gpt-4o",
            messages=[{"role": "user", "content": f"question {i}"}], stream=True,
            on_delta=pieces.append,
        )  # fmt: skip
    return len(pieces)


@workflow("debounced-payer", debounce=60, debounce_key=lambda input: input["account"])
def debounced_payer(ctx: RunContext, input: dict):
    """Pays what the last start in its quiet period asked, once a person approves."""
    decision = ctx.approval("ok", action="pay", summary=f"pay {input['amount']}", payload=input)
    return ctx.step("charge", effect, ctx, "charge", approval=decision)


@workflow("refused")
def refused(ctx: RunContext, input):
    """A step that fails for good (`final`: the provider refused the request, a 400 that the
    same request would get again), or with an outage a retry may get past."""

    def refuse():
        raise ModelRequestRejected("the model provider refused the request: 400 bad prompt")

    def flake():
        raise ConnectionError("payments API unreachable")

    return ctx.step("refund", refuse if input.get("final") else flake, retry=NO_RETRY)


@workflow("two-versions", version="1")
def two_versions_v1(ctx: RunContext, input):
    """Two versions registered side by side: the Start form offers the newest and the older."""
    return "v1"


@workflow("two-versions", version="2")
def two_versions_v2(ctx: RunContext, input):
    return "v2"


def _die() -> None:
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


@workflow("poison-pill")
def poison_pill(ctx: RunContext, input):
    """A run whose step kills the worker process it runs in, every time."""
    ctx.step("die", _die)


@workflow("labelled")
def labelled(ctx: RunContext, input):
    """What workflow code sees of who the run is for."""
    return ctx.labels


class InsufficientFunds(Exception):
    """The bank's answer to an over-balance withdrawal: the same request gets it again."""


class NoSuchAccount(Exception):
    """The bank's answer to a deposit into an account that does not exist."""


#: The transfer sample's policy: the bank's refusals are answers, not outages.
BANK_REFUSALS_ARE_FINAL = RetryPolicy(
    initial_interval=timedelta(0), non_retryable=(InsufficientFunds, NoSuchAccount)
)


@workflow("transfer")
def transfer(ctx: RunContext, input: dict):
    """The money-transfer sample of Temporal's and DBOS's docs: withdraw, then deposit, the
    deposit's failure compensated by a refund. Each call to the bank is an Effect row. `down`
    makes the bank unreachable instead (an outage its policy retries, then gives up on);
    `wrap` catches the withdrawal's failure and raises an error of the workflow's own."""
    from runs.sdk import StepFailed

    def withdraw():
        effect(ctx, "withdraw")
        if input.get("down"):
            raise ConnectionError("the bank is unreachable")
        if input["amount"] > input.get("balance", 100):
            raise InsufficientFunds(f"{input['amount']} is over the balance")
        return input["amount"]

    def deposit(amount):
        effect(ctx, "deposit")
        if input.get("to") != "B":
            raise NoSuchAccount(f"no account {input.get('to')!r}")
        return amount

    try:
        taken = ctx.step(
            "withdraw", withdraw, retry=BANK_REFUSALS_ARE_FINAL,
            compensate=lambda amount: effect(ctx, "refund", amount),
        )  # fmt: skip
    except StepFailed as exc:
        if input.get("wrap"):
            raise RuntimeError(f"transfer refused: {exc}") from exc
        raise
    return ctx.step("deposit", deposit, taken, retry=BANK_REFUSALS_ARE_FINAL)


def make_payment(to: str, amount: int, idempotency_key: str) -> dict:
    """A payment: one Effect labelled `paid <amount> to <to>` per call."""
    Effect.objects.create(
        idempotency_key=idempotency_key, label=f"paid {amount} to {to}", pid=os.getpid()
    )
    return {"paid": amount, "to": to}


@workflow("payout")
def payout(ctx: RunContext, input: dict):
    """A payment approved with the very arguments it is made with (issue 47 §1). With `plan`,
    the payment is what a step proposed (a model's plan), and the approver sees that."""
    payment = {"to": input["to"], "amount": input["amount"]}
    if input.get("plan"):
        payment = ctx.step("plan", lambda: payment)
    if variant.get("payout") == "double":  # the code changed: it asks for something else
        payment = {**payment, "amount": payment["amount"] * 2}
    decision = ctx.approval(
        "ok", action="pay", summary=f"pay {payment['amount']} to {payment['to']}", payload=payment
    )
    paid = ctx.step(
        "pay",
        lambda: make_payment(idempotency_key=ctx.idempotency_key, **payment),
        approval=decision,
    )
    return {"paid": paid, "approved_by": decision.decided_by}


@workflow("tool-payout")
def tool_payout(ctx: RunContext, input: dict):
    """The same payment as a tool that needs approval (`pay.approval`, then `pay`)."""
    args = {"to": input["to"], "amount": input["amount"]}
    return ctx.tool("pay", make_payment, args, requires_approval=True, action="pay")


@workflow("batch-payout")
def batch_payout(ctx: RunContext, input: dict):
    """Payments approved together (`ctx.approvals`), as an agent's parallel tool calls are."""
    from runs.sdk import Ask

    payments = input["payments"]
    asks = [Ask(f"ok-{p['to']}", "pay", f"pay {p['amount']} to {p['to']}", p) for p in payments]
    decided = ctx.approvals(asks)
    return [
        ctx.tool(f"pay-{p['to']}", make_payment, p, approved=d)
        for p, d in zip(payments, decided, strict=True)
    ]


def _held_value(value: int, sleep: float) -> int:
    if sleep:
        time.sleep(sleep)
    return value


@workflow("hold-churn")
def hold_churn(ctx: RunContext, input: dict):
    """`steps` short steps, then a failure if `fail` (tests/test_holds_concurrency.py: runs to
    halt, retry and fork while operators place and lift holds)."""
    for i in range(input.get("steps", 2)):
        ctx.step(f"s{i}", _held_value, i, input.get("sleep", 0))
    if input.get("fail"):
        raise ValueError("asked to fail")
    return input.get("steps", 2)
