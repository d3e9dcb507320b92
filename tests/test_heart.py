"""Leases and completions that workflow code cannot starve (issue 48 §1-3).

A step that holds the GIL (one `sorted()` of millions of floats: a parse, a local model) stops
every other thread of its process. Before, those threads were the heartbeat and the completion
writer: the lease lapsed under a long C call and another worker ran the step again, and a step
that returned before such a call was recorded only when the next step carried it. The heart
(runs/engine/heart.py) is a process of its own: it keeps both.
"""

import datetime
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.db import connection

from runs.models import Event, RunStatus, Step, StepStatus
from runs.sdk import start_run
from tests.conftest import ROOT, wait_until
from tests.test_workers import effect_counts, wait_done
from tests.testapp.models import Effect

pytestmark = pytest.mark.slow


def floats_for(seconds: float) -> int:
    """How many floats one `sorted()` takes `seconds` to sort on this machine now (it holds the
    GIL that long): timed here, on a list big enough to time, in a process of its own like the
    worker's."""
    code = (
        "import random, time\n"
        "data = [random.random() for _ in range(400_000)]\n"
        "began = time.perf_counter(); sorted(data); print(time.perf_counter() - began)"
    )
    took = min(
        float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True).stdout)
        for _ in range(2)
    )  # fmt: skip
    # n log n: a bigger list takes a little longer per float than this, never less.
    return max(400_000, min(9_000_000, int(400_000 * seconds / took)))


@pytest.mark.postgres
def test_a_step_holding_the_gil_for_five_leases_runs_once(spawn_worker):
    """Before: the step was called 2-4 times, each call overlapping the one before (its
    worker's heartbeat could not run, the lease lapsed, the other worker took the run).

    PostgreSQL only: on SQLite a thread of the worker caught inside a write transaction when
    the C call began (a claim, a chore) holds the file's one write lock until it ends, and the
    heart's renewal waits for it (docs/sdk.md, *Steps and the GIL*)."""
    floats = floats_for(5.0)
    spawn_worker(lease=1.0)
    spawn_worker(lease=1.0)
    began = time.monotonic()
    run = start_run("gil", {"floats": floats})
    run = wait_done(run, timeout=120)
    took = time.monotonic() - began
    calls = effect_counts().get(f"{run.pk}:hold", 0)
    print(f"{floats} floats: the run took {took:.1f} s; the step was called {calls} time(s)")
    assert calls == 1, f"the step was called {calls} times ({run.status}: {run.error})"
    assert run.status == RunStatus.COMPLETED, run.error
    assert run.recoveries == 0
    assert not Event.objects.filter(run=run, type="run.recovered").exists()


def test_a_step_is_recorded_within_the_window_while_the_workflow_holds_the_gil(spawn_worker):
    """Before: 3-5 s (the sort's length), when the next step carried it.

    When step a's completion was written is the database's own clock at the write (a trigger
    the test adds), not when this test happened to read it: on a loaded machine the reader
    lagged 3-8 s behind a write made in time."""
    floats = floats_for(3.0)
    with completion_written("a") as written:
        spawn_worker()
        run = start_run("gil", {"floats": floats, "between": True})
        row = wait_until(
            lambda: Step.objects.filter(run=run, key="a", status=StepStatus.COMPLETED).first(),
            timeout=30,
            what="step a recorded",
        )
        assert wait_done(run, timeout=60).status == RunStatus.COMPLETED
        at = written()
    b = Step.objects.get(run=run, key="b")
    after = (at - row.finished_at).total_seconds()
    held = (b.started_at - row.finished_at).total_seconds()  # the sort between a and b
    print(f"step a written {after * 1000:.0f} ms after it returned; the GIL held {held:.1f} s")
    # The window is 0.1 s (and the heart looks ten times per window); 1 s leaves room for a
    # loaded machine, and on one so loaded that the 3 s sort took longer, a third of it.
    assert after < max(1.0, held / 3), f"step a was written {after:.2f} s after it returned"
    assert at < b.started_at, "step a was recorded only by step b's start"


