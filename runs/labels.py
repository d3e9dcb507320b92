"""Run labels: who a run is for (`tenant=acme`, `user=42`), given when it starts.

Labels attribute spend (`/api/spend?label=tenant`), filter lists (`label=tenant=acme`) and
carry shared daily budgets (`budget --label tenant=acme --usd 5`: the Policy scope
`label:tenant=acme`). Every surface parses them here, so one set of rules says what a label
is, and a bad one is refused with a message that names it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from django.db import connection
from django.db.models import Q
from django.db.models.fields.json import KeyTextTransform
from django.db.models.lookups import Exact

from runs.errors import InvalidInput

#: A label's name: what the SDK, the API and `name=value` text accept.
NAME = re.compile(r"^[a-z][a-z0-9_.-]{0,39}$")
MAX_LABELS = 10
MAX_VALUE = 100
#: The Policy scope of a label value's shared daily budget.
SCOPE_PREFIX = "label:"


class BadLabel(InvalidInput):
    """A label that cannot be stored; the message names it and the rule it breaks."""


def _value(name: str, value: object) -> str:
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise BadLabel(f"label {name!r}: a value is text, not {type(value).__name__}")
    text = str(value).strip()
    if not text or len(text) > MAX_VALUE:
        raise BadLabel(f"label {name!r}: a value has 1 to {MAX_VALUE} characters")
    if any(not ch.isprintable() for ch in text) or "," in text:
        raise BadLabel(f"label {name!r}: a value has no control characters and no comma")
    return text


def _name(name: object) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise BadLabel(
            f"{name!r} is not a label name: a lowercase letter, then up to 39 of a-z, 0-9, "
            "'_', '.', '-'"
        )
    return name


def clean(labels: Mapping | None) -> dict[str, str]:
    """Labels as stored: names checked, values text, at most MAX_LABELS."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise BadLabel(f"labels are name: value pairs, not {type(labels).__name__}")
    if len(labels) > MAX_LABELS:
        raise BadLabel(f"a run has at most {MAX_LABELS} labels, not {len(labels)}")
    return {_name(k): _value(k, v) for k, v in sorted(labels.items())}


def pair(text: str) -> tuple[str, str]:
    """`name=value` (the CLI's --label, a list filter, a budget's label)."""
    name, sep, value = text.strip().partition("=")
    if not sep:
        raise BadLabel(f"{text!r} is not a label: write name=value (tenant=acme)")
    name = _name(name.strip())
    return name, _value(name, value)


def parse(texts: Iterable[str] | str) -> dict[str, str]:
    """Labels from `name=value` texts, or one text of them separated by commas (the Start
    form); a name given twice is refused rather than one value silently kept."""
    if isinstance(texts, str):
        texts = [part for part in texts.split(",") if part.strip()]
    labels: dict[str, str] = {}
    for text in texts:
        name, value = pair(text)
        if name in labels:
            raise BadLabel(f"label {name!r} is given twice")
        labels[name] = value
    return clean(labels)


def scope(name: str, value: str) -> str:
    return f"{SCOPE_PREFIX}{name}={value}"


def scopes(labels: Mapping[str, str]) -> list[str]:
    """The Policy scopes a run with these labels books its spend against (with a budget)."""
    return [scope(k, v) for k, v in sorted(labels.items())]


#: Label names with btree indexes of their own (runs.models.Run: by created-at, and by status
#: then created-at): a filter on one is an ordered index range, not a set gathered through the
#: labels' GIN index and sorted. Another name is indexed the same way by hand (docs/deploy.md).
INDEXED = ("tenant",)


def matching(name: str, value: str) -> Q:
    """Runs carrying label `name=value`. On PostgreSQL, for a name in INDEXED, the key's text
    (the expression its indexes hold), else a containment, which the labels' GIN index
    serves; SQLite (the embedded engine) compares the key. Values are text, so both say the
    same."""
    if connection.vendor == "postgresql" and name not in INDEXED:
        return Q(labels__contains={name: value})
    # An expression, not `labels__<name>`: a label called `contains` is a key, not a lookup.
    return Q(Exact(KeyTextTransform(name, "labels"), value))


def carrying(text: str) -> Q:
    """Runs carrying the label `name=value` written as text (a label scope's value)."""
    return matching(*pair(text))


def text(labels: Mapping[str, str]) -> str:
    """`tenant=acme, user=42`: how pages and the CLI show them, and the Start form takes."""
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
