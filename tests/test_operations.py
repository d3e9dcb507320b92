"""Operations: retention (prune), health, structured logs, metrics."""

import json
import logging
import os
import subprocess
import sys
import urllib.error
import urllib.request
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import DatabaseError, connection, transaction
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from runs import logcontext, retention
from runs.apikeys import create_key
from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.engine.worker import WorkerProcess
from runs.models import (
    Chore,
    Event,
    NotificationDelivery,
    Run,
    RunShaper,
    RunStatus,
    Signal,
    SpendRun,
    Step,
    StreamPiece,
    Worker,
)
from runs.operations import fork_run, halt
from runs.sdk import send_signal, start_run
from tests.conftest import ROOT, daphne, wait_until

pytestmark = pytest.mark.django_db

DAY = timedelta(days=1)


def age(*runs, days: float = 10) -> None:
    """Make finished runs look as if they ended `days` ago."""
    Run.objects.filter(pk__in=[r.pk for r in runs]).update(
        finished_at=timezone.now() - timedelta(days=days)
    )


def pruned_events() -> list[dict]:
    return [e.payload for e in Event.objects.filter(run=None, type="runs.pruned").order_by("id")]


def rows_of(run) -> dict:
    return {
        "steps": Step.objects.filter(run=run).count(),
        "events": Event.objects.filter(run=run).count(),
        "signals": Signal.objects.filter(run=run).count(),
        "approvals": ApprovalRequest.objects.filter(run=run).count(),
        "delivery": NotificationDelivery.objects.filter(run=run).count(),  # a notify run's
        "shapers": RunShaper.objects.filter(run=run).count(),  # who started it (four eyes)
        "spend_days": SpendRun.objects.filter(run=run).count(),  # days it spent (the rows
        # of what was spent, SpendDay, stay: they are not the run's)
        "annotations": run.annotations.count(),
        "published": run.published.count(),  # ctx.set_event's values
        "stream_pieces": run.stream_pieces.count(),  # what its streamed calls showed
    }


@pytest.fixture
def finished(drive, alice):
    """Three runs ended with steps, events, a signal and an approval: returns them."""
    ledger = start_run("ledger", {"steps": 3})
    waiter = start_run("waiter", {})
    approver = start_run("approver", {"amount": 5})
    drive()
    send_signal(waiter.pk, "go", {"x": 1})
    decide(ApprovalRequest.objects.get(run=approver).pk, "approve", alice)
    drive()
    runs = [Run.objects.get(pk=r.pk) for r in (ledger, waiter, approver)]
    assert [r.status for r in runs] == [RunStatus.COMPLETED] * 3
    return runs


# -- retention -------------------------------------------------------------------------------


def test_prune_deletes_runs_ended_before_the_limit_with_all_their_rows_and_audits_it(
    finished, drive
):
    young = start_run("ledger", {"steps": 1})
    waiting = start_run("waiter", {})
    drive()
    age(*finished)
    Run.objects.filter(pk=waiting.pk).update(created_at=timezone.now() - 30 * DAY)
    StreamPiece.objects.create(run=finished[0], seq=0, attempt=1, offset=0, text="hello")
    expected = {k: sum(rows_of(r)[k] for r in finished) for k in rows_of(finished[0])}
    assert expected["signals"] == 1 and expected["approvals"] == 1
    assert expected["stream_pieces"] == 1

    result = retention.prune(finished_before=timezone.now() - 7 * DAY)

    assert result.counts == {"runs": 3, **expected}
    assert set(Run.objects.values_list("pk", flat=True)) == {young.pk, waiting.pk}
    left = {k for r in finished for k, v in rows_of(r).items() if v}
    # On PostgreSQL a pruned run's events stay in their month's partition until it is dropped
    # whole (tests/test_partitions.py).
    assert left == ({"events"} if connection.vendor == "postgresql" else set())
    assert rows_of(young)["events"] > 0
    [audit] = pruned_events()
    assert audit["runs"] == 3 and audit["events"] == expected["events"]
    assert audit["steps"] == expected["steps"] and audit["approvals"] == 1


