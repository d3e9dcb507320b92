"""A scripted DEMO model on 127.0.0.1, speaking the OpenAI chat completions and responses
protocols and Anthropic's messages protocol, with usage and tool calls, streamed or not.

Not a language model: it answers from a script so the demo and the tests run with no network.
With tools offered, it calls them in the order a `SCRIPT: tool_a, tool_b` line in the system
message names (arguments from `ARGS tool_a: {...}` lines, or the last tool result's "next"),
then answers with a summary of what the tools returned. Without tools it writes a
deterministic paragraph about the last user message. It counts every call, by the request's
Idempotency-Key header, so tests can tell which calls were paid twice, and keeps each request's
body; `fail_next(status, ...)` makes the next calls fail as a provider would (a 429 with
`Retry-After`, a 400), so tests can see what the client and Stepguard do with errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stepguard-demo"


_BASE64 = re.compile(r"[A-Za-z0-9+/=]{1000,}")


def _tokens(text: str) -> int:
    """About 4 characters a token, and an image (a long run of base64) about 1,000 tokens."""
    text, images = _BASE64.subn("", text)
    return len(text) // 4 + 1 + 1_000 * images


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def write(prompt: str) -> str:
    """A deterministic 'completion' for a prompt: same prompt, same words; a prompt ending in
    `ANSWER JSON: {...}` is answered with that JSON (structured output a test can parse)."""
    if fixed := re.search(r"ANSWER JSON:\s*(\{.*\})\s*$", prompt, re.S):
        return fixed.group(1)
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:8]
    words = re.findall(r"[\w'-]+", prompt)[-24:]
    return f"[demo model] {' '.join(words[:18])} (note {digest})"


def plan(messages: list[dict], tools: list[dict]) -> list[tuple[str, object]]:
    """The next tool calls [(name, arguments)] the script asks for, or [] to answer. A script
    entry `a+b` asks for both in one turn (parallel tool calls)."""
    system = "\n".join(_text_of(m.get("content")) for m in messages if m.get("role") == "system")
    script = re.search(r"SCRIPT:\s*(.+)", system)
    offered = [t.get("function", t).get("name") for t in tools]
    order = [n.strip() for n in script.group(1).split(",")] if script else offered
    called = [
        call["function"]["name"]
        for m in messages
        if m.get("role") == "assistant"
        for call in m.get("tool_calls") or []
    ]
    for entry in order:
        names = [n.strip() for n in entry.split("+") if n.strip() in offered]
        if names and not all(n in called for n in names):
            break
    else:
        return []
    last = next((m for m in reversed(messages) if m.get("role") == "tool"), None)
    planned = []
    for name in names:
        args = re.search(rf"ARGS {re.escape(name)}:\s*([{{\[].*[}}\]])", system)
        arguments = json.loads(args.group(1)) if args else {}
        if last is not None and isinstance(arguments, dict):
            # A tool result's content is text, or a list of text parts (the Agents SDK's shape
            # for an MCP tool's answer).
            with contextlib.suppress(ValueError, AttributeError):
                said = _text_of(last.get("content")) or "{}"
                arguments |= json.loads(said).get("next", {}).get(name, {})
        planned.append((name, arguments))
    return planned


def _as_chat(system, conversation: list) -> list[dict]:
    """A responses-API input or an Anthropic conversation in chat completions' shape, for
    `plan`: system text, assistant tool calls, tool results."""
    chat = [{"role": "system", "content": _text_of(system)}] if system else []
    for item in conversation if isinstance(conversation, list) else []:
        kind, content = item.get("type"), item.get("content")
        if kind == "function_call":
            call = {"function": {"name": item["name"]}}
            chat.append({"role": "assistant", "tool_calls": [call]})
        elif kind == "function_call_output":
            chat.append({"role": "tool", "content": item.get("output")})
        elif isinstance(content, list) and any(
            isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in content
        ):
            for block in content:
                if block.get("type") == "tool_use":
                    call = {"function": {"name": block["name"]}}
                    chat.append({"role": "assistant", "tool_calls": [call]})
                elif block.get("type") == "tool_result":
                    chat.append({"role": "tool", "content": _text_of(block.get("content"))})
        else:
            chat.append({"role": item.get("role", "user"), "content": content})
    return chat


def _summary(chat: list[dict]) -> str | None:
    results = [m.get("content") for m in chat if m.get("role") == "tool"]
    return f"Done. Tool results: {'; '.join(map(str, results))}" if results else None


def _call_id(prompt: str, name: str, index: int) -> str:
    return hashlib.sha256(f"{prompt}{name}{index}".encode()).hexdigest()[:12]


class DemoModel:
    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.total = 0
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []  # time.time() of each call, for rate-limit tests
        #: time.time() just after the last byte of each key's latest answer was written: where
        #: the record window (bench/requests_per_call.py) starts.
        self.answered_at: dict[str, float] = {}
        self._failures: list[tuple[int, dict[str, str], dict]] = []
        self._cached: set[str] = set()
        self._lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self._arrivals = threading.Condition()
        self._hold: tuple[int, float] | None = None
        #: "output": Anthropic's streamed message_delta carries the output tokens only.
        self.anthropic_delta_usage = "cumulative"
        #: Streamed answers to pause, in order (see stall_streams).
        self._stalls: list[dict] = []
        self.stalled: list[threading.Event] = []  # set as each paused answer reaches its pause

    def stall_streams(self, *after: int | None) -> None:
        """Pause the next streamed answers, the first after `after[0]` of its events, and so
        on (None: that one not at all), each until `release()`: a test kills a worker
        mid-stream, or looks at what a page shows before the step completes."""
        with self._lock:
            self._stalls = [{"after": n, "gate": threading.Event(), "taken": False} for n in after]
            for stall in self._stalls:
                if stall["after"] is None:
                    stall["gate"].set()
            self.stalled = [threading.Event() for _ in after]

    def release(self) -> None:
        """Let the earliest paused (or still to pause) answer go on."""
        with self._lock:
            gate = next((s["gate"] for s in self._stalls if not s["gate"].is_set()), None)
        if gate is not None:
            gate.set()

    def _next_stall(self) -> tuple[int | None, threading.Event | None, threading.Event | None]:
        with self._lock:
            for index, stall in enumerate(self._stalls):
                if not stall["taken"]:
                    stall["taken"] = True
                    return stall["after"], stall["gate"], self.stalled[index]
        return None, None, None

    def hold(self, count: int, timeout: float = 5.0) -> None:
        """Answer no request until `count` are in flight together (or `timeout` s passed):
        calls made one after the other each wait the whole timeout, concurrent ones none."""
        self._hold = (count, timeout)

    @contextlib.contextmanager
    def answering(self):
        with self._arrivals:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            if self._hold is not None:
                count, timeout = self._hold
                if self.in_flight >= count:
                    self._hold = None  # met: let every held request go
                    self._arrivals.notify_all()
                else:
                    self._arrivals.wait_for(lambda: self._hold is None, timeout)
        try:
            yield
        finally:
            with self._arrivals:
                self.in_flight -= 1

    def record(self, key: str | None, body: dict) -> tuple[int, dict[str, str], dict] | None:
        """Count a call; returns the failure to answer it with, if one is queued."""
        with self._lock:
            self.total += 1
            self.arrivals.append(time.time())
            self.calls[key or "-"] += 1
            self.bodies.append(body)
            return self._failures.pop(0) if self._failures else None

    def fail_next(
        self, status: int, *, times: int = 1, headers: dict[str, str] | None = None
    ) -> None:
        """Answer the next `times` calls with `status` and an error body in both providers'
        shapes, instead of a completion."""
        error = {"message": f"demo model: scripted {status}", "type": "scripted_error"}
        with self._lock:
            self._failures += [(status, headers or {}, {"type": "error", "error": error})] * times

    def cache(self, prefix: str) -> tuple[int, int]:
        """Prompt caching as the providers report it: (tokens read, tokens written) of a
        prefix, read if an earlier request wrote it."""
        tokens = _tokens(prefix)
        with self._lock:
            if prefix in self._cached:
                return tokens, 0
            self._cached.add(prefix)
            return 0, tokens

    def chat(self, body: dict) -> dict:
        messages, tools = body.get("messages", []), body.get("tools") or []
        prompt = json.dumps(messages)
        steps = plan(messages, tools) if tools else []
        created = int(time.time())
        if steps:
            calls = [
                {
                    "id": "call_" + _call_id(prompt, name, index),
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments)},
                }
                for index, (name, arguments) in enumerate(steps)
            ]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            reason, out = "tool_calls", json.dumps(calls)
        else:
            results = [m.get("content") for m in messages if m.get("role") == "tool"]
            user = next(
                (_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"),
                "",
            )
            text = f"Done. Tool results: {'; '.join(results)}" if results else write(user)
            message = {"role": "assistant", "content": text}
            reason, out = "stop", text
        usage_in, usage_out = _tokens(prompt), _tokens(out)
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        if cap and usage_out > cap and message["content"]:  # cut short, as a provider would
            message["content"] = message["content"][: cap * 4]
            reason, usage_out = "length", cap
        # A reasoning model (o1, o3, o4-mini...) thinks first: reported inside the output.
        reasoning = 3 * usage_out if re.match(r"o\d", body.get("model", "")) else 0
        # With a prompt_cache_key, everything before the last message is a cacheable prefix.
        cached = self.cache(json.dumps(messages[:-1]))[0] if "prompt_cache_key" in body else 0
        return {
            "id": f"chatcmpl-{created}",
            "object": "chat.completion",
            "created": created,
            "model": body.get("model", MODEL),
            "choices": [
                {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": usage_in,
                "completion_tokens": usage_out + reasoning,
                "total_tokens": usage_in + usage_out + reasoning,
                "prompt_tokens_details": {"cached_tokens": cached},
                "completion_tokens_details": {"reasoning_tokens": reasoning},
            },
        }

    def responses(self, body: dict) -> dict:
        conversation = body.get("input")
        prompt = conversation if isinstance(conversation, str) else json.dumps(conversation)
        chat = _as_chat(body.get("instructions"), conversation)
        steps = plan(chat, body.get("tools") or []) if body.get("tools") else []
        text = _summary(chat) or write(prompt)
        output: list[dict] = [
            {
                "type": "function_call",
                "id": "fc_" + _call_id(prompt, name, index),
                "call_id": "call_" + _call_id(prompt, name, index),
                "name": name,
                "arguments": json.dumps(arguments),
                "status": "completed",
            }
            for index, (name, arguments) in enumerate(steps)
        ]
        if not output:
            output = [
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ]
        usage_in, usage_out = _tokens(prompt), _tokens(json.dumps(output))
        return {
            "id": f"resp_{int(time.time())}",
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model", MODEL),
            "status": "completed",
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": usage_in,
                "output_tokens": usage_out,
                "total_tokens": usage_in + usage_out,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    def messages(self, body: dict) -> dict:
        messages = body.get("messages", [])
        user = _text_of(messages[-1].get("content")) if messages else ""
        chat = _as_chat(body.get("system"), messages)
        steps = plan(chat, body.get("tools") or []) if body.get("tools") else []
        text = _summary(chat) or write(user)
        prompt = json.dumps(messages) + json.dumps(body.get("system", ""))
        content: list[dict] = [
            {
                "type": "tool_use",
                "id": "toolu_" + _call_id(prompt, name, index),
                "name": name,
                "input": arguments,
            }
            for index, (name, arguments) in enumerate(steps)
        ] or [{"type": "text", "text": text}]
        read = written = 0
        if "cache_control" in json.dumps(body.get("system")):  # a cached system prompt
            read, written = self.cache(json.dumps(body["system"]))
            prompt = json.dumps(messages)
        return {
            "id": f"msg_{int(time.time())}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", MODEL),
            "content": content,
            "stop_reason": "tool_use" if steps else "end_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": _tokens(prompt),
                "output_tokens": _tokens(json.dumps(content)),
                "cache_read_input_tokens": read,
                "cache_creation_input_tokens": written,
            },
        }


def _pieces(text: str, size: int = 12) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def stream_events(
    route: str, body: dict, response: dict, delta: str = "cumulative"
) -> list[tuple[str | None, dict | str]]:
    """`response` as the server-sent events its protocol streams: (event name, data)."""
    if route == "/chat/completions":
        head = {k: response[k] for k in ("id", "created", "model")}
        head["object"] = "chat.completion.chunk"
        choice = response["choices"][0]
        message = choice["message"]

        def chunk(delta: dict, finish=None) -> dict:
            return head | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        events = [chunk({"role": "assistant", "content": ""})]
        events += [chunk({"content": piece}) for piece in _pieces(message.get("content") or "")]
        for index, call in enumerate(message.get("tool_calls") or []):
            events.append(chunk({"tool_calls": [{"index": index, **call}]}))
        events.append(chunk({}, choice["finish_reason"]))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(head | {"choices": [], "usage": response["usage"]})
        return [(None, e) for e in events] + [(None, "[DONE]")]
    if route == "/responses":
        started = response | {"status": "in_progress", "output": []}
        events = [{"type": "response.created", "response": started}]
        for index, item in enumerate(response["output"]):
            events += _response_item_events(index, item)
        events.append({"type": "response.completed", "response": response})
        for number, event in enumerate(events):
            event["sequence_number"] = number
        return [(e["type"], e) for e in events]
    # Anthropic's messages: a text block's text, a tool_use block's input as JSON, in pieces
    usage = response["usage"]
    # Cumulative in message_delta, as the API sends it now; the output tokens only where the
    # input tokens come in message_start alone (Bedrock, Vertex, the API before 2025).
    delta_usage = usage if delta != "output" else {"output_tokens": usage["output_tokens"]}
    start = response | {"content": [], "stop_reason": None, "usage": usage | {"output_tokens": 1}}
    events = [{"type": "message_start", "message": start}]
    for index, block in enumerate(response["content"]):
        if block["type"] == "tool_use":
            opened = block | {"input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": piece}
                      for piece in _pieces(json.dumps(block["input"]))]  # fmt: skip
        else:
            opened = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": piece} for piece in _pieces(block["text"])]
        events.append({"type": "content_block_start", "index": index, "content_block": opened})
        events += [{"type": "content_block_delta", "index": index, "delta": d} for d in deltas]
        events.append({"type": "content_block_stop", "index": index})
    events += [
        {"type": "message_delta", "delta": {"stop_reason": response["stop_reason"],
         "stop_sequence": None}, "usage": delta_usage},
        {"type": "message_stop"},
    ]  # fmt: skip
    return [(e["type"], e) for e in events]


def _response_item_events(index: int, item: dict) -> list[dict]:
    """The responses API's events for one output item: a message's text or a function call's
    arguments, in pieces."""
    if item["type"] == "function_call":
        where = {"item_id": item["id"], "output_index": index}
        return [
            {"type": "response.output_item.added", "output_index": index,
             "item": item | {"status": "in_progress", "arguments": ""}},
            *({"type": "response.function_call_arguments.delta", **where, "delta": piece}
              for piece in _pieces(item["arguments"])),
            {"type": "response.function_call_arguments.done", **where,
             "arguments": item["arguments"], "name": item["name"]},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]  # fmt: skip
    text = item["content"][0]["text"]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    empty = {"type": "output_text", "text": "", "annotations": []}
    return [
        {"type": "response.output_item.added", "output_index": index,
         "item": item | {"status": "in_progress", "content": []}},
        {"type": "response.content_part.added", **where, "part": empty},
        *({"type": "response.output_text.delta", **where, "delta": piece, "logprobs": []}
          for piece in _pieces(text)),
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": item["content"][0]},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]  # fmt: skip


def serve(port: int = 0) -> tuple[ThreadingHTTPServer, DemoModel]:
    """Start the demo model on 127.0.0.1 in a daemon thread; returns the server and its state."""
    model = DemoModel()

    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as the providers do: clients pool the connection between calls.
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def handle(self):
            with contextlib.suppress(ConnectionError):  # a client that went away
                super().handle()

        def _send(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self._answered()

        def _answered(self) -> None:
            if key := self.headers.get("Idempotency-Key"):
                model.answered_at[key] = time.time()

        def do_GET(self):
            if self.path.rstrip("/").endswith("/stats"):
                return self._send(200, {"total": model.total, "by_key": dict(model.calls)})
            return self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                return self._send(400, {"error": {"message": "body is not JSON"}})
            routes = {
                "/chat/completions": model.chat,
                "/responses": model.responses,
                "/messages": model.messages,
            }
            route = next((path for path in routes if self.path.endswith(path)), None)
            handler = routes.get(route)
            if handler is None:
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            failure = model.record(self.headers.get("Idempotency-Key"), body)
            if failure is not None:
                status, headers, error = failure
                return self._send(status, error, headers)
            with model.answering():
                answer = handler(body)
            if body.get("stream"):
                events = stream_events(route, body, answer, model.anthropic_delta_usage)
                return self._stream(events)
            return self._send(200, answer)

        def _stream(self, events) -> None:
            """Server-sent events, one write each, as a provider streams them."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            pause, gate, reached = model._next_stall()
            for number, (name, data) in enumerate(events):
                if number == pause and gate is not None and reached is not None:
                    reached.set()
                    gate.wait(120)
                text = data if isinstance(data, str) else json.dumps(data)
                frame = (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
                raw = frame.encode()
                self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            self._answered()

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, name="demo-model", daemon=True).start()
    return server, model


if __name__ == "__main__":
    import sys

    server, _ = serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    print(f"demo model on http://127.0.0.1:{server.server_port}/v1", flush=True)
    threading.Event().wait()
