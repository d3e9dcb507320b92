"""Workflows of the flow-control tests, imported by those tests and by their workers only
(`--import tests.flow_workflows`): their limits and schedules stay out of the rest."""

import time

from runs.sdk import RunContext, workflow


def hold(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@workflow("flow.tenant", concurrency_key=lambda input: input["tenant"], per_key=2)
def tenant(ctx: RunContext, input: dict) -> str:
    """Two runs of one tenant at a time; as many tenants as there are threads."""
    ctx.step("work", hold, input.get("seconds", 0.4))
    return input["tenant"]


@workflow("flow.capped", concurrency=3)
def capped(ctx: RunContext, input: dict) -> int:
    ctx.step("work", hold, input.get("seconds", 0.4))
    return input.get("n", 0)


@workflow("flow.plain")
def plain(ctx: RunContext, input: dict | None) -> dict | None:
    return input


@workflow("flow.urgent", priority=50)
def urgent(ctx: RunContext, input: dict | None) -> dict | None:
    return input


@workflow("flow.ask")
def ask(ctx: RunContext, input: dict) -> str:
    """One model call: ctx.llm declares the model as its rate-limited resource."""
    from examples.llm import client

    response = ctx.llm(
        "ask",
        client().chat.completions.create,
        model="demo-rate",
        messages=[{"role": "user", "content": f"say hello to {input['n']}"}],
        max_tokens=20,
    )
    return response["choices"][0]["message"]["content"]


@workflow("flow.metered")
def metered(ctx: RunContext, input: dict) -> int:
    """A plain step that declares a resource (a payment API, say)."""
    return ctx.step("charge", lambda: input["n"], resource="payments")


@workflow("flow.digest", debounce=30, debounce_key=lambda input: input["user"], debounce_max=120)
def digest(ctx: RunContext, input: dict) -> dict:
    """One digest per user after 30 s without news (at most 2 minutes after the first)."""
    return input
