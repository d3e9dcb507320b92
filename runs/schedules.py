"""Cron schedules: each tick of a schedule starts exactly one run, however many workers are up.

A tick's run is keyed `schedule:<name>:<tick>`, so the run table's unique key makes a second
start of the same tick return the first run; the schedule row is locked while its due ticks
are fired (SKIP LOCKED: a worker never waits for another's firing). Cron expressions are
parsed and iterated by cronsim (5 fields, or 6 with seconds first), in the schedule's time
zone, so a daily 09:00 schedule follows daylight saving time.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from cronsim import CronSim
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from runs.cron import NAME, ScheduleError, check_cron, check_name, zone
from runs.engine import registry
from runs.engine.chores import Chore
from runs.engine.serialization import to_json
from runs.engine.starts import start_run
from runs.errors import StepguardError, UnknownWorkflow
from runs.models import (
    MAX_BUFFERED_TICKS,
    TERMINAL_STATUSES,
    Catchup,
    Overlap,
    Run,
    Schedule,
    Shaped,
)

__all__ = [
    "NAME",
    "ScheduleError",
    "check_cron",
    "check_name",
    "chore",
    "fire_due",
    "next_due",
    "next_tick",
    "save",
    "set_paused",
    "sync_code_schedules",
    "zone",
]

log = logging.getLogger("stepguard.schedules")

#: How many due schedules one firing takes at a time; the rest wait for the next tick.
BATCH = 50
#: How often at most a worker fires due schedules (between its claims; every poll interval if
#: that is shorter).
FIRE_SECONDS = 0.5


def next_tick(cron: str, tz: str, after: datetime) -> datetime:
    """The first tick strictly after `after`, in UTC. In the hour a clock turns back, a local
    time comes twice and cronsim gives its first instance, which may be past: walk on."""
    ticks = CronSim(cron, after.astimezone(zone(tz)))
    for _ in range(3):
        tick = next(ticks).astimezone(UTC)
        if tick > after:
            return tick
    return tick


def ticks_to_fire(schedule: Schedule, now: datetime) -> list[datetime]:
    """The due ticks (from `next_fire_at` up to `now`) that its catch-up policy fires, oldest
    first. A tick is late once it is more than STEPGUARD_SCHEDULE_GRACE_SECONDS old: `skip`
    fires no late tick, `last` only the newest late one, `all` the newest `catchup_limit`
    of them; ticks within the grace period (the schedule's `catchup_window`, if set) always
    fire. Walks back from now, so a long outage costs no more than the ticks it fires."""
    assert schedule.next_fire_at is not None
    window = schedule.catchup_window or settings.STEPGUARD_SCHEDULE_GRACE_SECONDS
    grace = now - timedelta(seconds=window)
    back = CronSim(
        schedule.cron,
        (now + timedelta(microseconds=1)).astimezone(zone(schedule.timezone)),
        reverse=True,
    )
    found: list[datetime] = []
    late = 0
    for local in back:
        tick = local.astimezone(UTC)
        if tick < schedule.next_fire_at:
            break
        if tick < grace:  # late
            if schedule.catchup == Catchup.LAST:
                found.append(tick)
                break
            if schedule.catchup == Catchup.SKIP:
                break
            late += 1
            if late > schedule.catchup_limit:
                break
        found.append(tick)
    return found[::-1]


def run_key(schedule: Schedule, tick: datetime) -> str:
    return f"schedule:{schedule.name}:{tick.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}"


def fire_due(workflows: set[str], now: datetime | None = None) -> int:
    """Start the runs of every due tick of the schedules of `workflows` (those this process
    can start), and of ticks buffered behind a run that has ended since, per each schedule's
    overlap policy; returns how many runs it started. One transaction: the ticks' runs and the
    schedule's next fire time commit together, so a worker killed mid-way fires nothing
    twice and loses no tick (the next firing finds the same ticks due)."""
    now = now or timezone.now()
    started = 0
    with transaction.atomic():
        due = (
            Schedule.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(_author_active(), paused=False, workflow__in=workflows)
            .filter(Q(next_fire_at__lte=now) | ~Q(buffered=[]))
            .order_by("next_fire_at")[:BATCH]
        )
        for schedule in due:
            is_due = schedule.next_fire_at <= now
            ticks = ticks_to_fire(schedule, now) if is_due else []
            before = schedule.last_run_id
            try:
                with transaction.atomic():  # a savepoint: one schedule's failure is its own
                    started += _start_ticks(schedule, ticks)
            except (StepguardError, ValueError) as exc:  # ValueError: a foreign run's key
                # A tick whose run cannot be started (its input no longer fits the workflow)
                # is missed, said in the log; it must not stop the other schedules or claims.
                log.error("schedule %s: no run for its ticks up to %s: %s",
                          schedule.name, now.isoformat(), exc)  # fmt: skip
                ticks, schedule.buffered = [], []  # a buffered tick that cannot start is missed
                schedule.last_run_id = before
            fields = ["last_run_id", "buffered", "updated_at"]
            if is_due:
                if not ticks or ticks[0] != schedule.next_fire_at:
                    missed = schedule.next_fire_at.isoformat()
                    log.info("schedule %s: ticks from %s missed", schedule.name, missed)
                schedule.last_fired_at = ticks[-1] if ticks else schedule.last_fired_at
                schedule.next_fire_at = next_tick(schedule.cron, schedule.timezone, now)
                fields += ["last_fired_at", "next_fire_at"]
            schedule.save(update_fields=fields)
    return started


def _start_ticks(schedule: Schedule, ticks: list[datetime]) -> int:
    """Start the runs of the schedule's buffered ticks, then of `ticks`, as its overlap policy
    says while its last run is open: `skip` drops a tick, `buffer_one` keeps one (the first)
    to start when the run ends, `buffer_all` keeps them all (up to MAX_BUFFERED_TICKS) to
    start one after another, `allow_all` starts every tick at once. Returns the runs started."""
    policy = schedule.overlap
    waiting = [datetime.fromisoformat(tick) for tick in schedule.buffered]
    open_run = schedule.last_run_id is not None and (
        Run.objects.filter(pk=schedule.last_run_id).exclude(status__in=TERMINAL_STATUSES).exists()
    )
    room = {Overlap.BUFFER_ONE: 1, Overlap.BUFFER_ALL: MAX_BUFFERED_TICKS}.get(policy, 0)
    started, buffered = 0, []
    for tick in [*waiting, *ticks]:
        if policy == Overlap.ALLOW_ALL or not open_run:
            run = start_run(
                schedule.workflow,
                schedule.input,
                key=run_key(schedule, tick),
                started_by=schedule.created_by,
                shapers=[(user, Shaped.SCHEDULED) for user in schedule.shaped_by],
                created={"schedule": schedule.name, "tick": tick.isoformat()},
                engine=True,  # its key is a `schedule:` one; its workflow may be the engine's
            )
            started += int(run.was_created)
            schedule.last_run_id, open_run = run.pk, not run.is_terminal
        elif len(buffered) < room:
            buffered.append(tick)
        else:
            log.info("schedule %s: tick %s skipped, its last run is still open",
                     schedule.name, tick.isoformat())  # fmt: skip
    schedule.buffered = [tick.isoformat() for tick in buffered]
    return started


def _author_active() -> Q:
    """A schedule fires in its author's name: not once they are deactivated or deleted (a
    schedule declared in code has no author)."""
    return Q(created_by__is_active=True) | Q(created_by__isnull=True, shaped_by=[])


def next_due(workflows: set[str]) -> datetime | None:
    """When the next schedule of `workflows` fires (a worker sleeps no longer than that)."""
    return (
        Schedule.objects.filter(_author_active(), paused=False, workflow__in=workflows)
        .order_by("next_fire_at")
        .values_list("next_fire_at", flat=True)
        .first()
    )


def chore() -> Chore:
    """Firing schedules, by every worker between its claims: the code's schedules stored at
    start, then due ticks fired at most every FIRE_SECONDS; an idle worker wakes for the next
    tick of the schedules of its workflows."""
    return Chore(
        "firing schedules",
        FIRE_SECONDS,
        lambda context: fire_due(set(context.workflows)),
        between_claims=True,
        next_due=lambda context: next_due(set(context.workflows)),
        start=lambda context: sync_code_schedules(),
    )


def save(
    name: str,
    *,
    workflow: str,
    cron: str,
    timezone_name: str = "UTC",
    input: Any = None,
    catchup: str = Catchup.SKIP,
    catchup_limit: int = 10,
    catchup_window: int | None = None,
    overlap: str = Overlap.SKIP,
    paused: bool = False,
    source: str = "api",
    created_by=None,
    shaped_by: list[int] | None = None,
) -> Schedule:
    """Create or replace schedule `name`; its next tick is computed from now."""
    check_name(name)
    registry.load_configured()
    if registry.builtin(workflow):
        raise ScheduleError(f"workflow {workflow!r} is Stepguard's own: it is not scheduled")
    try:
        definition = registry.get(workflow)
    except UnknownWorkflow as exc:
        raise ScheduleError(str(exc)) from None
    cron = check_cron(cron)
    zone(timezone_name)
    if catchup not in Catchup.values:
        raise ScheduleError(f"catch-up must be one of {', '.join(Catchup.values)}, not {catchup!r}")
    if not 1 <= catchup_limit <= 1000:
        raise ScheduleError("catchup_limit must be between 1 and 1000")
    if overlap not in Overlap.values:
        raise ScheduleError(f"overlap must be one of {', '.join(Overlap.values)}, not {overlap!r}")
    if catchup_window is not None and not 1 <= catchup_window <= 366 * 86400:
        raise ScheduleError("catchup_window must be between 1 second and 366 days")
    data = to_json(input, what=f"the input of schedule {name!r}")
    definition.key_for(data)  # its runs must be startable: a key function that fails is said now
    definition.key_for(data, "debounce")
    now = timezone.now()
    schedule, _ = Schedule.objects.update_or_create(
        name=name,
        defaults={
            "workflow": workflow, "cron": cron, "timezone": timezone_name, "input": data,
            "catchup": catchup, "catchup_limit": catchup_limit, "paused": paused,
            "catchup_window": catchup_window, "overlap": overlap,
            "source": source, "next_fire_at": next_tick(cron, timezone_name, now),
            "created_by": created_by, "shaped_by": shaped_by or [],
        },
    )  # fmt: skip
    return schedule


def set_paused(name: str, paused: bool, by=None) -> Schedule:
    """Pause or resume; a resumed schedule fires from its next tick on, not the paused ones.
    Whoever resumes it (`by`) shapes what its runs do from then on (the four-eyes rule)."""
    with transaction.atomic():
        schedule = Schedule.objects.select_for_update().get(name=name)
        schedule.paused = paused
        if not paused:
            schedule.next_fire_at = next_tick(schedule.cron, schedule.timezone, timezone.now())
            if by is not None and by.pk not in schedule.shaped_by:
                schedule.shaped_by = [*schedule.shaped_by, by.pk]
        schedule.save(update_fields=["paused", "next_fire_at", "shaped_by", "updated_at"])
    return schedule


def sync_code_schedules() -> None:
    """Store the schedules declared in code (`@workflow(schedule=...)`), named after their
    workflow. A changed expression (or time zone, or overlap policy) replaces the stored
    one; whether it is paused is the operators' and stays as they left it."""
    for definition in registry.all_workflows():
        if not definition.schedule or registry.get(definition.name) != definition:
            continue  # only the newest version's declaration counts
        cron = check_cron(definition.schedule)
        existing = Schedule.objects.filter(name=definition.name).first()
        declared = (cron, definition.timezone, definition.overlap)
        if existing is not None and (existing.cron, existing.timezone, existing.overlap) == (
            declared
        ):
            continue
        save(
            definition.name, workflow=definition.name, cron=cron,
            timezone_name=definition.timezone, overlap=definition.overlap, source="code",
            paused=existing.paused if existing is not None else False,
        )  # fmt: skip
