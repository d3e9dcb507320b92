"""JSON in and out of checkpoints.

A step's output is handed back as its JSON round trip even on the first execution, so the
value a workflow sees live is the value it sees on replay (a tuple becomes a list both times).
"""

import json
from typing import Any

from django.conf import settings

from runs.errors import OutputNotSerializable


def _find_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_find_nul(k) or _find_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_find_nul(v) for v in value)
    return False


def to_json(value: Any, *, what: str, limit: int | None = None) -> Any:
    """Check `value` can be stored as a checkpoint and return its JSON round trip.

    Raises OutputNotSerializable naming `what` (e.g. "step 'search'") and the offending type.
    """
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise OutputNotSerializable(
            f"{what} returned a value that cannot be stored as JSON ({type(value).__name__}): {exc}"
        ) from None
    # PostgreSQL's jsonb cannot hold NUL; json.dumps writes it as \u0000 even unescaped.
    if "\\u0000" in text and _find_nul(value):
        raise OutputNotSerializable(
            f"{what} returned a string containing a NUL character (\\u0000), "
            "which the database cannot store"
        )
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise OutputNotSerializable(
            f"{what} returned a string that is not valid Unicode: {exc.reason}"
        ) from None
    limit = limit or settings.STEPGUARD_MAX_OUTPUT_BYTES
    if size > limit:
        raise OutputNotSerializable(
            f"{what} returned {size} bytes of JSON, over the {limit}-byte limit "
            "(STEPGUARD_MAX_OUTPUT_BYTES); store large payloads elsewhere and return a reference"
        )
    return json.loads(text)


#: Bytes of JSON of a step's arguments recorded whole (a model call's request: up to
#: STEPGUARD_MAX_OUTPUT_BYTES); beyond that the first 2,000 characters, marked as cut.
INPUT_LIMIT = 65536


def describe_input(args: tuple, kwargs: dict, *, limit: int = INPUT_LIMIT) -> Any:
    """Best-effort JSON of a step's arguments, for people reading the timeline."""
    if not args and not kwargs:
        return None
    value = {"args": list(args), "kwargs": kwargs} if kwargs else list(args)
    try:
        text = json.dumps(value, default=repr, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return {"repr": repr(value)[:2000]}
    size = len(text.encode("utf-8", "replace"))
    if size > limit:
        cut = f"{size:,} bytes of JSON, over the {limit:,} recorded; the first 2,000 characters"
        return {"truncated": cut, "repr": text[:2000] + "…"}
    if "\\u0000" in text:
        return {"repr": text[:2000] + "…"}
    return json.loads(text)
