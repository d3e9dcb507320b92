"""Stepguard inside a host project (in this process; tests/test_install.py runs docs/install.md's
embedding section in a generated project): its URL names in their own namespace, every link,
the API and the websockets under the path the host mounts it at, the login page the app ships,
the live feeds without a channel layer, and every setting defaulted inside the app."""

import importlib
import io
import re
from types import SimpleNamespace

import pytest
from channels.testing import WebsocketCommunicator
from django.core.exceptions import ImproperlyConfigured
from django.urls import reverse

from runs import conf
from runs.routing import MountedWebsockets
from runs.sdk import start_run
from tests.conftest import ROOT
from tests.test_live import run_async, session_of

pytestmark = pytest.mark.django_db(transaction=True)

#: Where a page of the embedded dashboard may send the browser (its own pages and API, its
#: static files, the host's login and logout).
MOUNTED = ("/agents/", "/static/", "/accounts/")
LINK = re.compile(r'(?:href|action|hx-get|hx-post|ws-connect|data-root)="(/[^"]*)"')


@pytest.fixture
def host(settings):
    """The test settings as a host project would have them: Stepguard under /agents/, Django's
    auth URLs for logging in, no channel layer, no LOG_FORMAT or REDIS_URL."""
    settings.ROOT_URLCONF = "tests.embedded_urls"
    settings.LOGIN_URL = "/accounts/login/"
    del settings.CHANNEL_LAYERS
    return settings


def test_stepguard_url_names_are_in_their_own_namespace_beside_the_hosts(host):
    assert reverse("runs") == "/runs/"  # the host's own page keeps its name
    assert reverse("stepguard:runs") == "/agents/"
    assert reverse("stepguard:approvals") == "/agents/approvals"
    assert reverse("stepguard:api:openapi-json") == "/agents/api/openapi.json"


def test_a_logged_out_visitor_gets_the_apps_login_page_at_the_hosts_login_url(host, client):
    page = client.get("/agents/", follow=True)
    assert page.redirect_chain == [("/accounts/login/?next=/agents/", 302)]
    text = page.content.decode()
    assert page.status_code == 200 and "<h1>Log in</h1>" in text
    assert "stepguard/css/app.css" in text and 'data-root="/agents/"' in text


def test_every_link_on_every_embedded_page_stays_under_the_mount_point(host, client, drive):
    from django.contrib.auth import get_user_model

    run = start_run("ledger", {"steps": 2})
    drive()
    client.force_login(get_user_model().objects.create_superuser("root", password="x"))
    pages = ["", f"runs/{run.pk}", "approvals", "halts", "budgets", "flow", "workers", "audit",
             "notifications"]  # fmt: skip
    for page in pages:
        response = client.get(f"/agents/{page}")
        assert response.status_code == 200, page
        links = LINK.findall(response.content.decode())
        assert links and all(link.startswith(MOUNTED) for link in links), (page, links)
    detail = client.get(f"/agents/runs/{run.pk}").content.decode()
    assert f'ws-connect="/agents/ws/runs/{run.pk}/' in detail
    assert client.get(f"/agents/api/runs/{run.pk}").json()["status"] == "completed"


def test_the_live_feeds_answer_under_the_mount_point_without_a_channel_layer(host, cast, drive):
    run = start_run("ledger", {"steps": 1})
    drive()
    websockets = MountedWebsockets()  # the host's ASGI application routes through one

    def feed(path: str) -> WebsocketCommunicator:
        comm = WebsocketCommunicator(websockets, path)
        comm.scope["user"] = cast["vera"]
        comm.scope["session"] = session_of(cast["vera"])
        return comm

    async def go():
        frames = []
        # An empty run page's feed: its status, its "no steps" row away, the step's row; the
        # site-wide one: "live".
        for path, count in ((f"/agents/ws/runs/{run.pk}/?after=0&last=-1", 3),
                            ("/agents/ws/live/", 1)):  # fmt: skip
            comm = feed(path)
            connected, _ = await comm.connect(timeout=10)
            assert connected, path
            frames += [await comm.receive_from(timeout=5) for _ in range(count)]
            await comm.disconnect()
        with pytest.raises(ValueError, match="No route found"):  # not at the site's root
            await feed(f"/ws/runs/{run.pk}/").connect(timeout=10)
        return frames

    status, _, row, live = run_async(go)
    assert 'data-state="open"' in status and '<tr id="step-0"' in row
    assert '"live": true' in live


