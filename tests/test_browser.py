"""Journeys through a real browser (Playwright driving Debian's Chromium) against daphne."""

import os
import re
from pathlib import Path

import pytest

from runs.sdk import start_run

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


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

    from runs.approvals.models import ApprovalRequest
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
# `make screenshots` sets this: the page tests then leave a picture of each page there. Other
# runs take none (CI's time goes to what the tests check).
SHOTS = os.environ.get("STEPGUARD_SCREENSHOTS")


def shoot(target, name: str, **options) -> None:
    """A picture of a page or a part of it, if `make screenshots` asked for pictures."""
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        target.screenshot(path=str(Path(SHOTS) / f"{name}.png"), **options)


@pytest.mark.parametrize("scheme", ["light", "dark", "narrow"])
def test_the_main_pages_have_no_serious_accessibility_violations(
    server, browser, cast, drive, scheme
):
    """Every page, in both themes and (light) at 390 px, the width of a common phone."""
    from playwright.sync_api import expect

    from runs.operations import halt

    # axe goes in as an inline script: the test's own tooling, which the pages' CSP refuses.
    narrow = {"viewport": {"width": 390, "height": 844}} if scheme == "narrow" else {}
    context = browser.new_context(bypass_csp=True, **narrow)
    page = context.new_page()
    page.set_default_timeout(10_000)

    waiting = start_run("approver", {"amount": 12})
    drive()
    halted = start_run("ledger", {"steps": 1})
    halt(halted, cast["otto"], "checking the halted state")
    failed = start_run("saga", {"fail": True}, max_attempts=1)
    drive()
    flow_content()
    page.emulate_media(color_scheme="dark" if scheme == "dark" else "light")
    page.goto(f"{server}/login/")
    page.get_by_label("Username").fill("otto")
    page.get_by_label("Password").fill("x")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    problems = {}
    runs = {waiting.pk: "run-detail", halted.pk: "run-halted", failed.pk: "run-failed"}
    pages = ["/", *(f"/runs/{pk}" for pk in runs), "/approvals", "/halts", "/budgets", "/flow",
             "/workers", "/audit", "/notifications", "/trends"]  # fmt: skip
    for path in pages:
        page.goto(f"{server}{path}")
        name = path.strip("/").split("/")[0] or "runs-list"
        if path.startswith("/runs/"):
            name = next(n for pk, n in runs.items() if str(pk) in path)
            if page.locator("#timeline .step-open").count():  # the step panel too
                page.locator("#timeline .step-open").last.click()
                expect(page.locator("#step-panel .step-body")).to_be_attached()
        shoot(page, f"{scheme}-{name}", full_page=True)
        page.add_script_tag(path=AXE)
        found = page.evaluate(
            "async () => (await axe.run(document, {runOnly: ['wcag2a', 'wcag2aa', 'wcag21a',"
            " 'wcag21aa']})).violations.filter(v => ['serious', 'critical'].includes(v.impact))"
            ".map(v => v.id + ': ' + v.nodes.map(n => n.target.join(' ')).join(', '))"
        )
        if found:
            problems[path] = found
    context.close()
    assert not problems, problems


def test_the_main_pages_fit_a_360_px_wide_screen(server, browser, cast, drive):
    from playwright.sync_api import expect

    run = start_run("approver", {"amount": 12}, key="a-rather-long-key-for-a-narrow-screen")
    drive()
    context = browser.new_context(viewport={"width": 360, "height": 740})
    page = context.new_page()
    login(page, server, "otto")
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    wide = {}
    flow_content()
    for path in ("/", f"/runs/{run.pk}", "/approvals", "/halts", "/budgets", "/workers", "/audit",
                 "/flow", "/trends"):  # fmt: skip
        page.goto(f"{server}{path}")
        name = path.strip("/").split("/")[0] or "runs-list"
        shoot(page, f"narrow-{name}", full_page=True)
        # Wide tables scroll inside their own box; the page itself never scrolls sideways.
        width = page.evaluate("document.documentElement.scrollWidth")
        if width > 360:
            wide[path] = width
    context.close()
    assert not wide, wide


def flow_content() -> None:
    """Something on every table of the Flow page: a limit, a rate limit, a schedule."""
    from runs import operations

    operations.set_limits("ledger", "otto", "a test", max_running=3)
    operations.set_rate_limit("gpt-4o", "otto", "a test", requests=60, tokens=100_000)
    operations.save_schedule("otto", "nightly", workflow="ledger", cron="0 3 * * *")
    # And the Notifications page's: a channel sending (test, pause, remove) and a paused one.
    from runs import notifications

    notifications.add_channel(None, "webhook", "https://hooks.example.com/a", ["run.failed"])
    paused = notifications.add_channel(None, "email", "ops@example.com", ["run.failed"])
    notifications.pause_channel(None, paused.pk, "mail relay moved")


def login(page, server: str, username: str, next_path: str = "/") -> None:
    page.goto(f"{server}/login/?next={next_path}")
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill("x")
    page.get_by_role("button", name="Log in").click()
    # Loaded, so htmx has wired the page: a click on a button it handles is not lost.
    page.wait_for_url(lambda url: "/login/" not in url)
    page.wait_for_load_state("load")


