"""Usage, estimates and the shared (workflow, label and global) daily budgets.

USD is carried in Python as Decimal and stored as integer micro-dollars, so both database
engines add and compare it exactly.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date
from decimal import ROUND_CEILING, Decimal
from typing import Any

from django.conf import settings
from django.db import connection
from django.db.models import Q, Sum
from django.utils import timezone

from runs import labels as run_labels
from runs.engine.cursors import in_list
from runs.errors import OverBudget
from runs.models import GLOBAL, BudgetLedger, Policy, SpendDay

MICROS = Decimal("1000000")


MAX_USD = Decimal(10) ** 9  # a billion dollars: far above any budget, far below BIGINT micros


def to_micros(usd: Decimal | int | str | float) -> int:
    """USD to integer micro-dollars, rounding fractions of a micro-dollar up."""
    text = str(usd).strip()
    if not text.isascii():  # Decimal reads "٣" as 3: amounts are ASCII digits only
        raise ValueError(f"{usd!r} is not an amount of USD (use the digits 0-9)")
    try:
        value = Decimal(text)
    except ArithmeticError:
        raise ValueError(f"{usd!r} is not an amount of USD") from None
    if not value.is_finite() or value < 0 or value > MAX_USD:
        raise ValueError(f"an amount of USD is a number from 0 to {MAX_USD:,}, not {usd!r}")
    return int((value * MICROS).to_integral_value(rounding=ROUND_CEILING))


#: An amount of USD as people type one: digits, at most 6 decimals (micro-dollars). The one
#: spelling the CLI, the API and the dashboard's forms take: `1e3` is not $1,000, `-5` is no
#: budget, and a 7th decimal is not rounded without a word.
PLAIN_USD = r"[0-9]{1,10}(\.[0-9]{1,6})?"


def plain_usd(text: str, what: str = "an amount") -> Decimal:
    """`text` as USD if it is a plain amount (PLAIN_USD, at most MAX_USD), else ValueError
    naming `what` and the problem."""
    text = text.strip()
    to_micros(text)  # no amount at all, or out of range: it says which
    if not re.fullmatch(PLAIN_USD, text):
        raise ValueError(
            f"{what} {text!r} is not a plain amount of USD: digits with at most 6 decimals,"
            " e.g. 2.50"
        )
    return Decimal(text)


def to_usd(micros: int | None) -> Decimal | None:
    return None if micros is None else (Decimal(micros) / MICROS).quantize(Decimal("0.000001"))


@dataclass(frozen=True, slots=True)
class Amount:
    """Micro-USD and tokens: what every budget counts."""

    micros: int = 0
    tokens: int = 0

    def __add__(self, other: Amount) -> Amount:
        # Only amounts: a bare (micros, tokens) pair was accepted once and reads either way.
        if not isinstance(other, Amount):
            return NotImplemented
        return Amount(self.micros + other.micros, self.tokens + other.tokens)

    def __bool__(self) -> bool:
        """True when it counts anything: a step that holds nothing writes no reservation."""
        return bool(self.micros or self.tokens)

    def beyond(self, other: Amount) -> Amount:
        """What this needs on top of `other` (never negative)."""
        return Amount(max(self.micros - other.micros, 0), max(self.tokens - other.tokens, 0))


#: No money and no tokens: the default of every amount held, reserved or estimated.
NOTHING = Amount()


@dataclass(frozen=True)
class Usage:
    """What a step spent (or, as an estimate, may spend): tokens and USD."""

    tokens_in: int = 0
    tokens_out: int = 0
    usd: Decimal = Decimal(0)
    #: A model call's tokens and USD per kind (input, cached input, ..., reasoning), recorded
    #: on its step as `Step.usage`; not part of what is compared or reserved.
    breakdown: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.tokens_in < 0 or self.tokens_out < 0:
            raise ValueError("token counts cannot be negative")
        object.__setattr__(self, "usd", Decimal(str(self.usd)))
        to_micros(self.usd)  # validates

    @property
    def tokens(self) -> int:
        return self.tokens_in + self.tokens_out

    @property
    def micros(self) -> int:
        return to_micros(self.usd)


@dataclass(frozen=True)
class Metered:
    """Return this from a step's function to report what the call cost.

    The step records `value` as its output and adds `usage` to the run's spend, in the
    transaction that completes the step.
    """

    value: Any
    usage: Usage
    #: The step's kind from now on, if the call made it another (a LangGraph node that
    #: called a chat model is an `llm` step).
    kind: str | None = None


_scopes: dict[str, Any] = {"at": -1e9, "value": frozenset()}


def shared_budget_scopes() -> frozenset[str]:
    """Scopes with a daily budget; cached for a second, so most steps pay no query for it."""
    now = time.monotonic()
    if now - _scopes["at"] > 1.0:
        with_budget = Q(daily_budget_micros__isnull=False) | Q(daily_budget_tokens__isnull=False)
        _scopes["value"] = frozenset(
            Policy.objects.filter(with_budget).values_list("scope", flat=True)
        )
        _scopes["at"] = now
    return _scopes["value"]


def forget_cached_scopes() -> None:
    _scopes["at"] = -1e9


def scopes_for(workflow: str, labels: Mapping[str, str] | None = None) -> list[str]:
    """The shared daily budgets a run's spend counts against: its workflow's, its labels'
    (`label:tenant=acme`) and the global one, those that have a budget."""
    shared = shared_budget_scopes()
    candidates = (workflow, *run_labels.scopes(labels or {}), GLOBAL)
    return [s for s in candidates if s in shared]


def shared_left(workflow: str, labels: Mapping[str, str] | None) -> tuple[int | None, int | None]:
    """What the tightest of a run's shared daily budgets has left today (limit less spent and
    held), in micro-USD and in tokens; None where none limits that unit. Read without locks:
    it caps a model call's answer, and the reservation still checks under the row lock."""
    scopes = scopes_for(workflow, labels)
    if not scopes:
        return None, None
    limits = daily_limits(scopes)
    ledgers: dict[str, dict[str, Any]] = {
        row["scope"]: dict(row)
        for row in BudgetLedger.objects.filter(day=timezone.now().date(), scope__in=scopes).values()
    }
    left: dict[str, list[int]] = {"micros": [], "tokens": []}
    for scope in scopes:
        row: dict[str, Any] = ledgers.get(scope, {})
        for unit in left:
            limit = limits.get(scope, {}).get(f"daily_budget_{unit}")
            if limit is not None:
                used = row.get(f"spent_{unit}", 0) + row.get(f"reserved_{unit}", 0)
                left[unit].append(limit - used)
    micros, tokens = (min(left[u]) if left[u] else None for u in ("micros", "tokens"))
    return micros, tokens


