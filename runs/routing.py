"""The live run page's websocket route, for the ASGI application (controlplane.asgi, or a host
project's: docs/install.md)."""

from django.urls import path

from runs.consumers import LiveConsumer, RunConsumer

websocket_urlpatterns = [
    path("ws/runs/<uuid:run_id>/", RunConsumer.as_asgi()),
    path("ws/live/", LiveConsumer.as_asgi()),
]