def test_an_operator_halts_a_running_run_and_sees_it_stop_at_the_next_step(
    server, page, cast, spawn_worker
):
    from playwright.sync_api import expect

    from runs.models import Run, Step
    from tests.conftest import wait_until

    run = start_run("ledger", {"steps": 30, "sleep": 0.3})
    spawn_worker()
    login(page, server, "otto", f"/runs/{run.pk}")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    expect(page.locator("#step-2")).to_contain_text("completed", timeout=20_000)
    page.get_by_text("More actions").click()
    page.get_by_label("Reason to halt").fill("watching a runaway loop")
    page.get_by_role("button", name="Halt", exact=True).click()
    expect(page.get_by_role("status")).to_contain_text("by otto")
    expect(page.get_by_role("status")).to_contain_text("“watching a runaway loop”")
    # First the worker stops (the database says so), then the page shows it, live.
    wait_until(lambda: Run.objects.get(pk=run.pk).status == "halted", what="the worker to stop")
    expect(page.locator("#run-status")).to_have_text("halted")
    # The header caught up by itself: the sentence, and the one action that moves it on.
    expect(page.get_by_role("status")).to_contain_text("Halted by otto")
    expect(page.get_by_role("button", name="Unhalt", exact=True)).to_be_visible()
    expect(page.get_by_role("button", name="Halt", exact=True)).to_have_count(0)
    assert Step.objects.filter(run=run).count() < 30
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
    for name in ("ada", "bea", "ada"):
        context = browser.new_context()
        pages.append(context.new_page())
        login(pages[-1], server, name, "/approvals")
        expect(pages[-1].get_by_role("button", name="Approve")).to_be_visible()
        expect(pages[-1].locator("#site-live")).to_have_attribute("data-state", "open")
    # Bea is typing her comment when Ada approves: her inbox is not replaced under her (it is
    # live), so she still rejects, and the server says who decided first.
    pages[1].get_by_label(re.compile("^Comment on #")).fill("too much for one order")
    pages[0].get_by_role("button", name="Approve").click()
    expect(pages[0].get_by_text("Nothing waits for a decision.")).to_be_visible()
    # Ada's idle second tab follows by itself.
    expect(pages[2].get_by_text("Nothing waits for a decision.")).to_be_visible()
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


def _form_with(page, button: str):
    """The form holding the button named `button` (pages have several "Reason" fields)."""
    return page.locator("form").filter(has=page.get_by_role("button", name=button, exact=True))


def test_an_operator_raises_the_budget_of_a_run_paused_over_budget_and_it_resumes(
    server, page, cast, spawn_worker
):
    from decimal import Decimal

    from playwright.sync_api import expect

    from runs.models import Event, Run
    from tests.conftest import wait_until
    from tests.testapp.models import Effect

    steps = 5
    run = start_run("metered", {"steps": steps, "sleep": 0.4}, budget_usd=Decimal("1.5"))
    spawn_worker()
    wait_until(lambda: Run.objects.get(pk=run.pk).status == "over_budget", what="the pause")
    assert Run.objects.get(pk=run.pk).cost_micros == 1_000_000  # one call, the next would pass

    login(page, server, "otto", f"/runs/{run.pk}")
    expect(page.locator("#run-status")).to_have_text("over_budget")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    expect(page.get_by_role("status")).to_contain_text(
        "Paused because the next step needs $1.00 and the run budget has $0.50 left"
    )
    form = _form_with(page, "Raise the budget")
    form.get_by_label("New budget (USD)").fill("10")
    form.get_by_label("Reason for the budget").fill("the report is worth it")
    with page.expect_navigation():
        form.get_by_role("button", name="Raise the budget").click()
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    page.evaluate("window.__marker = 'after the budget'")
    # Four calls of 0.4 s remain: the page loaded before the end, so the end comes live.
    assert page.locator("#run-status").text_content().strip() != "completed"
    expect(page.locator("#run-status")).to_have_text("completed", timeout=20_000)
    expect(page.locator("#history")).to_contain_text("budget.set")
    assert page.evaluate("window.__marker") == "after the budget"  # no reload happened
    expect(page.locator("#timeline tr[id^=step-]")).to_have_count(steps)

    run.refresh_from_db()
    assert (run.status, run.budget_micros, run.cost_micros) == ("completed", 10_000_000, 5_000_000)
    budget_set = Event.objects.get(run=run, type="budget.set")
    assert (budget_set.actor, budget_set.payload["reason"]) == ("otto", "the report is worth it")
    assert Event.objects.filter(run=run, type="run.resumed").count() == 1
    labels = sorted(
        Effect.objects.filter(label__startswith="call-").values_list("label", flat=True)
    )
    assert labels == [f"call-{i}" for i in range(steps)]  # each call once: none repeated


