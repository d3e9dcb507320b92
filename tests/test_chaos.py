"""Chaos: real workers keep going while their PostgreSQL server restarts under them.

The test starts a PostgreSQL server of its own (so restarting it disturbs nobody else), migrates
a database there, starts three `runworker` processes and thirty `file_ledger` runs (their side
effects go to files, which no database crash can take back; half of them reconcile), and
restarts the server five times while the runs are stepping: immediate shutdowns (a crash),
a fast one, and an outage of a few seconds. Then every run must complete with the right output,
no completed step may have run again, a step that ran again must say so (its write-ahead row
survived the crash), a reconciling step must have been looked up rather than re-sent, each
interrupted run must write its next step within seconds of the server accepting connections (not
a lease later), and every worker must have reconnected by itself, saying so in one line.
"""

import json
import os
import pwd
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from tests.conftest import wait_until
from tests.workflows import file_effects

ROOT = Path(__file__).resolve().parent.parent

RUNS = 30
STEPS = 20
STEP_SLEEP = 0.15
WORKERS = 3
#: Longer than the recovery target, so a run left to lease expiry shows in the measure.
LEASE_SECONDS = 10
RESTARTS = ("immediate", "fast", "immediate", "outage", "immediate")
#: How long the server stays down in the "outage" restart.
OUTAGE_SECONDS = 3
#: Median seconds from "the server accepts connections" to "an interrupted run writes its
#: next step": a loose bound that only runs left to lease expiry (LEASE_SECONDS) break. The
#: figure itself is printed, and is a benchmark's to watch (typically 0.2-0.5 s; a run whose
#: step was retried after its backoff takes the backoff longer), not this test's.
RECOVERY_TARGET = LEASE_SECONDS / 2
EXPECTED_OUTPUT = sum(range(STEPS))
#: Steps that must complete between restarts, so the restarts hit every phase of the runs.
GAP = RUNS * STEPS // (len(RESTARTS) + 2)


def cannot_run(why: str):
    """Skip on a developer's machine without the server binaries; fail in CI, which has them."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"the chaos test must run in CI: {why}")
    pytest.skip(why)


def pg_bindir() -> Path:
    versions = [
        p
        for p in Path("/usr/lib/postgresql").glob("*")
        if p.name.isdigit() and (p / "bin").is_dir()
    ]
    if versions:
        return max(versions, key=lambda p: int(p.name)) / "bin"
    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl is None:
        cannot_run("no PostgreSQL server binaries (initdb, pg_ctl) on this machine")
    return Path(pg_ctl).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ChaosServer:
    bindir: Path
    base: Path
    port: int
    #: When the fixture began (before initdb), for the summary's total.
    created: float = field(default_factory=time.monotonic)

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def log(self) -> Path:
        return self.base / "server.log"

    def as_postgres(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Server binaries refuse to run as root: run them as the `postgres` OS user then."""
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(
            [*prefix, *argv], capture_output=True, text=True, timeout=timeout, check=False
        )

    def pg_ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return self.as_postgres(
            str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), *args,
            timeout=timeout,
        )  # fmt: skip

    def is_ready(self) -> bool:
        ready = subprocess.run(
            [str(self.bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port)],
            timeout=10,
            check=False,
        )
        return ready.returncode == 0

    def url(self, dbname: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def connect(self, dbname: str) -> psycopg.Connection:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True
        )

    def restart(self, mode: str) -> None:
        if mode == "outage":
            done = self.pg_ctl("-m", "fast", "-w", "-t", "60", "stop", timeout=90)
            assert done.returncode == 0, f"pg_ctl stop: {done.stdout}{done.stderr}"
            time.sleep(OUTAGE_SECONDS)  # the outage itself, not a wait for anything
            done = self.pg_ctl("-w", "-t", "60", "start", timeout=90)
        else:
            done = self.pg_ctl("-m", mode, "-w", "-t", "60", "restart", timeout=90)
        assert done.returncode == 0, f"pg_ctl {mode}: {done.stdout}{done.stderr}\n{self.log_tail()}"
        wait_until(self.is_ready, timeout=60, what=f"PostgreSQL to accept connections ({mode})")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@pytest.fixture
