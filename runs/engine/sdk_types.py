"""The SDK types a model's answer is parsed into, built before the first call is sent.

The openai and anthropic clients declare their response types with pydantic's deferred build:
a class builds its validator the first time an answer uses it. For the responses API's stream
events (some 450 classes) that is 1-3 s of CPU on the event loop, spent once the answer is
already on its way: a process's first streamed answers waited seconds between the provider's
last byte and their record (issue 49 §5: Runner.run_streamed 2.6 s), and a kill in that window
pays the answer again. Built here once per process and protocol, inside the step but before the
request is sent, so a kill during the build costs nothing.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import typing
from typing import Any

if typing.TYPE_CHECKING:
    from pydantic import BaseModel

#: The root types each protocol's answers (whole and streamed) are parsed into.
ROOTS: dict[str, tuple[tuple[str, str], ...]] = {
    "responses": (
        ("openai.types.responses", "ResponseStreamEvent"),
        ("openai.types.responses", "Response"),
        ("openai.types.responses", "ParsedResponse"),  # what a stream accumulates
    ),
    "chat": (
        ("openai.types.chat", "ChatCompletionChunk"),
        ("openai.types.chat", "ChatCompletion"),
        ("openai.types.chat", "ParsedChatCompletion"),
    ),
    "anthropic": (
        ("anthropic.types", "RawMessageStreamEvent"),
        ("anthropic.types", "Message"),
    ),
}

_built: set[str] = set()
_lock = threading.Lock()


def protocol_of(thing: Any) -> str | None:
    """The protocol a client method, a client resource or a framework's model speaks, by its
    class's name (`openai.resources.responses`, Pydantic AI's `AnthropicModel`, the Agents
    SDK's `OpenAIChatCompletionsModel`); None if it is none of the three."""
    owner = getattr(thing, "__self__", thing)
    cls = owner if isinstance(owner, type) else type(owner)
    name = f"{cls.__module__}.{cls.__qualname__}".lower()
    if "anthropic" in name:
        return "anthropic"
    if "responses" in name:
        return "responses"
    if "openai" in name or "chat" in name:
        return "chat"
    return None


def built(thing: Any) -> bool:
    """Whether the answer types of what `thing` speaks need no building (any more)."""
    protocol = protocol_of(thing)
    return protocol is None or protocol in _built


async def abuild_for(thing: Any) -> None:
    """`build_for` from the event loop: on a thread, so the answers other runs have in flight
    on the loop are not held up while it builds."""
    if not built(thing):
        await asyncio.to_thread(build_for, thing)


def build_for(thing: Any) -> None:
    """Build the answer types of the protocol `thing` speaks, once per process."""
    protocol = protocol_of(thing)
    if protocol is None or protocol in _built:
        return
    with _lock:
        if protocol in _built:
            return
        for module, name in ROOTS[protocol]:
            try:
                root = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):  # an SDK not installed, or renamed
                continue
            for cls in _models(root):
                if not cls.__pydantic_complete__:
                    cls.model_rebuild()
        _built.add(protocol)


def _models(root: Any) -> list[type[BaseModel]]:
    """Every pydantic model class `root` reaches through its fields' annotations."""
    from pydantic import BaseModel

    seen: set[int] = set()
    found: list[type[BaseModel]] = []
    todo = [root]
    while todo:
        tp = todo.pop()
        if id(tp) in seen:
            continue
        seen.add(id(tp))
        todo += typing.get_args(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            found.append(tp)
            todo += [field.annotation for field in tp.model_fields.values()]
    return found
