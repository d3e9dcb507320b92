"""Flight booking, driven by a model through the durable agent loop.

The model (the scripted demo model unless STEPGUARD_MODEL_BASE_URL names a real one) searches,
books (a person approves the charge first; a rejection ends the run) and sends the
confirmation, which fails once and is retried without a second booking.
"""

import json

from examples import llm, services
from runs.sdk import RunContext, Tool, workflow


def search_flights(origin: str, destination: str, date: str, passenger: str = "") -> dict:
    options = services.search_flights(origin, destination, date)
    cheapest = min(options, key=lambda option: float(option["price"]))
    # "next" lets the scripted demo model pass the choice on; a real model reads the options.
    return {"options": options, "next": {"book_flight": {"flight": cheapest}}}


def book_flight(flight: dict, passenger: str, idempotency_key: str) -> dict:
    booking = services.book(flight, passenger, idempotency_key=idempotency_key)
    return {**booking, "next": {"send_confirmation": {"reference": booking["reference"]}}}


def send_confirmation(passenger: str, reference: str, idempotency_key: str) -> dict:
    return services.send_confirmation(passenger, reference, idempotency_key=idempotency_key)


PARAMS = {"type": "object", "additionalProperties": True, "properties": {}}
TOOLS = {
    "search_flights": Tool(search_flights, "Find flights between two airports on a date", PARAMS),
    # The booking is the point of the run: a person's rejection ends it, shown as what it is
    # (failed with ApprovalRejected), not as a run that went on and completed without it.
    "book_flight": Tool(
        book_flight,
        "Book a flight and charge the card",
        PARAMS,
        requires_approval=True,
        on_refusal="raise",
    ),
    "send_confirmation": Tool(send_confirmation, "E-mail the booking confirmation", PARAMS),
}


@workflow("flight-booking", version="2")
def flight_agent(ctx: RunContext, input: dict) -> dict:
    search = {"origin": input["from"], "destination": input["to"], "date": input["date"]}
    who = {"passenger": input["passenger"]}
    system = (
        "You book flights for the user with the tools you have.\n"
        "SCRIPT: search_flights, book_flight, send_confirmation\n"
        f"ARGS search_flights: {json.dumps(search)}\n"
        f"ARGS book_flight: {json.dumps(who)}\n"
        f"ARGS send_confirmation: {json.dumps(who)}"
    )
    request = f"Book the cheapest flight {input['from']} to {input['to']} on {input['date']}."
    return ctx.agent_loop(
        client=llm.client(),
        model=llm.model_name(),
        messages=[{"role": "system", "content": system}, {"role": "user", "content": request}],
        tools=TOOLS,
    )
