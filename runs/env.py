"""Small strict parsers for settings read from the environment.

A bad value fails loudly at start-up with the variable's name, instead of turning into a
surprising default deep inside a worker.
"""

import os

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")


def env_float(name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be at least {minimum}")
    return value


def env_int(name: str, default: int, *, minimum: int = 0) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name}={raw!r} must be at least {minimum}")
    return value


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return list(default or [])
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_json(name: str, default):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        import json

        return json.loads(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} is not valid JSON: {exc}") from None


def env_networks(name: str) -> list[str]:
    """Comma-separated addresses or networks (`10.0.0.0/8`, `::1`), checked at start-up."""
    import ipaddress

    items = env_list(name)
    for item in items:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {item!r} is not an address or network") from None
    return items


def env_allow(name: str) -> list[str]:
    """Comma-separated addresses, networks or host names (`10.0.0.0/8`, `::1`,
    `hooks.internal`), checked at start-up (runs.egress.parse_allow)."""
    from runs.egress import parse_allow

    items = env_list(name)
    try:
        parse_allow(items, name)
    except ValueError as exc:
        raise ImproperlyConfigured(str(exc)) from None
    return items
