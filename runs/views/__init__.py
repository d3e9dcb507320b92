"""Dashboard pages: function views rendering server-side templates (htmx for actions), one
module per page (listing, run_page, steps, forks, bulk, halts, budgets, flow, workers, audit,
notifications, trace, trends, versions, annotations) and what they share (common).

Every page needs a login and the view permission; every action goes through the same operation
the CLI and the API call, so a viewer who posts anyway is refused by the server. The views
runs.urls routes to, and the helpers other apps use, are re-exported here.
"""

from runs.views.annotations import annotate_view, export_view
from runs.views.audit import audit_page
from runs.views.budgets import budget_scope, budgets_page
from runs.views.bulk import bulk_view
from runs.views.common import do_action, json_download, viewer_required
from runs.views.flow import flow_limits, flow_page, flow_rate, flow_schedule, flow_schedule_action
from runs.views.forks import fork_preview_view, fork_view
from runs.views.halts import halt_scope, halts_page, nav_part
from runs.views.listing import runs_count, runs_list, start_view
from runs.views.notifications import (
    notifications_add,
    notifications_channel,
    notifications_page,
    notifications_remove,
)
from runs.views.run_page import (
    budget_view,
    earlier_events,
    earlier_steps,
    run_action,
    run_detail,
    run_header,
    run_json,
    timeline_rows,
    with_context,
)
from runs.views.steps import step_body, step_json
from runs.views.trace import trace_part
from runs.views.trends import trends_page
from runs.views.versions import versions_check, versions_page
from runs.views.workers import workers_page

__all__ = [
    "annotate_view",
    "audit_page",
    "budget_scope",
    "budget_view",
    "budgets_page",
    "bulk_view",
    "do_action",
    "earlier_events",
    "earlier_steps",
    "export_view",
    "flow_limits",
    "flow_page",
    "flow_rate",
    "flow_schedule",
    "flow_schedule_action",
    "fork_preview_view",
    "fork_view",
    "halt_scope",
    "halts_page",
    "json_download",
    "nav_part",
    "notifications_add",
    "notifications_channel",
    "notifications_page",
    "notifications_remove",
    "run_action",
    "run_detail",
    "run_header",
    "run_json",
    "runs_count",
    "runs_list",
    "start_view",
    "step_body",
    "step_json",
    "timeline_rows",
    "trace_part",
    "trends_page",
    "versions_check",
    "versions_page",
    "viewer_required",
    "with_context",
    "workers_page",
]
