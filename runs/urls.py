"""Stepguard's pages, the approvals inbox and the REST API (at `api/`), under one URL namespace,
`stepguard` (`{% url 'stepguard:run' run.pk %}`): `path("agents/", include("runs.urls"))` in a
project that embeds Stepguard (docs/install.md), `path("", ...)` in controlplane.urls. The
websockets follow the same mount point (runs.routing)."""

from django.urls import include, path

from runs import views
from runs.rest import api_urls

app_name = "stepguard"

urlpatterns = [
    path("", views.runs_list, name="runs"),
    path("runs/bulk", views.bulk_view, name="runs-bulk"),
    path("runs/start", views.start_view, name="runs-start"),
    path("nav", views.nav_part, name="nav"),
    path("budgets", views.budgets_page, name="budgets"),
    path("runs/count", views.runs_count, name="runs-count"),
    path("runs/<uuid:run_id>", views.run_detail, name="run"),
    path("runs/<uuid:run_id>/budget", views.budget_view, name="run-budget"),
    path("runs/<uuid:run_id>/fork", views.fork_view, name="run-fork"),
    path("runs/<uuid:run_id>/fork-preview", views.fork_preview_view, name="run-fork-preview"),
    path("runs/<uuid:run_id>/steps", views.earlier_steps, name="run-earlier-steps"),
    path("runs/<uuid:run_id>/steps/<int:seq>", views.step_body, name="run-step"),
    path(
        "runs/<uuid:run_id>/steps/<int:seq>/<str:part>.json", views.step_json, name="run-step-json"
    ),
    path("runs/<uuid:run_id>/events", views.earlier_events, name="run-earlier-events"),
    path("runs/<uuid:run_id>/header", views.run_header, name="run-header"),
    path("runs/<uuid:run_id>/<str:part>.json", views.run_json, name="run-json"),
    path("runs/<uuid:run_id>/annotate", views.annotate_view, name="run-annotate"),
    path("runs/<uuid:run_id>/trace", views.trace_part, name="run-trace"),
    path("annotations.csv", views.export_view, name="annotations-export"),
    path("trends", views.trends_page, name="trends"),
    path("runs/<uuid:run_id>/<str:action>", views.run_action, name="run-action"),
    path("workers", views.workers_page, name="workers"),
    path("audit", views.audit_page, name="audit"),
    path("versions", views.versions_page, name="versions"),
    path("versions/check", views.versions_check, name="versions-check"),
    path("notifications", views.notifications_page, name="notifications"),
    path("notifications/add", views.notifications_add, name="notifications-add"),
    path(
        "notifications/<int:channel_id>/remove",
        views.notifications_remove,
        name="notifications-remove",
    ),
    path(
        "notifications/<int:channel_id>/<str:action>",
        views.notifications_channel,
        name="notifications-channel",
    ),
    path("flow", views.flow_page, name="flow"),
    path("flow/limits", views.flow_limits, name="flow-limits"),
    path("flow/rate", views.flow_rate, name="flow-rate"),
    path("flow/schedules", views.flow_schedule, name="flow-schedule"),
    path(
        "flow/schedules/<str:name>/<str:action>",
        views.flow_schedule_action,
        name="flow-schedule-action",
    ),
    path("halts", views.halts_page, name="halts"),
    path("halts/budget", views.budget_scope, name="budget-scope"),
    path("halts/<str:action>", views.halt_scope, name="halt-scope"),
    path("", include("runs.approvals.urls")),  # no namespace of its own: stepguard:approvals
    path("api/", api_urls()),  # every path under it answers the API's JSON, a 404 included
]
