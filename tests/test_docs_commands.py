"""Every shell command README.md and docs/*.md show, run as a reader would paste it (issues 33
and 53).

Each fenced `sh`/`bash` block runs line by line (a line ending in a backslash goes on) in one
terminal (a bash of its own: variables and exports hold for the rest of the block), at a
reader's pace (the next line once the worker has caught up), in the world the docs assume: a
checkout with `make run`'s development settings (var/stepguard.env: examples.settings, DEBUG,
SQLite) and nothing else: the workflows are the ones that ship in examples/ (the README's
`book-trip` is examples/trips.py), no code of the test's own. The users `ada` and `otto` exist.
What a reader fills in is filled in: `RUN_ID` (the run the block started, as `startrun` printed
it, else a run of book-trip waiting for its signal), `APPROVAL_ID` (that run's pending approval,
else a new one's), `...` values, the port; the server at 127.0.0.1:8000 is the world's, and curl
fails on an HTTP error. Commands that do not exit (workers, servers, `--follow`) pass when they
are still up a few seconds after they start, or ended well. A block that turns the kill switch
on turns it off again. `python manage.py` is forked from a Django started once
(tests/warm_manage.py, checked by test_a_command_forked_warm_ends_as_it_would_cold): the same
command, streams and exit status, without the second a cold start took sixty times over.

Not run, each for its reason (NOT_RUN): `make run` and `make test`, and `pip` (it changes the
environment and needs an index); what the docs install is checked against pyproject.toml below,
and tests/test_install.py builds and installs the wheel. A block that cannot run here says so
just above it, in the Markdown source: `<!-- docs-test: skip: the reason -->`.
test_the_commands_not_run_are_few_and_say_why counts both, so they stay few.
"""

import contextlib
import json
import os
import queue
import re
import secrets
import shlex
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_until

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"(?:^<!-- docs-test: (?P<mark>.*?) -->\n)?^```(?:sh|bash)\n(?P<body>.*?)^```$", re.M | re.S
)
#: Commands that serve until stopped.
SERVES = re.compile(r"\b(runworker|serve|runserver)\b|--follow\b")
#: The commands not run here, and why.
NOT_RUN = {
    "make run": "serves until Ctrl-C; tests/test_commands.py runs it",
    "make test": "the whole suite, which this test is part of",
    "pip ": "builds and installs packages (an index, a changed environment): "
    "test_what_pip_installs_is_what_pyproject_declares",
}
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f-]{27}")
TRIP = {"from": "LIS", "to": "BER", "email": "a@b.c"}


def blocks() -> list:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start("body")) + 1
            name = f"{path.relative_to(ROOT)}:{line}"
            found.append((name, match["body"], match["mark"] or ""))
    return found


def commands(body: str) -> list[str]:
    """The block's commands: continuation lines and quoted text over several lines joined,
    blank and comment lines left out."""
    out, pending = [], ""
    for line in body.splitlines():
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quotation still open: the command goes on
            pending += "\n"
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            out.append(pending.strip())
        pending = ""
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Terminal:
    """A bash the test types into, one command at a time, as a reader at a terminal."""

    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"], cwd=ROOT, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def type(self, command: str, timeout: float = 120) -> tuple[int, str]:
        """Run `command`; its exit status and what it printed."""
        marker = f"__done_{secrets.token_hex(4)}__"
        assert self.proc.stdin is not None
        # One command after it, so that $? is the reader's command's (an `echo` before it
        # would report its own 0: every command passed, whatever it exited with).
        self.proc.stdin.write(f"{command}\nprintf '\\n{marker} %s\\n' $?\n")
        self.proc.stdin.flush()
        output, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{command!r} still running after {timeout} s") from None
            if line.startswith(marker):
                return int(line.split()[1]), "".join(output)
            output.append(line)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


