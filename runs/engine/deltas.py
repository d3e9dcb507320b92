"""A model call's request stored as what it adds to the run's previous one.

Turn N of a conversation sends turns 1 to N-1 again: stored whole, a 30-turn run writes the
square of its conversation. So `ctx.llm` records a request's conversation fields (`messages`,
`input`, `tools`, `system`, `instructions`) against the request of the run's model call before
it, by position in the run's history:

    {"$after": 12, "$keep": 9, "$new": [...]}   the first 9 items of seq 12's list, then these
    {"$after": 12}                              the same value as seq 12's

and adds `"$hash"`, a fingerprint of the whole request, so a later execution can tell whether
the request its code sends now is the one stored (code can change under a run) before
recording the next one against it. Readers get the whole request back with `Conversations`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

FIELDS = ("messages", "input", "tools", "system", "instructions")
HASH = "$hash"


def fingerprint(request: dict) -> str:
    text = json.dumps(request, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def against(request: dict, base: tuple[int, dict] | None) -> dict:
    """`request` as stored: its conversation fields relative to `base` (seq, whole request)."""
    stored = dict(request)
    if base is not None:
        seq, previous = base
        for field in FIELDS:
            if field not in request or field not in previous:
                continue
            value, before = request[field], previous[field]
            if value == before and not isinstance(value, list):
                stored[field] = {"$after": seq}
            elif isinstance(value, list) and isinstance(before, list):
                keep = _common_prefix(value, before)
                if keep:
                    stored[field] = {"$after": seq, "$keep": keep, "$new": value[keep:]}
    stored[HASH] = fingerprint(request)
    return stored


def _common_prefix(value: list, before: list) -> int:
    keep = 0
    for mine, theirs in zip(value, before, strict=False):
        if mine != theirs:
            break
        keep += 1
    return keep


def is_stored_delta(value: Any) -> bool:
    first = value[0] if isinstance(value, list) and value else None
    return isinstance(first, dict) and HASH in first


class Conversations:
    """The whole requests of one run's model calls, each base loaded and expanded once (one
    query the first time a delta needs its bases): use one per page or response."""

    def __init__(self, run_id: Any):
        self.run_id = run_id
        self._whole: dict[int, dict] = {}
        self._stored: dict[int, Any] | None = None

    def expanded(self, seq: int, value: Any) -> Any:
        """A step's input as it was sent: a model call's request whole, anything else as is."""
        if not is_stored_delta(value):
            return value
        return [self._expand(seq, value[0]), *value[1:]]

    def _expand(self, seq: int, stored: dict) -> dict:
        if seq in self._whole:
            return self._whole[seq]
        request = {key: item for key, item in stored.items() if key != HASH}
        for field in FIELDS:
            delta = request.get(field)
            after = delta.get("$after") if isinstance(delta, dict) else None
            if not isinstance(delta, dict) or not isinstance(after, int) or not 0 <= after < seq:
                continue
            before = self._base(after).get(field)
            if "$keep" in delta:
                request[field] = [*(before or [])[: delta["$keep"]], *delta.get("$new", [])]
            else:
                request[field] = before
        self._whole[seq] = request
        return request

    def _base(self, seq: int) -> dict:
        if self._stored is None:
            from runs.models import Step, StepKind

            rows = Step.objects.filter(run_id=self.run_id, kind=StepKind.LLM)
            self._stored = dict(rows.values_list("seq", "input"))
        value = self._stored.get(seq)
        if value is None or not is_stored_delta(value):
            return {}  # not a recorded request (never written by ctx.llm): nothing to add
        return self._expand(seq, value[0])
