"""OpenTelemetry traces: one trace per run across executions; steps and model calls as spans."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from runs.models import Run, Step
from runs.sdk import start_run
from tests import agent_workflows, workflows  # noqa: F401  (registers them)
from tests.workflows import Crash

pytestmark = pytest.mark.django_db

EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans():
    """The SDK's in-memory exporter behind the global tracer provider (set once a process:
    OpenTelemetry allows no second one)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    return EXPORTER


def named(finished, prefix: str) -> list:
    return [s for s in finished if s.name.startswith(prefix)]


def test_every_execution_of_a_run_is_a_span_of_the_trace_it_was_started_in(
    drive, expire_lease, spans
):
    run = start_run("ledger", {"steps": 3})
    workflows.crash_at.add("s1")
    with pytest.raises(Crash):  # the first execution dies in s1
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]  # the second resumes from its checkpoints

    finished = spans.get_finished_spans()
    (start,) = named(finished, "start ledger")
    executions = named(finished, "run ledger")
    assert len(executions) == 2
    # The carrier on the run row ties them: same trace, same parent, whichever process.
    assert Run.objects.get(pk=run.pk).trace_context["traceparent"].split("-")[1] == (
        f"{start.context.trace_id:032x}"
    )
    for execution in executions:
        assert execution.context.trace_id == start.context.trace_id
        assert execution.parent.span_id == start.context.span_id
        assert execution.attributes["stepguard.run.id"] == str(run.id)
    assert executions[1].attributes["stepguard.outcome"] == "completed"

    # Steps that ran are spans of their execution; s0, replayed by the second, is not.
    steps = named(finished, "step ")
    assert [s.name for s in steps] == ["step s0", "step s1", "step s1", "step s2"]
    owner = [executions[0], executions[0], executions[1], executions[1]]
    assert [s.parent.span_id for s in steps] == [e.context.span_id for e in owner]
    assert steps[2].attributes["stepguard.step.attempt"] == 2  # s1 re-sent


def test_a_model_call_span_follows_the_genai_conventions(drive, demo_model, spans):
    run = start_run("llm-chat", {"prompt": "Why do steps need keys?"})
    assert drive() == ["completed"]
    step = Step.objects.get(run=run, kind="llm")
    (span,) = named(spans.get_finished_spans(), "chat ")
    assert span.name == "chat gpt-4o-mini"
    assert span.kind == trace.SpanKind.CLIENT
    attributes = span.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "openai"
    assert "gen_ai.system" not in attributes  # deprecated by the conventions
    assert attributes["gen_ai.request.model"] == "gpt-4o-mini"
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (
        step.tokens_in,
        step.tokens_out,
    )
    assert attributes["stepguard.cost_usd"] == pytest.approx(step.cost_micros / 1e6, abs=1e-6)


def test_a_tool_call_span_is_a_genai_tool_span(drive, demo_model, spans):
    start_run("guide-weather", {"city": "Lisbon"})
    assert drive() == ["completed"]
    (span,) = named(spans.get_finished_spans(), "execute_tool ")
    assert span.name == "execute_tool get_weather"
    assert span.kind == trace.SpanKind.INTERNAL
    assert span.attributes["gen_ai.operation.name"] == "execute_tool"
    assert span.attributes["gen_ai.tool.name"] == "get_weather"
    assert span.attributes["stepguard.step.key"] == "get_weather"
    assert [s.name for s in named(spans.get_finished_spans(), "chat ")] == ["chat gpt-4.1"] * 2
