"""Decision links: an approval notification carries, for each approver, links to approve or
reject from where they are (a mail, a chat tool's buttons), without logging in.

A link is a bearer credential for one person's decision on one action, so it works only while
all of these hold: its signature (TimestampSigner, salted for links: a cut or changed link is
refused before the database is read), its age and its row's expiry, its row (not used, not
revoked: single use is the row's conditional UPDATE), its person (active, still holding the
decide permission, not refused by four eyes: checked when it is followed, not when it was sent)
and its action (still pending, with the digest the link was made for). A GET only shows what a
POST would decide: mail scanners and chat previews follow links.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core import signing
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.crypto import salted_hmac

from runs.approvals.models import ApprovalKind, ApprovalLink, ApprovalRequest, ApprovalStatus
from runs.approvals.services import DECIDE, barred, decide, four_eyes_refusals
from runs.errors import Conflict, DecisionError, Forbidden, NotFound, StepguardError
from runs.operations import needs_reason, require

log = logging.getLogger("stepguard.approvals")

SALT = "stepguard.approvals.link"
DECISIONS = ("approve", "reject")
#: At most this many approvers get links in one webhook message (a chat tool's buttons).
MAX_APPROVERS = 50
COMMENT_MAX = 2000


class LinkRefused(StepguardError):
    """A decision link that does not hold (why, in words for the person who followed it)."""

    code = "link_refused"

    def __init__(self, message: str, status: int = 403):
        super().__init__(message)
        self.status = status


def public_base() -> str:
    """The dashboard's address, which links start with, or a clear error."""
    base = settings.STEPGUARD_PUBLIC_URL.strip().rstrip("/")
    if not base.startswith(("https://", "http://")):
        raise ImproperlyConfigured(
            "approval links need STEPGUARD_PUBLIC_URL, the dashboard's address as approvers "
            "reach it (e.g. https://stepguard.example.com); it is "
            f"{settings.STEPGUARD_PUBLIC_URL!r}. Set it, or STEPGUARD_APPROVAL_LINKS=0 to send "
            "approval notifications without links"
        )
    return base


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Links:
    """One approver's links to one approval."""

    username: str
    email: str
    review: str
    approve: str
    reject: str
    expires_at: str

    def as_json(self) -> dict:
        return self.__dict__.copy()


def issue(approval: ApprovalRequest, user, *, key: str, via: str, now=None) -> Links:
    """`user`'s links to decide `approval`, sent under `key` (a delivery's idempotency key):
    the same key gives the same links (a re-sent message carries what the first one did), so
    a delivery retried after a crash issues no second credential."""
    return issue_many(approval, [user], key=key, via=via, now=now)[0]


def issue_many(approval: ApprovalRequest, users: list, *, key: str, via: str, now=None):
    """`issue` for each of `users`, in two queries whatever their number."""
    now = now or timezone.now()
    base = public_base()
    expires = now + timedelta(seconds=settings.STEPGUARD_APPROVAL_LINK_SECONDS)
    if approval.expires_at is not None:
        expires = min(expires, approval.expires_at)
    tokens = {
        user.pk: salted_hmac(SALT, f"{key}|{approval.pk}|{user.pk}", algorithm="sha256").hexdigest()
        for user in users
    }
    rows = [
        ApprovalLink(
            approval=approval,
            user=user,
            token_sha256=_sha(tokens[user.pk]),
            sent_via=via,
            action_sha256=approval.sha256,
            created_at=now,
            expires_at=expires,
        )
        for user in users
    ]
    # A re-send finds its rows made: the unique token keeps the first, with its expiry.
    ApprovalLink.objects.bulk_create(rows, ignore_conflicts=True)
    made = ApprovalLink.objects.filter(token_sha256__in=[row.token_sha256 for row in rows])
    expiry = dict(made.values_list("user_id", "expires_at"))
    signer = signing.TimestampSigner(salt=SALT)
    issued = []
    for user in users:
        claims = {"a": approval.pk, "u": user.pk, "t": tokens[user.pk]}
        url = f"{base}/approvals/link/{signer.sign_object(claims, compress=True)}"
        issued.append(
            Links(
                username=user.get_username(),
                email=getattr(user, "email", "") or "",
                review=url,
                approve=f"{url}?decision=approve",
                reject=f"{url}?decision=reject",
                expires_at=expiry[user.pk].isoformat(),
            )
        )
    return issued


