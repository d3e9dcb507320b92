"""Streamed answers with positions: each piece is (step, attempt, offset), and a re-send says so.

A step re-sent after a crash (or retried in place) streams its answer again from the start. Its
`on_delta` gets each piece as a `Delta`, a str that also carries where it goes: the attempt, its
offset in the step's stream and, on the first piece of a later attempt, `restart=True`, so a
consumer replaces what an earlier attempt showed instead of appending to it.

What the run's readers see (the live page, the SSE stream) is written once per position: the
pieces are stored (`StreamPiece`) as writes at an offset of the step's stream, and a re-sent
attempt is compared with what the earlier ones already showed. The part it repeats is not
written again; where it differs, the first piece written cuts back to that offset. A reader
applies every piece as `text = text[:offset] + piece` and sees each piece once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

TEXT, TOOL_CALL = "text", "tool_call"


class Delta(str):
    """A piece of a streamed answer: its text, and its position in the step's stream.

    `seq` and `step` name the step, `attempt` the step's attempt that streamed it, `offset` the
    number of characters the attempt streamed before it, `restart` whether it is the first piece
    of an attempt after an earlier one (whose pieces it replaces), `kind` "text" or "tool_call"
    (a tool call's arguments, JSON in pieces; `tool` names the call: its index or its id)."""

    step: str
    seq: int
    attempt: int
    offset: int
    restart: bool
    kind: str
    tool: Any

    def __new__(
        cls, text: str, *, step: str = "", seq: int = 0, attempt: int = 1, offset: int = 0,
        restart: bool = False, kind: str = TEXT, tool: Any = None,
    ) -> Delta:  # fmt: skip
        self = super().__new__(cls, text)
        self.step, self.seq, self.attempt, self.offset = step, seq, attempt, offset
        self.restart, self.kind, self.tool = restart, kind, tool
        return self


def fold(pieces: Iterable[tuple[int, str]]) -> str:
    """A step's stream as its readers see it: each (offset, text) written in order."""
    shown = ""
    for offset, text in pieces:
        shown = shown[:offset] + text
    return shown


def shown_text(run_id: Any, seq: int) -> tuple[str, int]:
    """What the run's readers were shown of step `seq`'s stream, and the last attempt that
    showed anything (0 if none)."""
    from runs.models import StreamPiece

    rows = StreamPiece.objects.filter(run_id=run_id, seq=seq).order_by("id")
    pieces = list(rows.values_list("offset", "text", "attempt"))
    return fold((o, t) for o, t, _ in pieces), max((a for *_, a in pieces), default=0)


class Relay:
    """One attempt of a step's stream: each piece to `on_delta` with its position, and to the
    run's readers (`share(offset, kind, text)`) only where it is new to them."""

    def __init__(
        self, *, step: str, seq: int, attempt: int, shown: str,
        share: Callable[[int, str, str], None], on_delta: Callable[[str], Any] | None,
    ) -> None:  # fmt: skip
        self.step, self.seq, self.attempt = step, seq, attempt
        self.shown, self.share, self.on_delta = shown, share, on_delta
        self.offset = 0
        self.matching = True  # so far this attempt repeats what the readers were shown

    def __call__(self, text: str, kind: str = TEXT, tool: Any = None) -> None:
        if not text:
            return
        start = self.offset
        self.offset += len(text)
        self._share(start, kind, text)
        if self.on_delta is not None:
            self.on_delta(
                Delta(
                    text, step=self.step, seq=self.seq, attempt=self.attempt, offset=start,
                    restart=start == 0 and self.attempt > 1, kind=kind, tool=tool,
                )
            )  # fmt: skip

    def _share(self, start: int, kind: str, text: str) -> None:
        if self.matching:
            before = self.shown[start : start + len(text)]
            same = 0
            while same < min(len(before), len(text)) and before[same] == text[same]:
                same += 1
            if same == len(text):
                return  # the readers have it already
            self.matching = False
            start, text = start + same, text[same:]
        self.share(start, kind, text)

    def close(self) -> None:
        """The stream ended: an attempt shorter than what was shown cuts the rest."""
        if self.matching and self.offset < len(self.shown):
            self.matching = False
            self.share(self.offset, TEXT, "")


def event_piece(event: Any) -> tuple[str, str, Any] | None:
    """(kind, text, tool) an event of the three protocols' stream helpers adds, if any: text, or
    a tool call's arguments (chat completions name the call by its index, the responses API by
    its item id, Anthropic by its content block's index)."""
    kind = getattr(event, "type", "")
    if kind in ("content.delta", "response.output_text.delta"):
        text = getattr(event, "delta", None)
        return (TEXT, text, None) if text else None
    if kind == "text":  # anthropic
        text = getattr(event, "text", None)
        return (TEXT, text, None) if text else None
    if kind == "tool_calls.function.arguments.delta":
        text = getattr(event, "arguments_delta", None)
        return (TOOL_CALL, text, getattr(event, "index", None)) if text else None
    if kind == "response.function_call_arguments.delta":
        text = getattr(event, "delta", None)
        return (TOOL_CALL, text, getattr(event, "item_id", None)) if text else None
    if kind == "content_block_delta":  # anthropic's raw event: a tool_use block's input
        delta = getattr(event, "delta", None)
        text = getattr(delta, "partial_json", None)
        if getattr(delta, "type", "") == "input_json_delta" and text:
            return (TOOL_CALL, text, getattr(event, "index", None))
    return None
