"""The queries the dashboard, the API and the live feed share: which runs a filter means, pages
of runs by keyset, and which steps a timeline filter shows.

One place, so that the runs list, a bulk action over a filter, `GET /api/runs` and the live
feed can never disagree about what a filter matches.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from datetime import date, datetime
from decimal import Decimal
from uuid import UUID

from django.core.exceptions import EmptyResultSet
from django.db import connection, connections
from django.db.models import F, Q, QuerySet, Sum
from django.db.models.fields.json import KeyTextTransform

from runs import labels as run_labels
from runs.engine.budget import to_usd
from runs.errors import OperationError, StepguardError
from runs.models import Run, RunStatus, SpendDay, StepKind, StepStatus
from runs.operations.common import in_utc


class BadFilter(OperationError):
    """A filter value that means nothing (the message names the parameter)."""


#: The runs list's filters, as URL parameters (the API names `since`/`until` differently).
RUN_FILTERS = (
    "status", "workflow", "version", "parent", "since", "until", "q", "top", "label", "annotation",
)  # fmt: skip


def _when(value: datetime | str, name: str) -> datetime:
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else value
        return in_utc(when, name)
    except StepguardError as exc:  # out of range
        raise BadFilter(str(exc)) from None
    except ValueError:
        raise BadFilter(f"{name} {value!r} is not a date and time") from None


#: The engine's own workflows (notification deliveries: registry.builtin).
ENGINE_PREFIX = "stepguard."


def runs_matching(filters: Mapping[str, object]) -> QuerySet:
    """Runs matching the filters given (empty values ignored): status, workflow, version,
    parent (a run id), since and until (created at or after, before), label (`tenant=acme`,
    several separated by commas: runs carrying all of them), annotation (good, bad, note or
    any: runs someone marked so), and q (a whole run id, a whole
    key, or part of a key).

    The engine's own runs (notification deliveries) are left out unless asked for (`engine`,
    a `stepguard.*` workflow, or an id or key searched for): one dead webhook filled the
    waiting list and most of the failed one with its retries."""
    f = {k: v.strip() if isinstance(v, str) else v for k, v in filters.items() if v}
    runs = Run.objects.all()
    asked = f.get("engine") in ("1", True) or "q" in f
    if not (asked or str(f.get("workflow", "")).startswith(ENGINE_PREFIX)):
        runs = runs.exclude(workflow__startswith=ENGINE_PREFIX)
    for field in ("status", "workflow", "version"):
        if field in f:
            runs = runs.filter(**{field: f[field]})
    if "parent" in f:
        try:
            runs = runs.filter(parent_id=UUID(str(f["parent"])))
        except ValueError:
            raise BadFilter(f"parent {f['parent']!r} is not a run id") from None
    for name, lookup in (("since", "created_at__gte"), ("until", "created_at__lt")):
        if name in f:
            runs = runs.filter(**{lookup: _when(f[name], name)})
    if "label" in f:
        try:
            wanted = run_labels.parse(str(f["label"]))
        except run_labels.BadLabel as exc:
            raise BadFilter(f"label: {exc}") from None
        for name, value in wanted.items():
            runs = runs.filter(run_labels.matching(name, value))
    if f.get("top") in ("1", True):
        runs = runs.filter(parent__isnull=True)
    if "annotation" in f:  # good, bad, note or any (runs/annotations.py)
        from runs import annotations  # it imports the operations, as this module does

        try:
            runs = annotations.runs_annotated(runs, str(f["annotation"]))
        except annotations.BadAnnotation as exc:
            raise BadFilter(str(exc)) from None
    if "q" in f:
        q = str(f["q"])
        try:  # a whole run id is looked up by index, not by scanning every key
            runs = runs.filter(Q(pk=UUID(q)) | Q(key=q))
        except ValueError:
            runs = runs.filter(id_prefix(q) | Q(key__icontains=q))
    return runs


def id_prefix(q: str) -> Q:
    """Runs whose id starts with `q` (the 8 characters the pages show): a range of the primary
    key, so found by index. Nothing if `q` is not the start of an id."""
    digits = q.lower().replace("-", "")
    if not 4 <= len(digits) < 32 or any(c not in "0123456789abcdef" for c in digits):
        return Q(pk__in=[])
    low, high = UUID(digits.ljust(32, "0")), UUID(digits.ljust(32, "f"))
    return Q(pk__gte=low, pk__lte=high)


#: Up to this many runs of a status are counted; above it, PostgreSQL's estimate is shown. At a
#: million runs a count by status read the whole table on every list (122 ms, growing with it);
#: counted up to 10,000, the eight statuses still read 100,000 index entries per list. A bulk
#: action takes at most 1,000 runs, so past this bound "more" is all it needs to know.
EXACT_UP_TO = 1_000


def run_id_from(text: str) -> UUID | None:
    """The run a whole id or the start of one (the 8 characters pages show) names; None if no
    run's id starts so. BadFilter when several do."""
    try:
        return UUID(text)
    except ValueError:
        pass
    found = list(Run.objects.filter(id_prefix(text)).values_list("pk", flat=True)[:2])
    if len(found) > 1:
        raise BadFilter(f"more than one run's id starts with {text!r}: give more of it")
    return found[0] if found else None


