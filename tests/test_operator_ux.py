"""Operator experience, third pass (issue 34): what an operator sees and can do."""

import html
import json
import re

import pytest

from runs import notifications
from runs.engine.holds import holds_on
from runs.errors import OperationError
from runs.models import (
    Event,
    EventType,
    NotificationChannel,
    NotificationDelivery,
    Run,
    RunStatus,
)
from runs.operations import halt, unhalt
from runs.sdk import start_run
from tests.test_notifications import Receiver

pytestmark = pytest.mark.django_db


@pytest.fixture
def hook():
    receiver = Receiver()
    yield receiver
    receiver.close()


def test_the_kill_switch_does_not_hold_the_alert_that_a_run_was_halted(drive, cast, hook):
    """An incident must still alert: the kill switch and workflow halts hold every run but the
    engine's own deliveries (a hold on the delivery run itself still holds it)."""
    notifications.add_channel(None, "webhook", hook.url, ["run.halted"])
    run = start_run("waiter", {})
    assert drive() == ["waiting"]
    halt("all", cast["otto"], "incident 42")
    halt("workflow:waiter", cast["otto"], "bad deploy of waiter")
    halt(run, cast["otto"], "this one too")
    assert Run.objects.get(pk=run.pk).status == RunStatus.HALTED
    assert Event.objects.filter(run=run, type=EventType.RUN_HALTED).exists()

    assert notifications.sweep() == 1  # one run.halted event: the run's own halt
    delivery = NotificationDelivery.objects.get()
    assert holds_on(delivery.run) == []

    # A hold on the delivery run itself still holds it, and only that one.
    halt(delivery.run, cast["otto"], "hold this alert")
    assert drive() == []
    assert [h.kind for h in holds_on(Run.objects.get(pk=delivery.run_id))] == ["run"]
    unhalt(delivery.run, cast["otto"], "send it")

    assert drive() == ["completed"]  # under the kill switch: only the delivery ran
    (request,) = hook.requests
    body = json.loads(request["body"])
    assert body["event"]["type"] == "run.halted" and body["event"]["run_id"] == str(run.pk)
    assert Run.objects.get(pk=run.pk).status == RunStatus.HALTED  # the run itself still held
    assert [h.kind for h in holds_on(Run.objects.get(pk=run.pk))] == ["run", "workflow", "global"]


def test_the_runs_list_leaves_the_engine_s_own_runs_out_unless_asked(drive, hook, client, cast):
    """One dead webhook filled the failed and waiting lists with deliveries: the list, its
    counts and its bulk actions show the operator's runs; a filter shows the engine's."""
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    hook.answers = [404]  # the receiver refuses: the delivery fails at once
    mine = start_run("bad-output", {})
    assert drive() == ["failed"]
    assert notifications.sweep() == 1
    assert drive() == ["failed"]
    delivery = NotificationDelivery.objects.get().run
    client.force_login(cast["otto"])

    page = client.get("/").content.decode()
    assert str(mine.pk)[:8] in page and str(delivery.pk)[:8] not in page
    assert "failed</a>: 1 ·" in page  # the delivery's failure is not counted
    assert client.get("/runs/count", {"status": "failed"}).content.decode().startswith("1 ")

    shown = client.get("/", {"engine": "1"}).content.decode()
    assert str(delivery.pk)[:8] in shown and "failed</a>: 2 ·" in shown
    assert 'name="engine" value="1" checked' in shown
    by_workflow = client.get("/", {"workflow": "stepguard.notify"}).content.decode()
    assert str(delivery.pk)[:8] in by_workflow and str(mine.pk)[:8] not in by_workflow
    assert str(delivery.pk)[:8] in client.get("/", {"q": str(delivery.pk)}).content.decode()

    def listed(**params) -> set[str]:
        return {run["id"] for run in client.get("/api/runs", params).json()["items"]}

    assert listed() == {str(mine.pk)}  # the API's list as the page's
    assert listed(engine="true") == {str(mine.pk), str(delivery.pk)}
    assert listed(workflow="stepguard.notify") == {str(delivery.pk)}
    assert listed(q=str(delivery.pk)) == {str(delivery.pk)}


