"""The operator commands, as a terminal user runs them."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from runs.models import Run, RunStatus, Step
from runs.sdk import start_run
from tests.conftest import ROOT, database_url, wait_until

pytestmark = pytest.mark.django_db


def call(*args) -> str:
    from io import StringIO

    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_startrun_prints_the_run_id_and_is_idempotent_by_key():
    first = call("startrun", "ledger", "--input", '{"steps": 2}', "--key", "nightly-1").strip()
    again = call("startrun", "ledger", "--input", '{"steps": 9}', "--key", "nightly-1").strip()
    assert first == again == str(Run.objects.get(key="nightly-1").id)
    assert Run.objects.get().input == {"steps": 2}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ledger", "--input", "{steps: 2}"], "--input is not valid JSON"),
        (["no-such-flow"], "unknown workflow 'no-such-flow'"),
        (
            ["ledger", "--import", "no.such.module"],
            "cannot import workflow module 'no.such.module'",
        ),
    ],
)
def test_startrun_rejects_bad_input_with_a_clear_error_and_stores_nothing(args, message):
    with pytest.raises(CommandError, match=re.escape(message)):
        call("startrun", *args)
    assert not Run.objects.exists()


def test_showrun_json_prints_the_run_and_its_steps(drive):
    run = start_run("flight-booking", {"from": "LIS", "to": "BER", "date": "d", "passenger": "Ada"})
    drive()
    shown = json.loads(call("showrun", str(run.id), "--json"))
    assert shown["status"] == "completed" and shown["attempt"] == 1
    assert shown["output"]["booking"]["flight"] == "FR1213"
    assert [(s["key"], s["status"], s["attempt"]) for s in shown["steps"]] == [
        ("search", "completed", 1),
        ("pick", "completed", 1),
        ("book", "completed", 1),
        ("notify", "completed", 2),
    ]
    assert shown["steps"][2]["idempotency_key"] == f"{run.id}:book"


def test_showrun_names_an_unknown_run():
    with pytest.raises(CommandError, match="no run with id 'nope'"):
        call("showrun", "nope")


def test_every_command_that_takes_a_run_accepts_the_start_of_its_id_the_pages_show(cast):
    run = start_run("ledger", {"steps": 1})
    short = str(run.pk)[:8]
    assert json.loads(call("showrun", short, "--json"))["id"] == str(run.pk)
    assert short in call("signal", short, "go")
    call("halt", "--run", short, "--user", "otto", "--reason", "look")
    assert f"run {run.pk}: unhalted" in call(
        "unhalt", "--run", short, "--user", "otto", "--reason", "ok"
    )
    assert "cancel" in call("cancel", short, "--user", "otto", "--reason", "done")
    Run.objects.create(id=f"{short}-0000-4000-8000-000000000000", workflow="ledger", input={})
    with pytest.raises(CommandError, match=f"more than one run's id starts with '{short}'"):
        call("showrun", short)
    with pytest.raises(CommandError, match="no run with id 'abcd0123x'"):
        call("retry", "abcd0123x", "--user", "otto", "--reason", "again")


def test_runworker_refuses_a_module_that_does_not_import():
    with pytest.raises(CommandError, match=re.escape("cannot import workflow module 'no.such")):
        call("runworker", "--import", "no.such.module")


def run_manage(*args, env_extra: dict | None = None, **popen) -> subprocess.Popen:
    env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
    env.update(env_extra or {})
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return subprocess.Popen(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, text=True, **popen
    )


@pytest.mark.django_db(transaction=True)
def test_showrun_follow_prints_each_step_as_it_happens_until_the_run_ends(spawn_worker):
    run = start_run("ledger", {"steps": 3, "sleep": 0.2})
    follow = run_manage("showrun", str(run.id), "--follow", stdout=subprocess.PIPE)
    spawn_worker()
    out, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0
    lines = out.splitlines()
    events = [line.split()[2] for line in lines if line.startswith("#")]
    assert events[:2] == ["run.created", "run.claimed"]
    assert sum("step.completed" in line for line in lines) == 3
    assert lines[-1] == "completed: 3"


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_the_demo_shows_every_capability_and_ctrl_c_stops_everything(tmp_path):
    var = {"STEPGUARD_VAR_DIR": str(tmp_path)}  # its settings file for a second terminal
    demo = run_manage(
        "rundemo", "--port", "0", env_extra=var, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(demo.stdout), daemon=True)
    reader.start()
    try:
        wait_until(
            lambda: any("follow a run:" in line for line in lines),
            timeout=240,  # its own waits give up well before; under load it has taken > 120 s
            what=lambda: "the demo's summary; it printed:\n" + "".join(lines),
        )
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
    assert demo.wait(30) == 0
    reader.join(5)
    text = "".join(lines)
    assert "demo operator: demo / " in text and "not booked twice" in text
    assert "scripted demo model, not a language model" in text
    statuses = {
        (run.workflow, run.version, run.status) for run in Run.objects.filter(parent__isnull=True)
    }
    assert statuses == {
        ("flight-booking", "1", RunStatus.COMPLETED),  # retried notify, booked once
        ("flight-booking", "2", RunStatus.WAITING),  # waiting for an approval
        ("research", "1", RunStatus.COMPLETED),  # recovered from a SIGKILLed worker
        ("orchestrator", "1", RunStatus.COMPLETED),  # subagents as child runs
        ("outreach", "1", RunStatus.OVER_BUDGET),  # paused by its budget
        ("outreach", "1", RunStatus.HALTED),  # stopped by an operator
        ("refund", "1", RunStatus.COMPLETED),  # its notify went through on the third attempt
        ("refund", "1", RunStatus.FAILED),  # the payments API refused: to retry or fork
    }
    failed = Run.objects.get(status=RunStatus.FAILED)
    assert failed.error["cause"]["type"] == "RefundRefused"
    assert "RefundRefused: payments API refused" in failed.error["message"]
    assert "card visa-0005 expired" in failed.error["message"]
    assert failed.steps.filter(status="completed", kind__in=["llm", "tool"]).count() >= 2
    notify = Step.objects.get(run__key="demo:refund", key="notify")
    assert notify.status == "completed" and notify.attempt >= 3  # NotifierDown twice
    research = Run.objects.get(workflow="research", parent__isnull=True)
    assert research.events.filter(type="run.recovered").exists()
    assert "worker" in text and "stopped" in text
    assert_printed_commands_work(text, tmp_path)


def assert_printed_commands_work(text: str, var: Path) -> None:
    """The commands the demo prints, pasted into a new terminal in the project directory: a
    `python` without Django first on PATH, no settings in the environment but the database's
    (the test's own, where a developer's is the default file under var/)."""
    bin_dir = var / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys._base_executable)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": os.environ.get("HOME", "/root"),
        "STEPGUARD_VAR_DIR": str(var),
        "DATABASE_URL": database_url(),
    }
    commands = [line.split(":", 1)[1].strip() for line in text.splitlines()
                if line.strip().startswith(("approve the booking:", "follow a run:"))]  # fmt: skip
    assert len(commands) == 2 and all(c.startswith("python manage.py ") for c in commands)
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"


def test_a_second_make_run_prints_the_approvals_still_waiting(db):
    """The first `make run` printed how to approve the booking; a second one keeps its runs and
    must say it again while the approval waits (it printed only a new password)."""
    from io import StringIO

    from examples.management.commands.rundemo import Command
    from runs.approvals.models import ApprovalRequest

    run = start_run("ledger", {"steps": 1}, key="demo:agent")
    request = ApprovalRequest.objects.create(run=run, step_key="ask", action="book the flight")
    command = Command(stdout=StringIO())
    command.port = 8000
    command.demo_agents()
    printed = command.stdout.getvalue()
    assert "kept" in printed and str(run.pk)[:8] in printed
    assert f"python manage.py approve {request.pk} --user demo" in printed


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["budget", "--all", "--usd", "abc"], "'abc' is not an amount of USD"),
        (["budget", "--all", "--usd", "-5"], "an amount of USD is a number from 0 to"),
        (["budget", "--all", "--usd", "1e3"], "the budget '1e3' is not a plain amount of USD"),
        (["budget", "--all", "--tokens", "\u0663"], "'\u0663' is not a number of tokens"),
        (["spend", "--label", "tenant", "--since", "yesterday"], "'yesterday' is not a day"),
    ],
)
def test_a_bad_value_on_the_command_line_is_a_usage_error_not_a_traceback(argv, says, tmp_path):
    """`budget --usd abc`, `--usd -5` and `spend --since yesterday` ended in a 38-line
    traceback, and `--usd 1e3` set $1,000 where the dashboard and the API refuse it: the three
    now share one check (runs.engine.budget.plain_usd)."""
    from tests.test_settings import PRODUCTION, manage

    result = manage(
        *argv, "--user", "u", "--reason", "r", **PRODUCTION, STEPGUARD_VAR_DIR=str(tmp_path)
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: argument {argv[-2]}: {says}" in result.stderr


def test_the_dashboard_the_api_and_the_cli_take_one_spelling_of_usd():
    from runs.api import USD
    from runs.engine.budget import plain_usd

    for text in ("0", "2.50", "1000000000", "0.000001"):
        assert plain_usd(text) >= 0 and re.fullmatch(USD, text), text
    for text in ("1e3", "-5", " ", "2.5000001", "\u0661", "1000000001", "12345678901"):
        with pytest.raises(ValueError):
            plain_usd(text)


def test_make_run_prints_the_same_demo_password_on_every_start_with_one_database(
    db, settings, tmp_path
):
    """It printed a new one each start: a browser that had saved the password was logged out
    and could not log in again."""
    from io import StringIO

    from django.contrib.auth import get_user_model

    from examples.management.commands.rundemo import Command

    def logs_in(password: str) -> bool:
        return get_user_model().objects.get(username="demo").check_password(password)

    settings.VAR_DIR = tmp_path
    first = Command(stdout=StringIO()).demo_operator()
    again = Command(stdout=StringIO()).demo_operator()
    assert first == again and logs_in(again)
    assert (tmp_path / "demo-operator-password").stat().st_mode & 0o077 == 0
    (tmp_path / "demo-operator-password").write_text("not-this-database's\n")  # another DB's
    fresh = Command(stdout=StringIO()).demo_operator()
    assert fresh != first and logs_in(fresh)
