"""Lists whose size does not grow with the values in them (issue 31 item 4).

A list response (the API's runs, approvals and events, the approvals inbox) carries its rows'
large JSON values (a run's input, output and error, an approval's payload, an event's payload)
only while the page's total stays under a cap; a value that would pass it is not even read
from the database: the row says how big it is and where the whole of it is. The page keeps
every row it was asked for, so cursors and limits mean what they did.

Two queries whatever the values: the rows with each value's size (measured by the database,
the value itself deferred), then the values that fit, by primary key.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.db.models import BigIntegerField, Func, QuerySet, TextField
from django.db.models.functions import Cast
from django.http import HttpResponse
from ninja.responses import NinjaJSONEncoder


class JsonBytes(Func):
    """The size in bytes of a JSON column's text (NULL for SQL NULL): about its size in a
    response (PostgreSQL prints jsonb with ', ' and ': ', as json.dumps does)."""

    output_field = BigIntegerField()
    template = "length(%(expressions)s)"

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(
            compiler, connection, template="octet_length((%(expressions)s)::text)", **extra
        )

    def as_sqlite(self, compiler, connection, **extra):
        return self.as_sql(
            compiler, connection, template="length(CAST(%(expressions)s AS BLOB))", **extra
        )


def size_name(field: str) -> str:
    return f"{field}_bytes"


def sized(queryset: QuerySet, fields: Sequence[str]) -> QuerySet:
    """`queryset` without `fields` (deferred), each annotated with its size (`<field>_bytes`)."""
    return queryset.defer(*fields).annotate(**{size_name(f): JsonBytes(f) for f in fields})


def cut(size: int, whole: str) -> dict[str, Any]:
    """What a list carries in place of a value it leaves out (docs/api.md, *Lists*)."""
    return {"cut": True, "bytes": size, "whole": whole}


def fill(
    rows: Iterable,
    fields: Sequence[str],
    cap: int,
    whole: Callable[[Any, str], str],
    *,
    first_always: bool = True,
    marker: Callable[[int, str], Any] = cut,
    as_text: bool = False,
) -> int:
    """Load the `fields` of `rows` (from `sized`) in order, each value that still fits under
    `cap` bytes in all; with `first_always` the first value loads whatever its size (an API
    page of one always carries its value, as a page of steps always holds one step). Each
    value left out is replaced by `marker(size, whole(row, field))` and named in
    `row.cut_fields` ({field: size}). Returns the bytes loaded. One query per field loaded."""
    rows = list(rows)
    total, wanted = 0, {f: [] for f in fields}
    for row in rows:
        row.cut_fields = {}
        for field in fields:
            size = getattr(row, size_name(field))
            if size is None:  # SQL NULL: nothing to read
                setattr(row, field, None)
            elif (first_always and total == 0) or total + size <= cap:
                wanted[field].append(row.pk)
                total += size
            else:
                row.cut_fields[field] = size
    if not rows:
        return 0
    manager = type(rows[0])._default_manager
    for field, pks in wanted.items():
        if not pks:
            continue
        if as_text:  # the stored JSON's text, never parsed: `relay` writes it out as it is
            texts = manager.filter(pk__in=pks).annotate(_text=Cast(field, TextField()))
            values = {pk: Relayed(text) for pk, text in texts.values_list("pk", "_text")}
        else:
            values = dict(manager.filter(pk__in=pks).values_list("pk", field))
        for row in rows:
            if row.pk in values:
                setattr(row, field, values[row.pk])
    for row in rows:
        for field, size in row.cut_fields.items():
            setattr(row, field, marker(size, whole(row, field)))
    return total


class Relayed(str):
    """A stored JSON value's text, which a list relays without parsing it (`relay`)."""


def relay(items: list[dict], status: int = 200) -> HttpResponse:
    """A JSON response of `items` (already shaped by their schema) whose Relayed values are
    written out as the text the database holds. Parsing a list's stored JSON only to print it
    again was most of its cost: 500 approvals of 7.5 MiB with 42,000 small objects in their
    payloads took 2.6 s and 1.35 GB of memory across ten requests."""
    nonce = secrets.token_hex(8)
    texts: list[str] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Relayed):
            texts.append(value)
            return f"\x00{nonce}:{len(texts) - 1}\x00"
        return value

    body = json.dumps(
        [{k: mark(v) for k, v in item.items()} for item in items], cls=NinjaJSONEncoder
    )
    if texts:  # each mark is a JSON string of its own, escaped as json.dumps escapes NUL
        body = re.sub(rf'"\\u0000{nonce}:(\d+)\\u0000"', lambda m: texts[int(m.group(1))], body)
    return HttpResponse(body, status=status, content_type="application/json; charset=utf-8")
