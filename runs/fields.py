"""A JSON column that gives back exactly the JSON it was given.

PostgreSQL's `jsonb` normalises what it stores: object keys come back sorted (shorter keys
first) and numbers rewritten (`1e16` as `10000000000000000`, an int in Python). A checkpoint
must replay to the very value the live run saw, or a loop over a step's dict output takes
another order after a crash. So values handed to workflow code live in a `json` column on
PostgreSQL, which keeps the text as written; SQLite stores the text as written anyway.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from django.db import models

#: The one way checkpointed JSON is written: compact, UTF-8, no NaN.
dumps = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class ExactJSONField(models.JSONField):
    """A JSONField stored as `json` (text kept verbatim) rather than `jsonb` on PostgreSQL.

    Costs: no GIN indexes or containment lookups on these columns (none are used), and
    PostgreSQL validates the JSON on write instead of parsing it into a binary form.
    """

    def db_type(self, connection) -> str | None:
        if connection.vendor == "postgresql":
            return "json"
        return super().db_type(connection)

    def get_db_prep_value(self, value: Any, connection, prepared: bool = False) -> Any:
        if connection.vendor != "postgresql":
            return super().get_db_prep_value(value, connection, prepared)
        from psycopg.types.json import Json

        if not prepared:
            value = self.get_prep_value(value)
        return Json(value, dumps=dumps)

    def from_db_value(self, value: Any, expression, connection) -> Any:
        # psycopg decodes a `json` column itself (with json.loads, so key order and number
        # types are kept); only a text value, as SQLite returns, is left to decode.
        if connection.vendor == "postgresql":
            return value
        return super().from_db_value(value, expression, connection)
