"""Reads on a replica (issue 35 item 3, runs/replica.py).

A primary of the test's own and a streaming standby made from it (pg_basebackup), and the web
process (daphne) given both: DATABASE_URL the primary, DATABASE_REPLICA_URL the standby. The
standby's replay is paused to make it lag: the pages and the API's reads show what it has,
and say how far behind it is; an action goes to the primary, and the client that acted reads
the primary afterwards; a replica that stops answering is skipped.
"""

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from django.contrib.auth.models import User

from runs import replica
from runs.approvals.models import ApprovalRequest
from runs.models import ApiKey, Event, Run
from tests.conftest import ROOT, daphne, own_cluster, wait_until
from tests.test_failover import query, standby_of
from tests.test_install import Browser
from tests.test_settings import PRODUCTION, manage

SETUP = """
import json
import tests.workflows
from django.contrib.auth.models import Group, User
from runs.apikeys import create_key
from runs.roles import ensure_groups
from runs.sdk import start_run
from django.apps import apps
ensure_groups(apps)  # the copied test database may have been flushed by an earlier test
user = User.objects.create_user("otto", password="a-long-enough-password")
user.groups.add(Group.objects.get(name="operator"))
_, key = create_key(user, "replica test")
print("SETUP " + json.dumps({"key": key, "run": str(start_run("many", {"steps": 1}).id)}))
"""

START = """
import tests.workflows
from runs.sdk import start_run
print("RUN " + str(start_run("many", {"steps": 1}).id))
"""


def on_primary(primary, code: str) -> str:
    """Run `code` in a Django process of its own on the primary; its output."""
    environ = {k: v for k, v in os.environ.items() if k != "DJANGO_ALLOW_ASYNC_UNSAFE"}
    environ.update(DATABASE_URL=primary.url(), DJANGO_SETTINGS_MODULE="tests.settings")
    done = subprocess.run(
        [sys.executable, "-c", f"import django; django.setup()\n{code}"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


class Api:
    """The API with a key, and a cookie jar (as `requests.Session` has)."""

    def __init__(self, base: str, key: str):
        self.base, self.key = base, key
        self.cookies: dict[str, str] = {}

    def call(self, method: str, path: str, body: dict | None = None, jar: bool = True):
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        if jar and self.cookies:
            headers["Cookie"] = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data, headers, method=method)
        with urllib.request.urlopen(request, timeout=15) as response:
            for cookie in response.headers.get_all("Set-Cookie") or []:
                name, _, value = cookie.split(";", 1)[0].partition("=")
                self.cookies[name] = value
            return response.headers, json.loads(response.read() or b"null")

    def run_ids(self, jar: bool = True) -> tuple[set[str], str | None]:
        headers, page = self.call("GET", "/api/runs", jar=jar)
        return {run["id"] for run in page["items"]}, headers.get("X-Stepguard-Replica-Lag")


def test_only_what_pages_show_is_read_on_the_replica_and_only_inside_a_request_that_reads_there():
    router = replica.ReplicaRouter()
    assert router.db_for_read(Run) is None  # a worker, a command, a live feed: the primary
    token = replica._reading.set(True)
    try:
        assert [router.db_for_read(m) for m in (Run, Event, ApprovalRequest)] == ["replica"] * 3
        # Who may do what is never read behind: a revoked key or a removed role is gone at once.
        assert router.db_for_read(ApiKey) is None and router.db_for_read(User) is None
        assert router.db_for_write(Run) == "default"
    finally:
        replica._reading.reset(token)
    assert not router.allow_migrate("replica", "runs") and router.allow_migrate("default", "runs")


def test_a_replica_without_a_postgresql_primary_stops_the_process(tmp_path):
    result = manage(
        "check", DATABASE_REPLICA_URL="postgres://db2/stepguard", STEPGUARD_VAR_DIR=str(tmp_path),
        **PRODUCTION,
    )  # fmt: skip
    assert result.returncode != 0
    assert "DATABASE_REPLICA_URL needs a PostgreSQL DATABASE_URL" in result.stderr


@pytest.mark.postgres
@pytest.mark.slow
def test_pages_and_api_read_the_replica_say_its_lag_and_an_action_reads_the_primary(
    transactional_db, tmp_path
):
    with own_cluster() as primary:
        standby = standby_of(primary)
        try:
            setup = json.loads(on_primary(primary, SETUP).split("SETUP ", 1)[1])
            first = setup["run"]
            env = {
                "DATABASE_URL": primary.url(),
                "DATABASE_REPLICA_URL": standby.url(),
                "STEPGUARD_REPLICA_RETRY": "1",
                "SERVE_STATIC": "1",
            }
            with daphne(tmp_path, **env) as base:
                exercise(base, setup["key"], first, primary, standby)
        finally:
            standby.stop()


def exercise(base: str, key: str, first: str, primary, standby) -> None:
    api = Api(base, key)
    # Caught up: the replica serves the list, 0 s behind.
    wait_until(lambda: first in api.run_ids()[0], what="the replica to have the first run")
    assert api.run_ids()[1] == "0.0"

    # Replay paused: a run started on the primary is not on the replica, which falls behind.
    standby.psql("SELECT pg_wal_replay_pause()")
    second = on_primary(primary, START).split("RUN ", 1)[1].strip()
    assert query(primary.port, "SELECT 1 FROM runs_run WHERE id = %s", (second,)) == [(1,)]
    ids, lag = wait_until(
        lambda: next((found for found in [api.run_ids()] if float(found[1] or 0) > 1), None),
        timeout=30,
        what="the API to say the replica lags",
    )
    assert second not in ids and first in ids  # read on the replica

    # The dashboard says so, and shows what the replica has.
    browser = Browser(base)
    browser.get("/login/")
    login = browser.post("/login/", username="otto", password="a-long-enough-password")
    assert login.status == 200 and "Log out" in login.text, login.text[:500]
    page = browser.get("/")
    assert re.search(r"reads from a replica <strong>\d+ s behind</strong>", page.text)
    assert first[:8] in page.text and second[:8] not in page.text

    # An action goes to the primary (the replica has no such run yet), and the client that
    # acted reads the primary for a while: it sees the run it just cancelled.
    api.call("POST", f"/api/runs/{second}/cancel", {"reason": "replica test"})
    ids, lag = api.run_ids()
    assert second in ids and lag is None
    assert second not in api.run_ids(jar=False)[0]  # a client that did not act: the replica

    # Metrics say how far behind.
    request = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=15) as response:
        metrics = response.read().decode()
    assert "stepguard_replica_up 1.0" in metrics
    behind = re.search(r"^stepguard_replica_lag_seconds (\S+)$", metrics, re.M)
    assert behind and float(behind[1]) > 1, metrics

    # A replica that does not answer is skipped: every read goes to the primary, and the page
    # says so.
    standby.stop()
    ids, lag = wait_until(
        lambda: next((found for found in [api.run_ids(jar=False)] if second in found[0]), None),
        timeout=30,
        what="reads to go to the primary once the replica is down",
    )
    assert lag is None
    assert "The replica does not answer" in browser.get("/").text
