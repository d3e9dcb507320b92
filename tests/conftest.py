import asyncio
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from runs.engine.fences import Lease
from runs.engine.lifecycle import execute
from runs.engine.worker import WorkerProcess
from runs.models import Run, RunStatus
from tests import workflows

ROOT = Path(__file__).resolve().parent.parent

# Playwright's sync API keeps an event loop running in the test thread (browser tests only);
# the servers the tests start never get this variable.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


def pytest_collection_modifyitems(config, items):
    """On SQLite, PostgreSQL-only tests are deselected (not skipped): they cannot run there.

    Tests marked `slow` go first, so that under pytest-xdist the longest ones start at once
    and the processes finish together instead of one waiting on a long test handed out last.
    """
    if connection.vendor != "postgresql":
        keep, drop = [], []
        for item in items:
            (drop if item.get_closest_marker("postgres") else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """At the end, close what is still connected to the test database so it can be dropped.

    The connections that Channels' `database_sync_to_async` opens live in asgiref's thread pool
    and outlast the tests that used them; Django's teardown would fail on them after a 5 s wait.
    """
    yield
    if connection.vendor == "postgresql":
        with django_db_blocker.unblock(), connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )


def run_coroutine(coroutine):
    """`asyncio.run(coroutine)` on a thread of its own: once a browser test ran in this
    process, Playwright's sync API keeps an event loop running in the test thread, and
    asyncio.run() refuses to start there."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def wait_until(
    condition: Callable[[], object],
    *,
    timeout: float = 20.0,
    what: str | Callable[[], str] = "condition",
):
    """Poll `condition` until it returns something truthy; fail with `what` after `timeout` s
    (a callable `what` is asked at the failure, to show the state that was waited on)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(
                f"timed out after {timeout}s waiting for {what() if callable(what) else what}"
            )
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _reset_workflow_state():
    workflows.calls.clear()
    workflows.crash_at.clear()
    workflows.variant.clear()
    workflows.seen.clear()
    workflows.hooks.clear()


@pytest.fixture
def drive(db):
    """Claim and execute runnable runs in this thread, like a worker with one slot.

    Returns the outcomes. A `workflows.Crash` propagates, as if the process died there.
    """
    worker = WorkerProcess(concurrency=1)
    worker.register()
    if connection.vendor == "postgresql" and connection.in_atomic_block:
        # The spend triggers are deferred to commit (migration 0023), and a test's transaction
        # never commits: here they fire at the end of each statement, as a commit would.
        with connection.cursor() as cursor:
            cursor.execute("SET CONSTRAINTS runs_spend_insert, runs_spend_update IMMEDIATE")

    def _drive(*, limit: int = 50) -> list[str]:
        outcomes = []
        for _ in range(limit):
            claimed = worker.claim(1)
            if not claimed:
                break
            run = claimed[0]
            outcomes.append(execute(run, Lease(run.id, run.lease_epoch)))
        return outcomes

    return _drive


@pytest.fixture
def expire_lease(db):
    """Make a run's lease lapse now, as if its worker stopped heartbeating long ago."""

    def _expire(run_id):
        past = timezone.now() - timezone.timedelta(seconds=1)
        Run.objects.filter(pk=run_id, status=RunStatus.RUNNING).update(lease_until=past)

    return _expire


def database_url() -> str:
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class WorkerProc:
    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        env = {
            **os.environ,
            "DATABASE_URL": database_url(),
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            **(env or {}),
        }
        env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        self.log_path = log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "runworker", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def wait_registered(self, timeout: float = 60.0) -> None:
        from runs.models import Worker

        wait_until(
            lambda: (
                Worker.objects.filter(pid=self.pid, stopped_at__isnull=True).exists()
                or self.proc.poll() is not None
            ),
            timeout=timeout,
            what=f"worker {self.pid} to register",
        )
        assert self.proc.poll() is None, self.output()


@pytest.fixture
def spawn_worker(transactional_db, tmp_path):
    """Start real `runworker` processes on the test database; all are killed at teardown."""
    started: list[WorkerProc] = []

    def _spawn(
        *args: str, lease: float = 2.0, wait: bool = True, env: dict | None = None
    ) -> WorkerProc:
        argv = ["--lease-seconds", str(lease), "--poll-interval", "0.1", *args]
        worker = WorkerProc(argv, tmp_path / f"worker-{len(started)}.log", env)
        started.append(worker)
        if wait:
            worker.wait_registered()
        return worker

    yield _spawn
    for worker in started:
        if worker.proc.poll() is None:
            worker.signal(signal.SIGCONT)
        worker.kill()


