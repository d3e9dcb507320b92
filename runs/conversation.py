"""A recorded model call read as a conversation: who said what, in order.

A model step records the request and the response of whichever protocol the official client
spoke (chat completions, Anthropic messages, OpenAI responses). People read a call as the
system prompt, the user's turns, the assistant's answer and the tools it called; this turns
any of the three into that list, and leaves the raw JSON one click away on the page.
"""

from __future__ import annotations

import json
from typing import Any, TypedDict


class Turn(TypedDict):
    role: str  # system, user, assistant, tool
    text: str
    calls: list[str]  # tool calls the assistant made, as "name(arguments)"


def _text(content: Any) -> tuple[str, list[str]]:
    """The text of a message's content (a string or a list of blocks), and its tool calls."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        return json.dumps(content, ensure_ascii=False), []
    texts, calls = [], []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
            continue
        if not isinstance(block, dict):
            continue
        kind = block.get("type", "")
        if "text" in block and isinstance(block["text"], str):
            texts.append(block["text"])
        elif kind in ("tool_use", "function_call"):
            args = block.get("input", block.get("arguments", ""))
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append(f"{block.get('name', '?')}({args})")
        elif kind in ("tool_result", "function_call_output"):
            inner, _ = _text(block.get("content", block.get("output")))
            texts.append(inner)
        elif kind.startswith("image") or kind == "input_image":
            texts.append("[image]")
    return "\n".join(t for t in texts if t), calls


def _turn(role: str, content: Any, tool_calls: Any = None) -> Turn:
    text, calls = _text(content)
    for call in tool_calls or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        calls.append(f"{fn.get('name', '?')}({fn.get('arguments', '')})")
    return {"role": role, "text": text, "calls": calls}


def _items(items: Any) -> list[Turn]:
    """Messages (chat, Anthropic) or input/output items (responses) as turns."""
    if isinstance(items, str):
        return [_turn("user", items)]
    turns: list[Turn] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind in ("function_call", "function_call_output", "tool_use", "tool_result"):
            role = "assistant" if kind in ("function_call", "tool_use") else "tool"
            turns.append(_turn(role, [item]))
        elif kind == "message" or "role" in item:
            turns.append(_turn(item.get("role", "user"), item.get("content"),
                               item.get("tool_calls")))  # fmt: skip
    return turns


def conversation(request: Any, response: Any) -> list[Turn]:
    """The turns of a model call, the answer last; empty if neither side looks like one."""
    turns: list[Turn] = []
    if isinstance(request, dict):
        for system in (request.get("system"), request.get("instructions")):
            if system:
                turns.append(_turn("system", system))
        turns += _items(request.get("messages") or request.get("input") or [])
    if isinstance(response, dict):
        if isinstance(response.get("choices"), list) and response["choices"]:
            message = response["choices"][0].get("message") or {}
            turns.append(_turn("assistant", message.get("content"), message.get("tool_calls")))
        elif isinstance(response.get("content"), list):  # Anthropic
            turns.append(_turn("assistant", response["content"]))
        elif isinstance(response.get("output"), list):  # responses
            turns += [{**t, "role": "assistant"} for t in _items(response["output"])]
    return [t for t in turns if t["text"] or t["calls"]]


def last_answer(response: Any) -> str:
    """What the model said in a response, for context beside an approval it led to."""
    turns = conversation(None, response)
    return turns[-1]["text"] if turns else ""
