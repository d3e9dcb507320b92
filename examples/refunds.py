"""Refund agent: look the order up, have the model write the customer a note, refund the card,
e-mail the customer.

Two demo runs of it show the states the outside world leaves a run in. The payments API refuses
to refund an expired card (`RefundRefused`, an answer rather than an outage: the step's policy
calls it final, so the run fails at once, its error naming the cause, and is not retried from
the top): a failed run to fork with an edit. The mail gateway is down for the first two sends of
each note (`NotifierDown`), and the step's retry policy sends it a third time.
"""

from examples import llm, services
from examples.flight_booking import QUICK_RETRY
from runs.sdk import RetryPolicy, RunContext, workflow

REFUSAL_IS_FINAL = RetryPolicy(non_retryable=(services.RefundRefused,))


@workflow("refund")
def refund(ctx: RunContext, input: dict) -> dict:
    order = ctx.tool("lookup", services.find_order, {"order": input["order"]})
    draft = ctx.llm(
        "draft",
        llm.client().chat.completions.create,
        model=llm.model_name(),
        messages=[
            {"role": "user", "content": f"Tell {order['customer']} their refund is on its way."}
        ],
        max_tokens=120,
    )
    paid = ctx.tool("refund", services.refund, {"order": order}, retry=REFUSAL_IS_FINAL)
    note = draft["choices"][0]["message"]["content"]
    sent = ctx.tool(
        "notify",
        services.send_confirmation,
        {"passenger": order["customer"], "reference": paid["refund"], "failures": 2},
        retry=QUICK_RETRY,
    )
    return {"refund": paid, "note": note, "sent_to": sent["sent_to"]}