def test_an_operator_forks_a_failed_run_from_a_step_and_lands_on_the_fork(
    server, page, cast, spawn_worker, tmp_path
):
    from playwright.sync_api import expect

    from runs.models import Run, Step
    from tests.conftest import wait_until
    from tests.testapp.models import Effect

    broken = tmp_path / "delivery-is-down"
    broken.touch()
    origin = start_run("breaks-after-effects", {"broken": str(broken)}, max_attempts=1)
    spawn_worker()
    wait_until(lambda: Run.objects.get(pk=origin.pk).status == "failed", what="the failure")
    broken.unlink()  # the delivery service is back: the fork can finish

    login(page, server, "otto", f"/runs/{origin.pk}")
    expect(page.locator("#run-status")).to_have_text("failed")
    page.get_by_text("Fork from a step").click()
    page.get_by_role("radio", name=re.compile(r"^from charge \(")).check()
    # Before confirming, the page says what will run again (and settles before the click).
    preview = page.locator("#fork-preview")
    expect(preview).to_contain_text(re.compile(r"reuses 1 recorded step\b"))
    expect(preview).to_contain_text("deliver")
    form = _form_with(page, "Fork")
    form.get_by_label("Reason").fill("delivery is fixed; charge again with the new price")
    form.get_by_role("button", name="Fork", exact=True).click()

    fork = wait_until(lambda: Run.objects.filter(forked_from=origin).first(), what="the fork")
    expect(page).to_have_url(f"{server}/runs/{fork.pk}")
    expect(page.get_by_text(f"forked from {str(origin.pk)[:8]}")).to_be_visible()
    expect(page.get_by_role("link", name=str(origin.pk)[:8])).to_have_attribute(
        "href", f"/runs/{origin.pk}"
    )
    expect(page.locator("#run-status")).to_have_text("completed", timeout=20_000)

    fork.refresh_from_db()
    assert (fork.forked_from_id, fork.forked_at_seq, fork.workflow) == (
        origin.pk, 1, "breaks-after-effects",
    )  # fmt: skip
    reserve, fork_reserve = (Step.objects.get(run=r, key="reserve") for r in (origin, fork))
    assert fork_reserve.output == reserve.output == {"seat": "12A"}  # reused, not run again
    assert fork.output == [{"seat": "12A"}, {"charged": 40}, "delivered"]
    ran = {label: Effect.objects.filter(label=label).count() for label in ("reserve", "charge")}
    assert ran == {"reserve": 1, "charge": 2}  # the chosen step and the rest ran again
    assert Effect.objects.filter(label="deliver").count() == 2
    assert Step.objects.get(run=fork, key="charge").idempotency_key != (
        Step.objects.get(run=origin, key="charge").idempotency_key
    )


def test_a_dropped_live_feed_reconnects_and_backfills_the_missed_steps_once(
    server, page, cast, spawn_worker
):
    from playwright.sync_api import expect

    from runs.models import Step
    from tests.conftest import wait_until

    cast["vera"]
    steps = 12
    run = start_run("ledger", {"steps": steps, "sleep": 0.5})
    sockets = []
    page.on("websocket", lambda ws: sockets.append(ws))
    login(page, server, "vera", f"/runs/{run.pk}")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    page.evaluate(
        """() => {
        window.__marker = 'before the drop';
        window.__ws = {open: 0, close: 0};
        document.body.addEventListener('htmx:wsOpen', () => window.__ws.open++);
        document.body.addEventListener('htmx:wsClose', () => window.__ws.close++);
    }"""
    )
    spawn_worker()
    expect(page.locator("#step-2")).to_contain_text("completed", timeout=20_000)

    # Drop the connection as a network does: the socket closes abnormally (code 1006, on which
    # the ws extension reconnects with backoff) and, while "offline", every reconnect attempt
    # fails too. (Chromium's offline emulation leaves websockets alone, so the page does it,
    # with a route of the same origin that refuses: the CSP allows no other host.)
    # Counted from the drop: on a loaded machine the first socket may already have dropped and
    # reconnected by itself (a reconnect is what this test is about; it counts the one it makes).
    at_drop = len(sockets)
    page.evaluate(
        """() => {
        window.__ws = {open: 0, close: 0};
        window.__offline = true;
        const connect = htmx.createWebSocket;
        htmx.createWebSocket = (url) =>
            window.__offline ? new WebSocket(location.origin.replace('http', 'ws') + '/ws/none/')
                             : connect(url);
        const socket = htmx.find('[ws-connect]')['htmx-internal-data'].webSocket.socket;
        const onclose = socket.onclose;
        socket.onclose = () => onclose.call(socket, new CloseEvent('close', {code: 1006}));
        socket.close();
    }"""
    )
    # Polled from here: wait_for_function evaluates a string in the page, which its CSP refuses.
    wait_until(lambda: page.evaluate("window.__ws.close") >= 1, what="the socket to drop")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "reconnecting")
    rows_at_drop = page.locator("#timeline tr[id^=step-]").count()
    last_event = page.locator("#history li[id^=event-]").last.get_attribute("id")
    done_at_drop = Step.objects.filter(run=run, status="completed").count()
    # Three more (or the rest: on a loaded machine the drop may land late in the run).
    more = min(done_at_drop + 3, steps)
    wait_until(
        lambda: Step.objects.filter(run=run, status="completed").count() >= more,
        what="steps to complete while the page is offline",
    )
    assert page.locator("#timeline tr[id^=step-]").count() == rows_at_drop  # nothing came
    assert page.evaluate("window.__ws.open") == 0, [ws.url for ws in sockets]  # still disconnected
    page.evaluate("window.__offline = false")

    wait_until(lambda: page.evaluate("window.__ws.open") >= 1, what="a new socket to open")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    # The new socket resumed after the last event the page showed when it dropped.
    feed = server.replace("http", "ws") + "/ws/runs/"
    live = [ws.url for ws in sockets[at_drop:] if ws.url.startswith(feed)]
    resumed_after = rf"[?&]after={last_event.removeprefix('event-')}(&|$)"
    assert live and re.search(resumed_after, live[-1]), live
    expect(page.locator("#run-status")).to_have_text("completed", timeout=20_000)
    expect(page.locator(f"#step-{steps - 1}")).to_contain_text("completed")
    expect(page.locator("#timeline tr[id^=step-]")).to_have_count(steps)  # each step once
    ids = page.locator("#timeline tr[id^=step-]").evaluate_all("rows => rows.map(r => r.id)")
    assert ids == [f"step-{i}" for i in range(steps)]
    for i in range(steps):
        expect(page.locator(f"#step-{i}")).to_contain_text("completed")
    recorded = list(run.events.order_by("seq").values_list("seq", flat=True))
    expect(page.locator(f"#event-{recorded[-1]}")).to_be_attached()  # the run's last event
    shown = page.locator("#history li[id^=event-]").evaluate_all(
        "items => items.map(i => Number(i.id.slice('event-'.length)))"
    )
    assert shown == recorded == list(range(1, len(recorded) + 1))  # each once, no gaps
    assert page.evaluate("window.__marker") == "before the drop"  # no reload happened


