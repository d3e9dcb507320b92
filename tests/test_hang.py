"""A database that hangs instead of refusing (issue 35 item 5): a SIGSTOPped PostgreSQL.

A stopped server accepts TCP connections (the kernel queues them) and answers nothing, so a
client without timeouts waits as long as the server is stopped. Before, /api/health did: the
load balancer's check hung with it. Tested on a cluster of the test's own, never the shared one.
"""

import concurrent.futures
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import ROOT, daphne, wait_until

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _get(url: str, **headers: str) -> tuple[int, dict | str, float]:
    """Status, body (JSON if it is) and seconds taken; a client timeout far above what is
    asserted."""
    began = time.monotonic()
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        status, body = refused.code, refused.read()
    try:
        return status, json.loads(body or b"null"), time.monotonic() - began
    except ValueError:
        return status, body.decode(), time.monotonic() - began


def _start_runs(url: str, n: int, steps: int) -> None:
    code = (
        "import tests.workflows\nfrom runs.sdk import start_run\n"
        f"for _ in range({n}): start_run('ledger', {{'steps': {steps}, 'sleep': 0.1}})"
    )
    env = {"DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT, capture_output=True, text=True, env={**_environ(), **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def _environ() -> dict:
    import os

    env = dict(os.environ)
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return env


def test_a_stopped_database_fails_health_fast_and_workers_carry_on(
    own_postgres, spawn_worker, tmp_path
):
    cluster = own_postgres
    cluster.psql("TRUNCATE runs_run, runs_worker, testapp_effect CASCADE")
    worker = spawn_worker(
        "--concurrency",
        "4",
        wait=False,
        env={"DATABASE_URL": cluster.url(), "DB_CONNECT_TIMEOUT": "2"},
    )
    live = "SELECT count(*) FROM runs_worker WHERE stopped_at IS NULL"
    wait_until(
        lambda: cluster.psql(live) == "1" or worker.proc.poll() is not None,
        timeout=60,
        what="the worker on the test's own cluster to register",
    )
    assert worker.proc.poll() is None, worker.output()
    _start_runs(cluster.url(), 8, 10)
    completed = "SELECT count(*) FROM runs_step WHERE status = 'completed'"
    wait_until(lambda: int(cluster.psql(completed)) >= 4, what="steps to complete")

    env = {"DATABASE_URL": cluster.url(), "DB_CONNECT_TIMEOUT": "2", "REDIS_URL": ""}
    env["STEPGUARD_HEALTH_TIMEOUT"] = "2"
    with daphne(tmp_path, **env) as url:
        status, body, _ = _get(f"{url}/api/health")
        assert status == 200 and body["database"] == "ok"

        cluster.signal_all(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            status, body, took = _get(f"{url}/api/health")
            assert status == 503 and body["status"] == "down", body
            assert body["database"] in ("down", "timeout")
            assert took < 5, f"/api/health took {took:.1f} s to say the database is down"
            # Checks do not pile up behind the stuck one: twenty at once, each answered.
            with concurrent.futures.ThreadPoolExecutor(20) as pool:
                answers = list(pool.map(_get, [f"{url}/api/health"] * 20))
            assert {a[0] for a in answers} == {503}
            slowest = max(a[2] for a in answers)
            assert slowest < 5, f"the slowest of 20 checks took {slowest:.1f} s"
            print(f"health: 503 in {took:.2f} s; 20 at once, slowest {slowest:.2f} s")
            # Requests that need the database fail as fast, saying why: the API (its key is
            # looked up) and a dashboard page (its session is).
            status, body, took = _get(f"{url}/api/runs", Authorization="Bearer sg_nosuchkey")
            assert status == 503 and took < 5, (status, body, took)
            assert body["error"]["code"] == "database_unavailable", body
            status, body, took = _get(f"{url}/", Cookie="sessionid=nosuchsession")
            assert status == 503 and took < 5, (status, body, took)
            assert "database is not answering" in body, body
            print(f"API and dashboard: 503 in {took:.2f} s")
            # Longer than the workers' lease (2 s): they find their leases lapsed on waking.
            while time.monotonic() - stopped < 6:
                time.sleep(0.2)
        finally:
            cluster.signal_all(signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(
            lambda: _get(f"{url}/api/health")[0] == 200, timeout=30, what="health back to 200"
        )
        print(f"health 200 again {time.monotonic() - resumed:.2f} s after SIGCONT")

    # The worker carries on without a restart: every run completes, every step ran once.
    ended = "SELECT count(*) FROM runs_run WHERE status IN ('completed', 'failed', 'cancelled')"
    wait_until(lambda: cluster.psql(ended) == "8", timeout=90, what="the 8 runs to end")
    assert cluster.psql("SELECT DISTINCT status FROM runs_run") == "completed"
    assert cluster.psql(completed) == "80"
    # A step called twice (its first call interrupted by the stop) is marked re-sent.
    unmarked = (
        "SELECT count(*) FROM (SELECT idempotency_key FROM testapp_effect GROUP BY 1"
        " HAVING count(*) > 1) d WHERE NOT EXISTS (SELECT 1 FROM runs_step s"
        " WHERE s.idempotency_key = d.idempotency_key AND s.recovered = 'resent')"
    )
    assert cluster.psql(unmarked) == "0", worker.output()[-5000:]
    assert worker.proc.poll() is None, worker.output()[-5000:]
    logs = worker.output()
    assert "Traceback" not in logs, logs[-5000:]
    assert logs.count("stepguard.database: database unreachable") <= 1, logs[-5000:]
    print(logs[-3000:])