def test_prune_keeps_a_parent_until_every_child_ended_before_the_limit(drive):
    parent = start_run("parent", {"n": 2, "steps": 1})
    drive()
    family = list(Run.objects.all())
    assert len(family) == 3 and {r.status for r in family} == {RunStatus.COMPLETED}
    children = [r for r in family if r.parent_id]
    age(parent, children[0])

    assert retention.prune(finished_before=timezone.now() - 7 * DAY).runs == 0
    assert Run.objects.count() == 3

    age(children[1])
    assert retention.prune(finished_before=timezone.now() - 7 * DAY).runs == 3
    assert not Run.objects.exists()


def test_prune_never_deletes_a_run_that_has_not_ended_however_old(drive):
    run = start_run("waiter", {})
    drive()
    # Even with a finished_at in the past (a retried run keeps none), a waiting run stays.
    Run.objects.filter(pk=run.pk).update(finished_at=timezone.now() - 30 * DAY)
    assert retention.prune(finished_before=timezone.now()).runs == 0
    assert Run.objects.get(pk=run.pk).status == RunStatus.WAITING


def test_a_fork_that_stays_keeps_the_run_it_was_forked_from(finished, cast):
    origin = finished[0]
    fork = fork_run(origin.pk, "s1", cast["otto"], "try again")
    age(*finished)
    assert retention.prune(finished_before=timezone.now() - DAY).runs == 2  # the other two
    assert Run.objects.filter(pk=origin.pk).exists()

    Run.objects.filter(pk=fork.pk).update(status=RunStatus.CANCELLED)
    age(fork)
    assert retention.prune(finished_before=timezone.now() - DAY).runs == 2
    assert not Run.objects.exists()


def test_a_fork_of_a_fork_that_stays_keeps_the_whole_chain_and_prune_goes_on(finished, cast):
    """Before, O <- F1 <- F2 with only F2 live wedged every prune (F1 stayed, O was deleted
    under it: an IntegrityError at commit), and each failed prune still claimed its runs."""
    origin = finished[0]
    first = fork_run(origin.pk, "s1", cast["otto"], "try again")
    Run.objects.filter(pk=first.pk).update(status=RunStatus.CANCELLED, finished_at=timezone.now())
    second = fork_run(first.pk, "s0", cast["otto"], "and again")  # live
    age(*finished, first)
    result = retention.prune(finished_before=timezone.now() - DAY)  # O and F1 in one batch
    assert result.runs == 2  # the other two; the chain stays whole
    assert set(Run.objects.values_list("pk", flat=True)) == {origin.pk, first.pk, second.pk}
    assert pruned_events()[-1]["runs"] == 2


def test_dry_run_counts_what_would_go_and_deletes_nothing(finished):
    age(*finished)
    before = Event.objects.count()
    result = retention.prune(finished_before=timezone.now(), dry_run=True, batch_size=1)
    assert result.runs == 3 and result.batches == 3
    assert result.counts["events"] == before
    assert Run.objects.count() == 3 and Event.objects.count() == before


