"""Decision links in approval notifications (issue 53 item 2): each approver's mail carries
links of their own that decide once, through a confirm page (a GET never decides), and only
while the link's signature, expiry and the person's standing hold; the decision's event says
it was made through a link. Mails through Django's locmem outbox, pages through the test
client with CSRF checks on."""

import io
import json
import re
import time

import django
import pytest
from django.contrib.auth.models import Group
from django.core import mail, signing
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from django.utils import timezone

from runs import notifications
from runs.approvals import links
from runs.approvals.models import ApprovalLink, ApprovalRequest
from runs.models import Event, EventType, Run
from runs.sdk import start_run
from tests.test_notifications import Receiver

PUBLIC = "http://testserver"


@pytest.fixture
def outbox(settings):
    locmem = "django.core.mail.backends.locmem.EmailBackend"
    if django.VERSION >= (6, 1):
        settings.MAILERS = {"default": {"BACKEND": locmem, "OPTIONS": {}}}
    else:
        settings.EMAIL_BACKEND = locmem
    settings.STEPGUARD_PUBLIC_URL = PUBLIC
    return mail.outbox


@pytest.fixture
def approvers(cast, django_user_model):
    """ada and bea approve (each with an address of her own); otto operates."""
    cast["ada"].email = "ada@example.com"
    cast["ada"].save()
    bea = django_user_model.objects.create_user("bea", "bea@example.com", password="x")
    bea.groups.add(Group.objects.get(name="approver"))
    return {"ada": cast["ada"], "bea": bea, "otto": cast["otto"]}


def ask(drive, amount=30, timeout=None, **options) -> ApprovalRequest:
    timed = {"timeout": timeout} if timeout else {}
    run = start_run("approver", {"amount": amount, **timed}, **options)
    assert drive() == ["waiting"]
    return ApprovalRequest.objects.get(run=run)


def deliver(drive) -> None:
    assert notifications.sweep() >= 1
    assert set(drive()) == {"completed"}


def mail_to(outbox, address: str):
    (found,) = [m for m in outbox if m.to == [address]]
    return found


def link_in(message, decision="approve") -> str:
    return re.search(rf"^{decision.capitalize()}:\s+(\S+)$", message.body, re.M).group(1)


def path_of(url: str) -> str:
    return url.removeprefix(PUBLIC)


def follow(url: str, decision="approve", comment="", client=None):
    """GET the link as a browser would, then POST its form with the page's CSRF token."""
    client = client or Client(enforce_csrf_checks=True)
    page = client.get(path_of(url))
    if page.status_code != 200:
        return page
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.content.decode())
    return client.post(
        path_of(url).split("?")[0],
        {"decision": decision, "comment": comment, "csrfmiddlewaretoken": token.group(1)},
    )


def test_each_approver_gets_own_links_and_one_decides_once_through_a_confirm_page(
    drive, outbox, approvers
):
    notifications.add_channel(
        None, "email", "ada@example.com, bea@example.com, ops@example.com", "approval.requested"
    )
    approval = ask(drive)
    deliver(drive)
    assert sorted(m.to[0] for m in outbox) == [
        "ada@example.com",
        "bea@example.com",
        "ops@example.com",
    ]
    ada_mail, bea_mail = mail_to(outbox, "ada@example.com"), mail_to(outbox, "bea@example.com")
    assert "for ada only" in ada_mail.body and "for bea only" in bea_mail.body
    assert link_in(ada_mail) != link_in(bea_mail)
    assert "Approve:" not in mail_to(outbox, "ops@example.com").body  # nobody's identity
    assert json.loads(ada_mail.body[ada_mail.body.index("{") :])["decision"]["username"] == "ada"

    client = Client(enforce_csrf_checks=True)
    for method in (client.get, client.head):  # a mail scanner prefetching decides nothing
        assert method(path_of(link_in(ada_mail))).status_code == 200
    page = client.get(path_of(link_in(ada_mail))).content.decode()
    assert "You decide as <strong>ada</strong>" in page and "charge 30 EUR" in page
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
    assert (
        client.post(path_of(link_in(ada_mail)).split("?")[0], {"decision": "approve"}).status_code
        == 403
    )  # no CSRF token

    done = follow(link_in(ada_mail), comment="fine by me", client=client)
    assert (
        done.status_code == 200
        and "Approved</strong> by ada, through a link" in done.content.decode()
    )
    assert done["Referrer-Policy"] == "same-origin" and "no-store" in done["Cache-Control"]
    decided = Event.objects.get(run=approval.run, type=EventType.APPROVAL_DECIDED)
    assert decided.actor == "ada" and decided.payload["via"] == "link"
    assert decided.payload["sent_via"] == "email" and decided.payload["comment"] == "fine by me"
    assert drive() == ["completed"]
    assert Run.objects.get(pk=approval.run_id).output == {
        "approved_by": "ada",
        "comment": "fine by me",
    }

    again = follow(link_in(ada_mail, "reject"))
    assert again.status_code == 410 and "already used" in again.content.decode()
    late = follow(link_in(bea_mail))
    assert late.status_code == 409 and "already approved by ada" in late.content.decode()


