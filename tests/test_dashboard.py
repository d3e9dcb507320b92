"""The dashboard pages: login, runs, a run, the approvals inbox, and permission-gated actions."""

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from runs.approvals.models import ApprovalRequest
from runs.models import GLOBAL, Policy, Run, RunStatus, Worker
from runs.sdk import start_run
from tests import workflows  # noqa: F401  (registers "metered")

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser_as(cast):
    def _as(name: str) -> Client:
        client = Client()
        client.force_login(cast[name])
        return client

    return _as


def test_every_page_needs_a_login(client):
    run = start_run("ledger", {"steps": 1})
    for path in ("/", f"/runs/{run.pk}", "/approvals"):
        response = client.get(path)
        assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert client.post(f"/runs/{run.pk}/halt", {"reason": "x"}).status_code == 302


def test_the_runs_list_filters_and_shows_spend_against_budget(browser_as, drive):
    start_run("ledger", {"steps": 1}, key="alpha", budget_usd="4")
    start_run("loop", {"queries": []}, key="beta")
    drive()
    page = browser_as("vera").get("/", {"workflow": "ledger"}).content.decode()
    assert "alpha" in page and "beta" not in page
    assert "<title>Runs · Stepguard</title>" in page
    assert "completed</a>: 1" in page  # the counts follow the filter: beta is not a ledger
    assert "0%" in page  # a budget badge


def test_a_run_page_shows_its_timeline_and_history(browser_as, drive):
    run = start_run("ledger", {"steps": 2})
    drive()
    page = browser_as("vera").get(f"/runs/{run.pk}").content.decode()
    assert f"{run.pk}:s1" in page and "step.completed" in page
    assert f"<title>Run {str(run.pk)[:8]} (ledger) · Stepguard</title>" in page


def test_a_viewer_sees_no_action_buttons_and_is_refused_if_it_posts(browser_as, drive):
    run = start_run("approver", {"amount": 5})
    drive()
    vera = browser_as("vera")
    page = vera.get(f"/runs/{run.pk}").content.decode()
    assert "Halt</button>" not in page and "Approve</button>" not in page
    assert vera.post(f"/runs/{run.pk}/halt", {"reason": "x"}).status_code == 403
    approval = ApprovalRequest.objects.get(run=run)
    assert vera.post(f"/approvals/{approval.pk}/decide", {"decision": "approve"}).status_code == 403
    assert Run.objects.get(pk=run.pk).halted_at is None
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


@pytest.fixture
def pending_approval(drive) -> ApprovalRequest:
    """A run of "approver" waiting for someone to approve charging 5."""
    run = start_run("approver", {"amount": 5})
    drive()
    return ApprovalRequest.objects.get(run=run)


def test_an_approver_decides_from_the_inbox(browser_as, pending_approval):
    ada = browser_as("ada")
    inbox = ada.get("/approvals").content.decode()
    assert "charge card" in inbox and 'value="approve"' in inbox
    ada.post(f"/approvals/{pending_approval.pk}/decide", {"decision": "approve", "comment": "ok"})
    assert ApprovalRequest.objects.get(pk=pending_approval.pk).status == "approved"


def test_a_second_decision_is_refused_and_names_the_first(browser_as, pending_approval):
    ada = browser_as("ada")
    ada.post(f"/approvals/{pending_approval.pk}/decide", {"decision": "approve", "comment": "ok"})
    again = ada.post(
        f"/approvals/{pending_approval.pk}/decide", {"decision": "reject"}, follow=True
    )
    assert "already approved by ada" in again.content.decode()
    assert ApprovalRequest.objects.get(pk=pending_approval.pk).status == "approved"


def test_an_operator_halts_a_run_from_its_page(browser_as):
    run = start_run("ledger", {"steps": 1})
    browser_as("otto").post(f"/runs/{run.pk}/halt", {"reason": "look first"})
    assert Run.objects.get(pk=run.pk).status == RunStatus.HALTED


