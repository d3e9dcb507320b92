"""Creating, checking and revoking API keys."""

import hashlib
import hmac
import secrets

from django.utils import timezone

from runs.errors import NotFound
from runs.models import ApiKey
from runs.operations import resolve_user


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(user, name: str = "") -> tuple[ApiKey, str]:
    """A new key for `user`; returns it and the full key text, which is never shown again."""
    user = resolve_user(user)
    prefix = secrets.token_hex(4)
    secret = secrets.token_urlsafe(32)
    key = ApiKey.objects.create(user=user, name=name, prefix=prefix, digest=_digest(secret))
    return key, f"sg_{prefix}_{secret}"


def check_key(text: str) -> ApiKey | None:
    """The live key `text` names, or None. Compares digests in constant time."""
    parts = text.split("_", 2) if text else []
    if len(parts) != 3 or parts[0] != "sg":
        return None
    key = ApiKey.objects.select_related("user").filter(prefix=parts[1]).first()
    if key is None or key.revoked_at is not None or not key.user.is_active:
        return None
    if not hmac.compare_digest(key.digest, _digest(parts[2])):
        return None
    now = timezone.now()
    if key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)  # at most once a minute
    return key


def revoke_key(prefix: str) -> ApiKey:

    key = ApiKey.objects.filter(prefix=prefix.removeprefix("sg_").split("_")[0]).first()
    if key is None:
        raise NotFound(f"no API key with prefix {prefix!r}")
    ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
    key.refresh_from_db()
    return key
