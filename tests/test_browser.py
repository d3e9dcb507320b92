"""Journeys through a real browser (Playwright driving Debian's Chromium) against daphne."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from runs.sdk import start_run
from tests.conftest import ROOT, database_url, wait_until

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
def server(transactional_db, tmp_path):
    """daphne on a port the OS picks, on the test database, serving static files."""
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "SERVE_STATIC": "1",
        "ALLOWED_HOSTS": "127.0.0.1",
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    log = tmp_path / "daphne.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "daphne",
                "-b",
                "127.0.0.1",
                "-p",
                "0",
                "controlplane.asgi:application",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        match = wait_until(
            lambda: re.search(r"Listening on TCP address 127\.0\.0\.1:(\d+)", log.read_text()),
            what="daphne to listen",
        )
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


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
