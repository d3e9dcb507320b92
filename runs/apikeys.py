"""Creating, checking and revoking API keys."""

import hashlib
import hmac
import secrets
from datetime import UTC, datetime

from django.db import transaction
from django.utils import timezone

from runs.errors import NotFound, OperationError
from runs.models import ApiKey, ApiKeyScope, EventType
from runs.operations import audit, require, resolve_user


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(
    user,
    name: str = "",
    *,
    scope: str = ApiKeyScope.FULL,
    expires_at: datetime | None = None,
    actor: str = "cli",
) -> tuple[ApiKey, str]:
    """A new key for `user`; returns it and the full key text, which is never shown again.

    `scope` narrows what the user's permissions allow (full, read, start); past `expires_at`
    the key is refused. `actor` is who made it (a username, or "cli" for the shell): each
    creation is an audit event (`apikey.created`: who, for whom, which key, scope, expiry)."""
    user = resolve_user(user)
    if scope not in ApiKeyScope.values:
        raise OperationError(f"unknown API key scope {scope!r}: one of {', '.join(ApiKeyScope)}")
    if expires_at is not None:
        if timezone.is_naive(expires_at):
            raise OperationError("an expiry needs a time zone")
        if expires_at <= timezone.now():
            raise OperationError(f"the expiry {expires_at.isoformat()} has already passed")
    prefix = secrets.token_hex(4)
    secret = secrets.token_urlsafe(32)
    with transaction.atomic():
        key = ApiKey.objects.create(
            user=user, name=name, prefix=prefix, digest=_digest(secret), scope=scope,
            expires_at=expires_at,
        )  # fmt: skip
        owner = user.get_username()
        audit(
            actor, EventType.API_KEY_CREATED, target=f"API key sg_{prefix} of {owner}",
            **_described(key),
        )  # fmt: skip
    return key, f"sg_{prefix}_{secret}"


def _described(key: ApiKey) -> dict:
    """What an audit event says of a key: never its secret or digest."""
    return {
        "prefix": key.prefix, "key_name": key.name, "owner": key.user.get_username(),
        "scope": key.scope, "expires_at": key.expires_at.isoformat() if key.expires_at else None,
    }  # fmt: skip


def parse_expiry(text: str) -> datetime:
    """An ISO date or date-time (`2027-01-31`, `2027-01-31T18:00+01:00`) as an aware moment:
    a date alone is its midnight UTC, a time without offset is UTC."""
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise OperationError(
            f"expiry {text!r} is not an ISO date or date-time (2027-01-31, 2027-01-31T18:00Z)"
        ) from None
    return moment if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)


def match_key(text: str) -> ApiKey | None:
    """The unrevoked key of an active user that `text` names, expired or not (the caller says
    which), or None. Compares digests in constant time; notes its use at most once a minute."""
    parts = text.split("_", 2) if text else []
    if len(parts) != 3 or parts[0] != "sg":
        return None
    key = ApiKey.objects.select_related("user").filter(prefix=parts[1]).first()
    if key is None or key.revoked_at is not None or not key.user.is_active:
        return None
    if not hmac.compare_digest(key.digest, _digest(parts[2])):
        return None
    now = timezone.now()
    if not key.expired(now) and (
        key.last_used_at is None or (now - key.last_used_at).total_seconds() > 60
    ):
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)  # at most once a minute
    return key


def check_key(text: str) -> ApiKey | None:
    """The live key `text` names (not revoked, not expired, its user active), or None."""
    key = match_key(text)
    return None if key is None or key.expired() else key


#: Revoking (and seeing) another person's keys; everyone may revoke their own.
OTHERS = "runs.revoke_others_apikey"


def revoke_key(prefix: str, user=None) -> ApiKey:
    """Revoke the key `prefix` names (`sg_<prefix>` or the whole key will do). `user` is the
    person revoking: their own key, or another person's with runs.revoke_others_apikey;
    None is the CLI, whose authority is the shell it runs in. Each revocation is an audit
    event (`apikey.revoked`: who, whose key, which, its scope and expiry); revoking a revoked
    key changes nothing."""
    key = ApiKey.objects.select_related("user")
    key = key.filter(prefix=prefix.removeprefix("sg_").split("_")[0]).first()
    if key is None:
        raise NotFound(f"no API key with prefix {prefix!r}")
    actor = "cli"
    if user is not None:
        person = resolve_user(user)
        if key.user_id != person.pk:
            require(person, OTHERS, "revoke another person's API key")
        actor = person.get_username()
    with transaction.atomic():
        now = timezone.now()
        if ApiKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=now):
            owner = key.user.get_username()
            audit(
                actor, EventType.API_KEY_REVOKED, target=f"API key sg_{key.prefix} of {owner}",
                **_described(key),
            )  # fmt: skip
    key.refresh_from_db()
    return key
