"""Settings for the test suite and the worker subprocesses it starts."""

import os

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production-0123456789abcdef")

from controlplane.settings import *  # noqa: F403

SECURE_SSL_REDIRECT = False
STEPGUARD_WORKFLOW_MODULES = ["tests.workflows", "examples.flight_booking"]
STEPGUARD_POLL_INTERVAL = 0.1
STEPGUARD_RUN_RETRY_BASE_SECONDS = 0.0
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast test logins
