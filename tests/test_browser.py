"""Journeys through a real browser (Playwright driving Debian's Chromium) against daphne."""

import os
import re
import shutil
from pathlib import Path

import pytest

from runs.sdk import start_run

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "Chromium is missing: CI must run the browser tests (apt-get install chromium)"
            )
        pytest.skip("Chromium is not installed (apt-get install chromium); CI runs these tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
                "--disable-gpu",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()


def test_an_operator_logs_in_and_finds_a_run_and_its_steps_in_the_admin(
    server, page, django_user_model, drive
):
    from playwright.sync_api import expect

    django_user_model.objects.create_superuser("ops", "ops@example.com", "a-long-passphrase")
    run = start_run("ledger", {"steps": 2}, key="browser-run")
    drive()

    page.goto(f"{server}/admin/runs/run/")
    expect(page).to_have_url(re.compile(r"/admin/login/"))
    page.get_by_label("Username").fill("ops")
    page.get_by_label("Password").fill("a-long-passphrase")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("link", name=str(run.id))).to_be_visible()
    page.get_by_role("link", name=str(run.id)).click()
    expect(page.get_by_text("browser-run")).to_be_visible()
    expect(page.get_by_text(f"{run.id}:s1")).to_be_visible()  # a step's idempotency key


def test_an_approver_logs_in_approves_and_the_run_goes_on(server, page, cast, spawn_worker):
    from playwright.sync_api import expect

    from approvals.models import ApprovalRequest
    from runs.models import Run
    from tests.conftest import wait_until

    run = start_run("approver", {"amount": 30})
    spawn_worker()
    wait_until(lambda: ApprovalRequest.objects.filter(run=run).exists(), what="the approval")

    page.goto(f"{server}/approvals")
    expect(page).to_have_url(re.compile(r"/login/"))
    page.get_by_label("Username").fill("ada")
    page.get_by_label("Password").fill("x")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name=re.compile("charge card"))).to_be_visible()
    expect(page.get_by_role("link", name=re.compile(r"Approvals 1"))).to_be_visible()
    page.get_by_role("button", name="Approve").click()
    expect(page.get_by_text("Nothing waits for a decision.")).to_be_visible()
    wait_until(lambda: Run.objects.get(pk=run.pk).status == "completed", what="the run")
    page.goto(f"{server}/runs/{run.pk}")
    expect(page.get_by_role("heading", name=re.compile("approver@1"))).to_contain_text("completed")
    expect(page).to_have_title(re.compile(r"Run .* \(approver\)"))


def test_a_running_runs_steps_appear_live_without_a_reload(server, page, cast, spawn_worker):
    from playwright.sync_api import expect

    cast["vera"]
    run = start_run("ledger", {"steps": 8, "sleep": 0.4})
    page.goto(f"{server}/login/?next=/runs/{run.pk}")
    page.get_by_label("Username").fill("vera")
    page.get_by_label("Password").fill("x")
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    page.evaluate("window.__marker = 42")
    spawn_worker()
    expect(page.locator("#step-7")).to_contain_text("completed", timeout=20_000)
    expect(page.locator("#run-status")).to_have_text("completed")
    assert page.evaluate("window.__marker") == 42  # no reload happened
    assert page.locator("#timeline tr[id^=step-]").count() == 8  # each step once
    assert page.locator("#no-steps").count() == 0


AXE = os.path.join(os.path.dirname(__file__), "vendor", "axe.min.js")
# `make screenshots` runs the accessibility test, which leaves a picture of each page here.
SHOTS = Path(
    os.environ.get("STEPGUARD_SCREENSHOTS", Path(__file__).parent.parent / "var" / "screenshots")
)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_main_pages_have_no_serious_accessibility_violations(server, page, cast, drive, scheme):
    from playwright.sync_api import expect

    from runs.operations import halt

    waiting = start_run("approver", {"amount": 12})
    drive()
    halted = start_run("ledger", {"steps": 1})
    halt(halted, cast["otto"], "checking the halted state")
    page.emulate_media(color_scheme=scheme)
    page.goto(f"{server}/login/")
    page.get_by_label("Username").fill("otto")
    page.get_by_label("Password").fill("x")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    problems = {}
    for path in ("/", f"/runs/{waiting.pk}", f"/runs/{halted.pk}", "/approvals", "/halts"):
        page.goto(f"{server}{path}")
        name = path.strip("/").split("/")[0] or "runs-list"
        if path.startswith("/runs/"):
            name = "run-halted" if str(halted.pk) in path else "run-detail"
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{scheme}-{name}.png"), full_page=True)
        page.add_script_tag(path=AXE)
        found = page.evaluate(
            "async () => (await axe.run(document, {runOnly: ['wcag2a', 'wcag2aa', 'wcag21a',"
            " 'wcag21aa']})).violations.filter(v => ['serious', 'critical'].includes(v.impact))"
            ".map(v => v.id + ': ' + v.nodes.map(n => n.target.join(' ')).join(', '))"
        )
        if found:
            problems[path] = found
    assert not problems, problems