@pytest.fixture
def cast(django_user_model):
    """The named cast of the permission tests: one user per role, and a superuser."""
    from django.apps import apps
    from django.contrib.auth.models import Group

    from runs.roles import ensure_groups

    ensure_groups(apps)  # a flush after a transactional test removes the migration's groups
    users = {}
    for name, role in (("vera", "viewer"), ("otto", "operator"), ("ada", "approver")):
        users[name] = django_user_model.objects.create_user(name, password="x")
        users[name].groups.add(Group.objects.get(name=role))
    return users


@pytest.fixture
def alice(django_user_model):
    """An approver who may also cancel runs."""
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("alice", password="x")
    user.user_permissions.add(
        Permission.objects.get(codename="decide_approvalrequest"),
        Permission.objects.get(codename="cancel_run"),
    )
    return user


@contextmanager
def daphne(tmp_path, **env):
    """daphne on a port the OS picks, with `env` over the test settings; yields its URL."""
    log = tmp_path / "daphne.log"
    environ = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env}
    environ["ALLOWED_HOSTS"] = env.get("ALLOWED_HOSTS", "127.0.0.1,localhost")
    environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", "0",
             "controlplane.asgi:application"],
            cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        match = wait_until(
            lambda: re.search(r"Listening on TCP address 127\.0\.0\.1:(\d+)", log.read_text()),
            what="daphne to listen",
        )
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture
def server(transactional_db, tmp_path):
    """daphne on the test database, serving static files."""
    with daphne(tmp_path, DATABASE_URL=database_url(), SERVE_STATIC="1") as url:
        yield url


@pytest.fixture
def demo_model(monkeypatch):
    """The scripted demo model on 127.0.0.1 (workers started afterwards inherit its URL)."""
    from examples.model_server import serve

    server, model = serve()
    monkeypatch.setenv("STEPGUARD_MODEL_BASE_URL", f"http://127.0.0.1:{server.server_port}/v1")
    yield model
    server.shutdown()


PGBOUNCER = "/usr/sbin/pgbouncer"