def test_archive_writes_each_run_as_json_lines_before_deleting_it(finished, tmp_path):
    age(*finished)
    expected = {str(r.pk): rows_of(r) for r in finished}
    retention.prune(finished_before=timezone.now(), archive=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{i}.jsonl" for i in expected)
    for run_id, counts in expected.items():
        lines = [json.loads(line) for line in (tmp_path / f"{run_id}.jsonl").open()]
        assert lines[0]["table"] == "runs_run" and lines[0]["row"]["id"] == run_id
        tables = [line["table"] for line in lines[1:]]
        assert tables.count("runs_step") == counts["steps"]
        assert tables.count("runs_event") == counts["events"]
        assert tables.count("approvals_approvalrequest") == counts["approvals"]
    approver = [json.loads(x) for x in (tmp_path / f"{finished[2].pk}.jsonl").open()]
    assert approver[0]["row"]["status"] == "completed"


@pytest.mark.postgres
def test_events_stay_append_only_outside_the_prune_path(finished):
    run = finished[0]
    for attempt in (
        lambda: Event.objects.filter(run=run).delete(),
        lambda: Event.objects.filter(run=run).update(type="forged"),
    ):
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            attempt()
    # The prune path opens the history for its own batches only: the next DELETE is refused.
    age(finished[1])
    assert retention.prune(finished_before=timezone.now() - DAY).runs == 1
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        Event.objects.filter(run=run).delete()


def test_prune_command_records_only_a_person_allowed_to_delete_runs(
    finished, cast, django_user_model
):
    """Issue 31 item 8: `--user` named anyone, and the audit said they pruned."""
    age(*finished, days=3)
    with pytest.raises(CommandError, match=r"otto may not prune runs \(needs runs.delete_run\)"):
        call_command("prune", "--finished-before", "2", "--user", "otto", stdout=StringIO())
    with pytest.raises(CommandError, match="no user named 'nemo'"):
        call_command("prune", "--finished-before", "2", "--user", "nemo", stdout=StringIO())
    assert Run.objects.count() == 3 and pruned_events() == []
    django_user_model.objects.create_superuser("root", password="x")
    call_command("prune", "--finished-before", "2", "--user", "root", stdout=StringIO())
    assert not Run.objects.exists() and Event.objects.get(type="runs.pruned").actor == "root"


def test_prune_command_prints_the_counts_and_refuses_a_negative_limit(finished):
    age(*finished, days=3)
    out = StringIO()
    call_command("prune", "--finished-before", "5", "--dry-run", stdout=out)
    assert out.getvalue().startswith("would delete 0 runs")
    call_command("prune", "--finished-before", "2", stdout=out)
    assert "deleted 3 runs" in out.getvalue() and not Run.objects.exists()
    assert pruned_events()[-1]["runs"] == 3
    with pytest.raises(CommandError, match="finished-before"):
        call_command("prune", "--finished-before", "-1", stderr=StringIO())


def test_of_many_claims_of_the_daily_prune_one_wins_until_the_next_day():
    assert retention.claim_daily_prune("w1") is True
    assert retention.claim_daily_prune("w2") is False
    Chore.objects.filter(name="prune").update(due_at=timezone.now())
    assert retention.claim_daily_prune("w2") is True
    assert Chore.objects.get(name="prune").claimed_by == "w2"


def test_workers_prune_daily_on_their_own_one_worker_at_a_time(spawn_worker, monkeypatch):
    runs = [start_run("ledger", {"steps": 2}) for _ in range(3)]
    young = start_run("ledger", {"steps": 1})
    first = spawn_worker()
    wait_until(
        lambda: Run.objects.filter(status=RunStatus.COMPLETED).count() == 4, what="runs to end"
    )
    first.kill()
    age(*runs, days=3)
    monkeypatch.setenv("STEPGUARD_RETENTION_DAYS", "2")
    spawn_worker(), spawn_worker()
    wait_until(lambda: not Run.objects.filter(pk__in=[r.pk for r in runs]).exists(), what="prune")
    wait_until(lambda: Chore.objects.filter(name="prune").exists(), what="the chore")
    # The prune's audit event is written once its deletions have committed: after the runs
    # are gone, not with them.
    wait_until(lambda: pruned_events(), what="the prune's audit event")
    assert [p["runs"] for p in pruned_events()] == [3]
    assert list(Run.objects.values_list("pk", flat=True)) == [young.pk]


def test_prune_is_safe_while_a_worker_runs_new_runs(spawn_worker):
    old = [start_run("ledger", {"steps": 1}) for _ in range(30)]
    spawn_worker()
    wait_until(lambda: not Run.objects.exclude(status=RunStatus.COMPLETED).exists(), what="end")
    age(*old)
    new = [start_run("ledger", {"steps": 3}) for _ in range(10)]
    result = retention.prune(finished_before=timezone.now() - DAY, batch_size=4)
    assert result.runs == 30 and result.batches == 8
    wait_until(
        lambda: Run.objects.filter(status=RunStatus.COMPLETED).count() == 10, what="new runs"
    )
    assert set(Run.objects.values_list("pk", flat=True)) == {r.pk for r in new}


# -- health ----------------------------------------------------------------------------------


def test_health_counts_live_workers_and_the_age_of_the_oldest_runnable_run(client, drive):
    empty = client.get("/api/health")
    assert empty.status_code == 200 and empty["Cache-Control"] == "no-store"
    assert empty.json()["workers"] == 1  # drive's worker, heartbeat just now
    assert empty.json()["oldest_runnable_seconds"] is None
    Worker.objects.update(heartbeat_at=timezone.now() - timedelta(minutes=10))
    run = start_run("ledger", {"steps": 1})
    Run.objects.filter(pk=run.pk).update(wake_at=timezone.now() - timedelta(seconds=90))

    body = client.get("/health").json()
    assert body["status"] == "degraded" and body["workers"] == 0
    assert 90 <= body["oldest_runnable_seconds"] < 3600
    assert set(body) == {"status", "database", "redis", "workers", "oldest_runnable_seconds"}

    drive()
    WorkerProcess(concurrency=1).register()  # a worker with a fresh heartbeat
    body = client.get("/api/health").json()
    assert body["workers"] == 1 and body["oldest_runnable_seconds"] is None


def test_health_says_redis_is_down_and_stays_200(client, settings, drive):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/api/health")
    assert response.status_code == 200
    assert response.json()["redis"] == "down" and response.json()["status"] == "degraded"


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="REDIS_URL not set")
def test_health_says_redis_is_ok_when_it_answers(client, drive):
    assert client.get("/api/health").json() | {"oldest_runnable_seconds": None} == {
        "status": "ok", "database": "ok", "redis": "ok", "workers": 1,
        "oldest_runnable_seconds": None,
    }  # fmt: skip