def login(page, server: str, username: str, next_path: str = "/") -> None:
    page.goto(f"{server}/login/?next={next_path}")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill("x")
    page.get_by_role("button", name="Log in").click()


def test_an_operator_halts_a_running_run_and_sees_it_stop_at_the_next_step(
    server, page, cast, spawn_worker
):
    from playwright.sync_api import expect

    from runs.models import Run, Step

    run = start_run("ledger", {"steps": 30, "sleep": 0.3})
    spawn_worker()
    login(page, server, "otto", f"/runs/{run.pk}")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    expect(page.locator("#step-2")).to_contain_text("completed", timeout=20_000)
    page.get_by_label("Reason").first.fill("watching a runaway loop")
    page.get_by_role("button", name="Halt").click()
    expect(page.get_by_role("status")).to_contain_text("Halted by otto")
    page.wait_for_function("document.querySelector('#run-status').textContent.trim() === 'halted'")
    stopped = Step.objects.filter(run=run).count()
    assert Run.objects.get(pk=run.pk).status == "halted" and stopped < 30
    # j / k walk the timeline from the keyboard.
    page.keyboard.press("j")
    page.keyboard.press("j")
    expect(page.locator("#step-1")).to_have_attribute("aria-current", "true")


def test_two_approvers_decide_the_same_request_and_the_first_wins(server, browser, cast, drive):
    from playwright.sync_api import expect

    cast["ada"]
    from django.contrib.auth.models import Group, User

    second = User.objects.create_user("bea", password="x")
    second.groups.add(Group.objects.get(name="approver"))
    start_run("approver", {"amount": 77})
    drive()
    pages = []
    for name in ("ada", "bea"):
        context = browser.new_context()
        pages.append(context.new_page())
        login(pages[-1], server, name, "/approvals")
        expect(pages[-1].get_by_role("button", name="Approve")).to_be_visible()
    pages[0].get_by_role("button", name="Approve").click()
    expect(pages[0].get_by_text("Nothing waits for a decision.")).to_be_visible()
    pages[1].get_by_role("button", name="Reject").click()
    expect(pages[1].get_by_text(re.compile("already approved by ada"))).to_be_visible()
    for p in pages:
        p.context.close()


@pytest.fixture(params=["redis", "notify"])
def doorbell_server(request, monkeypatch):
    """daphne whose live pages poll only every 30 s: anything sooner is the doorbell's doing."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the doorbell needs Redis or PostgreSQL NOTIFY; SQLite pages poll")
    monkeypatch.setenv("STEPGUARD_LIVE_POLL", "30")
    if request.param == "notify":
        monkeypatch.delenv("REDIS_URL", raising=False)
    elif not os.environ.get("REDIS_URL"):
        if os.environ.get("CI") == "true":
            pytest.fail("CI must set REDIS_URL for the Redis doorbell test")
        pytest.skip("REDIS_URL is not set")
    return request.getfixturevalue("server")


@pytest.mark.postgres
def test_the_doorbell_brings_new_steps_without_waiting_for_a_poll(
    doorbell_server, page, cast, spawn_worker
):
    from playwright.sync_api import expect

    cast["vera"]
    run = start_run("ledger", {"steps": 3, "sleep": 0.2})
    login(page, doorbell_server, "vera", f"/runs/{run.pk}")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    spawn_worker()
    # The worker starts in about a second and the run takes about one more: far below 30 s.
    expect(page.locator("#run-status")).to_have_text("completed", timeout=10_000)
    expect(page.locator("#step-2")).to_contain_text("completed")