def _label(scope: str) -> str:
    if scope == GLOBAL:
        return "global daily"
    if scope.startswith(run_labels.SCOPE_PREFIX):
        return f"label {scope.removeprefix(run_labels.SCOPE_PREFIX)!r} daily"
    return f"workflow {scope!r} daily"


def _ensure_rows(scopes: list[str], day=None):
    """The ledger rows of these scopes for `day` (default today, UTC) exist afterwards."""
    day = day or timezone.now().date()
    BudgetLedger.objects.bulk_create(
        [BudgetLedger(scope=s, day=day) for s in scopes], ignore_conflicts=True
    )
    return day


def count_the_day(scope: str, day: date | None = None) -> None:
    """Make the ledger of `scope` for `day` (default today, UTC) count at least what the day's
    spend rows (SpendDay) hold for it: a daily budget counts the whole day's spend, whenever it
    was set. Called when a daily budget is set, last in that transaction (after the policy and
    the runs it resumes: docs/architecture.md, *lock order*).

    Ledgers are booked only for scopes that have a budget, so one set mid-day would otherwise
    count from its first use. Booking every scope always would instead put a lock on the global
    ledger (and every workflow's and label's) into every step of every run, budgeted or not;
    this costs one aggregate over the day's spend rows per budget change. The ledger is raised,
    never lowered: one kept since midnight already counts the day (and its holds' spend on the
    day they were reserved)."""
    day = day or timezone.now().date()
    rows = SpendDay.objects.filter(day=day)
    if scope.startswith(run_labels.SCOPE_PREFIX):
        rows = rows.filter(run_labels.carrying(scope.removeprefix(run_labels.SCOPE_PREFIX)))
    elif scope != GLOBAL:
        rows = rows.filter(workflow=scope)
    found = rows.aggregate(micros=Sum("micros"), tokens=Sum("tokens"))
    if not (found["micros"] or found["tokens"]):
        return  # nothing spent yet: the ledger's first reserve makes its row
    _ensure_rows([scope], day)
    ledger = BudgetLedger.objects.filter(scope=scope, day=day)
    # Each a conditional UPDATE: raised to the day's figure under the row lock, never lowered.
    for column, spent in (("spent_micros", found["micros"]), ("spent_tokens", found["tokens"])):
        if spent:
            ledger.filter(**{f"{column}__lt": spent}).update(**{column: spent})


def daily_limits(scopes: list[str]) -> dict[str, Any]:
    """Each scope's daily limits (a row of values per scope that has a policy)."""
    rows = Policy.objects.filter(scope__in=scopes).values(
        "scope", "daily_budget_micros", "daily_budget_tokens"
    )
    return {row["scope"]: row for row in rows}


def _update(
    scopes: list[str], day, sets: str, amount: Amount | Usage, returning: str
) -> list[tuple]:
    """One UPDATE of the day's ledger rows of `scopes`; `sets` names the amount's parts
    `%(micros)s` and `%(tokens)s`."""
    marks, params = in_list("scope", scopes)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {BudgetLedger._meta.db_table} SET {sets} "
            f"WHERE day = %(day)s AND scope IN ({marks}) RETURNING {returning}",
            params | {"day": day, "micros": amount.micros, "tokens": amount.tokens},
        )
        return cursor.fetchall()


