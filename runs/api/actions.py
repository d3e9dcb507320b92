"""What an operator does to a run over REST: halt, unhalt, cancel, retry."""

from __future__ import annotations

from uuid import UUID

from runs import operations
from runs.api.common import ERRORS_422, ReasonIn, Router, RunOut, person_only, run_or_404
from runs.models import Run

router = Router(tags=["runs"])


def _action(request, run_id: UUID, action, *args):
    run_or_404(run_id)
    action(str(run_id), request.user, *args)
    return RunOut.of(Run.objects.get(pk=run_id))


@router.post("/runs/{run_id}/halt", response={200: RunOut, **ERRORS_422}, tags=["halts"])
def halt_run(request, run_id: UUID, body: ReasonIn):
    """Halt the run and its children: they stop at their next step. Only unhalt clears it."""
    return _action(request, run_id, operations.halt, body.reason)


@router.post("/runs/{run_id}/unhalt", response={200: RunOut, **ERRORS_422}, tags=["halts"])
def unhalt_run(request, run_id: UUID, body: ReasonIn):
    """Lift a halt. A person's act: refused for API keys (automation may halt, never unhalt)."""
    person_only(request, "unhalt")
    return _action(request, run_id, operations.unhalt, body.reason)


@router.post("/runs/{run_id}/cancel", response={200: RunOut, **ERRORS_422})
def cancel_run(request, run_id: UUID, body: ReasonIn):
    """Cancel: the run stops at its next step, its compensations run, it ends cancelled."""
    return _action(request, run_id, operations.cancel_run, body.reason)


@router.post("/runs/{run_id}/retry", response={200: RunOut, **ERRORS_422})
def retry_run(request, run_id: UUID, body: ReasonIn):
    """Retry a failed run from the top; completed steps are reused."""
    return _action(request, run_id, operations.retry_run, body.reason)