@contextmanager
def completion_written(key: str):
    """A trigger that notes, on the database's clock, when a step `key` is written completed;
    yields what reads it."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("CREATE TABLE heart_probe (at timestamptz)")
            cursor.execute(
                "CREATE FUNCTION heart_probe() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF NEW.key = '{key}' AND NEW.status = 'completed' THEN "
                "INSERT INTO heart_probe VALUES (clock_timestamp()); END IF; RETURN NEW; END $$"
            )
            cursor.execute(
                "CREATE TRIGGER heart_probe AFTER INSERT OR UPDATE ON runs_step "
                "FOR EACH ROW EXECUTE FUNCTION heart_probe()"
            )
        else:
            cursor.execute("CREATE TABLE heart_probe (at text)")
            for event in ("INSERT", "UPDATE"):
                cursor.execute(
                    f"CREATE TRIGGER heart_probe_{event} AFTER {event} ON runs_step "
                    f"WHEN NEW.key = '{key}' AND NEW.status = 'completed' BEGIN "
                    "INSERT INTO heart_probe VALUES (strftime('%Y-%m-%d %H:%M:%f', 'now')); END"
                )

    def written() -> datetime.datetime:
        with connection.cursor() as cursor:
            cursor.execute("SELECT min(at) FROM heart_probe")
            at = cursor.fetchone()[0]
        assert at is not None, f"no completed write of step {key} seen"
        if isinstance(at, str):  # SQLite's clock: UTC
            at = datetime.datetime.fromisoformat(at).replace(tzinfo=datetime.UTC)
        return at

    try:
        yield written
    finally:
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("DROP TRIGGER heart_probe ON runs_step")
                cursor.execute("DROP FUNCTION heart_probe()")
            else:
                for event in ("INSERT", "UPDATE"):
                    cursor.execute(f"DROP TRIGGER heart_probe_{event}")
            cursor.execute("DROP TABLE heart_probe")


@pytest.mark.postgres
def test_a_step_that_returns_during_a_database_outage_is_recorded_when_it_is_back(
    own_postgres, spawn_worker, tmp_path
):
    """Before: the failed write was left to the execution's carry-on, which only the next
    step (60 s on, here) set off."""
    cluster = own_postgres
    cluster.psql("TRUNCATE runs_run, runs_worker, testapp_effect CASCADE")
    env = {"DATABASE_URL": cluster.url(), "DB_CONNECT_TIMEOUT": "2"}
    worker = spawn_worker(wait=False, env=env, lease=10.0)
    wait_until(
        lambda: (
            cluster.psql("SELECT count(*) FROM runs_worker") == "1"
            or worker.proc.poll() is not None
        ),
        timeout=60,
        what="the worker on the test's own cluster to register",
    )
    returned = tmp_path / "returned"
    code = (
        "import tests.workflows\nfrom runs.sdk import start_run\n"
        f"print(start_run('gap', {{'step_sleep': 2, 'gap': 60, 'returned': '{returned}'}}).pk)"
    )
    started = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, capture_output=True,
        text=True, env={**_environ(), "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
    )  # fmt: skip
    assert started.returncode == 0, started.stderr[-3000:]
    run_id = started.stdout.strip().splitlines()[-1]
    effect = f"SELECT count(*) FROM testapp_effect WHERE idempotency_key = '{run_id}:a'"
    wait_until(lambda: cluster.psql(effect) == "1", what="step a's effect")
    data = str(cluster.data)
    cluster.run("pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
    try:
        wait_until(returned.exists, what="step a to return")
        time.sleep(1.0)  # the outage itself: the writer's attempts fail meanwhile
    finally:
        cluster.start()
    back = time.monotonic()
    status = f"SELECT status FROM runs_step WHERE run_id = '{run_id}' AND key = 'a'"
    wait_until(
        lambda: cluster.psql(status) == "completed",
        timeout=15,
        what=lambda: f"step a recorded after the outage (it is {cluster.psql(status)!r})",
    )
    print(f"step a recorded {time.monotonic() - back:.2f} s after the database came back")
    b = f"SELECT count(*) FROM runs_step WHERE run_id = '{run_id}' AND key = 'b'"
    assert cluster.psql(b) == "0"  # the next step did not carry it
    assert worker.proc.poll() is None, worker.output()[-3000:]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def test_a_heart_that_dies_is_replaced_and_told_every_lease(spawn_worker):
    if not Path("/proc").is_dir():
        pytest.skip("finds the heart's pid in /proc")
    worker = spawn_worker(lease=2.0)
    run = start_run("gap", {"gap": 8})
    wait_until(lambda: Effect.objects.filter(idempotency_key=f"{run.pk}:a").exists(), what="a")
    (heart,) = wait_until(lambda: children(worker.pid), what="the worker's heart")
    os.kill(heart, signal.SIGKILL)
    wait_until(lambda: "starting another" in worker.output(), what="the worker to notice")
    run = wait_done(run)
    # Its lease was kept through the 8 s between the steps (4 leases): no other claim.
    assert run.status == RunStatus.COMPLETED and run.recoveries == 0
    assert not Event.objects.filter(run=run, type="run.recovered").exists()
    assert effect_counts() == {f"{run.pk}:a": 1, f"{run.pk}:b": 1}
    (new,) = children(worker.pid)
    assert new != heart


def _environ() -> dict:
    env = dict(os.environ)
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return env


def test_a_lease_shorter_than_the_floor_is_warned_about_at_start(spawn_worker):
    """Issue 49 §6: under a 1 s lease a machine short of CPU delayed the heart's renewal past
    the lease and a step was re-sent with no crash; the worker says so when it starts."""
    short = spawn_worker(lease=1.0)
    wait_until(lambda: "a lease of 1 s" in short.output(), what="the short lease's warning")
    assert "use 10 s or more in production" in short.output()
    long = spawn_worker(lease=10.0)
    assert "a lease of" not in long.output()  # registered: the warning would be out by now
