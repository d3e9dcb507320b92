"""Streams a user never sees twice (issue 49 §4): a model call streamed, its worker killed by
SIGKILL mid-stream, and the call re-sent by the next worker. `on_delta` gets every piece with
its position and the re-send says so; the SSE stream of the run and its live page show each
piece once. Real workers, the demo model on 127.0.0.1 paused mid-answer, daphne, Chromium."""

import json
import threading

import httpx
import pytest

from runs.engine.streaming import fold, shown_text
from runs.models import Run, RunStatus, Step, StreamPiece
from runs.sdk import start_run
from tests import agent_workflows  # noqa: F401  (registers the workflow)
from tests.conftest import wait_until
from tests.test_agents import text_of

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

PROTOCOLS = ["chat", "responses", "anthropic"]
#: The events of the demo model's streamed answer after which two pieces (24 characters) of its
#: text are out, and after which the whole text is out but the answer not finished.
TWO_PIECES = {"chat": 3, "responses": 5, "anthropic": 4}
ALL_TEXT = {"chat": 6, "responses": 8, "anthropic": 7}
IMPORT = ("--import", "tests.agent_workflows")


def logged(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def finished(run) -> Run:
    return wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=60, what="the run"
    )


def killed_mid_stream(spawn_worker, demo_model, protocol, log, then=None):
    """A streamed call's worker killed by SIGKILL once two pieces of the answer were handed to
    `on_delta` and stored; the next worker re-sends it (paused again after `then` events)."""
    demo_model.stall_streams(TWO_PIECES[protocol], then)
    worker = spawn_worker(*IMPORT, lease=1.0)
    run = start_run("llm-stream-logged", {"protocol": protocol, "log": str(log)})
    wait_until(
        lambda: (
            demo_model.stalled[0].is_set()
            and len(logged(log)) == 2
            and len(shown_text(run.pk, 0)[0]) == 24
        ),
        timeout=60,
        what=lambda: (
            f"two pieces handed out and stored: stalled {demo_model.stalled[0].is_set()}, "
            f"handed {logged(log)}, stored {shown_text(run.pk, 0)}\n{worker.output()[-3000:]}"
        ),
    )
    worker.kill()
    demo_model.release()  # the dead worker's answer ends; nobody reads it
    spawn_worker(*IMPORT, lease=1.0)
    return run


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_stream_re_sent_after_sigkill_announces_itself_to_on_delta(
    spawn_worker, demo_model, tmp_path, protocol
):
    """Before: the re-send handed its text to on_delta again from the start with no sign (the
    first 2 pieces twice, here; 7, 3 and 5 in the issue). Now each piece says its attempt and
    offset, the first of the re-send says `restart`: replacing by offset gives the answer once."""
    log = tmp_path / "deltas.jsonl"
    run = finished(killed_mid_stream(spawn_worker, demo_model, protocol, log))
    assert run.status == RunStatus.COMPLETED
    step = Step.objects.get(run=run, seq=0)
    answer = text_of(protocol, step.output)
    pieces = logged(log)
    assert step.recovered == "resent" and step.attempt == 2
    assert "".join(p["text"] for p in pieces) == answer[:24] + answer  # re-sent from the start
    assert [p["attempt"] for p in pieces] == [1, 1] + [2] * (len(pieces) - 2)
    assert [p["restart"] for p in pieces] == [False, False, True] + [False] * (len(pieces) - 3)
    assert [p["offset"] for p in pieces[:3]] == [0, 12, 0]
    assert fold((p["offset"], p["text"]) for p in pieces) == answer  # replaced, not appended
    # The run's readers were shown each piece once: the re-send repeated the first two.
    stored = list(StreamPiece.objects.filter(run=run).order_by("id").values("offset", "text"))
    assert "".join(p["text"] for p in stored) == answer
    assert [p["offset"] for p in stored] == sorted({p["offset"] for p in stored})


