"""Research: search, open a dozen pages, summarize and extract claims from each, cross-check,
write the report. About 40 steps; a crash anywhere resumes with the same report, and no model
call that completed is paid for again."""

from examples import llm, web
from runs.sdk import RunContext, workflow


def ask(ctx: RunContext, key: str, client, prompt: str, max_tokens: int = 160) -> str:
    response = ctx.llm(
        key,
        client.chat.completions.create,
        model=llm.model_name(),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
    )
    return response["choices"][0]["message"]["content"]


@workflow("research")
def research(ctx: RunContext, input: dict) -> dict:
    client = llm.client()
    delay = input.get("delay", 0.0)
    hits = ctx.tool(
        "search",
        web.search,
        {"query": input["topic"], "limit": input.get("pages", 12), "delay": delay},
    )
    notes = []
    for hit in hits:
        page = ctx.tool("open", web.open_page, {"url": hit["url"], "delay": delay})
        summary = ask(
            ctx, "summarize", client, f"Summarize for a report on {input['topic']}: {page['text']}"
        )
        claims = ask(ctx, "claims", client, f"List the checkable claims in: {page['text']}", 80)
        notes.append({"url": hit["url"], "summary": summary, "claims": claims})
    check = ask(
        ctx,
        "cross-check",
        client,
        "Cross-check these claims: " + " | ".join(n["claims"] for n in notes),
    )
    summaries = " | ".join(n["summary"] for n in notes)
    prompt = f"Write the report on {input['topic']} from: {summaries} Caveats: {check}"
    report = ask(ctx, "report", client, prompt, 400)
    return {"topic": input["topic"], "report": report, "sources": [n["url"] for n in notes]}


@workflow("orchestrator")
def orchestrator(ctx: RunContext, input: dict) -> dict:
    """Subagents as child runs: one research run per subtopic (fan-out), then a synthesis."""
    subtopics = input["subtopics"]
    reports = ctx.children(
        [(f"sub-{i}", "research", {"topic": topic, "pages": input.get("pages", 3)})
         for i, topic in enumerate(subtopics)]
    )  # fmt: skip
    synthesis = ask(
        ctx, "synthesize", llm.client(),
        "Synthesize: " + " | ".join(r["report"] for r in reports), 400,
    )  # fmt: skip
    return {"synthesis": synthesis, "subreports": len(reports)}