def approvers(approval: ApprovalRequest, *, email: str = "") -> list:
    """Active people who may decide `approval` now (the permission, four eyes), by id; those
    whose address is `email` only, if given."""
    perm = Permission.objects.filter(
        content_type__app_label="approvals", codename="decide_approvalrequest"
    ).first()
    users = get_user_model().objects.filter(is_active=True)
    if email:
        users = users.filter(email__iexact=email)
    may = Q(is_superuser=True)
    if perm is not None:
        may |= Q(user_permissions=perm) | Q(groups__permissions=perm)
    return list(
        users.filter(may).exclude(pk__in=barred(approval)).distinct().order_by("pk")[:MAX_APPROVERS]
    )


def linkable(approval_id) -> ApprovalRequest | None:
    """The approval a notification is about, if links can decide it: an action, pending."""
    approval = ApprovalRequest.objects.filter(pk=approval_id).first()
    if approval is None or approval.kind != ApprovalKind.ACTION:
        return None  # an ambiguous step's answer may need an output: the dashboard asks
    return approval if approval.status == ApprovalStatus.PENDING else None


def for_webhook(approval_id, key: str) -> dict:
    """What a webhook message about an approval carries: every approver's links
    (`decisions`), for a chat tool's bot to show each person their own buttons; or why not."""
    approval = linkable(approval_id)
    if approval is None or not settings.STEPGUARD_APPROVAL_LINKS:
        return {}
    try:
        public_base()
    except ImproperlyConfigured as exc:
        log.error("approval #%s: no decision links: %s", approval_id, exc)
        return {"decisions": [], "decisions_error": str(exc)}
    people = approvers(approval)
    issued = issue_many(approval, people, key=key, via="webhook") if people else []
    return {"decisions": [one.as_json() for one in issued]}


def for_email(approval_id, key: str, addresses: list[str]) -> dict[str, dict] | None:
    """What each address's own mail about an approval carries: its approver's links (when the
    address is exactly one approver's), or nothing; None: no mail carries links."""
    approval = linkable(approval_id)
    if approval is None or not settings.STEPGUARD_APPROVAL_LINKS:
        return None
    try:
        public_base()
    except ImproperlyConfigured as exc:
        log.error("approval #%s: no decision links: %s", approval_id, exc)
        return {address: {"decisions_error": str(exc)} for address in addresses}
    each = {}
    for address in addresses:
        people = approvers(approval, email=address)
        each[address] = {}
        if len(people) == 1:  # an address two people share is nobody's identity
            mine = issue(approval, people[0], key=f"{key}|{address.lower()}", via="email")
            each[address] = {"decision": mine.as_json()}
    return each


def email_text(links: dict) -> str:
    """The lines a mail with links starts with: where to click, and what a link is."""
    if "decisions_error" in links:
        return f"Decide in the dashboard: links are off ({links['decisions_error']}).\n\n"
    mine = links.get("decision")
    if not mine:
        return ""
    return (
        f"Approve: {mine['approve']}\nReject:  {mine['reject']}\n\n"
        f"Each link opens a page where you confirm (and may comment). They are for "
        f"{mine['username']} only, work once, and expire at {mine['expires_at']}.\n\n"
    )


# -- following a link -------------------------------------------------------------------------