def test_a_re_sent_delivery_carries_the_same_links_and_issues_no_second_credential(
    db, outbox, approvers, drive
):
    approval = ask(drive)
    first = links.issue(approval, approvers["ada"], key="k1", via="email")
    again = links.issue(approval, approvers["ada"], key="k1", via="email")
    assert ApprovalLink.objects.count() == 1
    assert (
        links.check(first.review.split("/")[-1]).pk == links.check(again.review.split("/")[-1]).pk
    )


@pytest.mark.parametrize("how", ["row", "signature"])
def test_an_expired_link_is_refused(drive, outbox, approvers, monkeypatch, how):
    approval = ask(drive)
    if how == "signature":  # signed two days ago: older than STEPGUARD_APPROVAL_LINK_SECONDS
        real = time.time
        monkeypatch.setattr(signing.time, "time", lambda: real() - 2 * 86400)
    sent = links.issue(approval, approvers["ada"], key="k", via="email")
    monkeypatch.undo()
    if how == "row":
        ApprovalLink.objects.update(expires_at=timezone.now() - timezone.timedelta(seconds=1))
    answer = follow(sent.approve)
    assert answer.status_code == 410 and "expired" in answer.content.decode()
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


def test_a_link_expires_with_its_approval(drive, outbox, approvers):
    approval = ask(drive, timeout=600)
    links.issue(approval, approvers["ada"], key="k", via="email")
    assert ApprovalLink.objects.get().expires_at == approval.expires_at


def test_a_tampered_link_is_refused(drive, outbox, approvers):
    approval = ask(drive)
    url = links.issue(approval, approvers["ada"], key="k", via="email").review
    head, signed = url.rsplit("/", 1)
    for bad in (signed[:-12] + ("A" if signed[-12] != "A" else "B") + signed[-11:], signed[:-5]):
        answer = follow(f"{head}/{bad}")
        assert answer.status_code == 400 and "signature does not match" in answer.content.decode()
    # Claims signed with anything but the links' own key and salt are nobody's.
    forged = signing.TimestampSigner(salt="wrong").sign_object({"a": approval.pk, "u": 1, "t": "x"})
    assert follow(f"{head}/{forged}").status_code == 400
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


@pytest.mark.parametrize("revoked", ["deactivated", "permission", "link"])
def test_a_link_is_refused_after_revocation(drive, outbox, approvers, revoked):
    approval = ask(drive)
    ada = approvers["ada"]
    url = links.issue(approval, ada, key="k", via="email").approve
    if revoked == "deactivated":
        ada.is_active = False
        ada.save()
    elif revoked == "permission":
        ada.groups.clear()
    else:
        assert links.revoke(None, "mail box compromised", username="ada") == 1
    answer = follow(url)
    said = {
        "deactivated": "deactivated",
        "permission": "may not decide approvals",
        "link": "revoked by cli",
    }
    assert answer.status_code == 403 and said[revoked] in answer.content.decode()
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"


def test_the_requester_gets_no_links_and_is_refused_by_one_four_eyes(drive, outbox, approvers):
    ada = approvers["ada"]
    notifications.add_channel(
        None, "email", "ada@example.com, bea@example.com", "approval.requested"
    )
    approval = ask(drive, started_by=ada)
    deliver(drive)
    assert "Approve:" not in mail_to(outbox, "ada@example.com").body
    assert "for bea only" in mail_to(outbox, "bea@example.com").body
    url = links.issue(approval, ada, key="k", via="email").approve  # as if sent before
    answer = follow(url)
    assert answer.status_code == 403 and "another person must" in answer.content.decode()
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
    assert ApprovalLink.objects.get(user=ada).used_at is None


def test_a_rejection_by_link_reaches_the_run(drive, outbox, approvers):
    approval = ask(drive)
    url = links.issue(approval, approvers["bea"], key="k", via="email").reject
    otto = Client()
    otto.force_login(approvers["otto"])  # a link decides as its person, whoever is logged in
    assert "decides as bea, not as otto" in otto.get(path_of(url)).content.decode()
    assert follow(url, "reject", "too much").status_code == 200
    assert drive() == ["completed"]
    assert "refused" in Run.objects.get(pk=approval.run_id).output


def test_a_webhook_carries_every_approver_s_decision_urls(drive, outbox, approvers):
    hook = Receiver()
    try:
        notifications.add_channel(None, "webhook", hook.url, ["approval.requested"])
        approval = ask(drive, started_by=approvers["bea"])
        deliver(drive)
        (request,) = hook.requests
    finally:
        hook.close()
    body = json.loads(request["body"])
    assert [d["username"] for d in body["decisions"]] == ["ada"]  # bea asked: not hers
    ada = body["decisions"][0]
    assert ada["approve"].startswith(f"{PUBLIC}/approvals/link/") and ada["approve"].endswith(
        "?decision=approve"
    )
    assert follow(ada["approve"]).status_code == 200
    assert (
        Event.objects.get(run=approval.run, type=EventType.APPROVAL_DECIDED).payload["sent_via"]
        == "webhook"
    )


