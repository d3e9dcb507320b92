"""The engine's named statements (runs/engine/statements.py) and the cursor they go through.

Each statement's text is compared with its checked-in golden text, tests/golden/sql/
statements.sql (sections `-- name: ...`, as Procrastinate's queries.sql): a change to a
statement is a change to that file too, and shows in review. After a deliberate change,
rewrite it with `STEPGUARD_GOLDEN_UPDATE=1 pytest tests/test_statements.py` and read the diff.
"""

from __future__ import annotations

import inspect
import os
import re
import uuid
from pathlib import Path

import pytest
from django.db import DatabaseError, connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from django.utils import timezone

from runs.engine import fences, statements
from runs.engine.budget import Amount
from runs.engine.cursors import django_cursor, server_binding_cursor
from runs.engine.fences import Fence, Lease, Spend, fence_statement
from runs.models import Event, Run, Step

GOLDEN = Path(__file__).resolve().parent / "golden" / "sql" / "statements.sql"
_NAMED = re.compile(r"%\((\w+)\)s")


def _lease() -> Lease:
    return Lease(run_id=uuid.UUID(int=1), epoch=7)


def rendered() -> dict[str, str]:
    """Every named statement as it is sent (the claims for a worker with two workflows),
    and the fence as the fenced writes compose it."""
    texts = {
        name.lower(): value
        for name, value in vars(statements).items()
        if name.isupper()
        and not name.startswith("_")
        and isinstance(value, str)
        and name not in ("RUN", "STEP", "EVENT")
    }
    texts["claim_due"] = statements.claim(statements.CLAIM_DUE, 2)
    texts["claim_limited"] = statements.claim(statements.CLAIM_LIMITED, 2)
    fences = {
        "fence": Fence(),
        "fence_start": Fence(starting=True, estimate=Amount(5, 6), held=Amount(1, 2)),
        "fence_compensation_start": Fence(starting=True, compensating=True),
        "fence_finish": Fence(spend=Spend(10, 2, 3, Amount(4, 5)), progress=True, events=2),
        "fence_interrupted": Fence(possibly=Amount(1, 1)),
    }
    for name, checks in fences.items():
        texts[name] = fence_statement(_lease(), checks)[0]
    return dict(sorted(texts.items()))


def _golden_text(texts: dict[str, str]) -> str:
    return "".join(f"-- name: {name}\n{text.strip()}\n\n" for name, text in texts.items())


def _read_golden() -> dict[str, str]:
    sections = re.split(r"^-- name: (\w+)\n", GOLDEN.read_text(), flags=re.MULTILINE)
    return {name: text.strip() for name, text in zip(sections[1::2], sections[2::2], strict=True)}


def test_every_statement_matches_its_golden_text():
    texts = rendered()
    if os.environ.get("STEPGUARD_GOLDEN_UPDATE") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(_golden_text(texts))
    golden = _read_golden()
    assert sorted(golden) == sorted(texts), "statements added or removed: update the golden file"
    for name, text in texts.items():
        assert text.strip() == golden[name], (
            f"statement {name} differs from {GOLDEN.name}; if deliberate, rewrite it with "
            "STEPGUARD_GOLDEN_UPDATE=1 and review the diff"
        )


def test_statements_take_named_parameters_only():
    for name, text in rendered().items():
        assert "%s" not in text, name
        # Every % is a named placeholder (a literal one would be %%).
        assert text.count("%") == len(_NAMED.findall(text)), name


def test_the_statements_name_the_models_tables():
    assert Run._meta.db_table == statements.RUN
    assert f'"{Step._meta.db_table}"' == statements.STEP
    assert f'"{Event._meta.db_table}"' == statements.EVENT


