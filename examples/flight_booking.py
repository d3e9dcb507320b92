"""Flight booking agent: search, pick, book (once, whatever happens), notify.

The notify step fails on its first attempt; its retry policy sends it again and the run
completes, while the booking, already checkpointed, is not made a second time.
"""

from datetime import timedelta

from examples import services
from runs.sdk import NOT_FOUND, RetryPolicy, RunContext, workflow

QUICK_RETRY = RetryPolicy(max_attempts=3, initial_interval=timedelta(milliseconds=300))


def pick_cheapest(options: list[dict]) -> dict:
    return min(options, key=lambda option: float(option["price"]))


@workflow("flight-booking", version="1")
def flight_booking(ctx: RunContext, input: dict) -> dict:
    options = ctx.step(
        "search", services.search_flights, input["from"], input["to"], input["date"], kind="tool"
    )
    choice = ctx.step("pick", pick_cheapest, options)

    def book():
        return services.book(choice, input["passenger"], idempotency_key=ctx.idempotency_key)

    def reconcile(idempotency_key):
        return services.find_booking(idempotency_key) or NOT_FOUND

    booking = ctx.step("book", book, reconcile=reconcile, kind="tool")

    def notify():
        return services.send_confirmation(
            input["passenger"], booking["reference"], idempotency_key=ctx.idempotency_key
        )

    ctx.step("notify", notify, retry=QUICK_RETRY, kind="tool")
    return {"booking": booking, "flight": choice}