@contextmanager
def running_pgbouncer(server_port: int | None = None):
    """Debian's PgBouncer in transaction pooling mode, with its default settings otherwise, in
    front of the test database's server (or the one on `server_port`, on 127.0.0.1) on a free
    port, with the test database's credentials: yields its port."""
    import shutil
    import socket
    import tempfile

    if not os.path.exists(PGBOUNCER):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "PgBouncer is missing: CI must run the pooler tests (apt-get install pgbouncer)"
            )
        pytest.skip("pgbouncer is not installed")
    s = connection.settings_dict
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Not under pytest's own temporary directory: only root may enter that, and PgBouncer
    # drops root for the postgres user.
    home = Path(tempfile.mkdtemp(prefix="stepguard-pgbouncer-"))
    home.chmod(0o777)
    host, target = (s["HOST"] or "127.0.0.1", s["PORT"] or 5432)
    if server_port is not None:
        host, target = "127.0.0.1", server_port
    server = f"host={host} port={target} user={s['USER']}"
    if s["PASSWORD"]:
        server += f" password={s['PASSWORD']}"
    (home / "pgbouncer.ini").write_text(
        f"[databases]\n* = {server}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        "auth_type = any\npool_mode = transaction\nmax_client_conn = 200\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {home}/pgbouncer.log\npidfile = {home}/pgbouncer.pid\n"
    )
    argv = [PGBOUNCER, str(home / "pgbouncer.ini")]
    if os.geteuid() == 0:
        argv[1:1] = ["-u", "postgres"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def accepting() -> bool:
        assert proc.poll() is None, (home / "pgbouncer.log").read_text()
        with socket.socket() as client:
            return client.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(accepting, timeout=10, what="PgBouncer to listen")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def pgbouncer(transactional_db):
    """PgBouncer (`running_pgbouncer`) in front of the test database: yields its DATABASE_URL."""
    s = connection.settings_dict
    with running_pgbouncer() as port:
        auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
        yield f"postgres://{auth}@127.0.0.1:{port}/{s['NAME']}"


def _pg_bin() -> Path | None:
    """Debian's newest PostgreSQL binaries (initdb, pg_ctl, ...), if installed."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


class Cluster:
    """A PostgreSQL cluster of a test's own on 127.0.0.1 (trust, user postgres), so a test may
    stop, kill or promote it without touching the shared server. Run as the postgres user
    when the tests run as root (initdb refuses root)."""

    def __init__(self, bin_dir: Path, home: Path, port: int):
        self.bin, self.home, self.port = bin_dir, home, port
        self.data = home / "data"

    def run(self, *argv: str, check: bool = True) -> None:
        command = [str(self.bin / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, cwd=self.home, timeout=120)
        assert done.returncode == 0 or not check, f"{argv[0]}: {done.stdout}{done.stderr}"

    def url(self, dbname: str = "stepguard") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.home / "log"), "-w", "start")

    def stop(self) -> None:
        self.signal_all(signal.SIGCONT)
        if (self.data / "postmaster.pid").exists():  # a killed one leaves it: pg_ctl says so
            self.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def postmaster(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            return None

    def pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, walwriter, ...)."""
        root = self.postmaster()
        if root is None:
            return []
        pids = [root]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == root:
                pids.append(int(stat.parent.name))
        return pids

    def signal_all(self, sig: int) -> None:
        for pid in self.pids():
            with suppress(ProcessLookupError):
                os.kill(pid, sig)

    def psql(self, sql: str, dbname: str = "stepguard") -> str:
        out = subprocess.run(
            [str(self.bin / "psql"), "-X", "-tA", "-v", "ON_ERROR_STOP=1", self.url(dbname),
             "-c", sql],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return out.stdout.strip()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _need_pg_bin() -> Path:
    bin_dir = _pg_bin()
    if bin_dir is None or connection.vendor != "postgresql":
        if os.environ.get("CI") == "true" and connection.vendor == "postgresql":
            pytest.fail("PostgreSQL's server binaries are missing: apt-get install postgresql")
        pytest.skip("PostgreSQL's server binaries are not installed")
    return bin_dir


@contextmanager
def own_cluster(conf: str = "", copy: bool = True):
    """A started Cluster of the caller's own (extra postgresql.conf lines in `conf`), holding a
    copy of the test database (schema and migration data: pg_dump, not migrate, for speed) in
    database `stepguard` unless `copy` is false; stopped and removed at the end."""
    import shutil
    import tempfile

    bin_dir = _need_pg_bin()
    # Not under pytest's temporary directory: only root may enter that.
    home = Path(tempfile.mkdtemp(prefix="stepguard-pg-"))
    home.chmod(0o777)
    cluster = Cluster(bin_dir, home, _free_port())
    try:
        cluster.run("initdb", "-D", str(cluster.data), "-A", "trust", "-U", "postgres", "--no-sync")
        with (cluster.data / "postgresql.conf").open("a") as out:
            out.write(
                f"listen_addresses = '127.0.0.1'\nport = {cluster.port}\n"
                f"unix_socket_directories = '{home}'\nfsync = off\nshared_buffers = 32MB\n"
                f"max_connections = 60\n{conf}\n"
            )
        cluster.start()
        if copy:
            cluster.psql("CREATE DATABASE stepguard", dbname="postgres")
            s = connection.settings_dict
            dump = subprocess.run(
                [str(bin_dir / "pg_dump"), "--no-owner", "--no-privileges", "-h",
                 s["HOST"] or "127.0.0.1", "-p", str(s["PORT"] or 5432), "-U", s["USER"],
                 s["NAME"]],
                check=True, capture_output=True,
                env={**os.environ, "PGPASSWORD": s["PASSWORD"] or ""},
            )  # fmt: skip
            subprocess.run(
                [str(bin_dir / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", cluster.url()],
                input=dump.stdout, check=True, capture_output=True,
            )  # fmt: skip
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def own_postgres(django_db_setup):
    """A PostgreSQL cluster of the session's own with a copy of the test database (`own_cluster`).
    A test that stops it must let it go on again (SIGCONT) before it ends."""
    with own_cluster() as cluster:
        yield cluster


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser():
    """One Chromium per test process, shared by every browser test module: Playwright's sync
    API refuses a second instance while one runs in the same thread."""
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI") == "true":
            pytest.fail(
                "Chromium is missing: CI must run the browser tests (apt-get install chromium)"
            )
        pytest.skip("Chromium is not installed (apt-get install chromium); CI runs these tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
                "--disable-gpu",
            ],
        )
        yield browser
        browser.close()


def assert_acyclic(graph: dict[str, set[str]]) -> None:
    """Fail naming the first import cycle in `graph` (a module -> the modules it imports),
    as `a -> b -> a`: the shape tests of the engine and of the whole app share it."""
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join((*path[path.index(name) :], name))
        if name in done:
            return
        for imported in sorted(graph.get(name, ())):
            visit(imported, (*path, name))
        done.add(name)

    for name in sorted(graph):
        visit(name, ())
