"""The run view operators expect (issue 53 §3): the trace tree of child runs, and cost and
latency over time per workflow, label and model with readable axes."""

import re
from datetime import date, timedelta

import pytest

from runs import trends
from runs.models import Run
from runs.sdk import start_run

pytestmark = pytest.mark.django_db


def test_child_runs_sit_under_the_step_that_started_them_with_queue_delay_apart(
    client, cast, drive
):
    parent = start_run("parent", {"n": 2, "steps": 3})
    drive()
    parent.refresh_from_db()
    assert parent.status == "completed"
    children = {c.key.split(":")[-1]: c for c in Run.objects.filter(parent=parent)}
    client.force_login(cast["vera"])
    page = client.get(f"/runs/{parent.pk}").content.decode()
    assert re.search(r'<dd id="run-queued"[^>]*>\d+(\.\d+)? (ms|s)</dd>', page)  # its own wait
    trace = page[page.index('id="trace"') :]
    for key, child in children.items():
        entry = re.search(rf'<details class="trace-child" id="trace-{child.pk}">(.*?)</summary>',
                          trace, re.S)  # fmt: skip
        assert entry, key
        assert f"<code>{key}</code>" in entry.group(1)
        assert "queued " in entry.group(1) and "ran " in entry.group(1)
        assert "completed" in entry.group(1)
    assert (
        trace.index("<code>c0</code>")
        < trace.index("<code>c1</code>")
        < trace.index("<code>after</code>")
    )
    level = client.get(f"/runs/{children['c0'].pk}/trace").content.decode()
    assert [m for m in re.findall(r"<code>(\w+)</code>", level)] == ["s0", "s1", "s2"]
    assert "$0" in level
    # A run without children shows no tree; a viewer needs the view permission.
    alone = start_run("ledger", {"steps": 1})
    drive()
    assert 'id="trace"' not in client.get(f"/runs/{alone.pk}").content.decode()
    client.logout()
    assert client.get(f"/runs/{children['c0'].pk}/trace").status_code == 302


def test_the_trace_level_costs_two_queries_whatever_the_number_of_children(
    drive, django_assert_max_num_queries
):
    from runs.views.trace import trace_of

    parent = start_run("parent", {"n": 6})
    drive()
    parent.refresh_from_db()
    with django_assert_max_num_queries(2):
        level = trace_of(parent)
    assert sum(1 for row in level["rows"] if row["child"]) == 6


def test_cost_and_latency_per_workflow_label_and_model_have_axes_and_values(
    client, cast, drive, demo_model
):
    for tenant in ("acme", "globex"):
        start_run("llm-chat", {"prompt": "hello"}, labels={"tenant": tenant})
    start_run("ledger", {"steps": 2}, labels={"tenant": "acme"})
    assert drive() == ["completed"] * 3
    client.force_login(cast["vera"])
    pages = {by: client.get("/trends", {"by": by}).content.decode() for by in trends.BY}
    workflow = pages["workflow"]
    assert "llm-chat" in workflow and "ledger" in workflow
    charts = re.findall(r"<svg class=\"chart axes (\w+)\".*?</svg>", workflow, re.S)
    assert "cost" in charts and "latency" in charts
    cost = re.search(r'<svg class="chart axes cost".*?</svg>', workflow, re.S).group(0)
    assert re.search(r'<text class="y"[^>]*>\$0</text>', cost)  # a y axis in dollars
    assert len(re.findall(r'<text class="y"', cost)) == 3
    assert date.today().strftime("%b %d") in cost  # dates along x
    assert re.search(rf"<title>{date.today().isoformat()}: \$0\.\d+</title>", cost)  # a bar's value
    latency = re.search(r'<svg class="chart axes latency".*?</svg>', workflow, re.S).group(0)
    assert re.search(r'<text class="y"[^>]*>\d+(\.\d)? (ms|s)</text>', latency)
    assert "queued p50" in latency and "p95" in latency
    assert "tenant=acme" in pages["label"] and "tenant=globex" in pages["label"]
    assert "gpt-4o-mini" in pages["model"]
    refused = client.get("/trends", {"by": "colour", "days": "5"}).content.decode()
    assert "by &#x27;colour&#x27; is not one of workflow, label, model" in refused
    assert "days &#x27;5&#x27; is not 7, 14 or 30" in refused


def test_a_y_axis_ends_on_a_round_number_and_latency_percentiles_are_per_day():
    assert [trends.nice(v) for v in (0.0003, 0.7, 3.2, 12, 101)] == [0.0005, 1, 5, 20, 200]
    days = [date(2026, 1, 1) + timedelta(days=i) for i in range(3)]
    chart = trends.latency_chart("w", days, {days[1]: [1.0, 2.0, 3.0, 100.0]})
    assert "median 2.5 s" in chart and "95th percentile" in chart
    assert trends.latency_chart("w", days, {}) is None