def chaos_server():
    """A small PostgreSQL server of the test's own on a free port; always stopped and removed."""
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            cannot_run("running as root and there is no `postgres` user to run the server as")
    bindir = pg_bindir()
    base = Path(tempfile.mkdtemp(prefix="stepguard-chaos-"))
    server = ChaosServer(bindir, base, free_port())
    try:
        if os.geteuid() == 0:
            os.chown(base, owner.pw_uid, owner.pw_gid)
        done = server.as_postgres(
            str(server.bindir / "initdb"), "-D", str(server.data), "-U", "postgres",
            "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions",
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"initdb failed: {done.stdout}{done.stderr}"
        with (server.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# stepguard chaos test\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {server.port}\n"
                f"unix_socket_directories = '{base}'\n"
                "shared_buffers = 16MB\n"
                "max_connections = 80\n"
                "max_wal_size = 256MB\n"
            )
        done = server.pg_ctl("-w", "-t", "60", "start", timeout=90)
        assert done.returncode == 0, f"pg_ctl start: {done.stdout}{done.stderr}{server.log_tail()}"
        wait_until(server.is_ready, timeout=30, what="the chaos PostgreSQL server to start")
        yield server
    finally:
        try:
            stopped = server.pg_ctl("-m", "immediate", "-w", "-t", "30", "stop", timeout=60)
            pidfile = server.data / "postmaster.pid"
            if stopped.returncode != 0 and pidfile.exists():
                # SIGQUIT is an immediate shutdown, in case pg_ctl could not do it.
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGQUIT)
                wait_until(lambda: not pidfile.exists(), timeout=15, what="postmaster to exit")
        finally:
            shutil.rmtree(base, ignore_errors=True)


