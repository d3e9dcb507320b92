"""Starting a run: the options checked, its budget, its `run.created` record, idempotent by
key, debounced when its workflow says so. One signature for every caller: `runs.sdk` exports
`start_run` as it is, and the engine's own starts say `engine=True` (only they may start
what the engine keys or runs for itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from runs import labels as run_labels
from runs.engine import holds, registry
from runs.engine.budget import default_run_budget, to_micros, to_usd
from runs.engine.outage import once_more
from runs.engine.serialization import to_json
from runs.engine.store import append_event, create_run, record_shapers
from runs.errors import InvalidInput, OperationError
from runs.models import EventType, Run, RunStatus, Shaped

__all__ = ["RESERVED_KEY_PREFIXES", "refuse_reserved", "start_run"]

#: Run keys the engine gives its own runs: a notification delivery, a schedule's tick.
RESERVED_KEY_PREFIXES = ("notify:", "schedule:")


@once_more
def start_run(
    name: str,
    input: Any = None,
    *,
    key: str | None = None,
    version: str | None = None,
    max_attempts: int | None = None,
    budget_usd: Decimal | None = None,
    budget_tokens: int | None = None,
    started_by=None,
    api_key: str | None = None,
    priority: int | None = None,
    created: dict[str, Any] | None = None,
    labels: Mapping[str, str] | None = None,
    shapers: Iterable[tuple[int, str]] = (),
    engine: bool = False,
) -> Run:
    """Start a run of workflow `name` (its newest registered version unless `version` is given).

    Idempotent by `key`: starting twice with one key returns the first run, whatever the input.
    The returned Run has `was_created` set to tell the two cases apart. Raises UnknownWorkflow
    if this process has not registered the workflow, and OutputNotSerializable for input that
    is not JSON. `started_by` (a user) and `api_key` (the prefix of the key used) are recorded
    on the `run.created` event, with the run's budget: the person who started a run may not
    approve its actions (STEPGUARD_FOUR_EYES), nor may anyone in `shapers` ((user id,
    `Shaped`) pairs: a schedule's authors and resumers). `priority` (-1000 to 1000) overrides
    the workflow's; `created` adds to what the `run.created` event records (a schedule's
    tick). `labels` (`{"tenant": "acme"}`: up to 10, names of a-z, 0-9, `_.-`, values of up
    to 100 characters) say who the run is for: its children and forks keep them, and spend is
    attributed, filtered and budgeted by them (docs/agents.md, "Spend per tenant"). The
    engine's own workflows (`stepguard.*`) and run keys (`notify:`, `schedule:`) are refused
    (InvalidInput) unless `engine` says the engine itself is starting the run.

    One door for everyone: `runs.sdk.start_run` is this function, and the engine's own
    starts (a schedule's tick, a notification's delivery) pass `engine=True`.
    """
    if not engine:
        refuse_reserved(name, key)
    shapers = list(shapers)
    definition = registry.get(name, version)
    data = to_json(input, what=f"the input of workflow {name!r}")
    if priority is None:
        priority = definition.priority
    _check_options(priority, key, max_attempts)
    fields = _run_fields(definition, data, priority, max_attempts, budget_usd, budget_tokens)
    if labels := run_labels.clean(labels):
        fields["labels"] = labels
    given = budget_usd is not None or budget_tokens is not None
    created = _created_record(created, api_key, fields, budget_given=given)
    if definition.debounce is not None and key is None:
        return _debounced(definition, data, fields, created, started_by, shapers)
    try:
        with transaction.atomic():
            run = create_run(
                workflow=definition.name,
                version=definition.version,
                input=data,
                key=key,
                started_by=started_by,
                actor=started_by.get_username() if started_by is not None else "system",
                created=created,
                shapers=shapers,
                **fields,
            )
    except IntegrityError:
        existing = _started_before(definition, key)
        if existing is None:
            raise
        return existing
    run.was_created = True
    return run


def refuse_reserved(workflow: str, key: str | None) -> None:
    """A person (the API, the dashboard, the CLI, a script) may not start the engine's own
    workflows, nor take a key the engine keys its runs by: a planted `notify:<channel>:<event>`
    would stop that channel's deliveries, a `schedule:<name>:<tick>` run a tick with another
    input."""
    if registry.builtin(workflow):
        raise InvalidInput(f"workflow {workflow!r} is Stepguard's own: it is not started by hand")
    if isinstance(key, str) and key.startswith(RESERVED_KEY_PREFIXES):
        prefixes = " and ".join(f"'{p}'" for p in RESERVED_KEY_PREFIXES)
        raise InvalidInput(f"run key {key!r}: keys starting with {prefixes} are Stepguard's own")


def _check_options(priority: Any, key: Any, max_attempts: int | None) -> None:
    """ValueError for a start option out of its range."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise ValueError("priority must be an integer between -1000 and 1000")
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= 255):
        raise ValueError("a run key must be a string of 1 to 255 characters")
    if max_attempts is not None and not 1 <= max_attempts <= 100:
        raise ValueError("max_attempts must be between 1 and 100")