def test_health_is_503_when_the_database_is_down_and_tells_no_details(tmp_path):
    down = (
        "postgres://stepguard:stepguard@127.0.0.1:1/nowhere"
        if connection.vendor == "postgresql"
        else f"sqlite:///{tmp_path}/no/such/dir/db.sqlite3"
    )
    with daphne(tmp_path, DATABASE_URL=down, REDIS_URL="redis://127.0.0.1:1/0") as url:
        for path in ("/health", "/api/health"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url + path, timeout=30)
            assert refused.value.code == 503
            assert json.loads(refused.value.read()) == {
                "status": "down", "database": "down", "redis": "down",
                "workers": None, "oldest_runnable_seconds": None,
            }  # fmt: skip


# -- structured logs -------------------------------------------------------------------------


def test_json_lines_carry_the_run_workflow_and_worker_of_the_run_being_executed():
    out = StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logcontext.ContextFilter())
    handler.setFormatter(logcontext.JsonFormatter())
    log = logging.getLogger("stepguard.test")
    log.addHandler(handler)
    run = Run(workflow="ledger", version="1")
    try:
        log.warning("outside")
        logcontext.run_context(run, "w-1").run(
            log.warning, "inside %s", "a run", extra={"step": "s1"}
        )
        try:
            raise ValueError("boom")
        except ValueError:
            logcontext.run_context(run, "w-1").run(log.exception, "failed")
    finally:
        log.removeHandler(handler)
    outside, inside, failed = (json.loads(line) for line in out.getvalue().splitlines())
    assert set(outside) == {"time", "level", "logger", "message"}
    assert outside["level"] == "WARNING" and outside["logger"] == "stepguard.test"
    assert inside | {"time": None} == {
        "time": None, "level": "WARNING", "logger": "stepguard.test", "message": "inside a run",
        "run_id": str(run.id), "workflow": "ledger@1", "step": "s1", "worker": "w-1",
    }  # fmt: skip
    assert "ValueError: boom" in failed["exception"] and failed["run_id"] == str(run.id)