def test_a_viewer_sees_no_actions_and_the_server_refuses_her_posts(
    server, page, browser, cast, drive
):
    from playwright.sync_api import expect

    from runs.approvals.models import ApprovalRequest
    from runs.models import Run

    run = start_run("approver", {"amount": 45})
    drive()
    approval = ApprovalRequest.objects.get(run=run, status="pending")
    buttons = ("Halt", "Cancel", "Set budget", "Retry", "Fork", "Approve", "Reject", "Unhalt")

    # The same page for an operator has the buttons, so their absence below means something.
    operator = browser.new_context().new_page()
    login(operator, server, "otto", f"/runs/{run.pk}")
    operator.get_by_text("More actions").click()
    for name in ("Halt", "Cancel", "Set budget"):
        expect(operator.get_by_role("button", name=name, exact=True)).to_be_visible()
    operator.context.close()

    login(page, server, "vera", f"/runs/{run.pk}")
    expect(page.locator("#run-status")).to_have_text("waiting")
    # The pending approval is shown, and the header says the run waits for it.
    expect(page.get_by_role("heading", name=f"#{approval.pk} charge card")).to_be_visible()
    expect(page.get_by_role("status")).to_contain_text(f"Waiting for approval #{approval.pk}")
    for name in buttons:
        expect(page.get_by_role("button", name=name, exact=True)).to_have_count(0)

    token = page.locator("input[name=csrfmiddlewaretoken]").first.input_value()
    headers = {"Referer": f"{server}/runs/{run.pk}"}

    def post(path: str, **form):
        return page.request.post(
            f"{server}{path}",
            form={**form, "csrfmiddlewaretoken": token},
            headers=headers,
            max_redirects=0,
        )

    # Without the token the CSRF check refuses; with it, only the permission check can.
    no_token = page.request.post(
        f"{server}/runs/{run.pk}/halt", form={"reason": "x"}, headers=headers, max_redirects=0
    )
    assert no_token.status == 403 and "CSRF" in no_token.text()
    attempts = {
        "halt": post(f"/runs/{run.pk}/halt", reason="I want it stopped"),
        "cancel": post(f"/runs/{run.pk}/cancel", reason="I want it gone"),
        "budget": post(f"/runs/{run.pk}/budget", usd="1000", reason="more"),
        "fork": post(f"/runs/{run.pk}/fork", step="ok", reason="again"),
        "decide": post(f"/approvals/{approval.pk}/decide", decision="approve", comment="sure"),
    }
    for action, response in attempts.items():
        assert response.status == 403, (action, response.status, response.text()[:300])
        # Refused by the permission check, which says why (the CSRF check's page says
        # "CSRF verification failed"; every dashboard page carries a CSRF token header).
        assert "CSRF verification failed" not in response.text(), action
        assert "vera may not" in response.text(), (action, response.text()[-600:])

    run.refresh_from_db()
    assert (run.status, run.halted_at, run.cancel_requested_at, run.budget_micros) == (
        "waiting", None, None, None,
    )  # fmt: skip
    assert not Run.objects.filter(forked_from=run).exists()
    approval.refresh_from_db()
    assert (approval.status, approval.decided_by) == ("pending", None)
    assert not run.events.exclude(actor="system").exists()  # nothing done in vera's name


#: What an attacker would put in every field they control: markup that runs a script if a page
#: ever renders it unescaped.
XSS = '"><img src=x onerror="window.__xss=(window.__xss||0)+1"><script>window.__xss=1</script>'


