"""The run header's sentence and action (runs/explain.py), each state from real runs, and a
recorded model call read as a conversation (runs/conversation.py) for the three protocols."""

from datetime import timedelta

import pytest
from django.utils import timezone

from runs.conversation import conversation, last_answer
from runs.explain import explain
from runs.models import Run, RunStatus
from runs.operations import halt, set_budget
from runs.sdk import start_run
from tests import workflows  # noqa: F401  (registers the test workflows)

pytestmark = pytest.mark.django_db


def state_of(run):
    return explain(Run.objects.get(pk=run.pk))


def test_a_run_waiting_for_a_signal_names_it_since_when_and_when_it_gives_up(drive):
    run = start_run("waiter", {"timeout": 600})
    drive()
    state = state_of(run)
    assert state.sentence.startswith("Waiting for signal “go” since ")
    assert "gives up at" in state.sentence and "(in 9 minutes)" in state.sentence
    assert state.action is None


def test_a_sleeping_run_says_until_when(drive):
    run = start_run("sleeper", {"seconds": 3600})
    drive()
    assert state_of(run).sentence.startswith("Sleeping until ")
    assert "(in 59 minutes)" in state_of(run).sentence


def test_a_parent_waiting_for_its_children_counts_them(drive):
    run = start_run("parent", {"n": 2, "child": "waiter"})
    drive()
    assert state_of(run).sentence.startswith("Waiting for 2 child runs since ")


def test_an_approval_wait_names_the_request_and_offers_the_decision(drive):
    run = start_run("approver", {"amount": 3, "timeout": 3600})
    drive()
    state = state_of(run)
    ask = run.approvals.get()
    assert state.sentence.startswith(f"Waiting for approval #{ask.pk} to charge card")
    assert "expires at" in state.sentence
    assert (state.action, state.approval_id) == ("approve", ask.pk)


def test_a_run_over_a_shared_budget_points_to_the_budgets_not_its_own(drive, cast):
    set_budget("workflow:metered", cast["otto"], "cap", usd="1")
    run = start_run("metered", {"steps": 2})
    drive()
    state = state_of(run)
    assert Run.objects.get(pk=run.pk).status == RunStatus.OVER_BUDGET
    assert "workflow 'metered' daily budget has $0.00 left of $1.00" in state.sentence
    assert state.action == "open-budgets"


def test_a_workflow_hold_is_named_before_the_kill_switch_and_both_are_listed(drive, cast):
    run = start_run("waiter", {})
    drive()
    halt("workflow:waiter", cast["otto"], "bad deploy")
    halt("all", cast["otto"], "incident")
    state = state_of(run)
    assert "by a hold on workflow waiter: “bad deploy”" in state.sentence
    assert state.action == "unhalt-workflow"
    assert [h.scope for h in state.more_holds] == ["everything"]


def test_a_run_whose_retry_is_due_later_says_when_and_after_what(drive):
    run = start_run("fails-once", max_attempts=3)
    drive(limit=1)
    Run.objects.filter(pk=run.pk).update(wake_at=timezone.now() + timedelta(minutes=5))
    state = state_of(run)
    assert state.sentence.startswith("Retrying from the top at ")
    assert "(attempt 2 of 3) after RuntimeError" in state.sentence


def test_a_completed_run_says_how_long_it_took(drive):
    run = start_run("ledger", {"steps": 1})
    drive()
    assert state_of(run).sentence.startswith("Completed in ")
    assert state_of(run).action is None


def test_amounts_are_exact_so_need_and_left_never_look_the_same():
    from runs.explain import _amount

    assert [_amount("micro-USD", m) for m in (840, 778, 500_000, 1_000_000, 0, 1_234_567)] == [
        "$0.00084", "$0.000778", "$0.50", "$1.00", "$0.00", "$1.234567",
    ]  # fmt: skip
    assert _amount("tokens", 12_000) == "12,000 tokens"


def test_a_pending_run_nobody_serves_says_so():
    run = start_run("ledger", {"steps": 1})
    assert "no live worker serves ledger@" in state_of(run).sentence


CHAT = (
    {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi?"}]},
    {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "book", "arguments": "{\"seat\": 3}"}}]}}]},
)  # fmt: skip
ANTHROPIC = (
    {"model": "claude", "system": "Be brief.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi?"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "name": "look", "input": {"q": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": "found"}]}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
)  # fmt: skip
RESPONSES = (
    {"model": "gpt", "instructions": "Be brief.", "input": "Hi?"},
    {"output": [{"type": "message", "content": [{"type": "output_text", "text": "Hello."}]},
                {"type": "function_call", "name": "book", "arguments": "{}"}]},
)  # fmt: skip


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (CHAT, [("system", "Be brief.", []), ("user", "Hi?", []),
                ("assistant", "", ['book({"seat": 3})'])]),
        (ANTHROPIC, [("system", "Be brief.", []), ("user", "Hi?", []),
                     ("assistant", "", ['look({"q": 1})']), ("user", "found", []),
                     ("assistant", "Done.", [])]),
        (RESPONSES, [("system", "Be brief.", []), ("user", "Hi?", []),
                     ("assistant", "Hello.", []), ("assistant", "", ["book({})"])]),
    ],
    ids=["chat", "anthropic", "responses"],
)  # fmt: skip
def test_a_model_call_reads_as_turns_in_any_of_the_three_protocols(call, expected):
    turns = conversation(*call)
    assert [(t["role"], t["text"], t["calls"]) for t in turns] == expected


def test_what_a_model_said_is_its_last_text_and_anything_else_is_no_conversation():
    assert last_answer(ANTHROPIC[1]) == "Done."
    assert conversation({"args": [1]}, {"n": 2}) == []
    assert conversation([1, 2], "text") == []


@pytest.mark.parametrize(
    ("final", "action", "says"),
    [
        (True, "fork", "same answer (ModelRequestRejected is final for step refund)"),
        (False, "retry", "ConnectionError: payments API unreachable"),
    ],
)
def test_a_failure_its_policy_calls_final_offers_a_fork_not_a_retry(drive, final, action, says):
    """Retry as the one next action for a refusal (a provider's 400) runs it into the same
    wall; the error's type decides: a retryable one offers Retry, a final one Fork with edits
    (of the prompt, say)."""
    run = start_run("refused", {"final": final}, max_attempts=1)
    assert drive() == ["failed"]
    state = state_of(run)
    assert state.action == action
    assert says in state.sentence


def test_a_ready_run_held_back_by_a_concurrency_limit_says_so_and_offers_the_flow_page(
    drive, cast, client
):
    """It said 'Ready since ..., for the next free worker' while the worker sat idle: the limit
    holds it, not the workers (issue 34 item 3)."""
    from runs.operations import set_limits

    set_limits("ledger", cast["otto"], "a test", max_running=1)
    busy = start_run("ledger", {"steps": 1})
    lease = timezone.now() + timedelta(minutes=5)
    Run.objects.filter(pk=busy.pk).update(status=RunStatus.RUNNING, lease_until=lease)
    run = start_run("ledger", {"steps": 1})
    state = state_of(run)
    assert state.sentence.startswith(
        "Ready, but workflow ledger allows 1 running at once (1 running now)"
    ), state.sentence
    assert state.action == "open-flow"
    client.force_login(cast["otto"])
    assert (
        'href="/flow#workflows">Open the Flow page</a>'
        in client.get(f"/runs/{run.pk}").content.decode()
    )
    set_limits("ledger", cast["otto"], "a test", max_running=2)
    assert state_of(run).sentence.startswith("Ready since")