def test_a_worker_with_log_format_json_writes_only_json_lines_naming_runs_steps_and_events(
    spawn_worker, monkeypatch
):
    monkeypatch.setenv("LOG_FORMAT", "json")
    monkeypatch.setenv("LOG_EVENTS", "1")
    worker = spawn_worker()
    run = start_run("ledger", {"steps": 2})
    wait_until(lambda: Run.objects.get(pk=run.pk).status == RunStatus.COMPLETED, what="the run")
    wait_until(lambda: f"{run.id} (ledger@1): completed" in worker.output(), what="its line")
    lines = [json.loads(line) for line in worker.output().splitlines() if line.strip()]
    worker_id = str(Worker.objects.get(pid=worker.pid).id)
    assert all(line["worker"] == worker_id for line in lines)
    assert any("serving" in line["message"] for line in lines)
    mine = [line for line in lines if line.get("run_id") == str(run.id)]
    events = {line["event"]: line for line in mine if line["logger"] == "stepguard.events"}
    assert {"run.claimed", "run.completed"} <= set(events)
    assert events["run.completed"]["workflow"] == "ledger@1"  # logged while the run ran
    assert events["run.claimed"]["message"] == "run.claimed by system"
    # Step events name their step, on both engines.
    assert {"step.started", "step.completed"} <= set(events)
    steps = {line.get("step") for line in mine if line["logger"] == "stepguard.events"}
    assert steps - {None} == {"s0", "s1"}
    done = next(line for line in mine if line["logger"] == "stepguard.worker")
    assert done["workflow"] == "ledger@1" and "completed" in done["message"]


def test_an_unknown_log_format_stops_the_process_with_its_name(tmp_path):
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "LOG_FORMAT": "xml",
             "STEPGUARD_VAR_DIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode != 0
    assert "LOG_FORMAT='xml' is not 'plain' or 'json'" in result.stderr


# -- metrics ---------------------------------------------------------------------------------


