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
