from django.urls import path

from runs.approvals import link_views, views

urlpatterns = [
    path("approvals", views.approvals_inbox, name="approvals"),
    path("approvals/<int:approval_id>/decide", views.decide_view, name="decide"),
    # A decision link: no login (the signed link is the credential: runs/approvals/links.py).
    path("approvals/link/<str:signed>", link_views.link_page, name="approval-link"),
    path(
        "approvals/<int:approval_id>/payload.json", views.approval_payload, name="approval-payload"
    ),
]
