"""What every resource of the REST API shares: its error shape, the text and USD patterns, a
run as the API shows it, and the checks a route makes before it acts."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from decimal import Decimal
from typing import Any
from uuid import UUID

import ninja
from django.http import HttpRequest
from ninja import Field, Schema
from pydantic import ConfigDict

from runs import operations
from runs.engine.budget import PLAIN_USD, to_usd
from runs.errors import Forbidden
from runs.models import Run

TEXT = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL
# USD travels as a decimal string (no float rounding), at most 8 + 6 digits.
USD = rf"^{PLAIN_USD}$"  # ASCII digits: "\d" would take "٣" as 3


class Router(ninja.Router):
    """The routes of one resource. Each keeps the operation id it had when the whole API was
    the module `ids` names (`runs_api_create_run` for runs.api): clients generated from
    openapi.json call the routes by these names, whichever module of runs/api/ holds them."""

    def __init__(self, *, ids: str = "runs_api", **options: Any) -> None:
        super().__init__(**options)
        self.ids = ids

    def add_api_operation(
        self, path: str, methods: list[str], view_func: Callable, **options: Any
    ) -> None:
        options["operation_id"] = options.get("operation_id") or f"{self.ids}_{view_func.__name__}"
        super().add_api_operation(path, methods, view_func, **options)


class In(Schema):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(Schema):
    code: str
    message: str
    details: list[Any] | None = None


class ErrorOut(Schema):
    error: ErrorBody


ERRORS = {400: ErrorOut, 401: ErrorOut, 403: ErrorOut, 404: ErrorOut, 409: ErrorOut}


ERRORS_422 = {**ERRORS, 413: ErrorOut, 422: ErrorOut}


class Spend(Schema):
    tokens_in: int
    tokens_out: int
    usd: Decimal


class Budget(Schema):
    usd: Decimal | None
    tokens: int | None


class HaltState(Schema):
    at: datetime
    by: str
    reason: str


class RunOut(Schema):
    id: UUID
    workflow: str
    version: str
    status: str
    key: str | None
    parent_id: UUID | None
    forked_from_id: UUID | None
    labels: dict[str, str]
    attempt: int
    max_attempts: int
    input: Any
    output: Any
    error: Any
    spend: Spend
    budget: Budget
    halted: HaltState | None
    cancel_requested_by: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    @staticmethod
    def of(run: Run) -> dict:
        return {
            **{f: getattr(run, f) for f in ("id", "workflow", "version", "status", "key")},
            **{f: getattr(run, f) for f in ("parent_id", "forked_from_id", "attempt", "labels")},
            **{f: getattr(run, f) for f in ("max_attempts", "input", "output", "error")},
            **{f: getattr(run, f) for f in ("created_at", "started_at", "finished_at")},
            "spend": {
                "tokens_in": run.tokens_in,
                "tokens_out": run.tokens_out,
                "usd": to_usd(run.cost_micros),
            },
            "budget": {"usd": to_usd(run.budget_micros), "tokens": run.budget_tokens},
            "halted": (
                {"at": run.halted_at, "by": run.halted_by, "reason": run.halt_reason}
                if run.halted_at
                else None
            ),
            "cancel_requested_by": run.cancel_requested_by or None,
        }


class ReasonIn(In):
    reason: str = Field(min_length=1, max_length=2000, pattern=TEXT, examples=["runaway loop"])


def viewer(request: HttpRequest):
    if not request.user.has_perm("runs.view_run"):
        raise Forbidden(f"{request.user.get_username()} may not view runs (needs runs.view_run)")
    return request.user


def run_or_404(run_id: UUID) -> Run:
    return operations.find_run(run_id)


def person_only(request, action: str) -> None:
    if getattr(request, "api_key", None) is not None:
        raise Forbidden(f"{action} needs a person's browser session, not an API key")


def may(request, permission: str, action: str) -> None:
    if not request.user.has_perm(permission):
        raise Forbidden(f"{request.user.get_username()} may not {action} (needs {permission})")