def test_without_a_public_url_the_alert_still_goes_and_says_links_need_it(
    drive, outbox, approvers, settings
):
    settings.STEPGUARD_PUBLIC_URL = ""
    with pytest.raises(ImproperlyConfigured, match="approval links need STEPGUARD_PUBLIC_URL"):
        links.public_base()
    notifications.add_channel(None, "email", "ada@example.com", "approval.requested")
    ask(drive)
    deliver(drive)
    (message,) = outbox
    assert "links are off (approval links need STEPGUARD_PUBLIC_URL" in message.body
    assert not ApprovalLink.objects.exists()


def test_decisions_elsewhere_say_how_they_were_made(drive, approvers, client):
    from runs.approvals.services import decide

    approval = ask(drive)
    client.force_login(approvers["ada"])
    client.post(f"/approvals/{approval.pk}/decide", {"decision": "approve"})
    assert Event.objects.get(type=EventType.APPROVAL_DECIDED).payload["via"] == "dashboard"
    assert drive() == ["completed"]
    other = ask(drive)
    decide(other.pk, "reject", approvers["bea"], how={"via": "cli"})
    assert Event.objects.get(run=other.run, type=EventType.APPROVAL_DECIDED).payload["via"] == "cli"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_clicks_at_once_decide_once(approvers, outbox, drive):
    """Single use is the row's conditional UPDATE: of two posts racing, one decides."""
    import threading

    from django.db import connection

    approval = ask(drive)
    url = links.issue(approval, approvers["ada"], key="k", via="email").review
    signed, results, start = url.rsplit("/", 1)[1], [], threading.Barrier(2)

    def click(decision):
        start.wait()
        try:
            results.append(links.decide_by_link(signed, decision).status)
        except links.LinkRefused as exc:
            results.append(exc.status)
        finally:
            connection.close()

    threads = [threading.Thread(target=click, args=(d,)) for d in ("approve", "reject")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(map(str, results))[0] in ("409", "410") and len(results) == 2
    assert ApprovalLink.objects.get().used_at is not None
    assert Event.objects.filter(type=EventType.APPROVAL_DECIDED).count() == 1


def test_the_cli_revokes_a_person_s_links_with_a_reason(drive, outbox, approvers):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    approval = ask(drive)
    url = links.issue(approval, approvers["bea"], key="k", via="email").approve
    with pytest.raises(CommandError, match="say which links"):
        call_command("revokelinks", "--reason", "x")
    out = io.StringIO()
    call_command("revokelinks", "--user", "bea", "--reason", "phone lost", stdout=out)
    assert out.getvalue().strip() == "revoked 1 unused link"
    answer = follow(url)
    assert answer.status_code == 403 and "revoked by cli" in answer.content.decode()
    assert "phone lost" in answer.content.decode()


def test_a_webhook_s_links_cost_the_same_queries_for_one_approver_or_forty(
    drive, outbox, approvers, django_user_model
):
    """Before: 11 queries for one approver, 323 for forty (four eyes and a get_or_create
    each); now a fixed handful (one bulk insert, one read back)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    approval = ask(drive)
    counts = []
    for extra in (0, 38):
        for i in range(extra):
            user = django_user_model.objects.create_user(f"approver-{i}", password="x")
            user.groups.add(Group.objects.get(name="approver"))
        with CaptureQueriesContext(connection) as queries:
            sent = links.for_webhook(approval.pk, f"key-{extra}")["decisions"]
        counts.append((len(sent), len(queries.captured_queries)))
    assert [n for n, _ in counts] == [2, 40]
    assert counts[0][1] == counts[1][1] <= 8, counts


def test_the_admin_lists_links_without_their_token_hash(drive, outbox, approvers, admin_client):
    approval = ask(drive)
    links.issue(approval, approvers["ada"], key="k", via="email")
    link = ApprovalLink.objects.get()
    assert admin_client.get("/admin/approvals/approvallink/").status_code == 200
    page = admin_client.get(f"/admin/approvals/approvallink/{link.pk}/change/").content.decode()
    assert "ada" in page and link.token_sha256 not in page


def test_a_link_stands_for_the_action_digest_it_was_sent_for(drive, outbox, approvers):
    approval = ask(drive)
    url = links.issue(approval, approvers["ada"], key="k", via="email").approve
    ApprovalRequest.objects.filter(pk=approval.pk).update(sha256="0" * 64)
    answer = follow(url)
    assert answer.status_code == 409 and "no longer asks for what this link was sent for" in (
        answer.content.decode()
    )
    assert ApprovalRequest.objects.get(pk=approval.pk).status == "pending"