def test_a_host_that_sets_no_stepguard_setting_gets_every_default():
    host = SimpleNamespace(DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3"}})
    conf.apply_defaults(host)
    names = [name for name in vars(conf) if name.startswith("STEPGUARD_")]
    assert names and all(getattr(host, name) == getattr(conf, name) for name in names)
    assert (host.LOG_FORMAT, host.REDIS_URL, host.STEPGUARD_PREPARED_STATEMENTS) == (
        "plain", "", False
    )  # fmt: skip


def test_a_host_that_still_lists_the_old_approvals_app_is_told_its_new_name():
    """Before it moved into the runs package, the approvals app was "approvals"."""
    told = re.escape('replace "approvals" with "runs.approvals"')
    with pytest.raises(ImproperlyConfigured, match=told):
        importlib.import_module("approvals")


def test_every_stepguard_setting_the_code_reads_has_its_default_in_runs_conf():
    read = {
        name
        for package in ("runs", "controlplane")
        for path in (ROOT / package).rglob("*.py")
        for name in re.findall(r"settings\.(STEPGUARD_[A-Z0-9_]+)", path.read_text())
    }
    assert read and read - set(vars(conf)) <= {"STEPGUARD_PREPARED_STATEMENTS"}  # derived


def test_a_hosts_redis_channel_layer_is_the_doorbell_unless_it_names_another():
    layer = {"BACKEND": "channels_redis.core.RedisChannelLayer",
             "CONFIG": {"hosts": ["redis://cache:6379/2"]}}  # fmt: skip
    host = SimpleNamespace(DATABASES={"default": {}}, CHANNEL_LAYERS={"default": layer})
    conf.apply_defaults(host)
    assert host.REDIS_URL == "redis://cache:6379/2"
    own = SimpleNamespace(DATABASES={"default": {}}, REDIS_URL="", LOG_FORMAT="json")
    conf.apply_defaults(own)
    assert (own.REDIS_URL, own.LOG_FORMAT) == ("", "json")


def test_a_hosts_redis_layer_given_as_a_host_dict_is_the_doorbell_too():
    """channels-redis takes a host as a URL or as a dict of connection options."""
    host_options = {"address": "redis://cache:6379/3", "socket_keepalive": True}
    layer = {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [host_options]},
    }
    host = SimpleNamespace(DATABASES={"default": {}}, CHANNEL_LAYERS={"default": layer})
    conf.apply_defaults(host)
    assert host.REDIS_URL == "redis://cache:6379/3"


def test_serve_runs_the_hosts_asgi_application_and_says_when_there_is_none(host, monkeypatch):
    """`serve` is the app's command: daphne gets the project's ASGI_APPLICATION (the host's in
    a host project), not stand-alone Stepguard's controlplane.asgi."""
    from daphne.cli import CommandLineInterface
    from django.core.management import CommandError, call_command

    served = []
    monkeypatch.setattr(CommandLineInterface, "run", lambda self, argv: served.append(argv[-1]))
    host.ASGI_APPLICATION = "mysite.asgi.application"
    call_command("serve", "--port", "0", stdout=io.StringIO())
    assert served == ["mysite.asgi:application"]
    del host.ASGI_APPLICATION
    with pytest.raises(CommandError, match="serve needs ASGI_APPLICATION"):
        call_command("serve", "--port", "0", stdout=io.StringIO())
