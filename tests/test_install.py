"""Stepguard as others install it: embedded in a Django project of its own (the lines
docs/install.md shows), and as a built wheel in a clean virtualenv with its `stepguard`
command."""

import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import zipfile

import pytest

from tests.conftest import ROOT, wait_until

HOST_SETTINGS = """
import django

SECRET_KEY = "host-project-test-key-0123456789abcdefghijklmnopqrstuvwxyz"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "hostapp",
    # Stepguard: its two apps, and what they stand on.
    "runs",
    "approvals",
    "channels",
    "django_htmx",
    "axes",
]
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("template_partials")
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "axes.middleware.AxesMiddleware",
]
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
        "runs.context_processors.nav",
    ]},
}]
ROOT_URLCONF = "hostproj.urls"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "host.sqlite3"}}
USE_TZ = True
STATIC_URL = "static/"
STEPGUARD_WORKFLOW_MODULES = ["hostapp.agents"]
"""

HOST_URLS = """
from django.urls import include, path

from controlplane.api import api

urlpatterns = [
    path("accounts/", include("django.contrib.auth.urls")),
    path("agents/", include("runs.urls")),
    path("agents/api/", api.urls),
]
"""

HOST_AGENTS = """
from runs.sdk import RunContext, workflow


@workflow("greet")
def greet(ctx: RunContext, input: dict) -> str:
    name = ctx.step("lookup", lambda: input["name"].title())
    return ctx.step("greet", lambda: f"hello, {name}")
"""

DRIVE_AND_RENDER = """
from django.contrib.auth import get_user_model
from django.test import Client

from runs.engine import registry
from runs.engine.executor import execute
from runs.engine.store import Lease
from runs.engine.worker import WorkerProcess
from runs.models import Run

registry.load_configured()  # what runworker does: the host's STEPGUARD_WORKFLOW_MODULES
worker = WorkerProcess(concurrency=1)
worker.register()
for run in worker.claim(5):
    execute(run, Lease(run.id, run.lease_epoch))
run = Run.objects.get(workflow="greet")
print("status", run.status, run.output)
admin = get_user_model().objects.create_superuser("host-admin", password="x")
client = Client()
client.force_login(admin)
page = client.get("/agents/")
text = page.content.decode()
print("page", page.status_code, "greet" in text, str(run.pk)[:8] in text)
detail = client.get(f"/agents/runs/{run.pk}")
text = detail.content.decode()
print("detail", detail.status_code, "greet@1" in text and "status-completed" in text)
api = client.get(f"/agents/api/runs/{run.pk}")
print("api", api.status_code, api.json()["status"])
"""


def test_a_django_project_embeds_stepguard_runs_a_workflow_and_renders_its_pages(tmp_path):
    (tmp_path / "hostproj").mkdir()
    (tmp_path / "hostproj" / "__init__.py").write_text("")
    (tmp_path / "hostproj" / "settings.py").write_text(HOST_SETTINGS)
    (tmp_path / "hostproj" / "urls.py").write_text(HOST_URLS)
    (tmp_path / "hostapp").mkdir()
    (tmp_path / "hostapp" / "__init__.py").write_text("")
    (tmp_path / "hostapp" / "agents.py").write_text(HOST_AGENTS)
    (tmp_path / "manage.py").write_text(
        textwrap.dedent("""
        import os, sys
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "hostproj.settings")
        from django.core.management import execute_from_command_line
        execute_from_command_line(sys.argv)
        """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "STEPGUARD_"))}
    env.pop("DATABASE_URL", None)

    def manage(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"manage.py {args[0]}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    manage("check")
    manage("migrate", "--verbosity", "0")
    manage("startrun", "greet", "--input", '{"name": "ada"}')
    out = manage("shell", "-c", DRIVE_AND_RENDER)
    assert "status completed hello, Ada" in out, out
    assert "page 200 True True" in out, out
    assert "detail 200 True" in out, out
    assert "api 200 completed" in out, out


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "STEPGUARD_"))}
    for name in ("DATABASE_URL", "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    return {**env, **extra}


@pytest.mark.slow
def test_the_built_wheel_installs_migrates_runs_a_workflow_and_serves_the_dashboard(tmp_path):
    """The wheel, not the checkout: built, installed with its dependencies in a new
    virtualenv, then used only through its `stepguard` command from another directory."""
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(dist), str(ROOT)],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("stepguard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"runs/py.typed", "runs/templates/stepguard/base.html",
            "approvals/templates/approvals/inbox.html",
            "runs/static/stepguard/css/app.css"} <= names  # fmt: skip
    assert not any(n.startswith(("examples/", "tests/")) for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # Its dependencies as this checkout's virtualenv has them (the versions CI tests), then
    # the wheel itself: nothing from the checkout is importable in the new one.
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    (tmp_path / "constraints.txt").write_text(frozen)
    subprocess.run(
        [*pip, "-c", str(tmp_path / "constraints.txt"), str(wheel)], check=True, timeout=600
    )
    site = tmp_path / "site"
    site.mkdir()
    (site / "hello.py").write_text(
        "from runs.sdk import workflow\n\n\n"
        '@workflow("hello")\n'
        "def hello(ctx, input):\n"
        '    return ctx.step("say", lambda: f"hello {input}")\n'
    )
    env = _clean_env(
        SECRET_KEY="wheel-test-key-0123456789abcdefghijklmnopqrstuvwxyz-0123456789",
        ALLOWED_HOSTS="127.0.0.1",
        SECURE_SSL_REDIRECT="0",
        PYTHONPATH=str(site),
    )
    stepguard = str(venv / "bin" / "stepguard")

    def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            [stepguard, *args], cwd=site, env=env, capture_output=True, text=True,
            timeout=120, **kwargs,
        )  # fmt: skip

    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import runs, examples"],
        cwd=site, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert "No module named 'examples'" in probe.stderr  # the demo is not installed
    assert run("migrate", "--verbosity", "0").returncode == 0
    assert (site / "var" / "stepguard.sqlite3").exists()  # under the directory it runs in
    started = run("startrun", "hello", "--input", '"wheel"', "--import", "hello")
    assert started.returncode == 0, started.stderr
    worker = subprocess.Popen(
        [stepguard, "runworker", "--import", "hello", "--poll-interval", "0.1"],
        cwd=site, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    server = subprocess.Popen(
        [stepguard, "serve", "--port", "0", "--host", "127.0.0.1"],
        cwd=site, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        shown: list[str] = []

        def finished() -> bool:
            out = run("showrun", started.stdout.split()[-1] if started.stdout else "", "--json")
            shown[:] = [out.stdout + out.stderr]
            return '"status": "completed"' in out.stdout

        wait_until(finished, timeout=60, what=lambda: f"the run to complete: {shown}")
        assert '"output": "hello wheel"' in shown[0]
        port = _daphne_port(server)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/login/", timeout=10) as page:
            assert page.status == 200 and b"Log in" in page.read()
        with urllib.request.urlopen(f"{base}/static/stepguard/css/app.css", timeout=10) as css:
            assert css.status == 200 and b"--accent" in css.read()
    finally:
        for proc in (worker, server):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _daphne_port(server: subprocess.Popen) -> int:
    import re

    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            break
        seen.append(line)
        if match := re.search(r"Listening on TCP address 127\.0\.0\.1:(\d+)", line):
            return int(match.group(1))
    pytest.fail("stepguard serve did not listen:\n" + "".join(seen))
