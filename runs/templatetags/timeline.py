"""Filters for the run page: step kinds in operators' words, durations, money, JSON trees."""

from __future__ import annotations

import json
from datetime import datetime

from django import template
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from runs.engine.budget import to_usd

register = template.Library()

# What an operator calls each kind of step (the stored names are the SDK's).
KIND_LABELS = {
    "call": "step",
    "llm": "model",
    "tool": "tool",
    "sleep": "timer",
    "event": "event",
    "approval": "approval",
    "child": "child",
    "transaction": "transaction",
}
# Containers deeper than OPEN_DEPTH start folded; bigger or deeper trees are shown as text.
OPEN_DEPTH, MAX_NODES, MAX_DEPTH = 2, 2000, 40


@register.filter
def kind_label(kind: str) -> str:
    return KIND_LABELS.get(kind, kind)


@register.filter
def usd(micros: int | None) -> str:
    return f"${usd_value(micros) or 0}"


@register.filter
def epoch_ms(when: datetime | None) -> str:
    return "" if when is None else str(int(when.timestamp() * 1000))


@register.filter
def duration(step) -> str:
    """Wall time from the write-ahead row to the finish, as a person reads it."""
    if step.finished_at is None:
        return ""
    seconds = (step.finished_at - step.started_at).total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 120:
        return f"{minutes} min {rest} s"
    return f"{minutes // 60} h {minutes % 60} min"


@register.filter
def as_json(value) -> str:
    """Compact JSON, for copy buttons."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:  # jsonb nests deeper than Python's encoder goes
        return ""


@register.filter
def json_tree(value) -> SafeString:
    """Nested, collapsible JSON: objects and arrays are <details>, deeper levels start folded.
    Too big or too deep a value is shown as plain text instead (it stops building the tree)."""
    budget = [MAX_NODES]

    class TooBig(Exception):
        pass

    def node(v, depth: int) -> SafeString:
        budget[0] -= 1
        if budget[0] < 0 or depth > MAX_DEPTH:
            raise TooBig
        if isinstance(v, dict | list) and v:
            pairs = v.items() if isinstance(v, dict) else enumerate(v)
            n, plural = len(v), "" if len(v) == 1 else "s"
            label = f"{{{n} key{plural}}}" if isinstance(v, dict) else f"[{n} item{plural}]"
            items = format_html_join(
                "", '<li><span class="json-key">{}</span>: {}</li>',
                ((k, node(item, depth + 1)) for k, item in pairs),
            )  # fmt: skip
            return format_html(
                '<details class="json"{}><summary>{}</summary><ul>{}</ul></details>',
                mark_safe(" open") if depth < OPEN_DEPTH else "",
                label,
                items,
            )
        return format_html('<code class="json-leaf">{}</code>', json.dumps(v, ensure_ascii=False))

    try:
        return node(value, 0)
    except TooBig:
        text = as_json(value) or "(nested too deeply to show; the API returns it)"
        return format_html("<pre>{}</pre>", text)


@register.filter
def usd_value(micros: int | None) -> str:
    """An amount for an input field: empty when there is no limit."""
    # A scope with no policy yet resolves to "" in templates: no limit either.
    return "" if micros in (None, "") else f"{to_usd(micros).normalize():f}"
