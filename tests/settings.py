"""Settings for the test suite and the worker subprocesses it starts."""

import os

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production-0123456789abcdef")

from controlplane.settings import *  # noqa: F403

# The tests' own models (the ledger of side effects their workflows write).
INSTALLED_APPS = [*INSTALLED_APPS, "examples", "tests.testapp"]  # noqa: F405

# The test servers speak plain HTTP on 127.0.0.1.
SECURE_SSL_REDIRECT = False
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = False
# Not the adapters' workflows: with them here every worker and server of the suite imported
# three agent frameworks, and the live-feed browser test's websocket timed out reading Redis
# in one run of three. Their tests import them and pass --import to the workers they start.
STEPGUARD_WORKFLOW_MODULES = [
    "tests.workflows",
    "tests.model_workflows",
    "examples.flight_booking",
    "examples.research",
    "examples.outreach",
]
STEPGUARD_POLL_INTERVAL = 0.1
# 0 s between a run's attempts; a test shows the production default by setting the variable.
STEPGUARD_RUN_RETRY_BASE_SECONDS = float(os.environ.get("STEPGUARD_RUN_RETRY_BASE_SECONDS", "0"))
STEPGUARD_NOTIFY_SWEEP_SECONDS = 0.1
STEPGUARD_NOTIFY_RETRY_SECONDS = 0.05
# The suite's webhook receivers listen on 127.0.0.1; tests of refusal set the default, none.
STEPGUARD_WEBHOOK_ALLOW = ["127.0.0.1"]
STEPGUARD_METRICS_SUMMARY_SECONDS = 0.0  # figures right after each action (one test caches)
# Each test process its own cache (controlplane.settings puts it on Redis when REDIS_URL is set,
# shared by every process: tests/test_settings.py checks that).
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test logins

# Under pytest-xdist each test process has its own database (pytest-django adds the worker's
# suffix); its own Redis prefix keeps their live events apart too. Worker subprocesses inherit
# PYTEST_XDIST_WORKER, so they land on the same prefix as the test that started them.
_xdist_worker = os.environ.get("PYTEST_XDIST_WORKER")
if _xdist_worker and "CONFIG" in CHANNEL_LAYERS["default"]:  # noqa: F405
    CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = f"asgi-{_xdist_worker}"  # noqa: F405
