"""The airline and the mailer the README's agent (examples/trips.py) calls: stand-ins that need
nothing but Python, so the agent runs under any settings (`make run`'s, or production ones with
`--import examples.trips`). Not Stepguard code: the outside world."""

from types import SimpleNamespace

FARES = [
    {"flight": "TP540", "price": "212.00"},
    {"flight": "FR1213", "price": "89.99"},
    {"flight": "LH1173", "price": "164.50"},
]


def search(origin: str, destination: str) -> list[dict]:
    return [{**fare, "from": origin, "to": destination} for fare in FARES]


def cheapest(flights: list[dict]) -> dict:
    return min(flights, key=lambda flight: float(flight["price"]))


def book(flight: dict, seat: dict | None, *, key: str) -> dict:
    """The same key books once: the reference is made from it, as an airline's idempotent API
    would return the first booking again."""
    return {"reference": f"BK-{key[:8].upper()}", "flight": flight["flight"],
            "seat": (seat or {}).get("seat", "any")}  # fmt: skip


def send(to: str, reference: str) -> dict:
    return {"sent_to": to, "reference": reference}


airline = SimpleNamespace(search=search, book=book)
mailer = SimpleNamespace(send=send)
