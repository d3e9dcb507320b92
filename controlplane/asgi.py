import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from django.conf import settings
from django.core.asgi import get_asgi_application

from controlplane.webdb import ConnectionBound
from runs.engine.deadline import watchdog

# A statement of a request with no answer (a primary that hangs) is abandoned after this long:
# the request answers 503 instead of waiting as long as the server does (docs/deploy.md).
watchdog.enable(settings.STEPGUARD_WEB_STATEMENT_DEADLINE)

# No persistent connections under ASGI, and at most DB_WEB_CONNECTIONS requests in Django at
# once: a web process's connections are bounded and closed (controlplane/webdb.py).
http_app = ConnectionBound(get_asgi_application(), settings.DB_WEB_CONNECTIONS)
if settings.SERVE_STATIC:
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    http_app = ASGIStaticFilesHandler(http_app)

import sys  # noqa: E402

from controlplane.bodylimit import BodyLimit, limit_daphne  # noqa: E402

http_app = BodyLimit(http_app)  # before Django spools a body to disk
if "daphne.server" in sys.modules:
    limit_daphne()  # and before daphne does

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from controlplane.wsorigin import SameOrigin  # noqa: E402
from runs.routing import stepguard_websockets  # noqa: E402

# Websockets need a logged-in session and an Origin that is this very site (scheme, host among
# ALLOWED_HOSTS, and port) or one of CSRF_TRUSTED_ORIGINS.
application = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": AllowedHostsOriginValidator(
            SameOrigin(AuthMiddlewareStack(stepguard_websockets))
        ),
    }
)

# Behind reverse proxies, the client's address from X-Forwarded-For, believed only from them.
if settings.STEPGUARD_TRUSTED_PROXIES:
    from controlplane.proxy import ForwardedFor

    application = ForwardedFor(application, settings.STEPGUARD_TRUSTED_PROXIES)