def filtered_runs(params) -> tuple[QuerySet, dict]:
    """Runs matching the list's URL filters (the same for the page and for bulk actions;
    the engine's own runs only if asked for: `runs_matching`)."""
    chosen = {k: str(params.get(k) or "").strip() for k in RUN_FILTERS}
    chosen["engine"] = "1" if str(params.get("engine") or "").strip() == "1" else ""
    matching = dict(chosen)
    if chosen["parent"]:  # the short id the pages show is taken
        parent = run_id_from(chosen["parent"])
        if parent is None:
            raise BadFilter(f"parent: no run's id starts with {chosen['parent']!r}")
        matching["parent"] = str(parent)
    return runs_matching(matching), chosen


def capped_counts(runs: QuerySet, statuses, cap: int) -> dict[str, int]:
    """How many of `runs` have each of `statuses`, each counted no further than cap + 1 (one
    statement: a LIMIT per status, each an index range): above `cap` means "more"."""
    parts, params = [], []
    for i, status in enumerate(statuses):
        sql, p = (
            runs.filter(status=status)
            .order_by()
            .values("status")[: cap + 1]
            .query.sql_with_params()
        )
        parts.append(f"SELECT * FROM ({sql}) AS s{i}")
        params.extend(p)
    counts = dict.fromkeys(statuses, 0)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT status, COUNT(*) FROM ({' UNION ALL '.join(parts)}) AS u GROUP BY status",
            params,
        )
        counts.update(cursor.fetchall())
    return counts


def count_up_to(runs: QuerySet, cap: int) -> int:
    """How many of `runs` there are, counted no further than cap + 1: above `cap` means
    "more", and no count reads past that many rows."""
    return runs.order_by().values("pk")[: cap + 1].count()


def status_counts(runs: QuerySet, *, probe: bool = False) -> dict[str, tuple[int, bool]]:
    """How many of `runs` have each status, and whether that is exact: counted up to
    EXACT_UP_TO through the status index, estimated above it from the planner's statistics
    (PostgreSQL; SQLite, the embedded engine, counts them all). With `probe` (a search:
    `probed`), the matches are first counted whole, unordered, through the search's own
    indexes, if they are at most PROBE_UP_TO: eight status ranges ANDed with a search's
    trigrams read every index entry of each status (808,329 at 5M runs)."""
    if probe and connections[runs.db].vendor == "postgresql":
        found = _few_per_status(runs)
        if found is not None:
            return {status: (found.get(status, 0), True) for status in RunStatus.values}
    counts = {}
    for status, n in capped_counts(runs, RunStatus.values, EXACT_UP_TO).items():
        if n <= EXACT_UP_TO:
            counts[status] = (n, True)
            continue
        of_status = runs.filter(status=status).order_by()
        if connection.vendor == "postgresql":
            plan = json.loads(of_status.values("pk").explain(format="json"))
            counts[status] = (max(int(plan[0]["Plan"]["Plan Rows"]), n), False)
        else:
            counts[status] = (of_status.count(), True)
    return counts


def _few_per_status(runs: QuerySet) -> dict[str, int] | None:
    """`runs` counted per status if they are at most PROBE_UP_TO (one statement), else None."""
    gathered = runs.order_by().values("status")[: PROBE_UP_TO + 1]
    try:
        sql, params = gathered.query.get_compiler(runs.db).as_sql()
    except EmptyResultSet:
        return {}
    with connections[runs.db].cursor() as cursor:
        cursor.execute(
            f"WITH m (status) AS MATERIALIZED ({sql}) SELECT status, COUNT(*) FROM m"
            " GROUP BY status",
            params,
        )
        found = dict(cursor.fetchall())
    return None if sum(found.values()) > PROBE_UP_TO else found


def about(n: int) -> int:
    """An estimate said to three significant figures: 412,345 reads 412,000."""
    digits = len(str(n))
    return round(n, -(digits - 3)) if digits > 3 else n