def reserve_shared(scopes: list[str], estimate: Amount, held: Amount = NOTHING, day=None):
    """Hold a step's estimate against the shared budgets of `day`, or raise OverBudget.

    Inside the step-start transaction: the UPDATE row-locks each ledger row until commit, so
    two runs sharing a budget check and reserve one after the other, never both at once.
    `held` is what this step already holds from an attempt before a crash.
    """
    day = _ensure_rows(scopes, day)
    rows = _update(
        scopes, day,
        "reserved_micros = reserved_micros + %(micros)s, "
        "reserved_tokens = reserved_tokens + %(tokens)s",
        estimate,
        "scope, spent_micros, reserved_micros, spent_tokens, reserved_tokens",
    )  # fmt: skip
    limits = daily_limits(scopes)
    for scope, spent_m, reserved_m, spent_t, reserved_t in rows:
        policy = limits.get(scope, {})
        for unit, limit, spent, reserved, mine in (
            ("micro-USD", policy.get("daily_budget_micros"), spent_m, reserved_m,
             estimate.micros + held.micros),
            ("tokens", policy.get("daily_budget_tokens"), spent_t, reserved_t,
             estimate.tokens + held.tokens),
        ):  # fmt: skip
            others = spent + reserved - mine
            if limit is not None and (spent + reserved > limit or others >= limit):
                raise OverBudget(_label(scope), unit, limit, others, mine, scope)


_RELEASE = (
    "reserved_micros = CASE WHEN reserved_micros > %(micros)s"
    " THEN reserved_micros - %(micros)s ELSE 0 END, "
    "reserved_tokens = CASE WHEN reserved_tokens > %(tokens)s"
    " THEN reserved_tokens - %(tokens)s ELSE 0 END"
)


def release_shared(scopes: list[str], held: Amount, day) -> None:
    """Give back what a step held on `day` (the day it reserved) without spending it. The
    caller then resumes the runs that others' holds had paused (budget_room.resume_fitting)."""
    _update(scopes, day, _RELEASE, held, "scope")


def book_shared(
    spend_scopes: list[str],
    usage: Usage,
    held_scopes: list[str] | tuple[()] = (),
    held: Amount = NOTHING,
    day=None,
) -> list[str]:
    """Release a finished step's hold from the ledgers it was reserved against and book its
    spend on the day of that hold (today for a step that held nothing), so a day's spend is
    what that day's holds made room for. Returns the budgets now past the warning threshold
    for the first time that day."""
    day = day or timezone.now().date()
    if held and held_scopes:
        release_shared(list(held_scopes), held, day)
    if not spend_scopes or not (usage.micros or usage.tokens):
        return []
    _ensure_rows(spend_scopes, day)
    rows = _update(
        spend_scopes, day,
        "spent_micros = spent_micros + %(micros)s, spent_tokens = spent_tokens + %(tokens)s",
        usage, "scope, spent_micros, spent_tokens, warned",
    )  # fmt: skip
    limits = daily_limits(spend_scopes)
    warned = []
    threshold = Decimal(str(settings.STEPGUARD_BUDGET_WARN_AT))
    for scope, spent_m, spent_t, already in rows:
        policy = limits.get(scope, {})
        crossed = any(
            limit is not None and spent >= threshold * limit
            for limit, spent in (
                (policy.get("daily_budget_micros"), spent_m),
                (policy.get("daily_budget_tokens"), spent_t),
            )
        )
        if crossed and not already:
            BudgetLedger.objects.filter(scope=scope, day=day).update(warned=True)
            warned.append(_label(scope))
    return warned


def default_run_budget(workflow: str, micros: int | None = None, tokens: int | None = None):
    """A new run's own budget: as given, else its workflow's default, else the global one.
    Every way a run is created (start_run, children, the API) goes through this."""
    budget = {"budget_micros": micros, "budget_tokens": tokens}
    defaults = {p.scope: p for p in Policy.objects.filter(scope__in=[workflow, GLOBAL])}
    for scope in (workflow, GLOBAL):
        policy = defaults.get(scope)
        if policy is not None:
            for name in ("budget_micros", "budget_tokens"):
                if budget[name] is None:
                    budget[name] = getattr(policy, name.replace("budget", "run_budget"))
    return budget


def next_day_start():
    """When a paused run's shared daily budgets reset: the next UTC midnight."""
    from datetime import UTC, datetime, time, timedelta

    tomorrow = timezone.now().astimezone(UTC).date() + timedelta(days=1)
    return datetime.combine(tomorrow, time(0), tzinfo=UTC)


@dataclass(frozen=True)
class Reservation:
    """What a running step holds against budgets: its estimate, the shared budgets and the
    day it was reserved against. Released from exactly those when the step finishes."""

    reserved: Amount = NOTHING
    shared: list[str] = field(default_factory=list)
    day: date | None = None

    @classmethod
    def of(cls, record: Any) -> Reservation:
        """What a recorded step (a Step row found `started` after a crash) still holds."""
        if record is None or not (record.reserved_micros or record.reserved_tokens):
            return cls()
        reserved = Amount(record.reserved_micros, record.reserved_tokens)
        return cls(reserved, list(record.reserved_scopes or []), record.reserved_on)
