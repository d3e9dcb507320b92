"""The release check: would the code this process imports take over the runs in flight?

The stored histories of live runs (and of runs finished recently: they show the whole path a
live run has still to walk) are replayed dry (runs/engine/dry.py) against the workflow code
registered here under each run's name and version, and reported per workflow and version:
runs checked, runs that would diverge, and for the first divergent one where and how, with the
fix to consider. Nothing is written, and no step function or model call runs: outputs come from
the history. `manage.py replaycheck`, POST /api/replaycheck and the versions page share it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Q
from django.db.models.base import ModelState
from django.utils import timezone

from runs.engine import registry
from runs.engine.dry import RUN_FIELDS, STEP_FIELDS, Verdict, replay
from runs.errors import InvalidInput, UnknownWorkflow
from runs.models import TERMINAL_STATUSES, Run, Step
from runs.operations import in_utc

#: Who may run the check from the API or the dashboard: it replays up to thousands of histories
#: on the web process, a cost the operators (who deploy) may impose, a viewer not.
CHECK_PERMISSION = "runs.set_flow"
#: Finished runs checked by default: those that ended in the last day.
DEFAULT_WINDOW = timedelta(hours=24)
#: Live divergent runs listed by id per version (the count is always whole).
STAY_LISTED = 100
#: Runs whose steps are read in one query (and replayed in one read-only transaction).
BATCH = 500


@dataclass
class Group:
    """One workflow version's runs: how many were checked and what the check found."""

    workflow: str
    version: str
    served: bool  # this process has code registered for it
    checked: int = 0
    live: int = 0
    compatible: int = 0
    diverging: int = 0
    diverging_live: int = 0
    first: dict[str, Any] | None = None  # the first divergent run: where, what, the fix
    #: Live runs this code must not take over (the first STAY_LISTED): old workers keep them.
    stay: list[str] = field(default_factory=list)

    def add(self, run: Run, verdict: Verdict) -> None:
        self.checked += 1
        live = run.status not in TERMINAL_STATUSES
        self.live += live
        if verdict.compatible:
            self.compatible += 1
            return
        self.diverging += 1
        self.diverging_live += live
        if live and len(self.stay) < STAY_LISTED:
            self.stay.append(str(run.id))
        if self.first is None:
            self.first = {
                "run": str(run.id),
                "status": run.status,
                "outcome": verdict.outcome,
                "seq": verdict.seq,
                "recorded": verdict.recorded_key or None,
                "requested": verdict.requested_key or None,
                "error": verdict.error or None,
                "says": says(verdict),
                "fix": fix(self.workflow, self.version, verdict),
            }

    def as_json(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "version": self.version,
            "served": self.served,
            "checked": self.checked,
            "live": self.live,
            "compatible": self.compatible,
            "diverging": self.diverging,
            "diverging_live": self.diverging_live,
            "first_divergence": self.first,
            "must_stay_on_old_workers": self.stay,
        }


@dataclass
class Report:
    groups: list[Group] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def checked(self) -> int:
        return sum(g.checked for g in self.groups)

    @property
    def diverging(self) -> int:
        return sum(g.diverging for g in self.groups)

    @property
    def ok(self) -> bool:
        """No run would diverge: what CI gates on (a version with no code here is reported,
        but its runs stay on the workers that have it; see `lines`)."""
        return self.diverging == 0

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "diverging": self.diverging,
            "seconds": round(self.seconds, 3),
            "versions": [g.as_json() for g in self.groups],
        }

    def lines(self) -> list[str]:
        """The report as text, one block per workflow version."""
        out = []
        for g in self.groups:
            ref = f"{g.workflow}@{g.version}"
            if not g.served:
                out.append(
                    f"{ref}: no code for this version here: its {g.live} live run(s) must stay "
                    "on workers that have it until they drain (not checked)"
                )
                continue
            verdict = "ok" if not g.diverging else "DIVERGES"
            out.append(
                f"{ref}: {verdict}: {g.checked} checked ({g.live} live), {g.compatible} "
                f"compatible, {g.diverging} would diverge ({g.diverging_live} live)"
            )
            if g.first is not None:
                first = g.first
                out.append(f"  first: run {first['run']} ({first['status']}): {first['says']}")
                out.append(f"  fix: {g.first['fix']}")
        out.append(
            f"{self.checked} run(s) checked in {self.seconds:.2f} s: "
            + ("no divergence" if self.ok else f"{self.diverging} would diverge")
        )
        return out


def says(v: Verdict) -> str:
    """A divergence in one line: `history has 'charge' at 4, code asks for 'reserve'`."""
    if v.outcome == "diverges":
        if v.requested_key == "(the workflow returned)":
            return f"history has {v.recorded_key!r} at {v.seq}, code returns before it"
        return f"history has {v.recorded_key!r} at {v.seq}, code asks for {v.requested_key!r}"
    return f"code raises {v.error} replaying the history (after position {v.seq})"


