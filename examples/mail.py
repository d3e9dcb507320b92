"""A stand-in mail gateway: dedupes on the idempotency key, like a real provider would."""

import os

from examples.models import Effect


def send_email(to: str, body: str, idempotency_key: str) -> dict:
    effect, created = Effect.objects.get_or_create(
        idempotency_key=idempotency_key, defaults={"label": "email", "pid": os.getpid()}
    )
    return {"to": to, "message_id": f"m-{effect.pk}", "duplicate": not created}
