"""The versions page in a real browser: an operator finds it from Workers, reads the versions
in flight and runs the release check against the server's code (issue 53 §1)."""

import pytest

from runs.sdk import start_run
from tests.test_browser import AXE, login, shoot

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.mark.parametrize("width", [1280, 360])
def test_an_operator_checks_the_runs_in_flight_from_the_versions_page(
    server, browser, cast, drive, width
):
    from playwright.sync_api import expect

    from runs.models import Run

    start_run("waiter", {})
    assert drive() == ["waiting"]
    # a run of a version this server has no code for: it must stay on the workers that have it
    Run.objects.create(workflow="waiter", version="0", input={}, status="waiting")
    context = browser.new_context(viewport={"width": width, "height": 800}, bypass_csp=True)
    page = context.new_page()
    page.set_default_timeout(10_000)
    login(page, server, "otto", "/workers")
    page.get_by_role("link", name="Versions in flight").click()
    expect(page.get_by_role("heading", name="Versions in flight")).to_be_visible()
    table = page.locator("#versions")
    expect(table.get_by_role("row").filter(has_text="waiter")).to_have_count(2)
    expect(table).to_contain_text("no live worker")
    page.get_by_label("Workflow").select_option("waiter")
    page.get_by_role("button", name="Check").click()
    report = page.locator("#check-report")
    expect(report).to_contain_text("No run would diverge: 1 checked")
    expect(report).to_contain_text("waiter@0: no code for this version here")
    expect(report).to_contain_text("waiter@1: 1 checked (1 live), 1 compatible, 0 would diverge")
    shoot(page, f"versions-{width}", full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    page.add_script_tag(path=AXE)
    found = page.evaluate(
        "async () => (await axe.run(document, {runOnly: ['wcag2a', 'wcag2aa', 'wcag21a',"
        " 'wcag21aa']})).violations.filter(v => ['serious', 'critical'].includes(v.impact))"
        ".map(v => v.id + ': ' + v.nodes.map(n => n.target.join(' ')).join(', '))"
    )
    assert not found, found
    context.close()