def scrape(client, **headers) -> dict:
    """The samples of GET /metrics: {(name, ((label, value), ...)): value}."""
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    families = text_string_to_metric_families(response.content.decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_metrics_need_an_api_key_a_session_or_an_allowed_address(client, cast, settings):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer sg_x_y"}).status_code == 401
    key = create_key(cast["vera"])[1]
    scrape(client, Authorization=f"Bearer {key}")
    settings.STEPGUARD_METRICS_ALLOW = ["10.0.0.0/8"]
    assert client.get("/metrics").status_code == 401
    settings.STEPGUARD_METRICS_ALLOW = ["10.0.0.0/8", "127.0.0.0/8"]
    scrape(client)  # the test client's address is 127.0.0.1
    settings.STEPGUARD_METRICS_ALLOW = []
    client.force_login(cast["vera"])
    scrape(client)


def test_metrics_refuse_a_person_without_the_permission_to_read_runs(client, django_user_model):
    """Issue 31 item 8: /metrics takes runs.view_run, like every read-only page."""
    nobody = django_user_model.objects.create_user("nobody", password="x")
    key = create_key(nobody)[1]
    response = client.get("/metrics", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 403
    assert "runs.view_run" in response.json()["error"]["message"]
    client.force_login(nobody)
    assert client.get("/metrics").status_code == 403


def test_metrics_read_runs_steps_spend_approvals_and_halts_from_the_database(
    client, cast, drive, settings, django_assert_max_num_queries
):
    settings.STEPGUARD_METRICS_ALLOW = ["127.0.0.1"]
    done = [start_run("ledger", {"steps": 2}) for _ in range(2)]
    start_run("approver", {"amount": 5})
    drive()
    # Rewritten as if they had run so: a finished run's steps are counted as it finishes.
    finished = Run.objects.filter(pk__in=[r.pk for r in done])
    finished.update(status=RunStatus.PENDING)
    step = Step.objects.get(run=done[0], key="s0")
    Step.objects.filter(pk=step.pk).update(
        kind="llm", input=[{"model": "gpt-x"}], cost_micros=1_500_000, tokens_in=10, tokens_out=4
    )
    Step.objects.filter(pk=Step.objects.get(run=done[1], key="s1").pk).update(attempt=3)
    finished.update(status=RunStatus.COMPLETED)
    halt("workflow:ledger", cast["otto"], "maintenance")
    late = start_run("waiter", {})
    Run.objects.filter(pk=late.pk).update(wake_at=timezone.now() - timedelta(seconds=120))
    ApprovalRequest.objects.update(created_at=timezone.now() - timedelta(seconds=60))

    with django_assert_max_num_queries(19):  # one per figure, whatever the number of rows
        m = scrape(client)

    assert m[("stepguard_runs", (("status", "completed"), ("workflow", "ledger")))] == 2
    assert m[("stepguard_runs", (("status", "waiting"), ("workflow", "approver")))] == 1
    assert m[("stepguard_runnable_runs", ())] == 1
    assert 120 <= m[("stepguard_oldest_runnable_age_seconds", ())] < 3600
    assert m[("stepguard_steps", (("outcome", "completed"),))] == 4
    assert m[("stepguard_steps", (("outcome", "retried"),))] == 2
    assert m[("stepguard_steps", (("outcome", "failed"),))] == 0
    assert m[("stepguard_spend_usd", (("model", "gpt-x"), ("workflow", "ledger")))] == 1.5
    assert (
        m[("stepguard_tokens", (("direction", "in"), ("model", "gpt-x"), ("workflow", "ledger")))]
        == 10
    )
    assert m[("stepguard_approvals_pending", ())] == 1
    assert 60 <= m[("stepguard_oldest_pending_approval_age_seconds", ())] < 3600
    assert m[("stepguard_halts", (("scope", "workflow"),))] == 1
    assert m[("stepguard_halts", (("scope", "global"),))] == 0
    assert m[("stepguard_workers_live", ())] == 1
    call = (("kind", "call"),)
    assert m[("stepguard_step_duration_seconds_gcount", call)] == 3
    assert m[("stepguard_step_duration_seconds_bucket", (*call, ("le", "+Inf")))] == 3
    assert m[("stepguard_step_duration_seconds_bucket", (("kind", "llm"), ("le", "+Inf")))] == 1
    assert m[("stepguard_lease_losses", ())] == 0


def test_metrics_count_the_work_of_every_worker_process_and_outlive_them(
    client, spawn_worker, settings
):
    settings.STEPGUARD_METRICS_ALLOW = ["127.0.0.1"]
    workers = [spawn_worker(), spawn_worker()]
    runs = [start_run("ledger", {"steps": 3}) for _ in range(8)]
    wait_until(
        lambda: Run.objects.filter(status=RunStatus.COMPLETED).count() == len(runs), what="runs"
    )
    assert scrape(client)[("stepguard_workers_live", ())] == 2
    assert len(set(Run.objects.values_list("worker", flat=True))) >= 1
    for worker in workers:
        worker.kill()
    m = scrape(client)
    assert m[("stepguard_steps", (("outcome", "completed"),))] == 24
    assert m[("stepguard_runs", (("status", "completed"), ("workflow", "ledger")))] == 8
    beats = [k for k in m if k[0] == "stepguard_worker_last_heartbeat_timestamp_seconds"]
    assert len(beats) == 2  # killed, not stopped: shown until their heartbeat is a day old