def sse_events(response) -> list[dict]:
    """The events of a `text/event-stream` response, read to its end."""
    events, event = [], {}
    for line in response.iter_lines():
        if not line:
            if "event" in event:
                events.append(event)
            event = {}
        elif not line.startswith(":") and ":" in line:
            name, value = line.split(":", 1)
            event[name] = value.removeprefix(" ")
    return events


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_re_sent_stream_is_seen_once_through_the_sse_endpoint_and_resumes_by_last_event_id(
    server, spawn_worker, demo_model, tmp_path, protocol, django_user_model
):
    from django.contrib.auth.models import Permission

    from runs.apikeys import create_key

    vera = django_user_model.objects.create_user("vera", password="x")
    vera.user_permissions.add(Permission.objects.get(codename="view_run"))
    secret = create_key(vera, name="sse")[1]
    auth = {"Authorization": f"Bearer {secret}"}
    log = tmp_path / "deltas.jsonl"
    demo_model.stall_streams(TWO_PIECES[protocol])
    worker = spawn_worker(*IMPORT, lease=1.0)
    run = start_run("llm-stream-logged", {"protocol": protocol, "log": str(log)})
    url = f"{server}/api/runs/{run.pk}/stream"
    # Open before the kill: the client reads the first attempt's pieces, then the re-send's.
    seen: list[dict] = []
    opened = threading.Event()

    def read():
        with httpx.stream("GET", url, headers=auth, timeout=60) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            opened.set()
            seen.extend(sse_events(response))

    reader = threading.Thread(target=read)
    reader.start()
    wait_until(
        lambda: opened.is_set() and demo_model.stalled[0].is_set() and len(logged(log)) == 2,
        timeout=60,
        what="the stream open and two pieces out",
    )
    wait_until(lambda: len(shown_text(run.pk, 0)[0]) == 24, what="two pieces stored")
    worker.kill()
    demo_model.release()
    spawn_worker(*IMPORT, lease=1.0)
    reader.join(60)
    assert not reader.is_alive()
    run = finished(run)
    answer = text_of(protocol, Step.objects.get(run=run, seq=0).output)
    deltas = [json.loads(e["data"]) for e in seen if e["event"] == "delta"]
    assert seen[-1]["event"] == "end"
    assert "".join(d["text"] for d in deltas) == answer  # each piece once, nothing to cut
    assert [d["offset"] for d in deltas] == [
        sum(len(x["text"]) for x in deltas[:i]) for i in range(len(deltas))
    ]
    assert {d["attempt"] for d in deltas} == {1, 2}  # both attempts streamed to it
    ids = [int(e["id"]) for e in seen if e["event"] == "delta"]
    assert ids == sorted(ids)

    # A client that lost the connection after the first piece resumes from its id.
    resumed = httpx.get(url, headers=auth | {"Last-Event-ID": str(ids[0])}, timeout=30)
    rest = [json.loads(e["data"]) for e in sse_events(resumed) if e["event"] == "delta"]
    assert deltas[0]["text"] + "".join(d["text"] for d in rest) == answer
    assert rest == deltas[1:]
    # `?after=` does the same for clients that cannot set the header.
    again = httpx.get(f"{url}?after={ids[0]}", headers=auth, timeout=30)
    assert [json.loads(e["data"]) for e in sse_events(again) if e["event"] == "delta"] == rest

    # Authenticated and permission-checked as the run's detail; a bad cursor is named.
    assert httpx.get(url, timeout=30).status_code == 401
    bad = httpx.get(url, headers=auth | {"Last-Event-ID": "x1"}, timeout=30)
    assert bad.status_code == 400 and "Last-Event-ID" in bad.json()["error"]["message"]
    django_user_model.objects.create_user("nobody", password="x")
    other = create_key(django_user_model.objects.get(username="nobody"), name="n")[1]
    denied = httpx.get(url, headers={"Authorization": f"Bearer {other}"}, timeout=30)
    assert denied.status_code == 403


@pytest.mark.browser
def test_the_live_page_shows_a_re_sent_stream_once(
    server, page, cast, spawn_worker, demo_model, tmp_path
):
    """The run page's row shows the first attempt's text; after the kill and the re-send, it
    shows the answer once: the browser records every text the row's stream ever had."""
    from playwright.sync_api import expect

    from tests.test_browser import login

    protocol = "chat"
    log = tmp_path / "deltas.jsonl"
    demo_model.stall_streams(TWO_PIECES[protocol], ALL_TEXT[protocol])
    run = start_run("llm-stream-logged", {"protocol": protocol, "log": str(log)})
    login(page, server, "vera", f"/runs/{run.pk}")
    expect(page.locator("#ws-status")).to_have_attribute("data-state", "open")
    worker = spawn_worker(*IMPORT, lease=1.0)
    stream = page.locator("#stream-0")
    expect(stream).to_have_text("[demo model] stream abou", timeout=20_000)  # two pieces
    page.evaluate(
        """() => {
            window.__texts = [];
            const seen = () => {
                const out = document.getElementById('stream-0');
                if (out) window.__texts.push(out.textContent);
            };
            new MutationObserver(seen).observe(
                document.body, {subtree: true, childList: true, characterData: true});
        }"""
    )
    worker.kill()
    demo_model.release()
    spawn_worker(*IMPORT, lease=1.0)
    wait_until(lambda: len(logged(log)) == 7, timeout=30, what="the re-send's whole text")
    assert demo_model.stalled[1].is_set()  # and its answer paused before it finishes
    answer = "".join(p["text"] for p in logged(log)[2:])
    assert answer.startswith("[demo model]") and logged(log)[2]["restart"]
    expect(page.locator("#stream-0")).to_have_text(answer, timeout=20_000)
    texts = page.evaluate("window.__texts")
    assert texts and all(answer.startswith(text) for text in texts), texts  # never doubled
    demo_model.release()
    expect(page.locator("#run-status")).to_have_text("completed", timeout=30_000)


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()