def test_actions_need_the_csrf_token(cast):
    client = Client(enforce_csrf_checks=True)
    client.force_login(cast["otto"])
    run = start_run("ledger", {"steps": 1})
    assert client.post(f"/runs/{run.pk}/halt", {"reason": "x"}).status_code == 403
    assert Run.objects.get(pk=run.pk).halted_at is None


def test_the_workers_page_lists_the_workers_that_heartbeat(browser_as, drive):
    start_run("ledger", {"steps": 1})
    drive()
    assert "No worker" not in browser_as("otto").get("/workers").content.decode()


def test_a_worker_whose_heartbeat_stopped_shows_as_silent(browser_as, drive):
    start_run("ledger", {"steps": 1})
    drive()
    Worker.objects.update(stopped_at=None, heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert 'status-failed">silent</span>' in browser_as("otto").get("/workers").content.decode()


def test_the_kill_switch_is_turned_on_from_the_halts_page_and_leaves_finished_runs_alone(
    browser_as, drive
):
    run = start_run("ledger", {"steps": 1})
    drive()
    otto = browser_as("otto")
    refused = otto.post("/halts/halt", {"reason": "incident 7"}, follow=True).content.decode()
    assert "type “halt everything” to confirm" in refused  # not on without the typed phrase
    assert not Policy.objects.filter(scope=GLOBAL, halted_at__isnull=False).exists()
    otto.post("/halts/halt", {"reason": "incident 7", "confirm": " Halt everything "})
    for path in ("/halts", "/", f"/runs/{run.pk}", "/budgets"):  # the banner on every page
        page = otto.get(path).content.decode()
        assert "Kill switch on:" in page and "incident 7" in page and 'role="alert"' in page
    finished = Run.objects.get(pk=run.pk)
    assert (finished.status, finished.halted_at) == (RunStatus.COMPLETED, None)


def test_the_audit_page_lists_each_action_of_an_actor_with_its_reason(browser_as):
    otto = browser_as("otto")
    otto.post("/halts/halt", {"reason": "incident 7", "confirm": "halt everything"})
    otto.post("/halts/unhalt", {"reason": "over"})
    otto.post("/halts/halt", {"workflow": "ledger", "reason": "freeze ledger"})
    audit = otto.get("/audit", {"actor": "otto"}).content.decode()
    assert audit.count("<tr><td><time") == 3 and "freeze ledger" in audit


def test_a_viewer_cannot_lift_a_workflow_halt_from_the_halts_page(browser_as):
    browser_as("otto").post("/halts/halt", {"workflow": "ledger", "reason": "freeze ledger"})
    refused = browser_as("vera").post("/halts/unhalt", {"workflow": "ledger", "reason": "x"})
    assert refused.status_code == 403
    assert Policy.objects.get(scope="ledger").halted_at is not None


@pytest.fixture
def over_budget(drive) -> Run:
    """A run of "metered" paused over its $1 budget before its second $1 call."""
    run = start_run("metered", {"steps": 2}, budget_usd="1")
    drive()
    return run


def test_the_run_page_offers_an_operator_budget_and_fork_forms(browser_as, over_budget):
    page = browser_as("otto").get(f"/runs/{over_budget.pk}").content.decode()
    # The header says why it stopped, in numbers, with the one action that moves it on.
    assert (
        "Paused because the next step needs $1.00 and the run budget has $0.00 left of "
        "$1.00." in page
    )
    assert "Raise the budget</button>" in page and "Fork from a step" in page
    assert (
        browser_as("vera")
        .get(f"/runs/{over_budget.pk}")
        .content.decode()
        .count("Raise the budget</button>")
        == 0
    )  # a viewer reads the sentence but is offered no action


@pytest.mark.parametrize(
    ("input", "offers", "says"),
    [
        ({"amount": 500, "to": "B"}, "fork", "InsufficientFunds is final for step withdraw"),
        ({"amount": 50, "to": "B", "down": True}, "retry", "after 3 attempts: ConnectionError"),
    ],
)
def test_a_run_a_final_step_error_ended_offers_a_fork_with_edits_not_a_retry(
    browser_as, drive, input, offers, says
):
    """Issue 47 section 4: the policy's `non_retryable` did not reach the stored error, so
    the transfer refused for its balance offered Retry, which the bank refuses the same way."""
    run = start_run("transfer", input)
    assert drive() == ["failed"]
    page = browser_as("otto").get(f"/runs/{run.pk}").content.decode()
    assert says in page
    fork = '<a class="button primary" href="#fork">Fork from a step</a>' in page
    retry = "Reason to retry" in page
    assert (fork, retry) == (offers == "fork", offers == "retry")
    if offers == "fork":
        assert "with the input or an output edited" in page


def test_raising_the_budget_of_a_paused_run_from_its_page_resumes_it(browser_as, over_budget):
    browser_as("otto").post(f"/runs/{over_budget.pk}/budget", {"usd": "5", "reason": "raise"})
    assert Run.objects.get(pk=over_budget.pk).status == RunStatus.PENDING


def test_a_bad_budget_on_the_run_page_is_named(browser_as, over_budget):
    otto = browser_as("otto")
    bad = otto.post(f"/runs/{over_budget.pk}/budget", {"usd": "lots", "reason": "x"}, follow=True)
    assert "is not an amount of USD" in bad.content.decode()
    assert Run.objects.get(pk=over_budget.pk).status == RunStatus.OVER_BUDGET


def test_a_fork_from_the_run_page_lands_on_the_fork(browser_as, drive, over_budget):
    otto = browser_as("otto")
    otto.post(f"/runs/{over_budget.pk}/budget", {"usd": "5", "reason": "raise"})
    drive()
    response = otto.post(f"/runs/{over_budget.pk}/fork", {"step": "call#2", "reason": "again"})
    fork = Run.objects.get(forked_from=over_budget)
    assert response["Location"] == f"/runs/{fork.pk}"


def long_run(steps: int, events_per_step: int = 2) -> Run:
    """A finished run of `steps` steps written straight to the tables (running them is not the
    point here: the page is)."""
    from django.utils import timezone

    from runs.models import Event, Step

    run = start_run("ledger", {"steps": steps})
    now, base = timezone.now(), run.events.count()
    kinds = ["llm", "tool", "call"]
    Step.objects.bulk_create(
        Step(
            run=run, seq=i, key=f"s{i}", kind=kinds[i % 3], idempotency_key=f"{run.pk}:s{i}",
            status="failed" if i == 17 else "completed", input={"n": i}, output={"n": i},
            started_at=now, finished_at=now,
        )
        for i in range(steps)
    )  # fmt: skip
    Event.objects.bulk_create(
        Event(run=run, seq=base + i + 1, type="step.completed", step_key=f"s{i // events_per_step}",
              created_at=now)
        for i in range(steps * events_per_step)
    )  # fmt: skip
    return run


def rows(html: str) -> list[int]:
    import re

    return [int(s) for s in re.findall(r'<tr id="step-(\d+)"', html)]


def test_a_5000_step_run_renders_its_latest_chunk_and_loads_earlier_ones(
    browser_as, django_assert_max_num_queries
):
    import re

    run = long_run(5000)
    vera = browser_as("vera")
    # A fixed number, whatever the run's size: the header's explanation, holds, children's
    # spend, pending approvals and annotations are a query or two each.
    with django_assert_max_num_queries(19):
        page = vera.get(f"/runs/{run.pk}").content.decode()
    assert rows(page) == list(range(4800, 5000))
    assert len(re.findall(r'<li id="event-', page)) == 500
    assert len(page) < 600_000  # inputs and outputs load when a row opens
    last = run.events.order_by("-seq").first().seq
    assert f"after={last}&amp;last=4999&amp;from=4800" in page  # the live feed's cursor
    seen, before = rows(page), 4800
    while "Show earlier steps" in page:
        page = vera.get(f"/runs/{run.pk}/steps", {"before": before}).content.decode()
        seen = rows(page) + seen
        before = rows(page)[0]
    assert seen == list(range(5000))
    events = vera.get(f"/runs/{run.pk}/events", {"before": 601}).content.decode()
    assert re.findall(r'<li id="event-(\d+)"', events) == [str(i) for i in range(101, 601)]
    assert "Show earlier events" in events


def test_the_step_filter_never_hides_a_failure(browser_as):
    run = long_run(60)
    vera = browser_as("vera")
    page = vera.get(f"/runs/{run.pk}", {"kind": "tool"}).content.decode()
    assert rows(page) == sorted({i for i in range(60) if i % 3 == 1} | {17})  # 17 is an llm
    page = vera.get(f"/runs/{run.pk}", {"status": "completed", "kind": "llm"}).content.decode()
    assert 17 in rows(page) and all(i % 3 == 0 or i == 17 for i in rows(page))
    assert "kind=llm" in page and "status=completed" in page  # the live feed filters alike
    unknown = vera.get(f"/runs/{run.pk}", {"kind": "nonsense"}).content.decode()
    assert rows(unknown) == list(range(60))


def test_a_step_opens_to_its_input_output_and_error_as_json_with_copy_buttons(browser_as, drive):
    run = start_run("saga", {"fail": True})
    drive()
    ship = run.steps.get(key="ship")
    vera = browser_as("vera")
    body = vera.get(f"/runs/{run.pk}/steps/{ship.seq}").content.decode()
    assert "Copy input" in body and "Copy error" in body and "ZeroDivisionError" in body
    assert '<details class="json" open>' in body
    assert vera.get(f"/runs/{run.pk}/steps/999").status_code == 404


def test_the_fork_preview_lists_the_side_effects_that_will_run_again(browser_as, drive):
    run = start_run("saga", {"fail": True})
    drive()
    otto = browser_as("otto")
    preview = otto.get(f"/runs/{run.pk}/fork-preview", {"step": "charge"}).content.decode()
    assert "reuses 1 recorded step and runs" in preview
    effects, edits = preview.split('id="fork-edits"')
    assert "<code>charge</code>" in effects and "<code>ship</code>" in effects
    assert "<code>reserve</code>" not in effects  # reused, not run again: offered for editing
    assert 'name="output:reserve"' in edits and 'name="output:charge"' not in edits
    missing = otto.get(f"/runs/{run.pk}/fork-preview", {"step": "nope"}).content.decode()
    assert "has no step &#x27;nope&#x27;" in missing


@pytest.fixture
def few_and_many() -> tuple[list[Run], list[Run]]:
    """Three runs of "ledger" and twelve of "loop", none of them started by a worker yet."""
    few = [start_run("ledger", {"steps": 1}, key=f"few-{i}") for i in range(3)]
    many = [start_run("loop", {"queries": []}, key=f"many-{i}") for i in range(12)]
    return few, many


def test_the_runs_list_counts_what_a_filter_matches_before_a_bulk_action(browser_as, few_and_many):
    otto = browser_as("otto")
    page = otto.get("/", {"workflow": "loop"}).content.decode()
    assert 'hx-get="/runs/count?workflow=loop"' in page and "matching this filter" in page
    assert otto.get("/runs/count", {"workflow": "loop"}).content.decode() == "12 runs"
    assert otto.get("/runs/count", {"parent": "x"}).status_code == 400
    assert "all 15 runs (no filter)" in otto.get("/").content.decode()


def test_a_bulk_action_on_selected_runs_is_done_at_once_and_records_the_actor(
    browser_as, few_and_many
):
    few, _ = few_and_many
    browser_as("otto").post("/runs/bulk", {"action": "halt", "scope": "selected", "reason": "noisy",
                                           "run": [str(r.pk) for r in few]})  # fmt: skip
    assert all(Run.objects.get(pk=r.pk).halted_by == "otto" for r in few)


def test_a_bulk_action_on_a_filter_asks_for_the_count_and_a_wrong_count_does_nothing(
    browser_as, few_and_many
):
    _, many = few_and_many
    otto = browser_as("otto")
    form = {"action": "cancel", "scope": "filter", "workflow": "loop", "reason": "stale"}
    asked = otto.post("/runs/bulk", form).content.decode()
    assert "Type <strong>12</strong>" in asked and 'value="loop"' in asked
    wrong = otto.post("/runs/bulk", {**form, "confirm": "11"}).content.decode()
    assert "Nothing was done" in wrong
    assert not Run.objects.filter(pk__in=[r.pk for r in many], status="cancelled").exists()
    done = otto.post("/runs/bulk", {**form, "confirm": "12"}, follow=True).content.decode()
    assert "cancel: 12 of 12 runs" in done
    assert Run.objects.filter(pk__in=[r.pk for r in many], status="cancelled").count() == 12


def test_a_bulk_retry_refuses_runs_that_have_not_failed_one_by_one(browser_as, few_and_many):
    few, _ = few_and_many
    again = browser_as("otto").post("/runs/bulk", {"action": "retry", "scope": "selected",
                                                   "reason": "x", "run": [str(few[0].pk)]},
                                    follow=True)  # fmt: skip
    assert "retry: 0 of 1 runs" in again.content.decode() and "1 refused" in again.content.decode()


def test_a_viewer_is_refused_a_bulk_action_and_nothing_changes(browser_as, few_and_many):
    _, many = few_and_many
    vera = browser_as("vera")
    assert vera.post("/runs/bulk", {"action": "halt", "scope": "selected", "reason": "x",
                                    "run": [str(many[0].pk)]}).status_code == 403  # fmt: skip
    assert Run.objects.get(pk=many[0].pk).halted_at is None


def test_the_runs_list_filters_by_parent(browser_as, drive):
    parent = start_run("parent", {"n": 2}, key="the-parent")
    drive()
    children = browser_as("vera").get("/", {"parent": str(parent.pk)}).content.decode()
    assert children.count('name="run"') == 0 and children.count('<tr id="run-') == 2
    assert "the-parent" not in children


def test_the_runs_list_filters_by_start_time_and_version(browser_as):
    start_run("ledger", {"steps": 1}, key="the-run")
    vera = browser_as("vera")
    soon = (timezone.now() + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M")
    assert "No runs match." in vera.get("/", {"since": soon}).content.decode()
    assert "the-run" in vera.get("/", {"until": soon, "version": "1"}).content.decode()


def test_the_runs_list_names_a_bad_date(browser_as):
    bad = browser_as("vera").get("/", {"since": "yesterday"}, follow=True).content.decode()
    assert "since &#x27;yesterday&#x27; is not a date and time" in bad


def test_the_halts_page_has_a_row_for_everything_and_for_each_workflow(browser_as, drive):
    start_run("metered", {"steps": 2})
    drive()
    page = browser_as("otto").get("/halts").content.decode()
    assert '<th scope="row" data-label="Workflow">metered</th>' in page
    assert "Turn the kill switch on" in page
    page = browser_as("otto").get("/budgets").content.decode()
    assert '<th scope="row" data-label="Scope">metered</th>' in page and "everything" in page


def test_the_halts_page_shows_todays_spend_against_a_shared_budget(browser_as, drive):
    browser_as("otto").post("/halts/budget", {"workflow": "metered", "usd": "10", "reason": "cap"})
    start_run("metered", {"steps": 2})  # $1 a step
    drive()
    page = browser_as("vera").get("/budgets").content.decode()
    row = page[page.index('data-label="Scope">metered</th>') :].split("</tr>")[0]
    assert 'data-label="Spent today">$2 ' in row and "$10" in row and "20%" in row
    everything = page[page.index('data-label="Scope">everything</th>') :].split("</tr>")[0]
    assert 'data-label="Spent today">$2<' in everything  # no global budget, spend counted


def test_workflow_and_global_budgets_are_set_from_the_halts_page(browser_as):
    otto = browser_as("otto")
    otto.post("/halts/budget", {"workflow": "metered", "usd": "0.000001", "run_usd": "",
                                "reason": "tight"})  # fmt: skip
    assert Policy.objects.get(scope="metered").daily_budget_micros == 1
    otto.post("/halts/budget", {"usd": "", "run_usd": "2.5", "reason": "default per run"})
    assert Policy.objects.get(scope=GLOBAL).run_budget_micros == 2_500_000
    page = otto.get("/budgets").content.decode()
    assert 'value="0.000001"' in page and 'value="2.5"' in page


def test_a_bad_amount_on_the_halts_page_is_named_and_loses_no_budget(browser_as):
    otto = browser_as("otto")
    otto.post("/halts/budget", {"usd": "", "run_usd": "2.5", "reason": "default per run"})
    bad = otto.post("/halts/budget", {"usd": "ten", "reason": "x"}, follow=True).content.decode()
    assert "&#x27;ten&#x27; is not an amount of USD" in bad
    policy = Policy.objects.get(scope=GLOBAL)
    assert (policy.daily_budget_micros, policy.run_budget_micros) == (None, 2_500_000)


def test_a_viewer_cannot_set_budgets_from_the_halts_page(browser_as):
    refused = browser_as("vera").post("/halts/budget", {"usd": "9", "reason": "x"})
    assert refused.status_code == 403
    assert not Policy.objects.filter(scope=GLOBAL).exclude(daily_budget_micros=None).exists()


def test_the_search_box_finds_a_run_by_id_or_by_part_of_its_key(browser_as):
    run = start_run("ledger", {"steps": 1}, key="order-8812:refund")
    other = start_run("ledger", {"steps": 1}, key="order-1000")
    vera = browser_as("vera")
    for q in (str(run.pk), "8812", "REFUND"):
        page = vera.get("/", {"q": q}).content.decode()
        assert "order-8812:refund" in page and "order-1000" not in page, q
    assert str(other.pk)[:8] in vera.get("/", {"q": "order-1000"}).content.decode()


def test_older_runs_page_by_keyset_through_the_link_the_page_gives(browser_as):
    import re

    for i in range(55):
        start_run("ledger", {"steps": 1}, key=f"page-{i:02}")
    vera = browser_as("vera")
    first = vera.get("/", {"workflow": "ledger"}).content.decode()
    link = re.search(r'<a href="\?([^"]+)">Older runs', first).group(1).replace("&amp;", "&")
    second = vera.get(f"/?{link}")
    assert second.status_code == 200
    keys = re.findall(r"page-\d\d", first + second.content.decode())
    assert sorted(keys) == [f"page-{i:02}" for i in range(55)]  # each run once, none lost
    assert "workflow=ledger" in link and "Older runs" not in second.content.decode()


def test_bad_budget_amounts_are_named_and_change_nothing(browser_as):
    from runs.models import GLOBAL, Policy

    run = start_run("ledger", {"steps": 1}, budget_usd="3")
    otto = browser_as("otto")
    for amount in ("-1", "NaN", "Infinity", "1e30"):
        page = otto.post(f"/runs/{run.pk}/budget", {"usd": amount, "reason": "x"}, follow=True)
        assert "an amount of USD is a number from 0 to 1,000,000,000" in page.content.decode()
        page = otto.post("/halts/budget", {"usd": amount, "reason": "x"}, follow=True)
        assert "an amount of USD is a number from 0 to" in page.content.decode()
    assert Run.objects.get(pk=run.pk).budget_micros == 3_000_000
    assert not Policy.objects.filter(scope=GLOBAL).exclude(daily_budget_micros=None).exists()


def test_bulk_actions_tell_nothing_to_people_who_may_not_view_runs(alice):
    client = Client()
    client.force_login(alice)  # may decide and cancel, but not view runs
    start_run("ledger", {"steps": 1}, key="secret-customer-42")
    form = {"action": "cancel", "scope": "filter", "q": "secret", "reason": "probe"}
    assert client.post("/runs/bulk", form).status_code == 403


def test_a_decision_never_redirects_off_site(browser_as, drive):
    start_run("approver", {"amount": 5})
    drive()
    approval = ApprovalRequest.objects.get()
    ada = browser_as("ada")
    response = ada.post(f"/approvals/{approval.pk}/decide",
                        {"decision": "approve", "next": "//evil.example/"})  # fmt: skip
    assert response["Location"] == "/approvals"


def test_a_huge_or_deeply_nested_output_shows_as_text_not_an_error(browser_as):
    from django.utils import timezone

    from runs.models import Step

    run = start_run("ledger", {"steps": 1})
    deep = current = []
    for _ in range(100):
        current.append([])
        current = current[0]
    now = timezone.now()
    for seq, output in enumerate([deep, list(range(5000))]):
        Step.objects.create(run=run, seq=seq, key=f"s{seq}", status="completed", output=output,
                            started_at=now, finished_at=now, idempotency_key=f"k{seq}")  # fmt: skip
    vera = browser_as("vera")
    for seq in (0, 1):
        body = vera.get(f"/runs/{run.pk}/steps/{seq}").content.decode()
        assert '<pre tabindex="0">[' in body and "Copy output" in body


def test_the_run_page_reads_its_event_cursor_before_the_run(browser_as, drive):
    """The live feed sends what comes after the page's last event: the status and rows the
    page shows must be read after that cursor, or a change in between is never shown."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    run = start_run("ledger", {"steps": 2})
    drive()
    vera = browser_as("vera")
    with CaptureQueriesContext(connection) as queries:
        vera.get(f"/runs/{run.pk}")
    tables = [q["sql"].split(" FROM ")[1].split()[0] for q in queries if " FROM " in q["sql"]]
    first = {t: tables.index(t) for t in ('"runs_event"', '"runs_run"', '"runs_step"')}
    assert first['"runs_event"'] < first['"runs_run"'] < first['"runs_step"']


def test_a_run_page_names_every_hold_that_stops_the_run_and_offers_unhalt_only_for_its_own(
    browser_as, drive, cast
):
    from runs.operations import halt

    parent = start_run("parent", {"n": 1, "child": "waiter"})
    drive()
    child = Run.objects.get(parent=parent)
    halt("workflow:parent", cast["otto"], "bad deploy")
    otto = browser_as("otto")
    page = otto.get(f"/runs/{child.pk}").content.decode()
    assert "by otto" in page and "by a hold on workflow parent: “bad deploy”" in page
    assert "Unhalt</button>" not in page  # the child has no hold of its own to lift
    assert "Unhalt workflow parent</button>" in page  # but the hold that stops it
    assert "Halt</button>" not in page  # a held run is not offered another halt
    halt(child, cast["otto"], "this one too")
    page = otto.get(f"/runs/{child.pk}").content.decode()
    assert "by a hold on this run: “this one too”" in page and "Unhalt</button>" in page
    assert "Also held by workflow parent" in page  # every hold is named


def test_the_new_pages_and_fragments_need_a_login(client):
    run = start_run("ledger", {"steps": 1})
    for path in ("/budgets", "/nav", f"/runs/{run.pk}/header", f"/runs/{run.pk}/input.json"):
        response = client.get(path)
        assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert client.post("/runs/start", {"workflow": "ledger"}).status_code == 302


def test_the_start_run_form_names_what_is_wrong_and_starts_nothing(browser_as):
    from django.utils.html import escape

    otto = browser_as("otto")
    bad = [
        ({"budget_usd": amount}, f"the budget {amount!r} is not an amount over 0 USD")
        for amount in ("NaN", "Infinity", "1e400", "٣", "0", "-1")
    ] + [
        ({"workflow": "nope"}, "no workflow named 'nope' is registered"),
        ({"input": "{steps: 1}"}, "the input is not JSON"),
    ]
    for change, message in bad:
        form = {"workflow": "ledger", "input": "{}", **change}
        page = otto.post("/runs/start", form, follow=True)
        assert page.status_code == 200 and escape(message) in page.content.decode(), message
    assert not Run.objects.exists()
    assert browser_as("vera").post("/runs/start", {"workflow": "ledger"}).status_code == 403
    page = otto.post("/runs/start", {"workflow": "ledger", "input": '{"steps": 1}',
                                     "key": "k1", "budget_usd": "0.5"})  # fmt: skip
    run = Run.objects.get(key="k1")
    assert page["Location"] == f"/runs/{run.pk}" and run.budget_micros == 500_000


def test_a_refused_start_form_keeps_what_was_typed_and_older_versions_can_be_started(browser_as):
    """The form came back empty after a refusal (the JSON and the key typed again by hand),
    and offered no version: starting an older one needed the API (issue 34 item 4)."""
    from django.utils.html import escape

    otto = browser_as("otto")
    form = {"workflow": "ledger", "input": '{"steps": 3}', "key": "mine", "budget_usd": "0"}
    page = otto.post("/runs/start", form, follow=True).content.decode()
    assert escape("the budget '0' is not an amount over 0 USD") in page
    assert '<details class="start-run" open>' in page
    assert escape('{"steps": 3}') in page and 'value="mine"' in page and 'value="0"' in page
    assert '<option value="ledger" selected>' in page
    assert '<option value="two-versions">two-versions (default, @2)</option>' in page
    assert '<option value="two-versions@1">two-versions@1</option>' in page
    again = otto.get("/").content.decode()  # said once: a later visit starts afresh
    assert '<details class="start-run">' in again and 'value="mine"' not in again
    otto.post("/runs/start", {"workflow": "two-versions@1", "input": "{}", "key": "old"})
    otto.post("/runs/start", {"workflow": "two-versions", "input": "{}", "key": "new"})
    versions = dict(Run.objects.filter(workflow="two-versions").values_list("key", "version"))
    assert versions == {"old": "1", "new": "2"}
    page = otto.post("/runs/start", {"workflow": "two-versions@9"}, follow=True).content.decode()
    assert escape("two-versions has no version '9' here") in page


def test_the_inbox_reads_the_context_of_any_number_of_approvals_in_a_fixed_number_of_queries(
    browser_as, drive, django_assert_num_queries
):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    ada = browser_as("ada")

    def queries() -> int:
        with CaptureQueriesContext(connection) as seen:
            assert ada.get("/approvals").status_code == 200
        return len(seen)

    start_run("approver", {"amount": 1})
    drive()
    few = queries()
    for amount in range(2, 12):
        start_run("approver", {"amount": amount})
    drive()
    assert ApprovalRequest.objects.filter(status="pending").count() == 11
    assert queries() == few


def test_a_workflow_unhalt_is_offered_only_to_those_who_may_unhalt(
    browser_as, cast, django_user_model
):
    from django.contrib.auth.models import Permission

    from runs.operations import halt

    halt("workflow:ledger", cast["otto"], "freeze")
    start_run("ledger", {"steps": 1})
    assert "Unhalt ledger</button>" in browser_as("otto").get("/halts").content.decode()
    halter = django_user_model.objects.create_user("hal", password="x")
    halter.user_permissions.add(
        *Permission.objects.filter(
            codename__in=["view_run", "halt_run"], content_type__app_label="runs"
        )
    )
    client = Client()
    client.force_login(halter)
    page = client.get("/halts").content.decode()
    assert "Unhalt ledger</button>" not in page and "unhalting needs the unhalt permission" in page
    assert "Halt ledger</button>" not in page  # the halted workflow is not offered a halt
