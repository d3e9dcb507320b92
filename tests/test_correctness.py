"""Regression tests for the holes found by trying the engine as a hostile user would.

Each test failed on the engine before its fix. In-process, on both engines unless marked.
"""

import json

import pytest
from django.db import connection
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.models import Effect
from runs.engine.serialization import to_json
from runs.models import Run, RunStatus
from runs.sdk import send_signal, start_run
from tests import workflows
from tests.workflows import Crash

pytestmark = pytest.mark.django_db

# -- 1. replay hands back exactly what the live run saw ------------------------------------------

_text = st.text(
    alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), max_size=12
)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e16, -0.0, 0.0, 1.5e300, 5e-324, 1.0, 10.0**21])
    | _text
)
json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=6),
    max_leaves=25,
)


def exact(value) -> str:
    """A rendering that tells apart what replay must keep: types, key order, -0.0, 1e16."""
    return repr(value)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(value=json_values)
def test_every_value_handed_to_workflow_code_replays_exactly_as_it_was_live(drive, value):
    workflows.seen.clear()
    live = to_json(value, what="the test value")
    run = start_run("json-echo", {"value": value})
    assert drive() == ["waiting"]
    send_signal(run.id, "go", value)
    assert drive() == ["waiting"]
    send_signal(run.id, "end")
    assert drive() == ["completed"]
    got: dict[str, list[str]] = {}
    for what, handed in workflows.seen:
        got.setdefault(what, []).append(exact(handed))
    assert got["input"] == [exact({"value": live})] * 3
    assert got["make"] == [exact(live)] * 3  # live, then two replays
    assert got["signal"] == [exact(live)] * 2  # live, then one replay
    assert exact(Run.objects.get(pk=run.pk).output) == exact(live)


def test_a_loop_over_a_dict_output_books_the_same_cities_in_the_same_order_after_a_crash(
    drive, expire_lease
):
    plan = {"Zurich": 1, "Amsterdam": 2, "Rome": 3, "Oslo": 4}
    run = start_run("city-loop", {"plan": plan})
    workflows.crash_at.add("book-Amsterdam")
    with pytest.raises(Crash):
        drive()
    expire_lease(run.id)
    assert drive() == ["completed"]
    booked = list(Effect.objects.order_by("id").values_list("idempotency_key", "label"))
    labels_by_key: dict[str, set[str]] = {}
    for key, label in booked:
        labels_by_key.setdefault(key, set()).add(label)
    assert all(len(labels) == 1 for labels in labels_by_key.values()), labels_by_key
    assert [label for _, label in booked] == [
        "book-Zurich", "book-Amsterdam", "book-Amsterdam", "book-Rome", "book-Oslo"
    ]  # fmt: skip
    assert Run.objects.get(pk=run.pk).output == list(plan)


def test_step_outputs_are_stored_as_the_json_text_the_workflow_saw(drive):
    run = start_run("json-echo", {"value": {"zurich": 1e16, "a": -0.0}})
    drive()
    with connection.cursor() as cursor:
        cursor.execute("SELECT output FROM runs_step WHERE run_id = %s AND key = 'make'",
                       [Run._meta.pk.get_db_prep_value(run.pk, connection)])  # fmt: skip
        (stored,) = cursor.fetchone()
    text = stored if isinstance(stored, str) else json.dumps(stored, separators=(",", ":"))
    assert json.loads(text) == {"zurich": 1e16, "a": -0.0}
    assert list(json.loads(text)) == ["zurich", "a"]
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING
