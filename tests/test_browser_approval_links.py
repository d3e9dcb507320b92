"""Approving from the mail, in a real browser (issue 53 item 2): the approver follows the link
in the message Django's locmem backend caught, confirms on the page it opens (no login), and
the run goes on; the same link again, a changed one, an expired one, a deactivated person's
and the requester's own are refused, and nothing is decided by opening a link."""

import re

import django
import pytest
from django.core import mail

from runs import notifications
from runs.approvals import links
from runs.approvals.models import ApprovalLink, ApprovalRequest
from runs.models import Event, EventType, Run
from runs.sdk import start_run
from tests.test_browser import login, shoot
from tests.test_browser_fork_edits import axe_problems

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def mailed(settings, server):
    """Mail to locmem's outbox, links to the daphne the browser talks to."""
    locmem = "django.core.mail.backends.locmem.EmailBackend"
    if django.VERSION >= (6, 1):
        settings.MAILERS = {"default": {"BACKEND": locmem, "OPTIONS": {}}}
    else:
        settings.EMAIL_BACKEND = locmem
    settings.STEPGUARD_PUBLIC_URL = server
    return mail.outbox


def test_an_approver_approves_from_the_mail_and_the_run_goes_on(
    server, browser, cast, drive, mailed, django_user_model
):
    from django.contrib.auth.models import Group
    from playwright.sync_api import expect

    ada = cast["ada"]
    ada.email = "ada@example.com"
    ada.save()
    notifications.add_channel(None, "email", "ada@example.com", "approval.requested")
    run = start_run("approver", {"amount": 30})
    assert drive() == ["waiting"]
    assert notifications.sweep() == 1
    assert drive() == ["completed"]
    (message,) = mailed
    approve = re.search(r"^Approve: (\S+)$", message.body, re.M).group(1)
    assert approve.startswith(f"{server}/approvals/link/")

    context = browser.new_context(bypass_csp=True)  # axe goes in inline
    page = context.new_page()
    page.set_default_timeout(10_000)
    page.goto(approve)
    expect(page.get_by_role("heading", name=re.compile(r"charge card"))).to_be_visible()
    expect(page.locator("#link-who")).to_contain_text("You decide as ada")
    assert ApprovalRequest.objects.get(run=run).status == "pending"  # opening decides nothing
    problems = axe_problems(page)
    shoot(page, "approval-link-confirm", full_page=True)
    page.get_by_label("Comment").fill("approved from my phone")
    page.get_by_role("button", name="Approve").click()
    expect(page.locator("#link-outcome")).to_contain_text("Approved by ada, through a link")
    assert drive() == ["completed"]
    assert Run.objects.get(pk=run.pk).output == {
        "approved_by": "ada",
        "comment": "approved from my phone",
    }
    decided = Event.objects.get(run=run, type=EventType.APPROVAL_DECIDED)
    assert (decided.actor, decided.payload["via"]) == ("ada", "link")

    page.goto(approve)  # the same link again
    expect(page.locator("#link-refused")).to_contain_text("already used")
    head, signed = approve.split("?")[0].rsplit("/", 1)
    page.goto(f"{head}/{signed[:-3]}{'xyz' if signed[-3:] != 'xyz' else 'abc'}")
    expect(page.locator("#link-refused")).to_contain_text("signature does not match")

    # Another request, asked by bea: hers is refused (four eyes), an expired link and a
    # deactivated approver's too; none of them decides.
    bea = django_user_model.objects.create_user("bea", "bea@example.com", password="x")
    cy = django_user_model.objects.create_user("cy", "cy@example.com", password="x")
    for person in (bea, cy):
        person.groups.add(Group.objects.get(name="approver"))
    second = start_run("approver", {"amount": 40}, started_by=bea)
    assert drive() == ["waiting"]
    asked = ApprovalRequest.objects.get(run=second)
    sent = {u.username: links.issue(asked, u, key="k", via="email").approve for u in (ada, bea, cy)}
    ApprovalLink.objects.filter(user=ada, approval=asked).update(expires_at=asked.created_at)
    cy.is_active = False
    cy.save()
    for who, said in (
        ("ada", "expired"),
        ("bea", "bea started run"),
        ("cy", "account is deactivated"),
    ):
        page.goto(sent[who])
        expect(page.locator("#link-refused")).to_contain_text(said)
    assert ApprovalRequest.objects.get(pk=asked.pk).status == "pending"

    login(page, server, "ada", f"/runs/{run.pk}")  # the run, as the dashboard shows it
    expect(page.locator("#run-status")).to_have_text("completed")
    context.close()
    assert not problems, problems
