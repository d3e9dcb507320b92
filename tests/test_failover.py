"""A primary failover loses nothing (issue 35 item 2).

Two PostgreSQL clusters of the test's own: a primary and a streaming standby made from it by
pg_basebackup, synchronous (synchronous_standby_names, synchronous_commit=on: a commit returns
once the standby has it). Three worker processes reach them through one multi-host DATABASE_URL
(`host1:port1,host2:port2 ... target_session_attrs=read-write`). Mid-run the primary's host dies
(every process of it SIGKILLed), the standby is promoted, and the workers, never restarted,
find it by themselves: every run completes, no completed step is lost or run again, a step in
flight is re-sent marked `resent` or reconciled, and each interrupted run's next step comes
within seconds of the promotion.
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys

import psycopg
import pytest

from tests.conftest import ROOT, Cluster, _free_port, own_cluster, wait_until
from tests.workflows import file_effects

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

RUNS, STEPS, SLEEP, WORKERS, LEASE = 12, 15, 0.3, 3, 10
EXPECTED_OUTPUT = sum(range(STEPS))

START_RUNS = """
import json
import os
import tests.workflows
from runs.sdk import start_run
ids = [
    str(start_run("file_ledger", {{"dir": {dir!r}, "steps": {steps}, "sleep": {sleep},
                                  "reconcile": i % 2 == 0}}).id)
    for i in range({runs})
]
print("RUN IDS " + json.dumps(ids))
"""


def standby_of(primary: Cluster) -> Cluster:
    """A streaming standby of `primary` (pg_basebackup -R) on a port of its own, started; one
    that, once promoted, waits for no standby of its own."""
    home = primary.home / "standby"
    home.mkdir()
    home.chmod(0o777)
    standby = Cluster(primary.bin, home, _free_port())
    standby.run(
        "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
        "-D", str(standby.data), "-R", "-X", "stream", "--no-sync", "--checkpoint=fast",
    )  # fmt: skip
    with (standby.data / "postgresql.conf").open("a") as conf:
        conf.write(
            f"port = {standby.port}\nunix_socket_directories = '{home}'\n"
            "synchronous_standby_names = ''\n"
        )
    standby.start()
    return standby


def query(port: int, sql: str, params=()) -> list[tuple] | None:
    """Rows, or None while that server does not answer."""
    try:
        with psycopg.connect(
            host="127.0.0.1", port=port, user="postgres", dbname="stepguard", connect_timeout=3
        ) as conn:
            return conn.execute(sql, params).fetchall()
    except psycopg.OperationalError:
        return None


def test_a_promoted_synchronous_standby_loses_nothing(spawn_worker, tmp_path):
    with own_cluster("synchronous_commit = on\nwal_keep_size = 256MB") as primary:
        standby = standby_of(primary)
        try:
            # Synchronous from now on: a commit returns once the standby has it.
            primary.psql("ALTER SYSTEM SET synchronous_standby_names = '*'")
            primary.psql("SELECT pg_reload_conf()")
            wait_until(
                lambda: (
                    query(primary.port, "SELECT sync_state FROM pg_stat_replication") == [("sync",)]
                ),
                timeout=30,
                what="the standby to stream synchronously",
            )
            run_failover(primary, standby, spawn_worker, tmp_path)
        finally:
            standby.stop()


def run_failover(primary: Cluster, standby: Cluster, spawn_worker, tmp_path) -> None:
    url = (
        f"postgres://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/stepguard"
        "?target_session_attrs=read-write"
    )
    env = {"DATABASE_URL": url, "DB_CONNECT_TIMEOUT": "2"}
    workers = [
        spawn_worker("--concurrency", "4", lease=LEASE, wait=False, env=env) for _ in range(WORKERS)
    ]
    live = "SELECT count(*) FROM runs_worker WHERE stopped_at IS NULL"
    wait_until(
        lambda: (
            (query(primary.port, live) or [(0,)])[0][0] == WORKERS
            or any(w.proc.poll() is not None for w in workers)
        ),
        timeout=60,
        what="the workers to register",
    )
    assert all(w.proc.poll() is None for w in workers), [w.output() for w in workers]

    effects_dir = tmp_path / "effects"
    effects_dir.mkdir()
    code = START_RUNS.format(dir=str(effects_dir), steps=STEPS, sleep=SLEEP, runs=RUNS)
    environ = {k: v for k, v in os.environ.items() if k != "DJANGO_ALLOW_ASYNC_UNSAFE"}
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-v", "0", "-c", code],
        cwd=ROOT, capture_output=True, text=True,
        env={**environ, **env, "DJANGO_SETTINGS_MODULE": "tests.settings"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    run_ids = json.loads(re.search(r"^RUN IDS (.*)$", done.stdout, re.MULTILINE).group(1))

    completed = "SELECT count(*) FROM runs_step WHERE status = 'completed'"
    wait_until(
        lambda: (query(primary.port, completed) or [(0,)])[0][0] >= RUNS * STEPS // 3,
        timeout=60,
        what="a third of the steps to complete on the primary",
    )
    committed = dict(
        query(
            primary.port,
            "SELECT idempotency_key, finished_at FROM runs_step WHERE status = 'completed'",
        )
    )
    running = [
        r for (r,) in query(primary.port, "SELECT id::text FROM runs_run WHERE status = 'running'")
    ]
    # The primary's host dies: every process of it at once, no shutdown.
    primary.signal_all(signal.SIGKILL)
    standby.run("pg_ctl", "-D", str(standby.data), "-w", "promote")
    (promoted,) = query(standby.port, "SELECT now()")[0]
    assert query(standby.port, "SELECT pg_is_in_recovery()") == [(False,)]

    finished = "SELECT count(*) FROM runs_run WHERE status IN ('completed', 'failed', 'cancelled')"

    def all_finished() -> bool:
        for w in workers:
            assert w.proc.poll() is None, f"a worker exited:\n{w.output()[-5000:]}"
        rows = query(standby.port, finished)
        return rows is not None and rows[0][0] == RUNS

    wait_until(all_finished, timeout=120, what=f"all {RUNS} runs to end on the new primary")

    runs = query(standby.port, "SELECT id::text, status, output FROM runs_run")
    assert sorted(r[0] for r in runs) == sorted(run_ids)
    assert {(status, output) for _, status, output in runs} == {("completed", EXPECTED_OUTPUT)}
    steps = query(
        standby.port,
        "SELECT idempotency_key, status, finished_at, recovered FROM runs_step",
    )
    assert len(steps) == RUNS * STEPS and {s[1] for s in steps} == {"completed"}
    finished_at = {k: at for k, _, at, _ in steps}
    recovered = {k: how for k, _, _, how in steps}
    # Nothing the primary had committed was lost: each step it had completed is there, as it was.
    lost = {k: at for k, at in committed.items() if finished_at.get(k) != at}
    assert not lost, f"completed steps lost or rewritten by the failover: {lost}"

    per_key: dict[str, list[dict]] = {}
    for effect in file_effects(str(effects_dir)):
        per_key.setdefault(effect["key"], []).append(effect)
    assert set(per_key) == set(finished_at)
    late = {
        k: calls
        for k, calls in per_key.items()
        if any(c["at"] > finished_at[k].timestamp() for c in calls)
    }
    assert not late, f"completed steps ran again after completing (lost on failover): {late}"
    again = {k: calls for k, calls in per_key.items() if len(calls) > 1}
    unmarked = {k: recovered[k] for k in again if recovered[k] != "resent"}
    assert not unmarked, f"steps called again without being marked re-sent: {unmarked}"

    delays = []
    for run_id in running:
        rows = query(
            standby.port,
            "SELECT min(created_at) FROM runs_event"
            " WHERE run_id = %s AND type LIKE 'step.%%' AND created_at > %s",
            (run_id, promoted),
        )
        if rows and rows[0][0] is not None:
            delays.append((rows[0][0] - promoted).total_seconds())
    assert delays, "no run was interrupted by the failover"
    # A run left to its lease (10 s) would show here; found at once, it is about a second.
    assert statistics.median(delays) < LEASE / 2, sorted(delays)

    for w in workers:
        text = w.output()
        assert "Traceback" not in text, text[-5000:]
        assert text.count("stepguard.database: database unreachable") <= 1, text[-5000:]
    resent = sum(1 for how in recovered.values() if how == "resent")
    reconciled = sum(1 for how in recovered.values() if how == "reconciled")
    print(
        f"\nfailover: {RUNS} runs x {STEPS} steps, {len(committed)} completed before the kill, "
        f"{len(running)} running; {resent} re-sent, {reconciled} reconciled; "
        f"promotion to next step: median {statistics.median(delays):.2f} s, "
        f"max {max(delays):.2f} s, all {sorted(round(d, 2) for d in delays)}"
    )