def fix(workflow: str, version: str, v: Verdict) -> str:
    """What to consider: guard the change with ctx.patched, or ship it as a new version."""
    new_version = f'@workflow("{workflow}", version="<next>")'
    if v.outcome == "diverges":
        return (
            f'wrap the change in `if ctx.patched("<change-id>"): <new> else: <old>` so runs '
            f"that recorded {v.recorded_key!r} keep the old path, or register the new code as "
            f"{new_version} and keep a worker with {workflow}@{version} until its runs drain"
        )
    return (
        "make the new code accept what the old one recorded (its outputs, its failures), or "
        f"register it as {new_version} and keep a worker with {workflow}@{version} until its "
        "runs drain"
    )


def select(
    *, workflow: str | None = None, runs: int | None = None, since: datetime | None = None
) -> list[Run]:
    """The runs to check, oldest first: live ones and those finished since `since` (a day by
    default), or the `runs` most recent, live or not."""
    if runs is not None and since is not None:
        raise InvalidInput("give --runs or --since, not both")
    if runs is not None and runs < 1:
        raise InvalidInput(f"--runs must be a positive number, not {runs}")
    found = Run.objects.only(*RUN_FIELDS)
    if workflow:
        found = found.filter(workflow=workflow)
    if runs is not None:
        return list(found.order_by("-created_at", "-id")[:runs])[::-1]
    since = in_utc(since, "since") if since else timezone.now() - DEFAULT_WINDOW
    live = ~Q(status__in=TERMINAL_STATUSES)
    return list(found.filter(live | Q(finished_at__gte=since)).order_by("created_at", "id"))


def check(
    *, workflow: str | None = None, runs: int | None = None, since: datetime | None = None
) -> Report:
    """Replay the selected runs dry, per workflow version. Two queries per BATCH runs (their
    runs and their steps), each batch in a read-only transaction."""
    if workflow:
        try:
            registry.get(workflow)
        except UnknownWorkflow as exc:
            raise InvalidInput(f"{exc}: import its module (--import) to check it") from None
    started = time.perf_counter()
    chosen = select(workflow=workflow, runs=runs, since=since)
    groups: dict[tuple[str, str], Group] = {}
    for start in range(0, len(chosen), BATCH):
        batch = chosen[start : start + BATCH]
        with read_only():
            histories = _histories([r.id for r in batch])
            for run in batch:
                group = groups.get((run.workflow, run.version))
                if group is None:
                    served = _code_of(run.workflow, run.version) is not None
                    group = groups[(run.workflow, run.version)] = Group(
                        run.workflow, run.version, served
                    )
                fn = _code_of(run.workflow, run.version)
                if fn is None:
                    group.live += run.status not in TERMINAL_STATUSES
                    continue
                group.add(run, replay(run, histories.get(run.id, {}), fn))
    ordered = [groups[k] for k in sorted(groups)]
    return Report(ordered, time.perf_counter() - started)


def _code_of(workflow: str, version: str):
    try:
        return registry.get(workflow, version).fn
    except UnknownWorkflow:
        return None


def _histories(run_ids: list) -> dict[Any, dict[int, Step]]:
    """The steps of these runs by run and seq, in one query. Rows are made Steps without
    Model.__init__ (half the time of reading them): the fields read are set, the others are
    deferred, loaded by themselves if anything reads one."""
    found: dict[Any, dict[int, Step]] = {}
    names = [Step._meta.get_field(f).attname for f in STEP_FIELDS]
    for row in Step.objects.filter(run_id__in=run_ids).values_list(*names):
        step = Step.__new__(Step)
        step.__dict__.update(zip(names, row, strict=True))
        step._state = ModelState()
        step._state.adding, step._state.db = False, connection.alias
        found.setdefault(step.run_id, {})[step.seq] = step
    return found


@contextmanager
def read_only() -> Iterator[None]:
    """A transaction the database itself keeps from writing (PostgreSQL's READ ONLY, SQLite's
    query_only), rolled back at the end: the refusing checkpoints say nothing is written, this
    makes sure. (An async workflow's checkpoints run on threads of their own connections;
    there the refusing checkpoints alone hold.)"""
    vendor = connection.vendor
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                if vendor == "postgresql":
                    cursor.execute("SET TRANSACTION READ ONLY")
                elif vendor == "sqlite":  # after BEGIN IMMEDIATE, which it would refuse
                    cursor.execute("PRAGMA query_only = ON")
            yield
            transaction.set_rollback(True)
    finally:
        if vendor == "sqlite":  # a setting of the connection: off after the block, however it ended
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA query_only = OFF")
