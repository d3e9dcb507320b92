"""OpenTelemetry spans for runs, steps and model calls.

Built on opentelemetry-api only, so it is a no-op until the process configures a tracer
provider (for example `opentelemetry-instrument python manage.py runworker ...` with the
`OTEL_*` variables, or your own `trace.set_tracer_provider(...)`; docs/operations.md).

One trace per run, across crashes, hand-overs and worker processes: `start_run` records the
span context it was called in (or, with none, that of a short `start <workflow>` span) on the
run (`Run.trace_context`, a W3C `traceparent` carrier), and every execution of the run, in
whichever process, is a span under it. Steps that run (not those replayed) are spans under
their execution; a `ctx.llm` step is named and described by the GenAI semantic conventions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import SpanKind, Status, StatusCode

tracer = trace.get_tracer("stepguard")


def carrier_for_new_run(workflow: str) -> dict[str, str] | None:
    """The trace context a new run's executions will descend from, as a carrier to store."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        inject(carrier)
    else:
        with tracer.start_as_current_span(f"start {workflow}", kind=SpanKind.PRODUCER):
            inject(carrier)
    return carrier or None


@contextmanager
def execution(run, worker: str | None = None):
    """The span of one execution of `run`; yields the context its steps descend from."""
    attributes = {
        "stepguard.run.id": str(run.id),
        "stepguard.workflow": f"{run.workflow}@{run.version}",
        "stepguard.run.attempt": run.attempt,
        "stepguard.lease.epoch": run.lease_epoch,
    }
    if worker:
        attributes["stepguard.worker.id"] = worker
    with tracer.start_as_current_span(
        f"run {run.workflow}",
        context=extract(run.trace_context or {}),
        kind=SpanKind.CONSUMER,
        attributes=attributes,
    ) as span:
        yield trace.set_span_in_context(span)


def outcome(parent: Context | None, value: str, error: dict | None = None) -> None:
    """Say how the execution whose context is `parent` ended."""
    if parent is None:
        return
    span = trace.get_current_span(parent)
    span.set_attribute("stepguard.outcome", value)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error.get("message", ""))[:200]))


@contextmanager
def step(parent: Context | None, key: str, kind: str, attempt: int, model: str = ""):
    """The span of a step that runs: `step <key>`, `chat <model>` for a model call, or
    `execute_tool <tool>` for a tool call (`model` is then the tool's name), the last two
    following OpenTelemetry's GenAI semantic conventions."""
    name = f"step {key}"
    attributes: dict[str, Any] = {
        "stepguard.step.key": key,
        "stepguard.step.kind": kind,
        "stepguard.step.attempt": attempt,
    }
    if kind == "llm":
        name = f"chat {model}" if model else name
        attributes |= {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
    elif kind == "tool":
        name = f"execute_tool {model or key}"
        attributes |= {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": model or key}
    with tracer.start_as_current_span(
        name, context=parent, kind=SpanKind.CLIENT if kind == "llm" else SpanKind.INTERNAL,
        attributes=attributes, record_exception=True, set_status_on_exception=True,
    ) as span:  # fmt: skip
        yield span


def model_call(data: dict, usage) -> None:
    """GenAI attributes of the model call whose step span is current: provider, response
    model, tokens in and out, and its cost in USD."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    provider = "anthropic" if data.get("type") == "message" else "openai"
    span.set_attributes(
        {
            "gen_ai.provider.name": provider,  # was gen_ai.system, deprecated
            "gen_ai.response.model": str(data.get("model", "")),
            "gen_ai.usage.input_tokens": usage.tokens_in,
            "gen_ai.usage.output_tokens": usage.tokens_out,
            "stepguard.cost_usd": float(usage.usd),
        }
    )