def newest_first(runs: QuerySet) -> QuerySet:
    return runs.order_by("-created_at", "-pk")


def marker(run: Run) -> str:
    """Where the next page of `newest_first` starts: after this run."""
    return base64.urlsafe_b64encode(f"{run.created_at.isoformat()}|{run.pk}".encode()).decode()


def after_marker(runs: QuerySet, value: str) -> QuerySet:
    """The runs of `newest_first(runs)` after `marker(run)`."""
    try:
        when, pk = base64.urlsafe_b64decode(value.encode()).decode().split("|")
        when, pk = _when(when, "cursor"), UUID(pk)
    except (ValueError, UnicodeDecodeError, BadFilter):
        raise BadFilter(f"cursor {value!r} is not a page marker this server made") from None
    # The redundant `<=` lets the database start its index scan at the marker.
    return runs.filter(created_at__lte=when).filter(
        Q(created_at__lt=when) | Q(created_at=when, pk__lt=pk)
    )


#: The most matches `page` gathers unordered before it orders them itself (`probe`).
PROBE_UP_TO = 20_000


def probed(filters: Mapping[str, object]) -> bool:
    """Whether the runs `filters` mean are better found unordered first (`page`'s `probe`):
    a search matches runs that no index keeps in created-at order, and few of them. (A
    label's runs may be many: the indexed ones are ordered ranges, labels.INDEXED; gathering
    the 25,000 runs of a tenant at 5M runs first doubled its page's time.)"""
    return bool(filters.get("q"))


def page(
    runs: QuerySet, size: int, after: str | None = None, *, probe: bool = False
) -> tuple[list[Run], str | None]:
    """One page of `newest_first(runs)`, and the marker of the next (None on the last).

    With `probe` (PostgreSQL), the matches are first gathered through the filter's own
    indexes, unordered and up to PROBE_UP_TO, and the page is the newest of them: the
    planner otherwise may walk the newest-first index, filtering, on the assumption that
    matches are spread evenly over time, and matches that are all old are reached past every
    newer run (125,823 rows for 51 at a million runs, 1.07 s). Past that many matches, they
    are many enough for the walk to meet them soon."""
    runs = newest_first(runs)
    if after:
        runs = after_marker(runs, after)
    postgres = connections[runs.db].vendor == "postgresql"
    found = _newest_of_few(runs, size + 1) if probe and postgres else None
    if found is None:
        rows = list(runs[: size + 1])
    else:
        by_id = {run.pk: run for run in runs.filter(pk__in=found)}
        rows = [by_id[pk] for pk in found if pk in by_id]
    more = len(rows) > size
    rows = rows[:size]
    return rows, marker(rows[-1]) if more and rows else None


def _newest_of_few(runs: QuerySet, n: int) -> list[UUID] | None:
    """The ids of the `n` newest of `runs` if they match at most PROBE_UP_TO (one statement:
    the matches gathered unordered, fenced off from the ordering by MATERIALIZED), else
    None. Read where `runs` reads (a replica's pages from the replica)."""
    gathered = runs.order_by().values("pk", "created_at")[: PROBE_UP_TO + 1]
    try:
        sql, params = gathered.query.get_compiler(runs.db).as_sql()
    except EmptyResultSet:  # a filter that can match nothing (Run.objects.none())
        return []
    with connections[runs.db].cursor() as cursor:
        cursor.execute(
            f"WITH m (id, created_at) AS MATERIALIZED ({sql}) SELECT (SELECT COUNT(*) FROM m),"
            " ARRAY(SELECT id FROM m ORDER BY created_at DESC, id DESC LIMIT %s)",
            (*params, n),
        )
        matched, ids = cursor.fetchone()
    return None if matched > PROBE_UP_TO else [UUID(str(i)) for i in ids]


def step_filter(params: Mapping[str, str]) -> tuple[dict, Q]:
    """The timeline's status and kind filter (unknown values ignored). Failed steps match
    whatever it says: a filter must never hide a failure."""
    chosen = {k: (params.get(k) or "").strip() for k in ("status", "kind")}
    if chosen["status"] not in StepStatus.values:
        chosen["status"] = ""
    if chosen["kind"] not in StepKind.values:
        chosen["kind"] = ""
    match = Q(**{k: v for k, v in chosen.items() if v})
    return chosen, (match | Q(status=StepStatus.FAILED)) if match else Q()


def step_matches(step, chosen: dict) -> bool:
    """`step_filter` for a step already in hand (the live feed's new rows)."""
    wanted = all(getattr(step, k) == v for k, v in chosen.items() if v)
    return wanted or step.status == StepStatus.FAILED


