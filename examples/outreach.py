"""Outreach: draft and send one e-mail per prospect, up to a reply cap, within a budget.

Each draft is a model call (priced, reserved against the run's budget first), each send a tool
call deduped by its idempotency key. An operator can halt it between any two steps.
"""

from examples import llm, mail
from runs.sdk import RunContext, workflow


@workflow("outreach")
def outreach(ctx: RunContext, input: dict) -> dict:
    client = llm.client()
    sent = []
    for prospect in input["prospects"][: input.get("reply_cap", 5)]:
        draft = ctx.llm(
            "draft",
            client.chat.completions.create,
            model=llm.model_name(),
            messages=[
                {"role": "user", "content": f"Write a short, friendly intro e-mail to {prospect}."}
            ],
            max_tokens=input.get("max_tokens", 200),
        )
        text = draft["choices"][0]["message"]["content"]
        sent.append(ctx.tool("send", mail.send_email, {"to": prospect, "body": text})["message_id"])
        if input.get("pause_seconds"):
            ctx.sleep("pause", input["pause_seconds"])
    return {"sent": len(sent), "message_ids": sent}