def seed_hostile_fields(user):
    """Every field an agent, a model, an API caller or an operator can fill, filled with XSS."""
    from runs.approvals.models import ApprovalRequest
    from runs.models import ApiKey, Event, Run, Step, Worker
    from runs.operations import cancel_run, halt, set_budget
    from runs.sdk import send_signal

    run = start_run("ledger", {"steps": 0, "note": XSS}, key=XSS)
    now = run.created_at
    Step.objects.create(
        run=run, seq=0, key=XSS, status="completed", idempotency_key=f"{run.pk}:{XSS}",
        input={XSS: XSS}, output=XSS, started_at=now, finished_at=now,
    )  # fmt: skip
    Step.objects.create(
        run=run, seq=1, key=XSS + "2", status="failed", idempotency_key=f"{run.pk}:2",
        error={"type": XSS, "message": XSS, "traceback": XSS}, started_at=now, finished_at=now,
    )  # fmt: skip
    Event.objects.create(
        run=run, seq=90, type=XSS[:50], step_key=XSS, actor=XSS[:150],
        payload={"reason": XSS, "comment": XSS}, created_at=now,
    )  # fmt: skip
    send_signal(run.pk, XSS, {"x": XSS}, sent_by=XSS[:150])
    ApprovalRequest.objects.create(
        run=run, step_key=XSS, action=XSS, summary=XSS, payload={"x": XSS}
    )
    set_budget("workflow:ledger", user, XSS, usd="5")
    halt(run, user, XSS)
    other = start_run("ledger", {"steps": 0})
    cancel_run(other.pk, user, XSS)
    Run.objects.filter(pk=other.pk).update(workflow=XSS[:200], version=XSS[:50])
    ApiKey.objects.create(user=user, name=XSS, prefix="xss00000", digest="0" * 64)
    Worker.objects.create(
        host=XSS, pid=1, concurrency=1, workflows=[XSS], started_at=now, heartbeat_at=now
    )
    return run


def test_no_attacker_controlled_field_runs_a_script(server, browser, django_user_model):
    """Every page and the live feed, with CSP bypassed: escaping alone must hold."""
    from playwright.sync_api import expect

    from runs.engine.store import run_event
    from runs.models import Run, Step

    user = django_user_model.objects.create_superuser("root", "r@example.com", "a-long-passphrase")
    run = seed_hostile_fields(user)
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    page.set_default_timeout(10_000)
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{server}/login/")
    page.get_by_label("Username").fill("root")
    page.get_by_label("Password").fill("a-long-passphrase")
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()

    other = Run.objects.exclude(pk=run.pk).get()
    paths = [
        "/", "/?q=%22%3E%3Cimg%20src%3Dx%3E", "/?status=failed&workflow=%3Cb%3E",
        f"/runs/{run.pk}", f"/runs/{other.pk}", f"/runs/{run.pk}/steps/0",
        f"/runs/{run.pk}/steps/1", "/approvals", "/audit", "/audit?system=1", "/halts",
        "/workers", "/flow", "/admin/runs/run/", f"/admin/runs/run/{run.pk}/change/",
        "/admin/runs/event/", "/admin/runs/step/", "/admin/runs/apikey/",
        "/admin/runs/worker/", "/admin/runs/signal/", "/admin/runs/policy/",
        "/admin/approvals/approvalrequest/",
    ]  # fmt: skip
    ran = {}
    for path in paths:
        page.goto(f"{server}{path}")
        if path == f"/runs/{run.pk}":
            for row in page.locator("#timeline tr[id^=step-]").all():
                row.locator(".step-open").click()  # its attempts, input, output and error
                seq = row.get_attribute("id").removeprefix("step-")
                expect(page.locator(f"#step-panel .step-body[data-seq='{seq}']")).to_be_attached()
        found = page.evaluate("[window.__xss, document.querySelectorAll('img[src=x]').length]")
        if found != [None, 0]:
            ran[path] = found
    assert not ran, f"a payload ran or was rendered as markup: {ran}"

    # The live feed: a hostile step and event arriving while the page is open.
    page.goto(f"{server}/runs/{other.pk}")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    now = other.created_at
    Step.objects.create(
        run=other, seq=0, key="live" + XSS, status="completed", idempotency_key="live",
        output=XSS, started_at=now, finished_at=now,
    )  # fmt: skip
    run_event(other.pk, "step.completed", actor=XSS[:150], step_key="live" + XSS, note=XSS)
    expect(page.locator("#timeline tr[id^=step-]")).to_have_count(1, timeout=15_000)
    assert page.evaluate("[window.__xss, document.querySelectorAll('img[src=x]').length]") == [
        None,
        0,
    ]
    assert not dialogs
    context.close()


# -- the dashboard's second pass: one journey per part of issue 13 -------------------------------


