"""The REST API's resources, a module each. Each route calls the same operation the CLI calls
(runs.operations, runs.sdk), so permissions and audit events are the same.

runs.rest mounts `router` (the resources below, in this order) at the API's root, beside the
routers of annotations, versions and the SSE stream (this package's modules of those names)
and of approvals (runs/approvals/api.py). A new resource is a module with its own `router`
(common.Router), added below with one line. It re-exports what other modules import from it.
"""

from runs.api import (
    actions,
    flow,
    forks,
    history,
    notifications,
    policies,
    rates,
    runs,
    schedules,
    signals,
    spend,
    workers,
)
from runs.api.common import (
    ERRORS,
    ERRORS_422,
    TEXT,
    USD,
    In,
    ReasonIn,
    Router,
    RunOut,
    person_only,
    run_or_404,
    viewer,
)
from runs.api.runs import Filters, create_run
from runs.api.signals import signal_run

router = Router()
router.add_router("", runs.router)
router.add_router("", spend.router)
router.add_router("", history.router)
router.add_router("", actions.router)
router.add_router("", forks.router)
router.add_router("", signals.router)
router.add_router("", policies.router)
router.add_router("", workers.router)
router.add_router("", notifications.router)
router.add_router("", flow.router)
router.add_router("", schedules.router)
router.add_router("", rates.router)

__all__ = [
    "ERRORS",
    "ERRORS_422",
    "TEXT",
    "USD",
    "Filters",
    "In",
    "ReasonIn",
    "RunOut",
    "create_run",
    "person_only",
    "router",
    "run_or_404",
    "signal_run",
    "viewer",
]