def test_show_failed_only_includes_deliveries_being_retried(drive, hook, client, cast):
    notifications.add_channel(None, "webhook", hook.url, ["run.failed"])
    hook.answers, hook.retry_after = [503], "3600"  # refused, retried in an hour
    start_run("bad-output", {})
    drive()
    notifications.sweep()
    assert drive() == ["waiting"]
    client.force_login(cast["vera"])
    page = client.get("/notifications", {"failed": "1"}).content.decode()
    assert "Nothing delivered yet." not in page and "No delivery failed" not in page
    assert ">retrying<" in page and "503" in page
    assert notifications.deliveries(failed=True) == []  # the API's: failed after its retries


@pytest.mark.parametrize(
    ("workflow", "says"),
    [
        ("bad-ouptut", "no workflow named 'bad-ouptut': it is not registered and has no runs"),
        ("stepguard.notify", "the deliveries' own workflow"),
    ],
)
def test_a_channel_for_a_workflow_that_does_not_exist_is_refused(db, client, cast, workflow, says):
    with pytest.raises(OperationError, match=says):
        notifications.add_channel(
            None, "webhook", "https://x.example", ["run.failed"], workflow=workflow
        )
    notifications.add_channel(
        None, "webhook", "https://x.example", ["run.failed"], workflow="bad-output"
    )
    client.force_login(cast["otto"])
    form = {
        "kind": "webhook",
        "target": "https://y.example",
        "events": ["run.failed"],
        "workflow": workflow,
    }
    page = client.post("/notifications/add", form, follow=True).content.decode()
    assert NotificationChannel.objects.count() == 1
    assert "not registered" in page or "own workflow" in page


def test_the_short_ids_the_pages_show_are_taken_as_run_filters(drive, client, cast):
    parent = start_run("parent", {"n": 1, "steps": 1})
    drive()
    child = Run.objects.filter(parent=parent).first()
    held = start_run("waiter", {})
    halt(held, cast["otto"], "audit me")
    client.force_login(cast["vera"])
    short = str(parent.pk)[:8]
    page = client.get("/", {"parent": short}).content.decode()
    assert str(child.pk)[:8] in page and "is not a run id" not in page
    audit = client.get("/audit", {"run": str(held.pk)[:8]}).content.decode()
    assert "audit me" in audit
    missing = client.get("/", {"parent": "ffffffff"}, follow=True).content.decode()
    assert "no run&#x27;s id starts with &#x27;ffffffff&#x27;" in missing


def test_the_flow_page_lists_every_registered_workflow_with_or_without_runs(client, cast):
    client.force_login(cast["vera"])
    page = client.get("/flow").content.decode()
    workflows = page.split('id="workflows"')[1].split("</table>")[0]
    for name in ("ledger", "saga", "waiter", "llm-async"):  # none has a run here
        assert f">{name}<" in workflows or f"<code>{name}</code>" in workflows, name
    assert "stepguard.notify" not in workflows  # the engine's own


@pytest.mark.parametrize("amount", ["1e3", "1.1234567", "+5", "1_000", "2E+1"])
def test_budget_amounts_that_are_no_plain_decimal_are_refused_everywhere(client, cast, amount):
    from runs.models import Policy

    run = start_run("waiter", {})
    client.force_login(cast["otto"])
    says = "is not a plain amount of USD: digits with at most 6 decimals"
    form = {"workflow": "ledger", "input": "{}", "budget_usd": amount}
    page = client.post("/runs/start", form, follow=True).content.decode()
    assert says in page and Run.objects.count() == 1
    form = {"usd": amount, "reason": "raise"}
    page = client.post(f"/runs/{run.pk}/budget", form, follow=True).content.decode()
    assert says in page and Run.objects.get(pk=run.pk).budget_micros is None
    form = {"workflow": "ledger", "usd": amount, "run_usd": "", "reason": "cap"}
    page = client.post("/halts/budget", form, follow=True).content.decode()
    assert says in page
    assert not Policy.objects.filter(scope="ledger", daily_budget_micros__isnull=False).exists()