def _run_fields(
    definition, data: Any, priority: int, max_attempts: int | None, budget_usd, budget_tokens
) -> dict[str, Any]:
    """The new run's options: its attempts, its budget (given, else the defaults), its
    priority and its concurrency key."""
    fields: dict[str, Any] = {"max_attempts": max_attempts} if max_attempts else {}
    fields |= _run_budget(definition.name, budget_usd, budget_tokens)
    return fields | {"priority": priority, "concurrency_key": definition.key_for(data)}


def _created_record(
    created: dict[str, Any] | None, api_key: str | None, fields: dict, *, budget_given: bool
) -> dict[str, Any]:
    """What the `run.created` event records besides the defaults: `created`, the API key
    used, and the run's budget (and whether the starter gave it)."""
    created = dict(created or {})
    if api_key:
        created["api_key"] = api_key
    micros, tokens = fields.get("budget_micros"), fields.get("budget_tokens")
    if micros is not None or tokens is not None:
        created["budget"] = {
            "usd": None if micros is None else str(to_usd(micros)),
            "tokens": tokens,
            "given": budget_given,
        }
    if fields.get("labels"):
        created["labels"] = fields["labels"]
    return created


def _started_before(definition, key: str | None) -> Run | None:
    """The run a start with `key` found already there (`was_created` False), or None; a run
    of another workflow on that key is a ValueError."""
    existing = Run.objects.filter(key=key).first() if key is not None else None
    if existing is None:
        return None
    if existing.workflow != definition.name:
        raise ValueError(
            f"run key {key!r} already belongs to run {existing.id} of workflow "
            f"{existing.workflow!r}, not {definition.name!r}"
        ) from None
    existing.was_created = False
    return existing


def _debounced(
    definition, data: Any, fields: dict, created: dict, started_by, shapers: list
) -> Run:
    """Start a debounced run: the one still waiting out its quiet period for this key takes
    this input and waits again, or a new one is created. At most one such run per workflow and
    key is enforced by a partial unique constraint (runs_run_one_debouncing_per_key); the
    update is a compare-and-swap on the run's event sequence, so a claim racing it wins and
    this start makes a new run instead."""
    debounce_key = definition.key_for(data, "debounce")
    actor = started_by.get_username() if started_by is not None else "system"
    for _ in range(3):  # a concurrent start created the waiting run first: update that one
        try:
            with transaction.atomic():
                # Before the waiting run's row (the lock order): create_run's hold decision.
                holds.lock_covering(definition.name)
                now = timezone.now()
                quiet = [RunStatus.PENDING, RunStatus.HALTED]  # a halt does not end the quiet
                waiting = (
                    Run.objects.select_for_update()
                    .filter(workflow=definition.name, debounce_key=debounce_key)
                    .filter(status__in=quiet, lease_epoch=0)
                    .first()
                )
                if waiting is not None:
                    wake = now + definition.debounce
                    if definition.debounce_max is not None:
                        wake = min(wake, waiting.created_at + definition.debounce_max)
                    seq = waiting.event_seq + 1
                    moved = Run.objects.filter(
                        pk=waiting.pk, status__in=quiet, lease_epoch=0,
                        event_seq=waiting.event_seq,
                    ).update(input=data, wake_at=wake, event_seq=seq,
                             concurrency_key=fields["concurrency_key"])  # fmt: skip
                    if moved:
                        append_event(
                            waiting.pk, seq, EventType.RUN_DEBOUNCED, "", actor,
                            until=wake.isoformat(), debounce_key=debounce_key,
                        )  # fmt: skip
                        # Whoever gave the run its input now shaped what it will ask to do.
                        by = [(started_by.pk, Shaped.DEBOUNCED)] if started_by is not None else []
                        record_shapers(waiting.pk, [*by, *shapers])
                        waiting.refresh_from_db()
                        waiting.was_created = False
                        return waiting
                run = create_run(
                    workflow=definition.name, version=definition.version, input=data, key=None,
                    started_by=started_by, actor=actor, wake_at=now + definition.debounce,
                    debounce_key=debounce_key, shapers=shapers,
                    created={**created, "debounce_key": debounce_key}, **fields,
                )  # fmt: skip
                run.was_created = True
                return run
        except IntegrityError:
            continue
    raise OperationError(f"could not start a debounced run of {definition.name!r}; try again")


def _run_budget(workflow: str, usd, tokens) -> dict:
    """The run's own budget: as given, else the workflow's default, else the global one."""
    if tokens is not None and (not isinstance(tokens, int) or tokens < 0):
        raise ValueError("budget_tokens is a non-negative integer")
    return default_run_budget(workflow, None if usd is None else to_micros(usd), tokens)
