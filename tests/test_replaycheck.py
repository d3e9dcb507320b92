"""The release check (issue 53 §1): histories made by the code shipped before, replayed dry
against this release's code (tests/release_workflows.py)."""

import json
import os
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from runs.approvals.models import ApprovalRequest
from runs.engine import registry
from runs.engine.registry import WorkflowDef
from runs.models import Event, Run, RunStatus, Signal, Step
from runs.replaycheck import check
from runs.sdk import send_signal, start_run
from tests import release_workflows
from tests.conftest import ROOT, database_url

NAMES = ("release.compatible", "release.divergent", "release.patched")


@pytest.fixture
def outside():
    """The world outside a run: an HTTP server counting the requests its steps make."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()


@contextmanager
def old_code():
    """The three workflows run the code of the release before this one, in this block."""
    with pytest.MonkeyPatch.context() as patch:
        for name, fn in release_workflows.OLD.items():
            patch.setitem(registry._workflows, (name, "1"), WorkflowDef(name, "1", fn))
        yield


def histories(drive, url, *, waiting=2, finished=1, pending=0) -> None:
    """Runs of each workflow made by the old code: parked at the wait, finished, or not yet
    started."""
    for name in NAMES:
        runs = [start_run(name, {"url": url}) for _ in range(waiting + finished)]
        for run in runs[waiting:]:
            send_signal(run.id, "paid", 1)
    drive(limit=200)
    for name in NAMES:
        assert Run.objects.filter(workflow=name, status=RunStatus.WAITING).count() == waiting
        assert Run.objects.filter(workflow=name, status=RunStatus.COMPLETED).count() == finished
        for _ in range(pending):
            start_run(name, {"url": url})


def counts() -> dict[str, int]:
    models = (Run, Step, Event, Signal, ApprovalRequest)
    return {m.__name__: m.objects.count() for m in models}


@pytest.mark.django_db
def test_a_compatible_change_and_a_patched_one_pass_and_the_divergent_one_is_named(drive, outside):
    url, _ = outside
    with old_code():
        histories(drive, url)
        # the old code agrees with its own histories
        assert check().ok
    report = check()
    by_name = {g.workflow: g for g in report.groups}
    compatible, divergent, patched = (by_name[n] for n in NAMES)
    assert (compatible.checked, compatible.live, compatible.diverging) == (3, 2, 0)
    assert (patched.checked, patched.compatible, patched.diverging) == (3, 3, 0)
    assert (divergent.checked, divergent.diverging, divergent.diverging_live) == (3, 3, 2)
    first = divergent.first
    assert first["says"] == "history has 'reserve' at 0, code asks for 'quote'"
    assert (first["seq"], first["recorded"], first["requested"]) == (0, "reserve", "quote")
    assert "ctx.patched" in first["fix"] and 'version="<next>"' in first["fix"]
    assert not report.ok and report.diverging == 3


@pytest.mark.django_db
def test_new_runs_of_the_patched_code_take_the_new_path_and_replay_too(drive, outside):
    url, _ = outside
    run = start_run("release.patched", {"url": url})
    drive()
    keys = list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))
    assert keys == ["patch:quote-first", "quote", "reserve", "paid"]
    group = check(workflow="release.patched").groups[0]
    assert (group.checked, group.compatible) == (1, 1)


@pytest.mark.django_db
def test_the_check_writes_nothing_and_calls_nothing_outside(drive, outside, monkeypatch):
    url, hits = outside
    with old_code():
        # pending runs have no history: the patched code would write its marker first
        histories(drive, url, pending=1)
    for run in Run.objects.filter(status=RunStatus.PENDING):
        assert not Step.objects.filter(run=run).exists()
    before, calls_before = counts(), len(hits)
    connects = []
    real_connect = socket.socket.connect

    def connect(self, address):
        connects.append(address)
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    report = check()
    monkeypatch.undo()
    assert report.checked == 12
    assert counts() == before
    assert len(hits) == calls_before  # no step function ran: outputs came from the history
    assert connects == []  # no connection opened at all (the database's was open already)
    assert Run.objects.filter(status=RunStatus.PENDING).count() == 3  # nobody claimed them


@pytest.mark.django_db
def test_the_command_reports_and_exits_non_zero_on_divergence(drive, outside):
    url, _ = outside
    with old_code():
        histories(drive, url, waiting=1, finished=0)
    out = StringIO()
    call_command("replaycheck", "--workflow", "release.compatible", stdout=out)
    assert "release.compatible@1: ok: 1 checked (1 live)" in out.getvalue()
    out = StringIO()
    with pytest.raises(CommandError) as refused:
        call_command("replaycheck", "--workflow", "release.divergent", stdout=out)
    assert refused.value.returncode == 1
    text = out.getvalue()
    assert "DIVERGES" in text and "history has 'reserve' at 0, code asks for 'quote'" in text
    out = StringIO()
    with pytest.raises(CommandError):
        call_command("replaycheck", "--json", "--runs", "10", stdout=out)
    data = json.loads(out.getvalue())
    assert (data["ok"], data["checked"], data["diverging"]) == (False, 3, 1)
    versions = {v["workflow"]: v for v in data["versions"]}
    assert versions["release.divergent"]["first_divergence"]["requested"] == "quote"
    assert versions["release.patched"]["compatible"] == 1
    waiting = Run.objects.get(workflow="release.divergent", status=RunStatus.WAITING)
    assert versions["release.divergent"]["must_stay_on_old_workers"] == [str(waiting.id)]


@pytest.mark.django_db
def test_runs_of_a_version_this_release_has_no_code_for_must_stay_on_old_workers():
    Run.objects.create(workflow="release.compatible", version="0", input={}, status="waiting")
    report = check(workflow="release.compatible")
    group = report.groups[0]
    assert (group.version, group.served, group.live, group.checked) == ("0", False, 1, 0)
    assert report.ok
    assert "must stay on workers that have it" in report.lines()[0]


@pytest.mark.django_db
@pytest.mark.parametrize(
    "args, says",
    [
        (["--since", "yesterday"], "'yesterday' is neither a time ago"),
        (["--runs", "0"], "'0' is not a positive whole number"),
        (["--runs", "5", "--since", "2h"], "not allowed with argument"),
        (["--workflow", "no-such"], "unknown workflow 'no-such'"),
    ],
)
def test_bad_input_is_refused_by_name(args, says):
    with pytest.raises(CommandError, match=says):
        call_command("replaycheck", *args)


@pytest.mark.django_db(transaction=True)
def test_the_exit_status_gates_ci(drive, outside):
    """As CI runs it: a process of its own importing the release's module."""
    url, _ = outside
    with old_code():
        histories(drive, url, waiting=1, finished=0)

    def replaycheck(*args):
        env = {"DATABASE_URL": database_url(), "DJANGO_SETTINGS_MODULE": "tests.settings"}
        module = release_workflows.__name__
        command = [sys.executable, "manage.py", "replaycheck", "--import", module]
        return subprocess.run(
            [*command, *args], cwd=ROOT, env={**os.environ, **env},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    passing = replaycheck("--workflow", "release.patched")
    assert passing.returncode == 0, passing.stderr
    failing = replaycheck("--json")
    assert failing.returncode == 1, failing.stderr
    assert json.loads(failing.stdout)["diverging"] == 1
    assert "1 run(s) would diverge" in failing.stderr


@pytest.mark.django_db
def test_the_database_itself_refuses_a_write_inside_the_check():
    """Behind the refusing checkpoints, the check's transaction is read-only on both engines."""
    from django.db import DatabaseError

    from runs.replaycheck import read_only

    with pytest.raises(DatabaseError), read_only():
        Run.objects.create(workflow="release.compatible", version="1", input={})
    assert not Run.objects.exists()


@pytest.mark.django_db(transaction=True)  # an async workflow's checkpoints come from threads
def test_an_async_workflow_with_a_model_call_replays_without_calling_the_model(
    drive, expire_lease, demo_model
):
    from tests import workflows

    run = start_run("llm-async")
    workflows.crash_at.add("after-async")
    with pytest.raises(workflows.Crash):
        drive()  # the worker died in step 'after': the history ends there, the step started
    assert (demo_model.total, workflows.calls["async-tool"]) == (1, 1)
    group = check(workflow="llm-async").groups[0]
    assert (group.checked, group.live, group.compatible) == (1, 1, 1)
    expire_lease(run.id)
    assert drive() == ["completed"]
    steps = Step.objects.count()
    group = check(workflow="llm-async").groups[0]
    assert (group.checked, group.live, group.compatible) == (1, 0, 1)
    assert (demo_model.total, workflows.calls["async-tool"]) == (1, 1)  # nothing sent again
    assert Step.objects.count() == steps


def _reads_the_signal_as_a_dict(ctx, input: dict) -> str:
    ctx.step("reserve", release_workflows.call, input["url"], "reserve")
    paid = ctx.wait_for_event("paid", "paid")
    return ctx.step("charge", release_workflows.call, input["url"], f"charge-{paid['amount']}")


@pytest.mark.django_db
def test_code_that_cannot_read_what_the_old_code_recorded_is_a_divergence(drive, outside):
    url, _ = outside
    with old_code():
        histories(drive, url, waiting=1, finished=1)
    name = "release.compatible"
    with pytest.MonkeyPatch.context() as patch:
        new = WorkflowDef(name, "1", _reads_the_signal_as_a_dict)
        patch.setitem(registry._workflows, (name, "1"), new)
        group = check(workflow=name).groups[0]
    # the live run is parked before the change; the finished one went through it
    assert (group.checked, group.compatible, group.diverging, group.diverging_live) == (2, 1, 1, 0)
    assert group.first["outcome"] == "fails" and group.first["seq"] == 1
    says = "code raises TypeError: 'int' object is not subscriptable replaying the history"
    assert group.first["says"] == f"{says} (after position 1)"
    assert "accept what the old one recorded" in group.first["fix"]


def test_the_dry_replays_checkpoints_refuse_every_writing_method():
    """Built from Checkpoints' own methods: one added later is refused without a word here."""
    import inspect

    from runs.engine.checkpoints import Checkpoints
    from runs.engine.dry import HistoryEnds, RefusingCheckpoints

    writes = [
        name for name, member in vars(Checkpoints).items()
        if inspect.isfunction(member) and not name.startswith("_") and name != "check_approval"
    ]  # fmt: skip
    assert {"parking", "transaction_step", "write_start", "finish_step"} <= set(writes)
    refusing = RefusingCheckpoints.__new__(RefusingCheckpoints)
    for name in writes:
        with pytest.raises(HistoryEnds):
            getattr(refusing, name)()