def test_every_action_says_what_it_did(client, cast):
    run = start_run("waiter", {})
    client.force_login(cast["otto"])
    short = str(run.pk)[:8]
    page = client.post(f"/runs/{run.pk}/halt", {"reason": "look"}, follow=True).content.decode()
    assert f"Run {short} halted." in page
    form = {"usd": "2.50", "reason": "worth it"}
    page = client.post(f"/runs/{run.pk}/budget", form, follow=True).content.decode()
    assert f"Budget of run {short} set to $2.50." in page
    page = client.post(f"/runs/{run.pk}/unhalt", {"reason": "ok"}, follow=True).content.decode()
    assert f"Run {short} unhalted." in page
    refused = client.post(f"/runs/{run.pk}/unhalt", {"reason": "ok"}, follow=True).content.decode()
    assert "unhalted." not in refused  # a refusal says only why


def test_every_flow_schedule_channel_and_start_action_says_what_it_did(client, cast, hook):
    """Issue 34 item 4: no action goes unconfirmed (the Flow page's, the Notifications page's
    and the Start form's said nothing)."""
    from django.contrib.auth.models import Permission

    cast["otto"].user_permissions.add(Permission.objects.get(codename="add_notificationchannel"))
    cast["otto"].user_permissions.add(Permission.objects.get(codename="delete_notificationchannel"))
    client.force_login(cast["otto"])

    def said(path: str, **form) -> str:
        page = client.post(path, form, follow=True).content.decode()
        found = re.findall(r'<li class="success">(.*?)</li>', page)
        assert found, f"{path} said nothing: {re.findall(r'<li class=.error.>(.*?)</li>', page)}"
        return html.unescape(found[-1])

    assert said("/flow/limits", workflow="many", max_running="2", max_running_per_key="",
                reason="q") == "Limits of many saved."  # fmt: skip
    assert said("/flow/rate", resource="gpt-4o", requests="60", tokens="", window_seconds="60",
                reason="tier 1") == "Rate limit of gpt-4o set: 60 calls per 60 s."  # fmt: skip
    assert said("/flow/rate", resource="gpt-4o", remove="1", reason="gone") == (
        "Rate limit of gpt-4o removed."
    )
    saved = said("/flow/schedules", name="nightly", workflow="many", cron="0 3 * * *",
                 timezone="UTC", input="")  # fmt: skip
    assert saved == "Schedule nightly saved: many at 0 3 * * * (UTC)."
    assert said("/flow/schedules/nightly/pause") == "Schedule nightly paused."
    assert said("/flow/schedules/nightly/remove") == "Schedule nightly removed."
    added = said("/notifications/add", kind="webhook", target=hook.url, events=["run.failed"])
    assert re.fullmatch(r"Channel (\d+) added: webhook of run\.failed\.", added)
    channel = re.fullmatch(r"Channel (\d+) .*", added)[1]
    assert said(f"/notifications/{channel}/remove") == f"Channel {channel} removed."
    started = said("/runs/start", workflow="many", input='{"steps": 1}')
    run = Run.objects.get()
    assert started == f"Started many run {str(run.pk)[:8]}."


def test_lowering_a_runs_budget_says_what_it_will_do_and_asks_first(client, cast):
    """Issue 34 item 4: "Raise the budget" took a lower amount, even 0, without a word."""
    run = start_run("many", {"steps": 1}, budget_usd="5")
    Run.objects.filter(pk=run.pk).update(cost_micros=2_100_000)
    client.force_login(cast["otto"])
    form = {"usd": "1", "reason": "too much"}
    page = client.post(f"/runs/{run.pk}/budget", form).content.decode()
    assert f"Lower the budget of run {str(run.pk)[:8]}?" in page
    said = "From <strong>$5</strong> to <strong>$1</strong>. It has spent $2.1: at its next step"
    assert said in page
    assert Run.objects.get(pk=run.pk).budget_micros == 5_000_000  # nothing yet
    client.post(f"/runs/{run.pk}/budget", {**form, "lower": "1"})
    assert Run.objects.get(pk=run.pk).budget_micros == 1_000_000
    # Raising, or a first budget, asks nothing.
    client.post(f"/runs/{run.pk}/budget", {"usd": "3", "reason": "more"})
    assert Run.objects.get(pk=run.pk).budget_micros == 3_000_000
    page = client.post(f"/runs/{run.pk}/budget", {"usd": "2.5", "reason": "less"}).content.decode()
    assert "it pauses <em>over budget</em> before a step that would take it past $2.5" in page