def django_env(url: str) -> dict[str, str]:
    env = {**os.environ, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return env


def manage(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


START_RUNS = """
import json
import tests.workflows
from runs.sdk import start_run
ids = [
    str(start_run("file_ledger", {{"dir": {dir!r}, "steps": {steps}, "sleep": {sleep},
                                  "reconcile": i % 2 == 0}}, key=f"chaos-{{i}}").id)
    for i in range({runs})
]
print("RUN IDS " + json.dumps(ids))
"""


class Reader:
    """Reads the chaos database with a connection of its own, reconnecting after a restart."""

    def __init__(self, server: ChaosServer, dbname: str):
        self.server, self.dbname = server, dbname
        self.conn: psycopg.Connection | None = None

    def query(self, sql: str, params=()) -> list[tuple]:
        for attempt in (1, 2):
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = self.server.connect(self.dbname)
                return self.conn.execute(sql, params).fetchall()
            except psycopg.OperationalError:
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def try_query(self, sql: str, params=()) -> list[tuple] | None:
        """Like `query`, but None while the server is not answering (for polling)."""
        try:
            return self.query(sql, params)
        except psycopg.OperationalError:
            return None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def runs_input(reader: Reader) -> list[dict]:
    return [
        {"id": run_id, **(json.loads(data) if isinstance(data, str) else data)}
        for run_id, data in reader.query("SELECT id::text, input FROM runs_run")
    ]


def completed_steps(reader: Reader) -> int | None:
    rows = reader.try_query("SELECT count(*) FROM runs_step WHERE status = 'completed'")
    return None if rows is None else rows[0][0]


@pytest.mark.postgres
@pytest.mark.slow
def test_runs_survive_database_restarts(chaos_server, tmp_path):
    dbname = "stepguard_chaos_run"
    with chaos_server.connect("postgres") as admin:
        admin.execute(f"CREATE DATABASE {dbname}")
    env = django_env(chaos_server.url(dbname))
    manage(env, "migrate", "--noinput", "-v", "0")
    reader = Reader(chaos_server, dbname)

    workers: list[tuple[subprocess.Popen, Path]] = []
    try:
        for n in range(WORKERS):
            log_path = tmp_path / f"chaos-worker-{n}.log"
            with log_path.open("w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "manage.py", "runworker", "--concurrency", "4",
                     "--lease-seconds", str(LEASE_SECONDS), "--poll-interval", "0.1"],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            workers.append((proc, log_path))

        def registered():
            for proc, log_path in workers:
                assert proc.poll() is None, f"worker exited early:\n{log_path.read_text()}"
            rows = reader.query("SELECT pid FROM runs_worker WHERE stopped_at IS NULL")
            return {proc.pid for proc, _ in workers} <= {pid for (pid,) in rows}

        wait_until(registered, timeout=30, what="the workers to register")

        effects_dir = tmp_path / "effects"
        effects_dir.mkdir()
        start = START_RUNS.format(dir=str(effects_dir), steps=STEPS, sleep=STEP_SLEEP, runs=RUNS)
        out = manage(env, "shell", "-v", "0", "-c", start)
        match = re.search(r"^RUN IDS (.*)$", out, re.MULTILINE)
        assert match, out
        run_ids = json.loads(match.group(1))
        assert len(set(run_ids)) == RUNS
        runs_started = time.monotonic()

        def unfinished() -> int:
            rows = reader.query("SELECT count(*) FROM runs_run WHERE status <> 'completed'")
            return rows[0][0]

        # Restarts are spread over the runs' lifetime: before each one, at least GAP more
        # steps must have completed than right after the previous restart (or since the start).
        unfinished_at_restart = []
        #: Per restart: the runs executing when it came, and when the server started again.
        interrupted: list[tuple[list[str], object]] = []
        baseline = 0
        for n, mode in enumerate(RESTARTS):
            wait_until(
                lambda b=baseline: (completed_steps(reader) or 0) >= b + GAP,
                timeout=60,
                what=f"{GAP} more steps to complete before restart {n + 1}",
            )
            unfinished_at_restart.append(unfinished())
            running = reader.query("SELECT id::text FROM runs_run WHERE status = 'running'")
            running = [run_id for (run_id,) in running]
            reader.close()
            chaos_server.restart(mode)
            (back,) = reader.query("SELECT pg_postmaster_start_time()")[0]
            interrupted.append((running, back))
            (baseline,) = wait_until(
                lambda: [c for c in [completed_steps(reader)] if c is not None],
                timeout=30,
                what=f"the step count after restart {n + 1}",
            )

        def all_finished():
            for proc, log_path in workers:
                assert proc.poll() is None, f"a worker exited:\n{log_path.read_text()[-5000:]}"
            rows = reader.try_query(
                "SELECT count(*) FILTER (WHERE status = 'completed'),"
                " count(*) FILTER (WHERE status IN ('failed', 'cancelled')) FROM runs_run"
            )
            if rows is None:
                return False
            done, broken = rows[0]
            if broken:
                bad = reader.query(
                    "SELECT id, status, error FROM runs_run WHERE status IN ('failed', 'cancelled')"
                )
                pytest.fail(f"runs ended without completing: {bad}")
            return done == RUNS

        wait_until(all_finished, timeout=120, what=f"all {RUNS} runs to complete")
        chaos_seconds = time.monotonic() - runs_started

        # Every run completed with the ledger's sum.
        runs = reader.query("SELECT id::text, status, output FROM runs_run")
        assert sorted(r[0] for r in runs) == sorted(run_ids)
        assert all(status == "completed" for _, status, _ in runs), runs
        assert all(output == EXPECTED_OUTPUT for _, _, output in runs), runs

        # Every step completed once, as a checkpoint with a finish time.
        steps = reader.query(
            "SELECT run_id::text, key, status, idempotency_key, finished_at, recovered"
            " FROM runs_step"
        )
        assert len(steps) == RUNS * STEPS
        assert all(status == "completed" and finished for _, _, status, _, finished, _ in steps)
        finished_at = {ikey: finished for _, _, _, ikey, finished, _ in steps}
        recovered = {ikey: how for _, _, _, ikey, _, how in steps}
        assert len(finished_at) == RUNS * STEPS, "idempotency keys are not unique per step"

        # Effects: each step ran at least once, and never again after it completed.
        effects = file_effects(str(effects_dir))
        per_key: dict[str, list[dict]] = {}
        for e in effects:
            per_key.setdefault(e["key"], []).append(e)
        assert set(per_key) == set(finished_at), "effects without a step, or steps without one"
        late = {
            ikey: (finished_at[ikey], calls)
            for ikey, calls in per_key.items()
            if any(c["at"] > finished_at[ikey].timestamp() for c in calls)
        }
        assert not late, f"completed steps ran again after completing: {late}"
        # A step called more than once was re-sent after a crash, and is shown as such: its
        # write-ahead row survived the crash. Each crash can interrupt a step once at most.
        again = {ikey: calls for ikey, calls in per_key.items() if len(calls) > 1}
        unmarked = {ikey: recovered[ikey] for ikey in again if recovered[ikey] != "resent"}
        assert not unmarked, f"steps called again without being marked re-sent: {unmarked}"
        too_many = {k: calls for k, calls in again.items() if len(calls) > 1 + len(RESTARTS)}
        assert not too_many, f"steps called more often than there were crashes: {too_many}"
        resent = len(effects) - len(steps)
        many = {ikey: calls for ikey, calls in again.items() if len(calls) > 2}
        # A reconciling run's interrupted step was looked up, found, and not sent again.
        reconciling = {r["id"] for r in runs_input(reader) if r["reconcile"]}
        twice = {k: c for k, c in again.items() if k.split(":")[0] in reconciling}
        assert not twice, f"steps with reconcile= were sent again instead of looked up: {twice}"
        asked = file_effects(str(effects_dir), "asked-*.jsonl")
        reconciled = [k for k, how in recovered.items() if how == "reconciled"]
        assert asked, "no reconcile= step was interrupted: the crashes tested nothing of it"
        assert sorted(a["key"] for a in asked if a["found"]) == sorted(reconciled)

        # Recovery time: from the server accepting connections to each interrupted run's next
        # step write (any step event of it), after every restart.
        delays = []
        for running, back in interrupted:
            for run_id in running:
                rows = reader.query(
                    "SELECT min(created_at) FROM runs_event"
                    " WHERE run_id = %s AND type LIKE 'step.%%' AND created_at > %s",
                    (run_id, back),
                )
                if rows[0][0] is not None:
                    delays.append((rows[0][0] - back).total_seconds())
        assert delays, "no run was interrupted by a restart"
        recovery = statistics.median(delays)
        assert recovery < RECOVERY_TARGET, (
            f"interrupted runs took a median {recovery:.2f}s after the database came back "
            f"to write their next step (target {RECOVERY_TARGET}s): {sorted(delays)}"
        )

        assert all(unfinished_at_restart), (
            f"runs had all finished before a restart, nothing was tested: {unfinished_at_restart}"
        )
        # The workers reconnected by themselves: all alive, and each outage was said in one
        # line when the database went and one when it was back, never with a traceback.
        for proc, log_path in workers:
            text = log_path.read_text()
            assert proc.poll() is None, f"worker {proc.pid} exited:\n{text[-5000:]}"
            assert "Traceback" not in text, f"worker {proc.pid} logged a traceback:\n{text[-5000:]}"
            assert text.count("stepguard.database: database unreachable") <= len(RESTARTS), text[
                -5000:
            ]
            assert text.count("stepguard.database: database unreachable") == text.count(
                "stepguard.database: database back after"
            )
        logs = "".join(log.read_text() for _, log in workers)
        abandoned = logs.count("abandoning the run") + logs.count("no longer ours, or stopping")
        carried_on = logs.count("carrying on under the same lease")
        print(
            f"\nchaos: {RUNS} runs, {len(steps)} steps, {resent} re-sent "
            f"({len(effects)} effect rows, {len(many)} steps called 3+ times), "
            f"{len(RESTARTS)} restarts ({'/'.join(RESTARTS)}), "
            f"unfinished runs at each restart {unfinished_at_restart}, "
            f"{carried_on} runs carried on after reconnecting, "
            f"{abandoned} left to lease recovery, "
            f"{len(asked)} reconcile lookups; "
            f"next step a median {recovery:.2f}s (max {max(delays):.2f}s, {len(delays)} runs) "
            "after the database accepted connections; "
            f"{chaos_seconds:.1f}s from start to all completed, "
            f"{time.monotonic() - chaos_server.created:.1f}s in all (with initdb)"
        )
    finally:
        reader.close()
        for proc, _ in workers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
