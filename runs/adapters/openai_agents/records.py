"""What the adapter's steps record, and their keys: a model response as JSON and back as
the SDK's types, a tool's arguments and output."""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import ResponseOutputItem
from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_jsonable_python


def _key(kind: str, name: str) -> str:
    return f"{kind}:{name.replace('#', '_')}"[:200]  # '#' marks a key's repeats


_OUTPUT_ITEM: TypeAdapter = TypeAdapter(ResponseOutputItem)


def _recorded(output: list, usage: Any, model: str, response_id, request_id) -> dict:
    """A model response as the step stores it: its output items as the API's JSON, and its
    usage in the responses API's shape, which Stepguard prices."""
    # Every count the responses API's usage requires, 0 unless the provider said otherwise:
    # a provider that omits one (cache writes, often) must not fail the run when the usage is
    # validated again for the SDK (run_streamed's final event).
    details = {"input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}}
    details["output_tokens_details"] = {"reasoning_tokens": 0}
    for name in details:
        if (value := getattr(usage, name, None)) is not None:
            details[name] |= value.model_dump(mode="json", exclude_none=True)
    return {
        "model": model,
        "output": [_dump(item) for item in output],
        "usage": {
            "requests": getattr(usage, "requests", 1) or 1,
            **{
                k: getattr(usage, k, 0) or 0
                for k in ("input_tokens", "output_tokens", "total_tokens")
            },
            **details,
        },
        "response_id": response_id,
        "request_id": request_id,
    }


def _dump(item: Any) -> Any:
    if hasattr(item, "model_dump"):
        return item.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return item


def _item(data: Any) -> Any:
    """A recorded output item as the SDK's own type again (a dict if it is none it knows)."""
    try:
        return _OUTPUT_ITEM.validate_python(data)
    except ValidationError:
        return data


def _arguments(text: str) -> Any:
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text


def _jsonable(value: Any) -> Any:
    """A tool's output as JSON (pydantic models, dataclasses, the SDK's ToolOutputText...);
    what JSON cannot hold becomes its str(), which is what the SDK sends the model."""
    try:
        return to_jsonable_python(value)
    except Exception:  # pydantic raises serialization errors of its own
        return str(value)
