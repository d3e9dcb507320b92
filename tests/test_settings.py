"""Settings come from the environment, fail loudly, and are production-safe by default."""

import os
import subprocess
import sys

from tests.conftest import ROOT

PRODUCTION = {
    "DEBUG": "0",
    "SECRET_KEY": "k" * 20 + "-production-like-secret-with-enough-entropy-9f8e7d6c5b4a",
    "ALLOWED_HOSTS": "stepguard.example.com",
    "DATABASE_URL": "",
}


def manage(*args: str, **env: str) -> subprocess.CompletedProcess:
    drop = ("SECRET_KEY", "DEBUG", "DJANGO_ALLOW_ASYNC_UNSAFE")
    environ = {k: v for k, v in os.environ.items() if k not in drop}
    environ.update(DJANGO_SETTINGS_MODULE="controlplane.settings", **env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=environ, capture_output=True, text=True
    )


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    result = manage(
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        STEPGUARD_VAR_DIR=str(tmp_path),
        **PRODUCTION,
    )
    assert result.returncode == 0, result.stderr


def test_a_missing_secret_key_stops_the_process_with_its_name(tmp_path):
    result = manage("check", DEBUG="0", STEPGUARD_VAR_DIR=str(tmp_path))
    assert result.returncode != 0
    assert "SECRET_KEY must be set when DEBUG is off" in result.stderr


def test_a_malformed_setting_names_the_variable(tmp_path):
    result = manage(
        "check", STEPGUARD_LEASE_SECONDS="soon", STEPGUARD_VAR_DIR=str(tmp_path), **PRODUCTION
    )
    assert result.returncode != 0
    assert "STEPGUARD_LEASE_SECONDS='soon' is not a number" in result.stderr


def test_the_health_check_is_the_only_anonymous_route(client, db):
    assert client.get("/health").json()["database"] == "ok"
    response = client.get("/admin/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
