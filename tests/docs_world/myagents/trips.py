"""The README's trip agent, with a stand-in airline and mailer, and the other workflows the docs
name (digest, outreach, research), so that every command they show has something to act on."""

from runs.sdk import RunContext, workflow


def search(origin: str, destination: str) -> list[dict]:
    return [{"flight": f"{origin}-{destination}", "usd": 120}]


@workflow("book-trip", version="1")
def book_trip(ctx: RunContext, input: dict) -> dict:
    flights = ctx.step("search", search, input.get("from", "LIS"), input.get("to", "BER"))
    if input.get("wait"):  # `signal RUN_ID go` wakes it
        ctx.wait_for_event("seat", "go")
    if input.get("approve"):  # `approve APPROVAL_ID` decides it
        decision = ctx.approval("charge", action="charge the card", summary="120 USD")
        return ctx.step("book", lambda: {"reference": "ABC123", "flight": flights[0]},
                        approval=decision)  # fmt: skip
    return ctx.step("book", lambda: {"reference": "ABC123", "flight": flights[0]})


@workflow("digest")
def digest(ctx: RunContext, input: dict) -> str:
    return ctx.step("send", lambda: f"digest for {input.get('team', 'everyone')}")


@workflow("outreach")
def outreach(ctx: RunContext, input: dict) -> str:
    return ctx.step("write", lambda: "hello")


@workflow("research")
def research(ctx: RunContext, input: dict) -> str:
    return ctx.step("read", lambda: "notes")


@workflow("flight-booking")
def flight_booking(ctx: RunContext, input: dict) -> dict:
    """docs/api.md's walk-through: a search, a wait for the signal `go`, a person's approval,
    then the booking."""
    flights = ctx.step("search", search, input.get("from", "LIS"), input.get("to", "BER"))
    seat = ctx.wait_for_event("seat", "go")
    decision = ctx.approval("charge", action="charge the card", summary="120 USD")
    return ctx.step("book", lambda: {"reference": "ABC123", "flight": flights[0], "seat": seat},
                    approval=decision)  # fmt: skip
