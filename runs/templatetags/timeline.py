"""Filters for the run page: step kinds in operators' words, durations, money, JSON trees."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from django import template
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.timesince import timesince

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
    return span_text((step.finished_at - step.started_at).total_seconds())


def span_text(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"
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
def json_tree(value, unfolded: str = "") -> SafeString:
    """Nested, collapsible JSON: objects and arrays are <details>, deeper levels start folded
    (every level open with `json_tree:"unfolded"`: what an approval approves is read whole).
    Too big or too deep a value is shown as plain text instead (it stops building the tree)."""
    budget = [MAX_NODES]
    open_depth = MAX_DEPTH if unfolded else OPEN_DEPTH

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
                mark_safe(" open") if depth < open_depth else "",
                label,
                items,
            )
        return format_html('<code class="json-leaf">{}</code>', json.dumps(v, ensure_ascii=False))

    try:
        return node(value, 0)
    except TooBig:
        text = as_json(value) or "(nested too deeply to show; the API returns it)"
        return format_html('<pre tabindex="0">{}</pre>', text)


@register.filter
def usd_value(micros: int | None) -> str:
    """An amount for an input field: empty when there is no limit."""
    # A scope with no policy yet resolves to "" in templates: no limit either.
    return "" if micros in (None, "") else f"{to_usd(micros).normalize():f}"


def _field_value(name: str, value) -> str:
    if name.endswith("_micros") and isinstance(value, int):
        return usd(value)
    if isinstance(value, dict) and {"type", "message"} <= value.keys():
        return f"{value['type']}: {value['message']}"
    if isinstance(value, str):
        return value
    return as_json(value)


@register.filter
def event_fields(payload) -> list[tuple[str, str]]:
    """An event's payload as label/value pairs a person reads: amounts in USD, an error as its
    type and message, a change as old → new."""
    if not isinstance(payload, dict):
        return []
    pairs = []
    before, after = payload.get("before"), payload.get("after")
    for name, value in payload.items():
        if name in ("before", "after") and isinstance(before, dict) and isinstance(after, dict):
            continue
        pairs.append((name.replace("_", " "), _field_value(name, value)))
    if isinstance(before, dict) and isinstance(after, dict):
        for name in after:
            label = name.removesuffix("_micros").replace("_", " ")
            old, new = before.get(name), after[name]
            shown_old = "none" if old is None else _field_value(name, old)
            shown_new = "none" if new is None else _field_value(name, new)
            pairs.append((label, f"{shown_old} → {shown_new}"))
    return pairs


@register.filter
def ms_time(when: datetime | None) -> str:
    """A time of day to the millisecond, UTC: steps are milliseconds apart."""
    if when is None:
        return ""
    return when.astimezone(UTC).strftime("%H:%M:%S.") + f"{when.microsecond // 1000:03d}"


@register.filter
def short_id(value) -> str:
    """The 8 characters of an id the pages show (and the runs list searches by)."""
    return str(value)[:8]


@register.filter
def run_duration(run) -> str:
    """From the run's start to its end (or to now while it goes on)."""
    if run.started_at is None:
        return ""
    end = run.finished_at or timezone.now()
    return span_text((end - run.started_at).total_seconds())


@register.filter
def queue_delay(run) -> str:
    """From the run's creation to a worker first taking it (or to now while none has): the
    wait in the queue, apart from the run's own duration."""
    end = run.started_at or timezone.now()
    return span_text(max((end - run.created_at).total_seconds(), 0))


def how_far(at: datetime, now: datetime) -> str:
    """'41 s ago', '3 minutes ago', 'in 2 hours': one way of saying it on every page (the
    pages said '0 minutes ago' where the run's sentence said '41 s ago'); live.js keeps it
    ticking the same way."""
    seconds = (now - at).total_seconds()
    if abs(seconds) < 60:
        return f"{seconds:.0f} s ago" if seconds >= 0 else f"in {-seconds:.0f} s"
    if seconds > 0:
        return f"{timesince(at, now).split(',')[0]} ago".replace("\xa0", " ")
    return f"in {timesince(now, at).split(',')[0]}".replace("\xa0", " ")


@register.filter
def ago(at: datetime | None) -> str:
    """A moment as how long ago it was, in a <time> element live.js keeps up to date."""
    if at is None:
        return ""
    return format_html(
        '<time datetime="{}" data-ago title="{}">{}</time>',
        at.isoformat(), at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        how_far(at, timezone.now()),
    )  # fmt: skip
