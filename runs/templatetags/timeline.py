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
# Containers deeper than this start folded; trees bigger than this are shown as plain text.
OPEN_DEPTH, MAX_NODES = 2, 2000


@register.filter
def kind_label(kind: str) -> str:
    return KIND_LABELS.get(kind, kind)


@register.filter
def usd(micros: int | None) -> str:
    if not micros:
        return "$0"
    return f"${to_usd(micros).normalize():f}"


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
    return json.dumps(value, ensure_ascii=False)


@register.filter
def json_tree(value) -> SafeString:
    """Nested, collapsible JSON: objects and arrays are <details>, deeper levels start folded."""
    budget = [MAX_NODES]

    def node(v, depth: int) -> SafeString:
        budget[0] -= 1
        if isinstance(v, dict | list) and v:
            pairs = v.items() if isinstance(v, dict) else enumerate(v)
            label = f"{{{len(v)} keys}}" if isinstance(v, dict) else f"[{len(v)} items]"
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

    tree = node(value, 0)
    if budget[0] < 0:
        return format_html("<pre>{}</pre>", json.dumps(value, ensure_ascii=False, indent=2))
    return tree


@register.filter
def usd_value(micros: int | None) -> str:
    """An amount for an input field: empty when there is no limit."""
    # A scope with no policy yet resolves to "" in templates: no limit either.
    return "" if micros in (None, "") else f"{to_usd(micros).normalize():f}"
