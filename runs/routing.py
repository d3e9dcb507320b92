"""The live pages' websocket routes, for an ASGI application: controlplane.asgi, or a host
project's (docs/install.md):

    "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(stepguard_websockets))
"""

from channels.routing import URLRouter
from django.urls import get_script_prefix, path, reverse

from runs.consumers import LiveConsumer, RunConsumer

#: Relative to where the project's urls.py mounts the pages (runs.urls), as the pages open them:
#: `{% url 'stepguard:runs' %}ws/runs/<id>/`.
websocket_urlpatterns = [
    path("ws/runs/<uuid:run_id>/", RunConsumer.as_asgi()),
    path("ws/live/", LiveConsumer.as_asgi()),
]


class MountedWebsockets:
    """An ASGI application: `websocket_urlpatterns` under the path the pages are mounted at
    (`agents/` for `path("agents/", include("runs.urls"))`), so urls.py alone says where
    Stepguard lives. The path is looked up on the first connection, once the URLconf loads."""

    def __init__(self):
        self.router: URLRouter | None = None

    def routes(self) -> list:
        root = reverse("stepguard:runs")[len(get_script_prefix()) :]
        return [path(root + str(p.pattern), p.callback) for p in websocket_urlpatterns]

    async def __call__(self, scope, receive, send):
        if self.router is None:
            self.router = URLRouter(self.routes())
        return await self.router(scope, receive, send)


stepguard_websockets = MountedWebsockets()
