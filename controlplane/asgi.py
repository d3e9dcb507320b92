import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from django.conf import settings
from django.core.asgi import get_asgi_application

http_app = get_asgi_application()
if settings.SERVE_STATIC:
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    http_app = ASGIStaticFilesHandler(http_app)

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from runs.consumers import RunConsumer  # noqa: E402

websockets = URLRouter([path("ws/runs/<uuid:run_id>/", RunConsumer.as_asgi())])

# Websockets need a logged-in session and an Origin among ALLOWED_HOSTS.
application = ProtocolTypeRouter(
    {"http": http_app, "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(websockets))}
)
