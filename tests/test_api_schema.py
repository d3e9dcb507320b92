"""The OpenAPI schema documents what the routes answer (schemathesis's status-code conformance,
checked here without a server)."""

import pytest
from django.test import Client

from runs.apikeys import create_key

pytestmark = pytest.mark.django_db

CONSTRAINTS = {"pattern", "maxLength", "minLength", "format", "enum", "minimum", "maximum"}


def can_fail_validation(operation: dict) -> bool:
    """A body, or a parameter that is not any string: a request may not parse (422)."""
    if "requestBody" in operation:
        return True
    for parameter in operation.get("parameters", []):
        schema = parameter.get("schema", {})
        if schema.get("type") != "string" or CONSTRAINTS & set(schema):
            return True
    return False


def test_every_route_that_validates_its_input_documents_the_422(django_user_model):
    """Before: DELETE /api/notifications/channels/{id} and GET /api/notifications/deliveries
    answered 422 for a malformed id or flag without documenting it (schemathesis ST103)."""
    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {create_key(root)[1]}"}
    schema = Client().get("/api/openapi.json", **headers).json()
    missing = [
        f"{method.upper()} {path}"
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
        if can_fail_validation(operation) and "422" not in operation["responses"]
    ]
    assert not missing


@pytest.mark.parametrize("step", ["s\x00", "x" * 256, "", -1, 2**31])
def test_a_forks_step_outside_its_bounds_is_a_422_not_a_500(django_user_model, step):
    """schemathesis on the issue-31 API: a fork from a step key holding NUL answered 500 on
    PostgreSQL (the key went into a query)."""
    from runs.sdk import start_run

    root = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    headers = {"HTTP_AUTHORIZATION": f"Bearer {create_key(root)[1]}"}
    run = start_run("ledger", {"steps": 0})
    response = Client().post(
        f"/api/runs/{run.pk}/fork", {"step": step, "reason": "x"}, "application/json", **headers
    )
    assert response.status_code == 422, response.content
    assert "body.step" in response.json()["error"]["message"]
