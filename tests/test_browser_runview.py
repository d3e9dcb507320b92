"""The run view operators expect (issue 53 §3), through a real browser: the waterfall in view
at the common widths, the trace tree of child runs, cost and latency charts, annotations."""

import pytest

from runs.sdk import start_run
from tests.test_browser import login, shoot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()


WIDTHS = {"1280": (1280, 800), "1440": (1440, 900), "1920": (1920, 1080), "phone": (390, 844)}


def visible_box(page, selector: str) -> dict:
    """The part of an element's box that shows: clipped by every scrolling ancestor and by the
    viewport (its bounding box alone says nothing of what an overflow hides)."""
    return page.evaluate(
        """(selector) => {
          const el = document.querySelector(selector);
          const r = el.getBoundingClientRect();
          let left = r.left, right = r.right, top = r.top, bottom = r.bottom;
          for (let a = el.parentElement; a; a = a.parentElement) {
            const s = getComputedStyle(a);
            if (s.overflowX !== "visible" || s.overflowY !== "visible") {
              const b = a.getBoundingClientRect();
              left = Math.max(left, b.left); right = Math.min(right, b.right);
              top = Math.max(top, b.top); bottom = Math.min(bottom, b.bottom);
            }
          }
          right = Math.min(right, document.documentElement.clientWidth);
          left = Math.max(left, 0);
          return {width: r.width, visible: Math.max(0, right - left)};
        }""",
        selector,
    )


@pytest.mark.parametrize("width", list(WIDTHS))
def test_the_waterfall_shows_whole_at_the_common_widths(server, page, cast, drive, width):
    from playwright.sync_api import expect

    run = start_run("ledger", {"steps": 3})
    drive()
    w, h = WIDTHS[width]
    page.set_viewport_size({"width": w, "height": h})
    login(page, server, "vera", f"/runs/{run.pk}")
    expect(page.locator("th.waterfall .axis .tick")).to_have_count(3)
    box = visible_box(page, "th.waterfall")
    assert box["width"] >= 100, box
    assert box["visible"] >= box["width"] - 1, box  # 11 of 120 px showed at 1440 px
    # Opening a step keeps it in view.
    page.locator("#step-2 .step-open").click()
    expect(page.locator("#step-panel .step-body")).to_be_attached()
    box = visible_box(page, "#step-2 td.waterfall")
    assert box["visible"] >= box["width"] - 1, box
    shoot(page, f"waterfall-{width}", full_page=False)


def test_a_child_run_opens_in_place_under_the_step_that_started_it(server, page, cast, drive):
    from playwright.sync_api import expect

    from runs.models import Run

    parent = start_run("parent", {"n": 2, "steps": 3})
    drive()
    child = Run.objects.get(parent=parent, key=f"{parent.pk}:c0")
    page.set_viewport_size({"width": 1440, "height": 900})
    login(page, server, "vera", f"/runs/{parent.pk}")
    entry = page.locator(f"#trace-{child.pk}")
    expect(entry.locator("summary")).to_contain_text("queued")
    expect(entry.locator("summary")).to_contain_text("ran")
    expect(entry.locator(".trace-step")).to_have_count(0)  # loaded when opened
    entry.locator("summary").click()
    steps = entry.locator(".trace-step")
    expect(steps).to_have_count(3)
    expect(steps.nth(0)).to_contain_text("s0")
    expect(steps.nth(2)).to_contain_text("completed")
    expect(steps.nth(2)).to_contain_text("$")
    shoot(page.locator("#trace"), "light-run-trace")


def test_trends_charts_read_with_axes_and_an_operator_marks_a_step_bad(
    server, page, cast, drive, demo_model
):
    from playwright.sync_api import expect

    from runs.models import Annotation

    for tenant in ("acme", "globex", "acme"):
        start_run("llm-chat", {"prompt": "hello"}, labels={"tenant": tenant})
    run = start_run("ledger", {"steps": 3}, labels={"tenant": "acme"})
    drive()
    page.set_viewport_size({"width": 1440, "height": 900})
    login(page, server, "otto", "/trends?by=label")
    first = page.locator("#trends section.trend").first
    expect(first.locator("h2")).to_contain_text("tenant=acme")
    expect(first.locator("svg.cost text.y")).to_have_count(3)
    expect(first.locator("svg.latency text.legend")).to_have_count(3)
    box = first.locator("svg.cost").bounding_box()
    assert box["width"] >= 300, box  # readable, not a 240 x 48 sparkline
    shoot(page, "light-trends", full_page=True)
    # Annotate a step from its panel; the run shows up under "marked bad".
    page.goto(f"{server}/runs/{run.pk}")
    page.locator("#step-1 .step-open").click()
    panel = page.locator("#step-panel")
    panel.locator("summary", has_text="Mark this step").click()
    panel.get_by_label("bad").check()
    panel.get_by_label("Note on the step").fill("total is off by one")
    panel.get_by_role("button", name="Save annotation").click()
    expect(page.locator("#annotations li")).to_contain_text("step s1")
    expect(page.locator("#annotations li")).to_contain_text("total is off by one")
    assert Annotation.objects.get(run=run).by_name == "otto"
    shoot(page.locator("#annotations"), "light-run-annotations")
    page.goto(f"{server}/?annotation=bad")
    expect(page.locator("#runs-rows tr")).to_have_count(1)
    expect(page.locator(f"#run-{run.pk}")).to_be_visible()