def _when(moment) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def check(signed: str, now=None) -> ApprovalLink:
    """The link `signed` stands for, if it holds now; else LinkRefused saying why."""
    now = now or timezone.now()
    try:
        data = signing.TimestampSigner(salt=SALT).unsign_object(
            signed, max_age=timedelta(seconds=settings.STEPGUARD_APPROVAL_LINK_SECONDS)
        )
        approval_id, user_id, token = int(data["a"]), int(data["u"]), str(data["t"])
    except signing.SignatureExpired:
        raise LinkRefused("This link has expired: decide in the dashboard.", 410) from None
    except (signing.BadSignature, KeyError, TypeError, ValueError):
        raise LinkRefused(
            "This link is not valid: its signature does not match (was it cut or changed?).", 400
        ) from None
    link = (
        ApprovalLink.objects.select_related("approval", "user")
        .filter(token_sha256=_sha(token), approval_id=approval_id, user_id=user_id)
        .first()
    )
    if link is None:
        raise LinkRefused("This link is not valid: no such link was sent.", 404)
    if link.revoked_at is not None:
        why = f": {link.revoke_reason}" if link.revoke_reason else ""
        raise LinkRefused(
            f"This link was revoked by {link.revoked_by} at {_when(link.revoked_at)}{why}.", 403
        )
    if link.used_at is not None:
        raise LinkRefused(
            f"This link was already used, at {_when(link.used_at)} (to {link.decision}): "
            "a link works once.",
            410,
        )
    if link.expires_at <= now:
        raise LinkRefused(f"This link expired at {_when(link.expires_at)}.", 410)
    _holds(link)
    return link


def _holds(link: ApprovalLink) -> None:
    """The person and the action, as they are now."""
    user, approval = link.user, link.approval
    if not user.is_active:
        raise LinkRefused(f"{user.get_username()}'s account is deactivated: links refused.", 403)
    try:
        require(user, DECIDE, "decide approvals")
    except Forbidden as exc:
        raise LinkRefused(f"{exc}.", 403) from None
    if approval.sha256 != link.action_sha256:
        raise LinkRefused(
            f"Approval #{approval.pk} no longer asks for what this link was sent for.", 409
        )
    if approval.status != ApprovalStatus.PENDING:
        who = approval.decided_by.get_username() if approval.decided_by else "nobody"
        raise LinkRefused(f"Approval #{approval.pk} was already {approval.status} by {who}.", 409)
    refusal = four_eyes_refusals([approval], user).get(approval.pk)
    if refusal:
        raise LinkRefused(refusal, 403)


def decide_by_link(signed: str, decision: str, comment: str = "") -> ApprovalRequest:
    """Decide as the link's person, once: the link's row is spent by a conditional UPDATE in
    the decision's transaction (a refused decision leaves it unspent), and the decision's
    event says it was made through a link."""
    if decision not in DECISIONS:
        raise LinkRefused(f"a decision is 'approve' or 'reject', not {decision!r}", 400)
    if len(comment) > COMMENT_MAX:
        raise LinkRefused(f"a comment is at most {COMMENT_MAX} characters", 400)
    link = check(signed)
    now = timezone.now()
    how = {"via": "link", "link_id": link.pk, "sent_via": link.sent_via}
    statuses = {Forbidden: 403, Conflict: 409, NotFound: 404, DecisionError: 400}
    with transaction.atomic():
        live = ApprovalLink.objects.filter(
            pk=link.pk, used_at=None, revoked_at=None, expires_at__gt=now
        )
        if not live.update(used_at=now, decision=decision):
            check(signed)  # says why (used, revoked or expired a moment ago)
            raise LinkRefused("This link was used a moment ago: a link works once.", 410)
        try:
            return decide(link.approval_id, decision, link.user, comment, how=how)
        except StepguardError as exc:
            raise LinkRefused(str(exc), statuses.get(type(exc), 409)) from None


def revoke(
    by,
    reason: str,
    *,
    link_id: int | None = None,
    approval_id: int | None = None,
    username: str = "",
) -> int:
    """Revoke unused links: one, an approval's, a person's (or those of both). `by` None: the
    CLI. Returns how many; the rows keep who revoked them, when and why."""
    actor = "cli" if by is None else require(by, DECIDE, "revoke approval links").get_username()
    reason = needs_reason(reason, "revoking links")
    if link_id is None and approval_id is None and not username:
        raise DecisionError("say which links to revoke: a link, an approval or a user")
    links = ApprovalLink.objects.filter(used_at=None, revoked_at=None)
    if link_id is not None:
        links = links.filter(pk=link_id)
    if approval_id is not None:
        links = links.filter(approval_id=approval_id)
    if username:
        links = links.filter(**{f"user__{get_user_model().USERNAME_FIELD}": username})
    return links.update(revoked_at=timezone.now(), revoked_by=actor, revoke_reason=reason[:500])
