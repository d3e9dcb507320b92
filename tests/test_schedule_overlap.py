"""A schedule's overlap policy, catch-up window and scheduled time (issue 53 §5), on a clock
the tests control: `fire_due(now=...)`, and run ends written as a worker would."""

from datetime import UTC, datetime

import pytest

import tests.flow_workflows  # noqa: F401  (registers the flow.* workflows in this process)
from runs import schedules
from runs.models import Run, RunStatus, Schedule
from runs.schedules import ScheduleError

MINUTELY = "* * * * *"


def at(hhmmss: str) -> datetime:
    return datetime.fromisoformat(f"2026-12-02T{hhmmss}").replace(tzinfo=UTC)


def scheduled(name: str, overlap: str, cron: str = MINUTELY, first: str = "10:00:00", **kw):
    schedules.save(name, workflow="flow.plain", cron=cron, overlap=overlap, **kw)
    Schedule.objects.filter(name=name).update(next_fire_at=at(first))


def ticks(name: str) -> list[str]:
    """The ticks whose runs were started, in order (HH:MM:SS)."""
    keys = Run.objects.filter(key__startswith=f"schedule:{name}:").values_list("key", flat=True)
    return sorted(key.rsplit("T", 1)[1].rstrip("Z") for key in keys)


def finish(name: str) -> None:
    """Every run of the schedule ends, as a worker would end it."""
    Run.objects.filter(key__startswith=f"schedule:{name}:").update(status=RunStatus.COMPLETED)


def test_by_default_a_tick_is_skipped_while_the_last_run_is_open(db):
    scheduled("s", "skip")
    assert Schedule.objects.get(name="s").overlap == "skip"
    schedules.fire_due({"flow.plain"}, now=at("10:00:30"))
    schedules.fire_due({"flow.plain"}, now=at("10:01:30"))  # 10:00's run is still pending
    assert ticks("s") == ["10:00:00"]
    finish("s")
    schedules.fire_due({"flow.plain"}, now=at("10:02:30"))
    assert ticks("s") == ["10:00:00", "10:02:00"]  # 10:01 is gone for good


def test_buffer_one_keeps_one_tick_for_when_the_run_ends(db):
    scheduled("b1", "buffer_one")
    schedules.fire_due({"flow.plain"}, now=at("10:00:30"))
    schedules.fire_due({"flow.plain"}, now=at("10:01:30"))
    schedules.fire_due({"flow.plain"}, now=at("10:02:30"))
    assert ticks("b1") == ["10:00:00"]
    assert Schedule.objects.get(name="b1").buffered == ["2026-12-02T10:01:00+00:00"]
    finish("b1")
    assert schedules.fire_due({"flow.plain"}, now=at("10:02:40")) == 1  # no tick due: the buffer
    assert ticks("b1") == ["10:00:00", "10:01:00"]  # 10:02 was dropped: one buffered at most
    assert Schedule.objects.get(name="b1").buffered == []


def test_buffer_all_starts_every_tick_one_after_another(db):
    scheduled("ba", "buffer_all")
    for now in ("10:00:30", "10:01:30", "10:02:30"):
        schedules.fire_due({"flow.plain"}, now=at(now))
    assert ticks("ba") == ["10:00:00"]
    for started in (["10:00:00", "10:01:00"], ["10:00:00", "10:01:00", "10:02:00"]):
        schedules.fire_due({"flow.plain"}, now=at("10:02:40"))  # still open: nothing new
        finish("ba")
        schedules.fire_due({"flow.plain"}, now=at("10:02:50"))
        assert ticks("ba") == started
    assert Schedule.objects.get(name="ba").buffered == []


def test_allow_all_starts_ticks_side_by_side(db):
    scheduled("aa", "allow_all")
    schedules.fire_due({"flow.plain"}, now=at("10:00:30"))
    schedules.fire_due({"flow.plain"}, now=at("10:01:30"))
    assert ticks("aa") == ["10:00:00", "10:01:00"]
    assert Run.objects.exclude(status=RunStatus.COMPLETED).count() == 2