def test_the_run_span_ends_with_the_run_when_the_live_header_refreshes(drive, client, cast):
    """Issue 34 item 4: "Run span ... -> now" went on after the run finished, as the page's
    live refresh brought the header but not the span."""
    run = start_run("many", {"steps": 1})
    client.force_login(cast["vera"])
    page = client.get(f"/runs/{run.pk}").content.decode()
    assert "→ now (UTC)" in page and "#run-span" in page  # refreshed with the header
    drive()
    header = client.get(f"/runs/{run.pk}/header").content.decode()
    span = re.search(r'<p class="muted" id="run-span" data-start="\d+" data-end="(\d+)">(.*?)</p>',
                     header)  # fmt: skip
    assert span and "→ now" not in span[2], header[-400:]
    finished = Run.objects.get(pk=run.pk).finished_at
    assert int(span[1]) == int(finished.timestamp() * 1000)


def test_what_an_approval_approves_is_shown_unfolded_in_the_inbox_and_on_the_run_page(
    client, cast, drive
):
    """Item 5: the flight and its price, three levels down, are read without a click."""
    booking = {"flight": {"number": "LH 454", "price": {"amount": "612.40", "currency": "EUR"}}}
    run = start_run("approver", {"amount": 612, "booking": booking})
    assert drive() == ["waiting"]
    client.force_login(cast["ada"])
    for path in ("/approvals", f"/runs/{run.pk}"):
        page = client.get(path).content.decode()
        card = page[page.index('class="card approval"') :]
        card = card[: card.index("</article>")]
        assert "LH 454" in card and "612.40" in card, path
        assert re.findall(r'<details class="json"(?! open)', card) == [], path
    # Elsewhere deep values still start folded (a step's output on the run page).
    from runs.templatetags.timeline import json_tree

    assert '<details class="json">' in json_tree(booking)


def test_a_run_s_spend_over_time_and_each_workflow_s_spend_per_day_are_charted(client, cast, drive):
    """Item 5: a small chart of a run's spend as its steps finished, and on the Budgets page
    each workflow's spend per UTC day, each with a text alternative that gives the numbers."""
    from datetime import timedelta

    from django.utils import timezone

    from runs.models import Step

    client.force_login(cast["vera"])
    assert "Nothing spent in the last 14 days." in client.get("/budgets").content.decode()
    run = start_run("many", {"steps": 3})
    assert drive() == ["completed"]
    page = client.get(f"/runs/{run.pk}").content.decode()
    assert "Spend over time" not in page  # it spent nothing: no chart
    yesterday = timezone.now() - timedelta(days=1)
    Step.objects.filter(run=run, seq=0).update(cost_micros=1000, finished_at=yesterday)
    Step.objects.filter(run=run, seq__gt=0).update(cost_micros=2500)
    Run.objects.filter(pk=run.pk).update(cost_micros=6000)

    page = client.get(f"/runs/{run.pk}").content.decode()
    assert 'aria-label="Spend over time: $0.006 in 3 calls over' in page
    assert '<svg class="chart spark"' in page
    page = html.unescape(client.get("/budgets").content.decode())
    today = timezone.now().date().isoformat()
    assert f"many: cost per day, $0.006 in 14 days, most on {today} ($0.005)" in page
    bar = r'<rect class="col" x="[^"]+" y="[^"]+" width="[^"]+" height="([^"]+)">'
    bars = re.findall(bar, page)
    assert len(bars) == 14 and bars[-1] == "128.0" and bars[-2] == "25.6"  # today, yesterday
    assert '<text class="y" x="58" y="16">$0.005</text>' in page  # the y axis's top (issue 53)
