"""What a model's tokens cost: local prices first, then a maintained catalogue.

The catalogue is `genai-prices` (kept by the Pydantic team, the one Pydantic AI uses): its
data ships inside the package and is read from there; its auto-update (`UpdatePrices`, which
fetches from GitHub) is never started here, so pricing needs no network and changes only when
the package is upgraded. Each priced call records where its price came from (`Price.source`:
the catalogue and its version, or the local table) in its step's usage breakdown.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from django.conf import settings

#: USD per million tokens: (input, output[, cached input[, cache write]]); cached input and
#: cache writes cost the input price where not given. A string is an alias: the model it is
#: priced as. STEPGUARD_MODEL_PRICES, a JSON object of the same shape, extends and overrides
#: it, and both win over the catalogue (negotiated prices, fine-tunes, self-hosted models).
DEFAULT_PRICES: dict[str, tuple[str, ...] | str] = {
    # The scripted demo model served on 127.0.0.1 (examples/model_server.py): priced like a
    # small real model so the budget demos have something to stop.
    "stepguard-demo": ("1.00", "4.00", "0.10", "1.25"),
}

#: A dated snapshot's suffix: dropped only to match a local price (`my-model-2025-01-01` as
#: `my-model`); the catalogue knows which snapshots cost what (gpt-4o-2024-05-13 is $5/$15,
#: not gpt-4o's $2.50/$10).
_SNAPSHOT = re.compile(r"-(\d{4}-\d{2}-\d{2}|\d{8}|latest)$")

#: Bedrock's spelling of a model: `[us.]anthropic.claude-sonnet-4-5-20250929-v1:0`.
_BEDROCK = re.compile(
    r"^(?:[a-z]{2,6}\.)?(anthropic|amazon|meta|mistral|cohere|ai21|deepseek|openai|qwen)\."
    r"(.+?)(?:-v\d+(?::\d+)?)?$"
)

#: Providers tried, in order, for a name no provider claims by its pattern.
_FALLBACK_PROVIDERS = ("openai", "anthropic", "google")


def catalogue_version() -> str:
    """The catalogue the prices come from, as recorded on each call it priced."""
    from genai_prices import __version__

    return f"genai-prices {__version__}"


@dataclass(frozen=True)
class Price:
    """USD per million tokens of each kind, and where they came from."""

    input: Decimal
    output: Decimal
    cached_input: Decimal
    cache_write: Decimal
    source: str = field(default="local", compare=False)

    @classmethod
    def of(cls, entry: tuple | list, source: str = "local") -> Price:
        values = [Decimal(str(v)) for v in entry]
        if not 2 <= len(values) <= 4 or any(v < 0 for v in values):
            raise ValueError(f"a model price is [input, output, cached?, cache write?]: {entry}")
        values += [values[0]] * (4 - len(values))
        return cls(values[0], values[1], values[2], values[3], source=source)


def price_of(*models: str | None) -> Price | None:
    """The price of the first of `models` that has one (the response's model, then the
    request's), or None: a model nobody prices goes through the one unpriced check."""
    for model in filter(None, models):
        price = _local(model, stripped=False) or _catalogue(model, _today())
        price = price or _local(model, stripped=True)
        if price is not None:
            return price
    return None


def _local(model: str, *, stripped: bool) -> Price | None:
    """A local price (STEPGUARD_MODEL_PRICES over DEFAULT_PRICES): by the exact name or a
    gateway's (`openai/gpt-4o` as `gpt-4o`); `stripped`, by the name without its snapshot."""
    table = {**DEFAULT_PRICES, **settings.STEPGUARD_MODEL_PRICES}
    bare = model.rsplit("/", 1)[-1]
    names = (_SNAPSHOT.sub("", bare),) if stripped else (model, bare)
    for name in dict.fromkeys(names):
        entry, seen = table.get(name), {name}
        while isinstance(entry, str) and entry not in seen:  # an alias
            seen.add(entry)
            entry = table.get(entry)
        if entry is not None and not isinstance(entry, str):
            overridden = name in settings.STEPGUARD_MODEL_PRICES
            return Price.of(entry, "STEPGUARD_MODEL_PRICES" if overridden else "local")
    return None


def _today() -> str:
    return datetime.now(tz=UTC).date().isoformat()


@functools.lru_cache(maxsize=1024)
def _catalogue(model: str, day: str) -> Price | None:
    """The catalogue's price of `model` in any of its spellings: the provider's own, a
    gateway's (OpenRouter's `anthropic/claude-sonnet-4.5`), Bedrock's, Vertex's (`@date`).
    Kept for the `day`: a lookup scans the catalogue (milliseconds), and a price the
    catalogue schedules for a date applies from that day on."""
    from genai_prices import data_snapshot

    snapshot = data_snapshot.get_snapshot()
    assert not snapshot.from_auto_update, "prices come from the installed package only"
    name = model.lower()
    tries: list[tuple[str, str | None]] = []
    if "/" in name:
        tries += [(name, "openrouter"), (name.rsplit("/", 1)[-1], None)]
    elif bedrock := _BEDROCK.match(name):
        tries += [(name, "aws"), (bedrock.group(2), bedrock.group(1))]
    else:
        tries.append((name, None))
    tries += [(tries[-1][0], p) for p in _FALLBACK_PROVIDERS]
    for ref, provider in tries:
        try:
            _, info = snapshot.find_provider_model(ref, None, provider, None)
        except LookupError:
            continue
        price = _as_price(info.get_prices(datetime.now(tz=UTC)))
        if price is not None:
            return price
    return None


def _as_price(prices: Any) -> Price | None:
    """Token prices of a catalogue entry; a tiered price at its base (prompts up to the first
    tier: 200k tokens for Claude, 272k for the newest GPTs). None without input and output."""

    def base(key: str) -> Decimal | None:
        value = getattr(prices, key, None)
        return getattr(value, "base", value)

    given, taken = base("input_mtok"), base("output_mtok")
    if given is None or taken is None:
        return None
    cached, write = base("cache_read_mtok"), base("cache_write_mtok")
    return Price(
        given,
        taken,
        given if cached is None else cached,
        given if write is None else write,
        source=catalogue_version(),
    )


#: The most tokens a model answers in one call, by its name without gateway prefix or snapshot
#: date (a full match): the catalogue gives context windows only. For a model not listed, its
#: context window (from the catalogue) bounds the answer instead.
OUTPUT_LIMITS: tuple[tuple[re.Pattern, int], ...] = tuple(
    (re.compile(pattern), limit)
    for pattern, limit in (
        (r"(chatgpt-4o|gpt-4o)(-mini)?(-(search|audio)-preview)?", 16_384),
        (r"gpt-4\.1(-mini|-nano)?", 32_768),
        (r"gpt-4-turbo(-preview)?|gpt-3\.5-turbo(-\d+)?", 4_096),
        (r"gpt-4(-\d{4})?", 8_192),
        (r"o1-mini", 65_536),
        (r"o1(-pro|-preview)?|o3(-mini|-pro|-deep-research)?|o4-mini(-deep-research)?", 100_000),
        (r"gpt-5(\.\d+)?(-mini|-nano|-chat|-codex)?", 128_000),
        (r"claude-3-(opus|sonnet|haiku)", 4_096),
        (r"claude-3-5-(sonnet|haiku)", 8_192),
        (r"claude-3-7-sonnet|claude-sonnet-4(-0|-5)?|claude-haiku-4-5|claude-opus-4-5", 64_000),
        (r"claude-opus-4(-0|-1)?", 32_000),
        (r"gemini-2\.5-(pro|flash|flash-lite)", 65_536),
        (r"gemini-(1\.5|2\.0)-(pro|flash|flash-lite)", 8_192),
    )
)

#: A snapshot's date, or Vertex's `@date`, after a model's name.
_DATED = re.compile(r"(-\d{4}-\d{2}-\d{2}|-\d{8}|@\d{8}|-latest|-preview-\d{2}-\d{2})$")


def output_limit(model: str | None) -> int | None:
    """The most tokens `model` may answer in one call (OUTPUT_LIMITS, else its context window
    in the catalogue), or None if neither knows it: what a call with no `max_tokens` could
    cost at most, so a budget's answer cap (and what a crash books as possibly spent) is
    never more than the model could answer."""
    if not model:
        return None
    name = model.lower().rsplit("/", 1)[-1]
    if bedrock := _BEDROCK.match(name):
        name = bedrock.group(2)
    bare = _DATED.sub("", name)
    for pattern, limit in OUTPUT_LIMITS:
        if pattern.fullmatch(bare) or pattern.fullmatch(name):
            return limit
    return _context_window(model.lower())


@functools.lru_cache(maxsize=1024)
def _context_window(model: str) -> int | None:
    from genai_prices import data_snapshot

    snapshot = data_snapshot.get_snapshot()
    for ref in dict.fromkeys((model, model.rsplit("/", 1)[-1])):
        for provider in (None, *_FALLBACK_PROVIDERS):
            try:
                _, info = snapshot.find_provider_model(ref, None, provider, None)
            except LookupError:
                continue
            if info.context_window:
                return info.context_window
    return None