def test_a_failed_runs_header_says_why_and_offers_retry_which_moves_it_on(
    server, page, cast, drive
):
    """1. The header explains the run: its input, its final error as a readable traceback, the
    sentence saying why it is in its state, and the one action that moves it on."""
    from playwright.sync_api import expect

    from runs.models import Run
    from tests import workflows

    workflows.calls.pop("flaky", None)
    run = start_run("flaky", {"failures": 9, "attempts": 1}, max_attempts=1)
    drive()
    login(page, server, "otto", f"/runs/{run.pk}")
    status = page.get_by_role("status")
    expect(status).to_contain_text("Failed at step call after 1 attempt: ConnectionError: failure")
    header = page.locator("#run-header")
    expect(header.locator("pre.traceback")).to_contain_text("Traceback")  # real newlines
    assert "\\n" not in header.locator("pre.traceback").text_content()
    expect(header.locator("summary", has_text="Input")).to_be_visible()
    for fact in ("Started", "Ended", "Duration", "Attempt", "Steps"):
        expect(header.locator("dt", has_text=fact)).to_be_visible()
    page.get_by_label("Reason to retry").fill("the service is back")
    page.get_by_role("button", name="Retry", exact=True).click()
    expect(page.locator("#run-status")).not_to_have_text("failed")
    assert Run.objects.get(pk=run.pk).status != "failed"
    # A viewer reads the same kind of sentence and is offered nothing; a compensated run is
    # offered a fork (a retry would be refused).
    viewer = page.context.browser.new_context().new_page()
    failed = start_run("saga", {"fail": True}, max_attempts=1)
    drive()
    login(viewer, server, "vera", f"/runs/{failed.pk}")
    expect(viewer.get_by_role("status")).to_contain_text("Failed at step ship")
    expect(viewer.get_by_role("status")).to_contain_text("fork it from a step")
    expect(viewer.get_by_role("button", name="Retry", exact=True)).to_have_count(0)
    viewer.context.close()


def test_approving_in_one_tab_updates_the_header_approvals_badge_and_actions_in_another(
    server, browser, cast, spawn_worker
):
    """2. Everything live: another tab's header, approvals, actions and nav badge follow."""
    from playwright.sync_api import expect

    from runs.approvals.models import ApprovalRequest

    run = start_run("approver", {"amount": 30})
    spawn_worker()
    from tests.conftest import wait_until

    wait_until(lambda: ApprovalRequest.objects.filter(run=run).exists(), what="the approval")
    ask = ApprovalRequest.objects.get(run=run)
    tabs = [browser.new_context().new_page() for _ in range(2)]
    for tab in tabs:
        tab.set_default_timeout(10_000)
        login(tab, server, "ada", f"/runs/{run.pk}")
        expect(tab.locator("#site-live")).to_have_attribute("data-state", "open")
        expect(tab.get_by_role("status")).to_contain_text(f"Waiting for approval #{ask.pk}")
        expect(tab.get_by_role("link", name=re.compile("Approvals 1"))).to_be_visible()
    watcher = tabs[1]
    watcher.evaluate("window.__marker = 'no reload'")
    tabs[0].get_by_label(f"Comment on #{ask.pk}").fill("within the limit")
    tabs[0].get_by_role("button", name="Approve").click()
    expect(watcher.locator("#run-status")).to_have_text("completed", timeout=20_000)
    expect(watcher.get_by_role("status")).to_contain_text("Completed")
    expect(watcher.get_by_role("heading", name=f"#{ask.pk} charge card")).to_have_count(0)
    expect(watcher.get_by_role("link", name=re.compile("^Approvals$"))).to_be_visible()
    expect(watcher.get_by_role("button", name="Approve")).to_have_count(0)
    expect(watcher.locator("#ws-status")).to_contain_text("ended")  # live only while it can change
    assert watcher.evaluate("window.__marker") == "no reload"
    for tab in tabs:
        tab.context.close()


def test_a_new_run_and_the_kill_switch_appear_on_open_pages_without_a_reload(server, browser, cast):
    """2 and 7. The runs list shows a new run; every page shows the kill switch's banner."""
    from playwright.sync_api import expect

    from runs.operations import halt, unhalt

    runs, other = (browser.new_context().new_page() for _ in range(2))
    login(runs, server, "vera", "/")
    login(other, server, "vera", "/workers")
    for tab in (runs, other):
        expect(tab.locator("#site-live")).to_have_attribute("data-state", "open")
        tab.evaluate("window.__marker = 'no reload'")
    fresh = start_run("ledger", {"steps": 1}, key="arrives-live")
    expect(runs.locator(f"#run-{fresh.pk}")).to_contain_text("arrives-live", timeout=10_000)
    # The status counts follow (issue 34 item 4: they never updated).
    expect(runs.locator("#runs-counts")).to_contain_text("pending: 1")
    halt("all", cast["otto"], "incident 42")
    for tab in (runs, other):
        expect(tab.get_by_role("alert")).to_contain_text("Kill switch on")
        expect(tab.get_by_role("alert")).to_contain_text("incident 42")
    unhalt("all", cast["otto"], "over")
    for tab in (runs, other):
        expect(tab.get_by_role("alert")).to_have_count(0)
        assert tab.evaluate("window.__marker") == "no reload"
        tab.context.close()


