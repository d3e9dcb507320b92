"""Stand-ins for the services the demo agents call. Not Stepguard code: the outside world."""

import os

from examples.models import Booking, Effect

FLIGHTS = {
    ("LIS", "BER"): [
        {"flight": "TP540", "departs": "07:05", "price": "212.00"},
        {"flight": "FR1213", "departs": "10:40", "price": "89.99"},
        {"flight": "LH1173", "departs": "17:20", "price": "164.50"},
    ],
}


def search_flights(origin: str, destination: str, date: str) -> list[dict]:
    options = FLIGHTS.get((origin, destination))
    if options is None:
        options = [{"flight": "SG100", "departs": "12:00", "price": "150.00"}]
    return [{**option, "date": date} for option in options]


def book(flight: dict, passenger: str, *, idempotency_key: str) -> dict:
    """Charge and book once per key: a repeat with the same key returns the first booking."""
    Effect.objects.create(idempotency_key=idempotency_key, label="book", pid=os.getpid())
    booking, _ = Booking.objects.get_or_create(
        idempotency_key=idempotency_key,
        defaults={"flight": flight["flight"], "passenger": passenger, "price": flight["price"]},
    )
    return {"booking_id": booking.pk, "flight": booking.flight, "reference": f"SG{booking.pk:06d}"}


def find_booking(idempotency_key: str):
    """Look a booking up by its idempotency key (for `reconcile`); None if there is none."""
    booking = Booking.objects.filter(idempotency_key=idempotency_key).first()
    if booking is None:
        return None
    return {"booking_id": booking.pk, "flight": booking.flight, "reference": f"SG{booking.pk:06d}"}


class NotifierDown(ConnectionError):
    pass


def send_confirmation(
    passenger: str, reference: str, *, idempotency_key: str, failures: int = 1
) -> dict:
    """A flaky e-mail gateway: the first `failures` calls for each key fail, then it answers."""
    calls = Effect.objects.filter(idempotency_key=idempotency_key, label="notify").count()
    Effect.objects.create(idempotency_key=idempotency_key, label="notify", pid=os.getpid())
    if calls < failures:
        raise NotifierDown(
            f"mail gateway timed out (the demo fails the first {failures} attempt(s) on purpose)"
        )
    return {"sent_to": passenger, "reference": reference}


ORDERS = {
    "A-1001": {"order": "A-1001", "customer": "grace@example.com", "amount": "89.99",
               "card": "visa-4242"},
    "A-1002": {"order": "A-1002", "customer": "alan@example.com", "amount": "212.00",
               "card": "visa-0005"},
}  # fmt: skip
EXPIRED_CARDS = {"visa-0005": "2025-09"}


class RefundRefused(Exception):
    """The payments API's answer, not an outage: trying again cannot change it."""


def find_order(order: str) -> dict:
    return ORDERS[order]


def refund(order: dict, *, idempotency_key: str) -> dict:
    """Refund an order's card once per key; refuse when the card has expired."""
    expired = EXPIRED_CARDS.get(order["card"])
    if expired:
        raise RefundRefused(
            f"payments API refused to refund {order['amount']} EUR on order {order['order']}: "
            f"card {order['card']} expired in {expired}"
        )
    effect, _ = Effect.objects.get_or_create(
        idempotency_key=idempotency_key, defaults={"label": "refund", "pid": os.getpid()}
    )
    return {"refund": f"RF{effect.pk:06d}", "amount": order["amount"]}