@pytest.mark.parametrize(("overlap", "runs"), [("skip", 1), ("allow_all", 8)])
def test_workers_back_after_five_minutes_start_one_run_not_a_burst(db, overlap, runs):
    """Every 10 s, catch-up `all`, workers down from 10:00 to 10:05: the ticks within the
    grace period (60 s) and the newest missed ones came back at once before (allow_all)."""
    scheduled("tick", overlap, cron="*/10 * * * * *", catchup="all", catchup_limit=1)
    schedules.fire_due({"flow.plain"}, now=at("10:05:00"))
    assert len(ticks("tick")) == runs


def test_a_catch_up_window_bounds_how_late_a_tick_may_fire(db):
    scheduled("w", "allow_all", catchup_window=150)
    schedules.fire_due({"flow.plain"}, now=at("10:05:20"))
    assert ticks("w") == ["10:03:00", "10:04:00", "10:05:00"]  # within 150 s of 10:05:20


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"overlap": "sometimes"}, "overlap must be one of skip, buffer_one, buffer_all"),
        ({"catchup_window": 0}, "catchup_window must be between 1 second and 366 days"),
    ],
)
def test_a_bad_overlap_or_window_is_refused_by_name(db, fields, message):
    with pytest.raises(ScheduleError, match=message):
        schedules.save("x", workflow="flow.plain", cron=MINUTELY, **fields)


def test_the_api_and_the_dashboard_form_set_the_overlap_policy(client, cast):
    client.force_login(cast["otto"])
    saved = client.put(
        "/api/flow/schedules/api-one",
        {"workflow": "flow.plain", "cron": MINUTELY, "overlap": "buffer_all",
         "catchup_window": 300},
        content_type="application/json",
    )  # fmt: skip
    assert saved.status_code == 200, saved.content
    assert (saved.json()["overlap"], saved.json()["catchup_window"]) == ("buffer_all", 300)
    bad = client.put(
        "/api/flow/schedules/api-two",
        {"workflow": "flow.plain", "cron": MINUTELY, "overlap": "maybe"},
        content_type="application/json",
    )
    assert bad.status_code == 422
    client.post("/flow/schedules", {"name": "form-one", "workflow": "flow.plain",
                                    "cron": MINUTELY, "overlap": "buffer_one"})  # fmt: skip
    assert Schedule.objects.get(name="form-one").overlap == "buffer_one"
    page = client.get("/flow").content.decode()
    assert 'name="overlap"' in page and "start one tick when the last run ends" in page


def test_a_scheduled_run_is_handed_its_tick(db):
    from runs.engine.records import scheduled_tick

    scheduled("t", "skip")
    schedules.fire_due({"flow.plain"}, now=at("10:00:30"))
    run = Run.objects.get(key__startswith="schedule:t:")
    assert scheduled_tick(run.key) == at("10:00:00")
    assert scheduled_tick("my-own-key") is None and scheduled_tick(None) is None


def test_a_schedule_declared_in_code_takes_its_overlap_policy(db, monkeypatch):
    from runs.engine import registry
    from runs.errors import InvalidInput
    from runs.sdk import workflow

    # Registered for this test only: no other test's process sees its schedule.
    monkeypatch.setattr(registry, "_workflows", dict(registry._workflows))
    monkeypatch.setattr(registry, "_latest", dict(registry._latest))

    @workflow("peers.coded", schedule="*/5 * * * *", overlap="buffer_one")
    def coded(ctx, input):
        return None

    schedules.sync_code_schedules()
    assert Schedule.objects.get(name="peers.coded").overlap == "buffer_one"
    with pytest.raises(InvalidInput, match="overlap must be one of skip, buffer_one"):
        workflow("peers.badly", schedule="* * * * *", overlap="queue")


def test_a_refused_schedule_form_keeps_the_overlap_chosen(client, cast):
    client.force_login(cast["otto"])
    typed = {"name": "n", "workflow": "flow.plain", "cron": "0 3 * *", "overlap": "buffer_all"}
    page = client.post("/flow/schedules", typed, follow=True).content.decode()
    assert "bad cron expression" in page
    form = page[page.index('id="add-schedule"') :]
    assert '<option value="buffer_all" selected>' in form