def test_every_attempt_of_a_step_shows_its_error_and_worker_and_events_expand(
    server, page, cast, drive
):
    """3. Attempts and errors are first-class: the first attempts' errors are not lost."""
    from playwright.sync_api import expect

    from tests import workflows

    workflows.calls.pop("flaky", None)
    run = start_run("flaky", {"failures": 2, "attempts": 3})
    drive()
    login(page, server, "vera", f"/runs/{run.pk}")
    row = page.locator("#step-0")
    expect(row.locator(".status-retried")).to_have_text("3")
    row.locator(".step-open").click()
    attempts = page.locator("#step-panel .attempt")
    expect(attempts).to_have_count(3)
    expect(attempts.nth(0)).to_contain_text("attempt 1: failed, tried again")
    expect(attempts.nth(0)).to_contain_text("ConnectionError: failure 1")
    expect(attempts.nth(1)).to_contain_text("ConnectionError: failure 2")
    expect(attempts.nth(2)).to_contain_text("attempt 3: completed")
    expect(attempts.nth(0)).to_contain_text("worker ")  # where it ran
    page.get_by_role("tab", name="History").click()
    retrying = page.locator("#history li", has_text="step.retrying").first
    retrying.locator("summary").click()
    expect(retrying.locator("dl")).to_contain_text("ConnectionError: failure 1")


def test_a_model_call_reads_as_a_conversation_with_its_raw_json_a_click_away(
    server, page, cast, drive, demo_model
):
    """4. Steps you can read: a side panel, the conversation, tokens, a time axis, ms times."""
    from playwright.sync_api import expect

    run = start_run("llm-chat", {"prompt": "Why do steps need keys?"})
    assert drive() == ["completed"]
    page.set_viewport_size({"width": 1440, "height": 900})
    login(page, server, "vera", f"/runs/{run.pk}")
    expect(page.locator("#step-0 time")).to_have_text(re.compile(r"^\d\d:\d\d:\d\d\.\d{3}$"))
    expect(page.locator("th.waterfall .axis .tick")).to_have_count(3)
    expect(page.locator("#run-span")).to_contain_text("Run span:")
    page.locator("#step-0 .step-open").click()
    panel = page.locator("#step-panel")
    expect(panel.locator(".turn-user")).to_contain_text("Why do steps need keys?")
    expect(panel.locator(".turn-assistant")).not_to_be_empty()
    expect(panel).to_contain_text("gpt-4o-mini")
    # Readable beside the timeline on a 1440 px screen (it was 416 px: ~45 characters a line).
    assert panel.bounding_box()["width"] >= 560
    expect(panel.locator("dt", has_text="Tokens")).to_be_visible()
    raw = panel.get_by_text("Raw response")
    raw.click()
    expect(panel.locator("details.raw[open]")).to_contain_text("choices")
    expect(page.locator("#step-0")).to_have_class(re.compile("selected"))


def test_the_runs_list_finds_a_run_by_its_short_id_and_starts_one_from_its_form(
    server, page, cast, drive
):
    """5. Search by the 8-character id, children under their parent, a Start run form."""
    from playwright.sync_api import expect

    from runs.models import Run

    parent = start_run("parent", {"n": 2}, key="the-parent")
    other = start_run("ledger", {"steps": 1}, key="other")
    drive()
    login(page, server, "otto", "/")
    page.get_by_label("Id, key or key prefix").fill(str(other.pk)[:8])
    page.get_by_role("button", name="Filter", exact=True).click()
    expect(page.locator("tr[id^=run-]")).to_have_count(1)
    expect(page.locator(f"#run-{other.pk}")).to_be_visible()
    page.goto(f"{server}/?top=1")
    expect(page.locator("tr[id^=run-]")).to_have_count(2)  # the parent and "other"
    page.locator(f"#run-{parent.pk}").get_by_text("2 children").click()
    expect(page.locator("tr[id^=run-]")).to_have_count(2)
    expect(page.locator("tr[id^=run-]").first).to_contain_text("child of")

    page.goto(f"{server}/")
    page.get_by_text("Start run").click()
    page.locator("#start-run").get_by_label("Workflow").select_option("ledger")
    page.get_by_label("Input (JSON)").fill("{steps: 1}")  # not JSON: the page says so
    page.get_by_role("button", name="Start the run").click()
    assert page.url == f"{server}/"
    assert (
        page.get_by_label("Input (JSON)")
        .evaluate("e => e.validationMessage")
        .startswith("The input is not JSON")
    )
    page.get_by_label("Input (JSON)").fill('{"steps": 2}')
    page.get_by_label("Key (optional").fill("from-the-form")
    page.get_by_label("Budget in USD").fill("2.5")
    page.get_by_role("button", name="Start the run").click()
    started = Run.objects.get(key="from-the-form")
    expect(page).to_have_url(f"{server}/runs/{started.pk}")
    assert (started.input, started.budget_micros, started.workflow) == (
        {"steps": 2},
        2_500_000,
        "ledger",
    )