def usage(run: Run) -> dict:
    """A run's model spend per model and per kind of token, from its steps' recorded usage."""
    models: dict[str, dict] = {}
    unpriced: set[str] = set()
    rows = run.steps.filter(usage__isnull=False).values_list(
        "usage", "tokens_in", "tokens_out", "cost_micros"
    )
    for breakdown, tokens_in, tokens_out, micros in rows.iterator(chunk_size=500):
        name = breakdown.get("model") or "?"
        if not breakdown.get("priced", True):
            unpriced.add(name)
        entry = models.setdefault(
            name, {"calls": 0, "tokens_in": 0, "tokens_out": 0, "micros": 0, "kinds": {}}
        )
        entry["calls"] += 1
        entry["tokens_in"] += tokens_in
        entry["tokens_out"] += tokens_out
        entry["micros"] += micros
        for kind, spent in (breakdown.get("kinds") or {}).items():
            total = entry["kinds"].setdefault(kind, {"tokens": 0, "usd": Decimal(0)})
            total["tokens"] += spent["tokens"]
            total["usd"] += Decimal(spent["usd"])
    for entry in models.values():
        entry["usd"] = to_usd(entry.pop("micros"))
    spend = {
        "tokens_in": run.tokens_in,
        "tokens_out": run.tokens_out,
        "usd": to_usd(run.cost_micros),
    }
    # Model calls cut off in flight (a crash) and sent again: maybe paid, never recorded.
    possibly = {
        "tokens": run.possibly_spent_tokens,
        "usd": to_usd(run.possibly_spent_micros),
        "steps": list(
            run.steps.filter(Q(possibly_spent_micros__gt=0) | Q(possibly_spent_tokens__gt=0))
            .order_by("seq")
            .values_list("key", flat=True)
        ),
    }
    return {
        "spend": spend,
        "possibly_spent": possibly,
        "models": models,
        "unpriced": sorted(unpriced),
    }


#: The longest span `spend_by_label` sums in one answer.
SPEND_DAYS_MAX = 366


def spend_by_label(name: str, since: date, until: date) -> list[dict]:
    """What runs spent per value of label `name`, per UTC day from `since` to `until`
    (inclusive), from the days' spend rows (SpendDay): priced as recorded, with the estimates
    of model calls a crash cut off (possibly spent) apart. Runs without the label are the
    value None: the rows of a day add up to everything spent that day."""
    run_labels.pair(f"{name}=x")  # the name is a label name, or BadLabel says why not
    if until < since:
        raise BadFilter(f"until ({until}) is before since ({since})")
    if (until - since).days >= SPEND_DAYS_MAX:
        raise BadFilter(f"a spend query covers at most {SPEND_DAYS_MAX} days")
    rows = (
        SpendDay.objects.filter(day__gte=since, day__lte=until)
        .annotate(value=KeyTextTransform(name, "labels"))
        .values("day", "value")
        .annotate(
            micros=Sum("micros"),
            tokens=Sum("tokens"),
            possibly=Sum("possibly_micros"),
            runs=Sum("runs"),
        )
        .order_by("day", F("value").asc(nulls_first=True))  # runs without it first
    )
    return [
        {
            "day": row["day"],
            "value": row["value"],
            "usd": to_usd(row["micros"] or 0),
            "tokens": row["tokens"] or 0,
            "possibly_spent_usd": to_usd(row["possibly"] or 0),
            "runs": row["runs"],
        }
        for row in rows
    ]


#: Each next name from the index that leads with the workflow (runs_run_wf_status_created_idx):
#: one probe per name, where DISTINCT reads every run.
_WORKFLOW_NAMES = f"""
    WITH RECURSIVE names(name) AS (
        SELECT min(workflow) FROM "{Run._meta.db_table}"
        UNION ALL
        SELECT (SELECT min(workflow) FROM "{Run._meta.db_table}" WHERE workflow > names.name)
        FROM names WHERE names.name IS NOT NULL
    )
    SELECT name FROM names WHERE name IS NOT NULL
"""


def workflow_names() -> list[str]:
    """Every workflow that has runs, sorted: what the halts and budgets pages list. A million
    runs hold a few dozen names; on PostgreSQL they cost a few dozen index probes."""
    if connection.vendor != "postgresql":
        return sorted(Run.objects.order_by().values_list("workflow", flat=True).distinct())
    with connection.cursor() as cursor:
        cursor.execute(_WORKFLOW_NAMES)
        return [name for (name,) in cursor.fetchall()]
