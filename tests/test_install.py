"""Stepguard as others install it: embedded in a Django project of its own, exactly as
docs/install.md says, and as a built wheel in a clean virtualenv with its `stepguard`
command."""

import contextlib
import http.cookiejar
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from websockets.sync.client import connect as ws_connect

from tests.conftest import ROOT, wait_until

DOCS = ROOT / "docs" / "install.md"
EMBEDDING = "## Embedding Stepguard in your Django project"
#: How a python block of the embedding section says where it goes: its first line.
BLOCK_HEADER = re.compile(r"# (?P<path>\S+) \((?P<how>at the end|the whole file|a new file)\)")


def embedding_section() -> tuple[list[tuple[str, str, str]], list[str]]:
    """docs/install.md's embedding section, as the test applies it: its python blocks as
    (path, how, code) in order, and the commands of its shell blocks (comments dropped)."""
    section = DOCS.read_text().split(EMBEDDING, 1)[1].split("\n## ", 1)[0]
    files, commands = [], []
    for lang, body in re.findall(r"^```(\w+)\n(.*?)^```$", section, re.M | re.S):
        if lang == "python":
            header = BLOCK_HEADER.fullmatch(body.partition("\n")[0])
            assert header, f"a python block without a '# PATH (at the end)' line:\n{body}"
            files.append((header["path"], header["how"], body))
        elif lang == "sh":
            lines = (line.split("#", 1)[0].strip() for line in body.splitlines())
            commands += [line for line in lines if line]
    return files, commands


def copy_sources(tmp_path: Path) -> Path:
    """What a wheel is built from, copied: a build in the checkout writes its build/ and
    egg-info there, which another build (a test's, CI's editable install) may be writing."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, src)
    for package in ("controlplane", "runs", "approvals", "templates", "static"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def build_wheel(tmp_path: Path) -> Path:
    """The wheel, built offline from a copy of the sources, with the checkout's setuptools."""
    src = copy_sources(tmp_path)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-q", "-w", str(tmp_path / "dist"), str(src)],
        check=True, timeout=120,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("stepguard-*.whl")
    return wheel


