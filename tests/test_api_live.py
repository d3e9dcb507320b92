"""The API against a live daphne server: schemathesis fuzzing, and racing starts."""

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from runs.apikeys import create_key
from runs.models import Run

pytestmark = pytest.mark.django_db(transaction=True)

# No 5xx, and every response documented and matching its schema. (A schema-valid request the
# API refuses for a reason the schema cannot express, such as an unknown cursor, is fine.)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def operator_key(cast):
    return create_key(cast["otto"])[1]


@pytest.mark.slow
def test_the_schema_fuzzed_gives_no_5xx_and_every_response_matches(server, operator_key):
    headers = {"Authorization": f"Bearer {operator_key}"}
    schema = schemathesis.openapi.from_url(f"{server}/api/openapi.json", headers=headers)
    failures: list[str] = []
    calls: list[int] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25
    for operation in operations:
        fuzz_operation(operation, server, headers, failures, calls)
    print(f"\nschema fuzzed: {len(operations)} operations, {len(calls)} requests, "
          f"{sum(1 for status in calls if status >= 500)} answered 5xx")  # fmt: skip
    assert not failures, "\n\n".join(failures[:10])


#: Examples per operation: 15 in the suite; STEPGUARD_FUZZ_EXAMPLES=200 for a long run.
FUZZ_EXAMPLES = int(os.environ.get("STEPGUARD_FUZZ_EXAMPLES", "15"))


def fuzz_operation(
    operation, server: str, headers: dict, failures: list[str], calls: list[int]
) -> None:
    @hypothesis.given(case=operation.as_strategy())
    @hypothesis.settings(
        max_examples=FUZZ_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case):
        response = case.call(base_url=server, headers=headers, timeout=10)
        calls.append(response.status_code)
        try:
            case.validate_response(response, checks=CHECKS)
        except BaseException as exc:  # schemathesis reports through an exception group
            failures.append(f"{operation.label}: {exc!r}"[:800])

    fuzz()


def _start(url: str, key: str) -> int:
    body = json.dumps({"workflow": "ledger", "input": {"steps": 1}, "key": "one-key"}).encode()
    request = urllib.request.Request(
        f"{url}/api/runs",
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


@pytest.mark.postgres
def test_a_start_repeated_50_times_concurrently_with_one_key_creates_one_run(server, operator_key):
    with ThreadPoolExecutor(max_workers=25) as pool:
        statuses = list(pool.map(lambda _: _start(server, operator_key), range(50)))
    assert sorted(set(statuses)) == [200, 201] and statuses.count(201) == 1
    assert Run.objects.filter(key="one-key").count() == 1
