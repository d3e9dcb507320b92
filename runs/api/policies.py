"""Budgets and halts over REST: of one run, of a workflow, of a label value, of everything."""

from __future__ import annotations

from decimal import Decimal
from uuid import UUID

from ninja import Field, Schema

from runs import operations
from runs.api.common import (
    ERRORS_422,
    USD,
    HaltState,
    ReasonIn,
    Router,
    RunOut,
    person_only,
    run_or_404,
    viewer,
)
from runs.engine.budget import to_usd
from runs.errors import OperationError
from runs.models import GLOBAL, Policy, Run
from runs.operations import KEEP, Target

router = Router(tags=["runs"])


class BudgetIn(ReasonIn):
    usd: str | None = Field(None, pattern=USD, examples=["50"])
    tokens: int | None = Field(None, ge=0, le=10**15)
    run_usd: str | None = Field(None, pattern=USD, examples=["2.50"])
    run_tokens: int | None = Field(None, ge=0, le=10**15)


class PolicyOut(Schema):
    scope: str
    halted: HaltState | None
    daily_usd: Decimal | None
    daily_tokens: int | None
    run_usd: Decimal | None
    run_tokens: int | None

    @staticmethod
    def of(policy: Policy) -> dict:
        return {
            "scope": policy.scope,
            "halted": (
                {"at": policy.halted_at, "by": policy.halted_by, "reason": policy.halt_reason}
                if policy.halted_at
                else None
            ),
            "daily_usd": to_usd(policy.daily_budget_micros),
            "daily_tokens": policy.daily_budget_tokens,
            "run_usd": to_usd(policy.run_budget_micros),
            "run_tokens": policy.run_budget_tokens,
        }


def workflow_name(name: str) -> str:
    if not 0 < len(name) <= 200 or "\x00" in name:
        raise OperationError("a workflow name is 1 to 200 characters, without NUL")
    return name


def _policy(scope: str) -> dict:
    return PolicyOut.of(Policy.objects.filter(scope=scope).first() or Policy(scope=scope))


def _set_budget(request, target: Target, body: BudgetIn) -> None:
    given = body.model_fields_set - {"reason"}
    limits = {k: getattr(body, k) if k in given else KEEP for k in BUDGET_FIELDS}
    for k in ("usd", "run_usd"):
        if isinstance(limits[k], str):
            limits[k] = Decimal(limits[k])
    if all(v is KEEP for v in limits.values()):
        raise OperationError("give at least one of usd, tokens, run_usd, run_tokens")
    operations.set_budget(target, request.user, body.reason, **limits)


BUDGET_FIELDS = ("usd", "tokens", "run_usd", "run_tokens")


@router.put("/runs/{run_id}/budget", response={200: RunOut, **ERRORS_422}, tags=["budgets"])
def set_run_budget(request, run_id: UUID, body: BudgetIn):
    """Set the run's own budget (usd, tokens; null removes). A run over budget resumes."""
    run_or_404(run_id)
    _set_budget(request, Target("run", str(run_id)), body)
    return RunOut.of(Run.objects.get(pk=run_id))


@router.get("/workflows/{name}/policy", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def workflow_policy(request, name: str):
    viewer(request)
    return _policy(workflow_name(name))


@router.put("/workflows/{name}/budget", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def set_workflow_budget(request, name: str, body: BudgetIn):
    """The workflow's shared daily budget (usd, tokens) and default per-run budget."""
    _set_budget(request, Target("workflow", workflow_name(name)), body)
    return _policy(name)


@router.get("/labels/{label}/policy", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def label_policy(request, label: str):
    """The daily budget of one label value (`tenant=acme`)."""
    viewer(request)
    return _policy(Target("label", label).scope)


@router.put("/labels/{label}/budget", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def set_label_budget(request, label: str, body: BudgetIn):
    """The shared daily budget (usd, tokens) of the runs carrying one label value
    (`tenant=acme`), on top of their workflow's and the global one."""
    target = Target("label", label)
    _set_budget(request, target, body)
    return _policy(target.scope)


@router.post("/workflows/{name}/halt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def halt_workflow(request, name: str, body: ReasonIn):
    operations.halt(Target("workflow", workflow_name(name)), request.user, body.reason)
    return _policy(name)


@router.post("/workflows/{name}/unhalt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def unhalt_workflow(request, name: str, body: ReasonIn):
    person_only(request, "unhalt")
    operations.unhalt(Target("workflow", workflow_name(name)), request.user, body.reason)
    return _policy(name)


@router.get("/global/policy", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def global_policy(request):
    viewer(request)
    return _policy(GLOBAL)


@router.put("/global/budget", response={200: PolicyOut, **ERRORS_422}, tags=["budgets"])
def set_global_budget(request, body: BudgetIn):
    """The global daily budget (usd, tokens) and default per-run budget."""
    _set_budget(request, Target("all"), body)
    return _policy(GLOBAL)


@router.post("/global/halt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def halt_everything(request, body: ReasonIn):
    """The kill switch: nothing starts a step until it is lifted."""
    operations.halt(Target("all"), request.user, body.reason)
    return _policy(GLOBAL)


@router.post("/global/unhalt", response={200: PolicyOut, **ERRORS_422}, tags=["halts"])
def unhalt_everything(request, body: ReasonIn):
    person_only(request, "unhalt")
    operations.unhalt(Target("all"), request.user, body.reason)
    return _policy(GLOBAL)


@router.get("/halts", response={200: list[PolicyOut], **ERRORS_422}, tags=["halts"])
def list_halts(request):
    """Workflow-wide and global halts in force."""
    viewer(request)
    return [PolicyOut.of(p) for p in Policy.objects.filter(halted_at__isnull=False)]