class World:
    """The reader's terminal: a shell in the checkout with make run's development settings."""

    def __init__(self, home: Path):
        self.home = home
        var = home / "var"
        var.mkdir()
        (var / "stepguard.env").write_text("DJANGO_SETTINGS_MODULE=examples.settings\nDEBUG=1\n")
        bin_dir = Path(sys.executable).parent
        # curl as a reader sees it: an HTTP error is a failure of the command, with its body.
        tools = home / "bin"
        tools.mkdir()
        (tools / "curl").write_text('#!/bin/sh\nexec /usr/bin/curl --fail-with-body "$@"\n')
        (tools / "curl").chmod(0o755)
        # `python manage.py ...` forked from a Django started once (tests/warm_manage.py): the
        # same command, argv, environment and streams, its exit status; a second less each.
        python, warm = bin_dir / "python", ROOT / "tests" / "warm_manage.py"
        self.zygote_socket = home / "warm.sock"
        (tools / "python").write_text(
            f'#!/bin/sh\nexec {python} -I -S {warm} client {self.zygote_socket} {python} "$@"\n'
        )
        (tools / "python").chmod(0o755)
        self.env = {
            "PATH": f"{tools}:{bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(home),
            "LANG": "C.UTF-8",
            "STEPGUARD_VAR_DIR": str(var),
            "DJANGO_SUPERUSER_PASSWORD": secrets.token_urlsafe(12),
            "HOOK_SECRET": secrets.token_urlsafe(16),  # docs/operations.md's --secret-env
        }
        self.zygote = subprocess.Popen(
            [python, warm, "serve", self.zygote_socket], cwd=ROOT, env=self.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(self.zygote_socket.exists, timeout=60, what="the warm manage.py")
        self.shell("python manage.py migrate -v 0")
        self.shell(
            'python manage.py shell -c "from django.contrib.auth import get_user_model; '
            "[get_user_model().objects.create_superuser(n, f'{n}@example.com', 'pw') "
            "for n in ('ada', 'otto')]\""
        )
        self.db = var / "stepguard.sqlite3"
        self.log = home / "worker.log"
        with self.log.open("w") as out:
            self.worker = subprocess.Popen(
                ["python", "manage.py", "runworker", "--concurrency", "4"],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def settle(self, timeout: float = 30) -> None:
        """A reader's pace: the next command once the worker has done what the last one
        started (no run due and not yet taken, none running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.one(
            "SELECT count(*) FROM runs_run WHERE status = 'running' OR (status = 'pending' "
            "AND (wake_at IS NULL OR wake_at <= strftime('%Y-%m-%d %H:%M:%f', 'now')))"
        ):
            time.sleep(0.2)

    def serving(self) -> int:
        """The world's web server (the docs' 127.0.0.1:8000), started the first time it is
        needed; its port."""
        if not hasattr(self, "server"):
            port = free_port()
            self.server = subprocess.Popen(
                ["python", "manage.py", "serve", "--port", str(port)], cwd=ROOT, env=self.env,
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            )  # fmt: skip
            self.port = port

            def answers() -> bool:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    return True
                return False

            wait_until(answers, timeout=60, what="the world's web server")
        return self.port

    def shell(self, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", command], cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def one(self, sql: str, *params) -> object:
        with sqlite3.connect(self.db, timeout=30) as db:
            row = db.execute(sql, params).fetchone()
        return row[0] if row else None

    def run_waiting(self) -> str:
        """A new run of the README's book-trip, once it waits for its signal `go`."""
        out = self.shell(f"python manage.py startrun book-trip --input '{json.dumps(TRIP)}'")
        assert out.returncode == 0, out.stderr
        run_id = RUN_ID.search(out.stdout)[0]
        wait_until(
            lambda: self.status(run_id) == "waiting",
            timeout=60,
            what=lambda: f"run {run_id} waiting; the worker's log:\n{self.log.read_text()}",
        )
        return run_id

    def status(self, run_id: str) -> object:
        return self.one("SELECT status FROM runs_run WHERE id = ?", run_id.replace("-", ""))

    def pending_approval(self, run_id: str) -> object:
        return self.one(
            "SELECT id FROM approvals_approvalrequest WHERE run_id = ? AND status = 'pending'",
            run_id.replace("-", ""),
        )

    def approval_waiting(self) -> object:
        """The approval a new run of book-trip asks for once signalled."""
        run_id = self.run_waiting()
        out = self.shell(f"python manage.py signal {run_id} go")
        assert out.returncode == 0, out.stderr
        return wait_until(
            lambda: self.pending_approval(run_id),
            timeout=60,
            what=lambda: f"run {run_id}'s approval; the worker's log:\n{self.log.read_text()}",
        )

    def kill_switch(self) -> object:
        return self.one("SELECT halted_at FROM runs_policy WHERE scope = '*'")

    def fill(self, command: str, block: dict) -> str:
        """What a reader types in place of the docs' placeholders: the block's own run where it
        started one, its approval where it asks for one."""
        if "RUN_ID" in command or "RUN=..." in command:
            if "run" not in block:
                block["run"] = self.run_waiting()
            run_id = block["run"]
            command = command.replace("RUN_ID", run_id).replace("RUN=...", f"RUN={run_id}")
        if "APPROVAL_ID" in command:
            approval = None
            if "run" in block:
                approval = self.pending_approval(block["run"])
            command = command.replace("APPROVAL_ID", str(approval or self.approval_waiting()))
        command = command.replace("SECRET_KEY=...", f"SECRET_KEY={secrets.token_urlsafe(50)}")
        command = command.replace(
            "DATABASE_URL=postgres://...", f"DATABASE_URL=sqlite:///{self.db}"
        )
        command = re.sub(r"--port \d+", f"--port {free_port()}", command)
        if "127.0.0.1:8000" in command:
            command = command.replace("127.0.0.1:8000", f"127.0.0.1:{self.serving()}")
        command = re.sub(r"\brunserver\b(?! \S*\d)", f"runserver 127.0.0.1:{free_port()}", command)
        if command.endswith("createsuperuser"):  # asks for a name and password
            name = f"root{secrets.token_hex(4)}"
            command += f" --noinput --username {name} --email {name}@example.com"
        return command

    def close(self):
        if hasattr(self, "server"):
            self.server.terminate()
            self.server.wait(30)
        self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(30)
        except subprocess.TimeoutExpired:
            self.worker.kill()
        self.zygote.terminate()
        self.zygote.wait(30)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = World(tmp_path_factory.mktemp("reader"))
    yield world
    world.close()


@pytest.mark.parametrize(("name", "body", "mark"), blocks(), ids=[b[0] for b in blocks()])
def test_every_command_in_the_docs_runs_as_written(world, name, body, mark):
    if mark.startswith("skip"):
        pytest.skip(f"{name}: {mark}")
    terminal = Terminal(world.env)
    failures: list[str] = []
    block: dict = {}
    try:
        for written in commands(body):
            if not_run(written):
                continue
            world.settle()
            try:
                command = world.fill(written, block)
            except (AssertionError, pytest.fail.Exception) as exc:  # nothing to fill it with
                failures.append(f"$ {written}\n{exc}")
                continue
            if SERVES.search(command) and "--dry-run" not in command:
                # Up for a few seconds: stopped by the timeout (124), or still stopping 5 s
                # later and killed (137: a worker stops at its next step boundary).
                command = (
                    f"timeout -k 5 6 bash -c {shlex.quote(command)}; "
                    "case $? in 124|137) true ;; *) false ;; esac"
                )
            status, output = terminal.type(command)
            if status != 0:
                failures.append(f"$ {written}\nexited {status}:\n{output[-3000:]}")
            elif " startrun " in f" {written}" and (printed := RUN_ID.search(output)):
                block.setdefault("run", printed[0])  # the id the reader copies from it
        world.settle()
        if world.kill_switch() is not None:
            failures.append("the block leaves the kill switch on: it shows how to lift it")
    finally:
        terminal.close()
        if world.kill_switch() is not None:  # left on by a failure: not the next block's
            world.shell("python manage.py unhalt --all --user otto --reason 'docs test'")
    assert not failures, f"{name}:\n\n" + "\n\n".join(failures)


def test_a_command_forked_warm_ends_as_it_would_cold(world):
    """The commands above run forked from a Django started once (tests/warm_manage.py): one
    that fails still fails, with its message and status, killed is killed, reads its own
    stdin; one typed with an environment of its own runs cold, as typed."""
    parent = "python manage.py shell -c 'import os; print(os.getppid())'"
    warm = world.shell(f"{parent}; echo $$")
    assert warm.returncode == 0, warm.stderr
    assert len(set(warm.stdout.split()[-2:])) == 2, warm.stdout  # the zygote's, not bash's
    cold = world.shell(f"X=1 {parent}; echo $$")
    assert len(set(cold.stdout.split()[-2:])) == 1, cold.stdout
    failed = world.shell("python manage.py nosuchcommand")
    assert failed.returncode == 1 and "Unknown command: 'nosuchcommand'" in failed.stderr
    killed = world.shell("python manage.py shell -c 'import os; os.kill(os.getpid(), 15)'")
    assert killed.returncode == -15, killed
    read = world.shell("echo typed | python manage.py shell -c 'print(input() + \"!\")'")
    assert read.stdout.split()[-1] == "typed!", read


def not_run(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


def test_the_commands_not_run_are_few_and_say_why():
    skipped = [(name, mark) for name, _, mark in blocks() if mark]
    assert all(mark.startswith("skip: ") and len(mark) > 12 for _, mark in skipped), skipped
    assert len(skipped) <= 2, skipped
    not_here = [c for _, body, mark in blocks() if not mark for c in commands(body) if not_run(c)]
    assert len(not_here) <= 8, not_here


def test_the_readme_agent_is_the_one_that_ships():
    """The README's agent is examples/trips.py as it is, so the commands beside it act on it."""
    readme = (ROOT / "README.md").read_text()
    shown = re.search(r"^```python\n(.*?)^```$", readme, re.M | re.S)[1]
    assert shown in (ROOT / "examples" / "trips.py").read_text()


def test_what_pip_installs_is_what_pyproject_declares():
    """The `pip` lines, not run here (they need an index), install from the checkout or from
    the wheel it builds, with extras pyproject.toml declares: no `pip install stepguard[...]`
    that only a release on an index would satisfy."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, wheel = set(project["optional-dependencies"]), f"stepguard-{project['version']}-"
    lines = [c for _, body, _ in blocks() for c in commands(body) if c.startswith("pip install")]
    ours = [c for c in lines if "stepguard" in c or "'." in c]
    assert len(ours) >= 5, lines
    for line in ours:
        target = shlex.split(line, comments=True)[-1]
        path, _, named = target.partition("[")
        assert path == "." or path.startswith(f"./dist/{wheel}"), line
        assert set(filter(None, named.rstrip("]").split(","))) <= extras, line


def test_serve_says_first_how_to_open_it_when_production_settings_redirect_to_https(tmp_path):
    """`stepguard serve` with production settings answers plain HTTP with a redirect to an
    https:// that nothing serves on a laptop: its first lines say so, and what to set."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SECRET_KEY": secrets.token_urlsafe(50),
        "ALLOWED_HOSTS": "127.0.0.1",
        "STEPGUARD_VAR_DIR": str(tmp_path),
    }
    proc = subprocess.Popen(
        ["stepguard", "serve", "--port", "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        first = [proc.stdout.readline() for _ in range(2)] if proc.stdout else []
    finally:
        proc.terminate()
        proc.wait(30)
    assert first[0].startswith("Serving http://127.0.0.1:0/"), first
    assert "redirected to HTTPS" in first[1] and "http://127.0.0.1" in first[1], first
