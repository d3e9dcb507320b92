"""Model and tool calls: `ctx.llm`, `ctx.tool` and `ctx.agent_loop`, metered steps."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models.fields.json import KT

from runs import tracing
from runs.engine import agent, deltas, sdk_types, streaming
from runs.engine import llm as llm_engine
from runs.engine.aio.host import concurrently
from runs.engine.budget import Metered, Usage, scopes_for
from runs.engine.execution import Execution
from runs.engine.records import Decision, accepts, signature_names
from runs.engine.retry import RetryPolicy
from runs.engine.serialization import describe_input
from runs.engine.steps import Steps
from runs.engine.waits import Waits
from runs.engine.wakeup import doorbell
from runs.errors import UnpricedModel
from runs.models import EventType, Policy, Run, Step, StepKind

log = logging.getLogger("stepguard.executor")


class ModelCalls:
    """Steps that call a model (priced, estimated against budgets) or a tool (maybe approved)."""

    def __init__(self, ex: Execution, steps: Steps, waits: Waits):
        self.ex, self.steps, self.waits = ex, steps, waits
        self.checkpoints = ex.checkpoints
        self._unpriced_models: set[str] = set()  # flagged on the timeline this execution
        #: The run's last model call: (seq, its whole request, whether its stored form is known
        #: to expand to that request, None until checked); the next request is stored against it.
        self._last_request: tuple[int, dict, bool | None] | None = None

    def llm(
        self,
        key: str,
        call: Callable,
        /,
        *,
        estimate: Usage | bool = True,
        retry: RetryPolicy | None = None,
        typed: bool | type = False,
        on_delta: Callable[[str], Any] | None = None,
        timeout: float | timedelta | None = None,
        **request: Any,
    ) -> Any:
        """Call a model once for this run: `call(**request)`, e.g.
        `ctx.llm("think-0", client.chat.completions.create, model=..., messages=...)`.

        Works with the official openai (chat completions, responses) and anthropic clients,
        sync or async. Returns the response as JSON (a dict, the same on replay). Records the
        request on the step and the tokens and USD of `usage` on the step and the run. The
        call carries the step's idempotency key as an `Idempotency-Key` header. By default
        the prompt plus `max_tokens` is reserved against the budgets first (`estimate=False`
        to skip, or a Usage of your own). With `typed=True` (or a response class) the response
        comes back as the client's own type, `ChatCompletion`, `Response` or `Message`, rebuilt
        from the same JSON on replay, so code written for the SDK keeps `.choices[0].message`.

        With `stream=True` (or the client's `.stream` method) the answer is streamed inside the
        step: `on_delta(text)` gets each piece of text as it arrives, and the step records the
        final response and its usage. A replay returns the final response and emits no deltas.
        """
        cls = llm_engine.response_type(call, typed, request)
        streaming = llm_engine.streams(call, request)
        if streaming:
            llm_engine.stream_call(call, request)  # refuses what cannot stream, before the step
        model = str(request.get("model", ""))
        under_budget = self.ex.budgeted or scopes_for(self.ex.who.workflow, self.ex.who.labels)
        if under_budget and not any(k in request for k in llm_engine.MAX_TOKENS_FIELDS):
            request = self._capped(call, model, request)
        guess = llm_engine.estimate(model, request) if estimate is True else (estimate or None)

        def invoke():
            return self._send(key, call, model, request, streaming, on_delta)

        recorded = llm_engine.recorded_request(request | ({"stream": True} if streaming else {}))
        seq, described = self.ex.history.next_seq, None
        if self.ex.history.peek() is None:  # a new step: its request is written now
            stored = deltas.against(recorded, self._request_base())
            described = describe_input(
                (stored,), {}, limit=settings.STEPGUARD_MAX_OUTPUT_BYTES
            )  # fmt: skip
        output = self.steps.run_step(
            key, invoke, (), {}, retry=retry, estimate=guess, kind=StepKind.LLM,
            described=described, model=model, resource=model or None, timeout=timeout,
        )  # fmt: skip
        # A request stored whole or as a delta can be the next one's base; one cut to fit (or
        # recorded by an earlier execution, until its fingerprint is checked) cannot yet.
        trusted = isinstance(described, list) if described is not None else None
        self._last_request = (seq, recorded, trusted)
        return output if cls is None else llm_engine.typed_response(cls, output)

    def _send(
        self,
        key: str,
        call: Callable,
        model: str,
        request: dict,
        streaming: bool,
        on_delta: Callable[[str], Any] | None,
    ) -> Metered:
        """One attempt of a model call: sent with the step's idempotency key and the SDK's own
        retries off (the step retries); the answer and its usage, or what it cost if it failed."""
        idem = self.steps.idempotency_key
        self.steps.answered_now.pop(idem, None)
        self.refuse_unpriced(model)  # before paying; flagged after, by the answer
        sdk_types.build_for(call)  # the answer's types, before it is on its way
        kwargs = request
        if accepts(call, "extra_headers"):  # the SDKs' create() methods do
            headers = {"Idempotency-Key": self.steps.idempotency_key}
            headers |= request.get("extra_headers") or {}
            kwargs = {**request, "extra_headers": headers}
        try:
            if streaming:
                helper, kwargs = llm_engine.stream_call(call, kwargs)
                manager = llm_engine.without_sdk_retries(helper)(**kwargs)
                relay = self._relay(key, on_delta)
                try:
                    response = self.ex.wait_for(llm_engine.consume(manager, relay))
                finally:
                    doorbell.settle(self.ex.who.run_id, relay.seq)
            elif raw := llm_engine.parsed_call(llm_engine.without_sdk_retries(call)):
                answer = self.ex.wait_for(raw(**kwargs))
                try:
                    response = answer.parse()
                except Exception as exc:  # the answer came, and was paid: its usage too
                    data = answer.http_response.json()
                    self.steps.answered_now[idem] = llm_engine.answered(exc, model, data)
                    raise
            else:
                response = self.ex.wait_for(llm_engine.without_sdk_retries(call)(**kwargs))
        except Exception as exc:
            if idem not in self.steps.answered_now:
                self.steps.answered_now[idem] = llm_engine.answered(exc, model)
            if (refused := llm_engine.rejected(exc)) is not None:
                raise refused from exc
            raise
        data = llm_engine.as_json(response)
        usage = llm_engine.usage_of(data, model)
        self.flag_unpriced(key, usage, model)
        tracing.model_call(data, usage)
        return Metered(data, usage)

    def _request_base(self) -> tuple[int, dict] | None:
        """The run's previous model call to store this one's request against, if its stored
        form expands to the request this execution sent (see runs/engine/deltas.py)."""
        if self._last_request is None:
            return None
        seq, request, trusted = self._last_request
        if trusted is None:  # recorded by an earlier execution: the same request as now?
            stored = Step.objects.filter(run_id=self.ex.lease.run_id, seq=seq)
            found = stored.values_list(KT(f"input__0__{deltas.HASH}"), flat=True).first()
            trusted = found == deltas.fingerprint(request)
            self._last_request = (seq, request, trusted)
        return (seq, request) if trusted else None

    def _relay(self, key: str, on_delta: Callable[[str], Any] | None) -> streaming.Relay:
        """This attempt's stream: each piece to `on_delta` with its position, and to the run's
        readers (stored, and rung to its live page) where it is new to them. Two small reads
        on the step's thread: the step's attempt, and what earlier attempts showed."""
        running = self.ex.running()
        assert running is not None  # called from inside the model call's step
        run_id, seq = self.ex.who.run_id, running.seq
        shown, last = streaming.shown_text(run_id, seq)
        row = Step.objects.filter(run_id=run_id, seq=seq).values_list("attempt", flat=True)
        attempt = max(row.first() or 1, last + 1)

        def share(offset: int, kind: str, text: str) -> None:
            doorbell.stream(run_id, seq, attempt, offset, kind, text)

        return streaming.Relay(
            step=key, seq=seq, attempt=attempt, shown=shown, share=share, on_delta=on_delta
        )

    def _capped(self, call: Callable, model: str, request: dict) -> dict:
        """With no `max_tokens` (or its variant) given, a model may answer at length: cap it to
        what the tightest budget (the run's own, or a shared daily one) has left, so the call
        fits instead of pausing the run. A call re-sent after a crash keeps the cap it was
        first sent with (its recorded request)."""
        field = llm_engine.max_tokens_field(call)
        if field is None:
            return request
        record = self.ex.history.peek()
        if record is not None and record.input and isinstance(record.input[0], dict):
            cap = record.input[0].get(field)
        else:
            cap = llm_engine.answer_cap(model, request, Run.objects.get(pk=self.ex.lease.run_id))
        return request if cap is None else {**request, field: cap}

    def refuse_unpriced(self, model: str) -> None:
        """The one check before any model call is sent, on every path (`ctx.llm`, and through
        it the Agents SDK and Pydantic AI adapters; LangChain chat models in a metered node):
        under a USD budget and STEPGUARD_REFUSE_UNPRICED_MODELS, a model with no price is
        refused before it is sent, as its spend could never trip the budget. Runs on the
        step's thread: it may read the policies."""
        if llm_engine.price_of(model) is not None:
            return
        if settings.STEPGUARD_REFUSE_UNPRICED_MODELS and self._under_usd_budget():
            raise UnpricedModel(
                f"model {model!r} has no price (STEPGUARD_MODEL_PRICES) and this run has a USD "
                "budget it could never trip (STEPGUARD_REFUSE_UNPRICED_MODELS)"
            )

    def flag_unpriced(self, key: str, usage: Usage, model: str) -> None:
        """After the answer, on every path: a call that came back unpriced is flagged on the
        timeline (`_unpriced`), judged by the model the answer names."""
        if usage.breakdown is not None and not usage.breakdown["priced"]:
            self._unpriced(key, str(usage.breakdown["model"] or model))

    def _unpriced(self, key: str, model: str) -> None:
        """A model with no price spends nothing in USD, so a USD budget can never stop it: say
        so on the timeline, once an execution. Judged by the answer: an alias or a gateway's
        name that answers as a priced model is priced as that model."""
        if model not in self._unpriced_models:
            self._unpriced_models.add(model)
            log.warning(
                "run %s: model %r has no price; its calls count as $0", self.ex.who.run_id, model
            )
            self.checkpoints.note(EventType.MODEL_UNPRICED, key, model=model)

    def _under_usd_budget(self) -> bool:
        if self.ex.budgeted_usd:
            return True
        scopes = scopes_for(self.ex.who.workflow, self.ex.who.labels)
        return Policy.objects.filter(scope__in=scopes, daily_budget_micros__isnull=False).exists()

    def tool(
        self,
        key: str,
        fn: Callable,
        args: dict | None = None,
        *,
        requires_approval: bool | Callable[[dict], bool] = False,
        action: str | None = None,
        summary: str = "",
        approval_timeout: float | timedelta | None = None,
        retry: RetryPolicy | None = None,
        compensate: Callable[[Any], Any] | None = None,
        approved: Decision | None = None,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """Call a tool once for this run: `fn(**args)`, with its approval policy.

        `requires_approval` is True, False, or a predicate on the arguments (e.g. amount over
        100); when it holds, a person approves first (`<key>.approval`) and the tool starts
        only if that approval still stands. `approved` is a decision already obtained (from
        `ctx.approvals`, asking several at once), checked the same way as the tool starts. A
        tool whose function takes `idempotency_key` receives the step's. Raises
        ApprovalRejected when refused. `timeout` bounds each attempt, as on `ctx.step`.
        """
        args = dict(args or {})
        name = getattr(fn, "__name__", "tool")
        needed = requires_approval(args) if callable(requires_approval) else requires_approval
        decision = approved
        if needed and decision is None:
            decision = self.waits.approval(
                f"{key}.approval",
                action=(action or f"call {name}")[:200],
                summary=summary,
                payload={"tool": name, "args": args},
                timeout=approval_timeout,
            )
        if "idempotency_key" in signature_names(fn):

            def call(**kwargs):
                return fn(**kwargs, idempotency_key=self.steps.idempotency_key)

        else:
            call = fn
        return self.steps.run_step(
            key, call, (), args, retry=retry, approval=decision, compensate=compensate,
            kind=StepKind.TOOL, model=name, timeout=timeout,  # model: the tool's name, for its span
        )  # fmt: skip

    def concurrently(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        """Run `jobs`, each making its own steps, as concurrent steps of an async workflow
        (positions in the order given, as asyncio.gather would); one after another in a sync
        workflow. The first exception, in order, is raised once all have ended."""
        return concurrently(self.ex.host, jobs)

    def agent_loop(self, **options: Any) -> dict:
        """A durable tool-calling loop; see runs.engine.agent.agent_loop."""
        return agent.agent_loop(self, **options)
