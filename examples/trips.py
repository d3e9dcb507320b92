"""The README's agent, as the README shows it (tests/test_docs_commands.py checks they match):
what `--import examples.trips` names in the docs' commands. `make run`'s worker runs it too
(examples/demo.py)."""

from examples.travel import airline, cheapest, mailer  # stand-ins: your own clients here
from runs.sdk import RunContext, workflow


@workflow("book-trip", version="1")
def book_trip(ctx: RunContext, input: dict) -> dict:
    flights = ctx.step("search", airline.search, input["from"], input["to"])
    choice = ctx.step("pick", cheapest, flights)
    seat = ctx.wait_for_event("seat", "go")  # until someone signals `go`
    charge = ctx.approval("charge", action=f"charge {choice['price']} USD")  # a person decides
    booking = ctx.step(
        "book", lambda: airline.book(choice, seat, key=ctx.idempotency_key), approval=charge
    )
    ctx.step("notify", mailer.send, input["email"], booking["reference"])
    return booking