def offline_venv(tmp_path: Path, wheel: Path) -> Path:
    """A new virtualenv with the wheel installed by pip, and Stepguard's dependencies taken
    from this checkout's virtualenv (each of its packages, Stepguard's own editable install
    excepted, on the new one's path): nothing is downloaded."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    deps = tmp_path / "deps"
    deps.mkdir()
    ours = ("stepguard", "__editable__", "_distutils_hack", "pip", "distutils-precedence")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(ours) and entry.name != "__pycache__":
            (deps / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "stepguard-test-deps.pth").write_text(f"{deps}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        check=True, timeout=120,
    )  # fmt: skip
    return venv


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_a_new_django_project_embeds_stepguard_exactly_as_docs_install_md_says(tmp_path):
    """The embedding section of docs/install.md, run as written in a project fresh from
    `django-admin startproject`, with Stepguard installed from its wheel: migrate, a superuser,
    a worker and `runserver` as the docs start them; then a person logs in on the login page,
    starts a run from the dashboard, sees it finish, and the run page's websocket (under the
    mount point) sends its steps. Nothing in either process's log is a traceback."""
    files, commands = embedding_section()
    assert [path for path, _, _ in files] == [
        "mysite/settings.py", "mysite/urls.py", "mysite/asgi.py", "mysite/agents.py"
    ]  # fmt: skip
    assert not any("controlplane" in code for _, _, code in files)  # the app is all it imports
    venv = offline_venv(tmp_path, build_wheel(tmp_path))
    python = str(venv / "bin" / "python")
    host = tmp_path / "host"
    host.mkdir()
    env = _clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for name in ("REDIS_URL", "LOG_FORMAT", "SECRET_KEY", "DEBUG", "ALLOWED_HOSTS"):
        env.pop(name, None)

    def run(*args: str, **extra) -> str:
        done = subprocess.run(
            [python, *args], cwd=host, env={**env, **extra}, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    run("-m", "django", "startproject", "mysite", ".")  # django-admin startproject mysite .
    probe = run("-c", "import django, runs; print(runs.__file__, django.get_version())")
    assert str(venv) in probe.split()[0], probe  # the wheel's Stepguard, not the checkout's
    for path, how, code in files:
        target = host / path
        if how == "at the end":
            target.write_text(target.read_text() + "\n" + code)
        else:
            assert (how == "a new file") != target.exists(), f"{path}: {how}?"
            target.write_text(code)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    logs: dict[str, Path] = {}
    procs: list[subprocess.Popen] = []
    stack = contextlib.ExitStack()
    try:
        for command in commands:
            words = command.split()
            assert words[:2] == ["python", "manage.py"], f"not run by this test: {command}"
            name = words[2]
            if name == "migrate":
                run("manage.py", *words[2:], "--verbosity", "0")
            elif name == "createsuperuser":
                run(
                    "manage.py", *words[2:], "--noinput", DJANGO_SUPERUSER_USERNAME="ada",
                    DJANGO_SUPERUSER_PASSWORD="a-long-enough-password", DJANGO_SUPERUSER_EMAIL="",
                )  # fmt: skip
            elif name in ("runworker", "runserver"):
                extra = [f"127.0.0.1:{port}", "--noreload"] if name == "runserver" else []
                logs[name] = tmp_path / f"{name}.log"
                out = stack.enter_context(logs[name].open("w"))
                command_line = [python, "manage.py", *words[2:], *extra]
                procs.append(
                    subprocess.Popen(command_line, cwd=host, env=env, stdout=out, stderr=out)
                )
            else:
                pytest.fail(f"docs/install.md's embedding section runs {command!r}: test it")
        assert set(logs) == {"runworker", "runserver"}, commands
        browser = Browser(base)

        def serving() -> bool:
            for proc, name in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    pytest.fail(f"{name} exited:\n{logs[name].read_text()}")
            return browser.answers()

        wait_until(serving, timeout=30, what=lambda: logs["runserver"].read_text())
        _log_in_start_a_run_and_watch_it(browser, base, port)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        stack.close()
    assert "serving greet@1" in logs["runworker"].read_text()  # its own lines, plain
    for name, log in logs.items():
        assert "Traceback" not in log.read_text(), f"{name}:\n{log.read_text()}"


def _log_in_start_a_run_and_watch_it(browser: "Browser", base: str, port: int) -> None:
    # A logged-out visitor is sent to the login page, which the app ships, styled.
    page = browser.get("/agents/")
    assert page.url.startswith(f"{base}/accounts/login/?next=/agents/"), page.url
    assert "<h1>Log in</h1>" in page.text and "stepguard/css/app.css" in page.text
    css = browser.get("/static/stepguard/css/app.css")
    assert css.status == 200 and "--accent" in css.text  # runserver serves the static files
    page = browser.post(page.url, username="ada", password="a-long-enough-password")
    assert page.url == f"{base}/agents/", page.url
    assert 'data-root="/agents/"' in page.text  # the `/` shortcut and the live feed's path
    assert '<option value="greet">greet</option>' in page.text  # the web process has it too

    page = browser.post("/agents/runs/start", workflow="greet", input='{"name": "ada"}')
    run_id = page.url.removeprefix(f"{base}/agents/runs/")
    assert len(run_id) == 36 and page.status == 200, page.url
    assert f'ws-connect="/agents/ws/runs/{run_id}/' in page.text

    def finished():
        return browser.get(f"/agents/api/runs/{run_id}").json()["status"] == "completed"

    wait_until(finished, timeout=30, what="the worker to finish the run")
    assert browser.get(f"/agents/api/runs/{run_id}").json()["output"] == "hello, Ada"
    page = browser.get("/agents/")
    assert f"/agents/runs/{run_id}" in page.text and "status-completed" in page.text

    headers = {"Cookie": browser.cookie_header(), "Origin": base}
    url = f"ws://127.0.0.1:{port}/agents/ws/runs/{run_id}/?after=0"
    received = []
    with ws_connect(url, additional_headers=headers, open_timeout=10) as feed:
        while not any("step.completed" in m and "<code>lookup</code>" in m for m in received):
            received.append(feed.recv(timeout=10))
    assert any('id="step-1"' in m for m in received), received
    with ws_connect(
        f"ws://127.0.0.1:{port}/agents/ws/live/", additional_headers=headers, open_timeout=10
    ) as feed:
        assert json.loads(feed.recv(timeout=10))["live"] is True


class Browser:
    """Enough of a browser for Django's forms: cookies, redirects, the CSRF token."""

    def __init__(self, base: str):
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def answers(self) -> bool:
        try:
            self.get("/accounts/login/")
            return True
        except OSError:
            return False

    def _open(self, request: urllib.request.Request) -> "Page":
        try:
            response = self.opener.open(request, timeout=15)
        except urllib.error.HTTPError as error:
            response = error
        with response:
            return Page(response.status, response.url, response.read().decode())

    def get(self, path: str) -> "Page":
        return self._open(urllib.request.Request(urllib.parse.urljoin(self.base, path)))

    def post(self, path: str, **fields: str) -> "Page":
        token = next(c.value for c in self.jar if c.name == "csrftoken")
        body = urllib.parse.urlencode({"csrfmiddlewaretoken": token, **fields}).encode()
        url = urllib.parse.urljoin(self.base, path)
        return self._open(urllib.request.Request(url, data=body, headers={"Referer": url}))

    def cookie_header(self) -> str:
        return "; ".join(f"{c.name}={c.value}" for c in self.jar)


@dataclass
class Page:
    status: int
    url: str
    text: str

    def json(self):
        return json.loads(self.text)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "STEPGUARD_"))}
    for name in ("DATABASE_URL", "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    return {**env, **extra}


@pytest.mark.slow
def test_the_built_wheel_installs_migrates_runs_a_workflow_and_serves_the_dashboard(tmp_path):
    """The wheel, not the checkout: built, installed with its dependencies in a new
    virtualenv, then used only through its `stepguard` command from another directory."""
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(dist), str(copy_sources(tmp_path))],
        check=True, timeout=300,
    )  # fmt: skip
    (wheel,) = dist.glob("stepguard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # The project's shared templates and static files (top-level templates/ and static/ in
    # the checkout) ship inside the runs app, where an installing project finds them.
    assert {"runs/py.typed", "runs/templates/stepguard/base.html",
            "runs/templates/registration/login.html", "runs/static/stepguard/js/live.js",
            "runs/static/stepguard/vendor/htmx.min.js", "runs/static/stepguard/js/run.js",
            "runs/approvals/templates/approvals/inbox.html",
            "runs/static/stepguard/css/app.css"} <= names  # fmt: skip
    assert not any(n.startswith(("examples/", "tests/", "templates/", "static/")) for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # Its dependencies as this checkout's virtualenv has them (the versions CI tests), then
    # the wheel itself: nothing from the checkout is importable in the new one.
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    (tmp_path / "constraints.txt").write_text(frozen)
    subprocess.run(
        [*pip, "-c", str(tmp_path / "constraints.txt"), str(wheel)], check=True, timeout=600
    )
    site = tmp_path / "site"
    site.mkdir()
    (site / "hello.py").write_text(
        "from runs.sdk import workflow\n\n\n"
        '@workflow("hello")\n'
        "def hello(ctx, input):\n"
        '    return ctx.step("say", lambda: f"hello {input}")\n'
    )
    env = _clean_env(
        SECRET_KEY="wheel-test-key-0123456789abcdefghijklmnopqrstuvwxyz-0123456789",
        ALLOWED_HOSTS="127.0.0.1",
        SECURE_SSL_REDIRECT="0",
    )  # and no PYTHONPATH: `--import hello` finds hello.py in the directory it runs in
    stepguard = str(venv / "bin" / "stepguard")

    def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            [stepguard, *args], cwd=site, env=env, capture_output=True, text=True,
            timeout=120, **kwargs,
        )  # fmt: skip

    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import runs, examples"],
        cwd=site, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert "No module named 'examples'" in probe.stderr  # the demo is not installed
    assert run("migrate", "--verbosity", "0").returncode == 0
    assert (site / "var" / "stepguard.sqlite3").exists()  # under the directory it runs in
    started = run("startrun", "hello", "--input", '"wheel"', "--import", "hello")
    assert started.returncode == 0, started.stderr
    worker = subprocess.Popen(
        [stepguard, "runworker", "--import", "hello", "--poll-interval", "0.1"],
        cwd=site, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    server = subprocess.Popen(
        [stepguard, "serve", "--port", "0", "--host", "127.0.0.1"],
        cwd=site, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        shown: list[str] = []

        def finished() -> bool:
            out = run("showrun", started.stdout.split()[-1] if started.stdout else "", "--json")
            shown[:] = [out.stdout + out.stderr]
            return '"status": "completed"' in out.stdout

        wait_until(finished, timeout=60, what=lambda: f"the run to complete: {shown}")
        assert '"output": "hello wheel"' in shown[0]
        port = _daphne_port(server)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/login/", timeout=10) as page:
            assert page.status == 200 and b"Log in" in page.read()
        with urllib.request.urlopen(f"{base}/static/stepguard/css/app.css", timeout=10) as css:
            assert css.status == 200 and b"--accent" in css.read()
    finally:
        for proc in (worker, server):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_the_stepguard_command_imports_workflow_modules_from_the_directory_it_runs_in(tmp_path):
    (tmp_path / "myagents.py").write_text("WHERE = 'next to you'\n")
    stepguard = Path(sys.executable).parent / "stepguard"  # the console script, as installed
    done = subprocess.run(
        [str(stepguard), "shell", "-c", "import myagents; print(myagents.WHERE)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=_clean_env(SECRET_KEY="k" * 50, STEPGUARD_VAR_DIR=str(tmp_path)),
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.endswith("next to you\n"), done.stderr


def _daphne_port(server: subprocess.Popen) -> int:
    import re

    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            break
        seen.append(line)
        if match := re.search(r"Listening on TCP address 127\.0\.0\.1:(\d+)", line):
            return int(match.group(1))
    pytest.fail("stepguard serve did not listen:\n" + "".join(seen))
