from django.urls import path

from runs.approvals import views

urlpatterns = [
    path("approvals", views.approvals_inbox, name="approvals"),
    path("approvals/<int:approval_id>/decide", views.decide_view, name="decide"),
    path(
        "approvals/<int:approval_id>/payload.json", views.approval_payload, name="approval-payload"
    ),
]