def test_the_claims_parameters_are_the_ones_filled():
    """What claims.Claims fills (besides a per-call dict) names every placeholder."""
    mine = statements.mine_params([("a", "1"), ("b", "2")])
    common = {"now", "running", "waiting", "worker", "worker_text", "lease_until"}
    common |= {"recovered", "woken", "claimed", *mine}
    due = {"wakeable", "aged_before", "limited", "limit", "poison", "suspects", "suspect_after"}
    limited = {"workflow", "free", "total", "per_key", "wakeable", "aged_before", "fetch"}
    for text, own in ((rendered()["claim_due"], due), (rendered()["claim_limited"], limited)):
        assert set(_NAMED.findall(text)) == common | own


@pytest.mark.django_db
def test_djangos_cursor_takes_named_parameters_on_this_database():
    with connection.cursor() as cursor:
        cursor.execute("SELECT %(a)s, %(b)s, %(a)s", {"a": 1, "b": 2})
        assert tuple(cursor.fetchone()) == (1, 2, 1)


# -- the private Django API behind cursors.django_cursor -----------------------------------------


def test_django_still_has_the_private_method_that_wraps_a_cursor():
    method = getattr(BaseDatabaseWrapper, "_prepare_cursor", None)
    assert callable(method), (
        "Django no longer has BaseDatabaseWrapper._prepare_cursor: runs/engine/cursors.py "
        "(django_cursor) needs another way to wrap the engine's server-binding cursor"
    )
    assert list(inspect.signature(method).parameters) == ["self", "cursor"], (
        "BaseDatabaseWrapper._prepare_cursor changed its signature: see runs/engine/cursors.py"
    )


@pytest.mark.django_db
def test_a_wrapped_cursor_behaves_as_djangos_own():
    """Execute wrappers see its statements, and a failed statement raises Django's errors."""
    connection.ensure_connection()
    seen = []

    def wrapper(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper), django_cursor(connection.connection.cursor()) as c:
        assert isinstance(c, CursorWrapper)
        c.execute("SELECT 41 + 1")
        assert tuple(c.fetchone()) == (42,)
        with pytest.raises(DatabaseError):  # Django's class, not the driver's
            c.execute("SELECT * FROM no_such_table_here")
    assert seen[0] == "SELECT 41 + 1"


@pytest.mark.postgres
@pytest.mark.django_db
def test_the_server_binding_cursor_wrapped_takes_named_parameters():
    with django_cursor(server_binding_cursor()) as cursor:
        cursor.execute("SELECT %(a)s::int + %(b)s::int, %(a)s::int", {"a": 40, "b": 2})
        assert tuple(cursor.fetchone()) == (42, 40)


def _sample(field):
    """A value of `field`'s type as the engine writes it (its datetimes are aware)."""
    kind = field.get_internal_type()
    if kind == "ForeignKey":
        return _sample(field.target_field)
    samples = {
        "CharField": "x", "TextField": "x", "BooleanField": True,
        "DateTimeField": timezone.now(), "DateField": timezone.now().date(),
        "UUIDField": uuid.uuid4(),
    }  # fmt: skip
    return samples.get(kind, 3)  # the integer fields


@pytest.mark.django_db
def test_the_columns_written_without_djangos_preparation_need_none():
    """fences.prep sends the values of some field types as they are, skipping Django's
    per-value preparation (a fifth of a step's Python). It may only if that preparation
    gives back the very value: checked for every such column of the rows a step writes, on
    this database, so a Django upgrade (or a new column of another type) that prepares
    them differently fails here, not in a stored row."""
    skipped = 0
    for model in (Run, Step, Event):
        for field in model._meta.concrete_fields:
            _, _, placeholder, _, adapt = fences._column(model, field.name, "t_")
            if adapt is not None:
                continue
            value = _sample(field)
            prepared = field.get_db_prep_save(value, connection)
            assert prepared == value, (model, field.name, prepared)
            # Django on psycopg wraps a big integer as Int8 to type its parameter: the
            # statement's cast of the placeholder (`::bigint`) types it instead.
            typed = type(prepared) is type(value) or "::" in placeholder
            assert typed, (model, field.name, type(prepared))
            skipped += 1
    assert skipped >= 10  # the list is in force, not empty