def test_an_approval_shows_its_arguments_expiry_and_what_the_model_said_and_takes_a_comment(
    server, page, cast, drive
):
    """6. Approvals with context, decided with a comment from the run page."""
    from playwright.sync_api import expect

    from runs.approvals.models import ApprovalRequest

    run = start_run("approver", {"amount": 77, "timeout": 3600})
    drive()
    ask = ApprovalRequest.objects.get(run=run)
    login(page, server, "ada", "/approvals")
    card = page.locator("article.approval")
    expect(card).to_contain_text("expires")
    expect(card.locator(".json-key", has_text="amount")).to_be_visible()
    expect(card.locator(".json-leaf", has_text="77")).to_be_visible()  # JSON, not a repr
    expect(card).to_contain_text("step ok")
    page.goto(f"{server}/runs/{run.pk}")
    page.get_by_role("link", name=f"Decide approval #{ask.pk}").click()
    page.get_by_label(f"Comment on #{ask.pk}").fill("fine, the customer asked")
    page.get_by_role("button", name="Reject").click()
    ask.refresh_from_db()
    assert (ask.status, ask.comment) == ("rejected", "fine, the customer asked")
    page.goto(f"{server}/approvals")
    expect(page.get_by_text("“fine, the customer asked”")).to_be_visible()


def test_the_kill_switch_asks_for_confirmation_and_a_run_it_stops_offers_to_lift_it(
    server, page, cast, drive
):
    """7. Governance: a typed confirmation; the stopped run says so and offers the lift."""
    from playwright.sync_api import expect

    from runs.models import GLOBAL, Policy

    run = start_run("approver", {"amount": 5})
    drive()
    login(page, server, "otto", "/halts")
    page.get_by_label("Reason to halt everything").fill("incident 9")
    page.get_by_role("button", name="Turn the kill switch on").click()
    assert not Policy.objects.filter(scope=GLOBAL, halted_at__isnull=False).exists()
    page.get_by_label("Type “halt everything” to confirm").fill("halt everything")
    page.get_by_role("button", name="Turn the kill switch on").click()
    expect(page.get_by_role("alert")).to_contain_text("Kill switch on")
    page.goto(f"{server}/runs/{run.pk}")
    expect(page.get_by_role("alert")).to_contain_text("incident 9")
    expect(page.get_by_role("status")).to_contain_text("by a hold on the kill switch")
    expect(page.get_by_role("button", name="Halt", exact=True)).to_have_count(0)
    page.get_by_label("Reason to lift the kill switch").fill("over")
    page.get_by_role("button", name="Lift the kill switch").click()
    expect(page.get_by_role("alert")).to_have_count(0)
    expect(page.get_by_role("status")).not_to_contain_text("kill switch")


def test_spent_today_on_the_budgets_page_counts_what_runs_spent(server, page, cast, drive):
    """7. The Budgets page of its own: today's spend is what the steps cost today."""
    from playwright.sync_api import expect

    start_run("metered", {"steps": 2})
    drive()
    login(page, server, "vera", "/budgets")
    row = page.locator("tr", has=page.locator("th", has_text="metered"))
    expect(row.locator("td").first).to_have_text("$2")


def test_at_390_px_tables_become_cards_and_every_action_field_names_its_action(
    server, browser, cast, drive
):
    """8. Small screens and labels."""
    from playwright.sync_api import expect

    run = start_run("approver", {"amount": 12}, key="narrow")
    drive()
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    login(page, server, "otto", "/")
    first = page.locator("tr[id^=run-]").first
    expect(first.locator("td[data-label=Status]")).to_be_visible()
    # The card shows each value under its column's name.
    label = first.locator("td[data-label=Status]").evaluate(
        "e => getComputedStyle(e, '::before').content"
    )
    assert label == '"Status"'
    page.goto(f"{server}/runs/{run.pk}")
    page.get_by_text("More actions").click()
    for name in ("Reason to halt", "Reason to cancel", "Reason for the budget"):
        expect(page.get_by_label(name, exact=True)).to_have_count(1)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    context.close()


def test_the_sentence_follows_the_run_while_an_operator_types_in_an_action_form(
    server, page, cast, spawn_worker
):
    """2. A half-typed reason is never replaced, and the state above it still updates."""
    from playwright.sync_api import expect

    from runs.operations import halt

    run = start_run("ledger", {"steps": 30, "sleep": 0.3})
    spawn_worker()
    login(page, server, "otto", f"/runs/{run.pk}")
    expect(page.locator("#step-2")).to_contain_text("completed", timeout=20_000)
    page.get_by_text("More actions").click()
    page.get_by_label("Reason to cancel").fill("half-typed")
    halt(run, cast["otto"], "from another desk")  # from the CLI, say
    expect(page.get_by_role("status")).to_contain_text("“from another desk”", timeout=10_000)
    assert page.get_by_label("Reason to cancel").input_value() == "half-typed"


def test_relative_times_read_alike_everywhere_and_keep_ticking(server, page, cast):
    """Issue 34 item 4: the pages said "0 minutes ago" where the run's sentence said "41 s
    ago", and neither moved until a reload."""
    from playwright.sync_api import expect

    from runs.operations import halt

    halt("workflow:ledger", cast["otto"], "a quiet hour")
    login(page, server, "vera", "/halts")
    held = page.locator("time[data-ago]").first
    expect(held).to_have_text(re.compile(r"^\d+ s ago$"))
    # Two minutes later, by the page's clock: the same element says so without a reload.
    page.evaluate(
        """() => { const t = document.querySelector('time[data-ago]');
                   t.setAttribute('datetime', new Date(Date.now() - 125000).toISOString());
                   window.stepguardTick(); }"""
    )
    expect(held).to_have_text("2 minutes ago")
