"""MCP tools as durable steps (runs/adapters/mcp.py): the real MCP server of tests/mcp_server.py
(stdio and streamable HTTP), its tools offered to the agent loop against the demo model on
127.0.0.1, each call a step, counted at the server."""

import json
import socket
import subprocess
import sys
from collections import Counter

import pytest

from runs.approvals.models import ApprovalRequest
from runs.approvals.services import decide
from runs.models import Run, Step
from runs.sdk import start_run
from tests import adapter_mcp_workflows as wf
from tests import workflows
from tests.conftest import wait_until

pytestmark = pytest.mark.django_db

SERVER_TOOLS = ["send_note", "refund", "lookup"]


@pytest.fixture(autouse=True)
def _reset():
    wf.server_args.clear()
    workflows.crash_at.clear()
    yield
    wf.server_args.clear()
    workflows.crash_at.clear()


def keys(run) -> list[str]:
    return list(Step.objects.filter(run=run).order_by("seq").values_list("key", flat=True))


def offered(body: dict) -> list[str]:
    return [t["function"]["name"] for t in body["tools"]]


def told(body: dict) -> list:
    """The tool results the model was sent in a request, in order."""
    return [json.loads(m["content"]) for m in body["messages"] if m["role"] == "tool"]


def test_each_call_is_a_step_approvals_wait_and_errors_go_to_the_model(
    drive, demo_model, cast, tmp_path
):
    calls = str(tmp_path / "calls.jsonl")
    run = start_run("mcp-agent", {"calls": calls, "approve": ["refund"]})
    assert drive() == ["waiting"]
    request = ApprovalRequest.objects.get(run=run)
    assert request.step_key == "tool-refund-2.approval"
    assert request.payload == {"tool": "refund", "args": {"order": "A1", "amount": 30}}
    assert [c["tool"] for c in wf.server_calls(calls)] == ["send_note"]  # refund waits

    decide(request.pk, "approve", cast["ada"], "ok")
    assert drive() == ["completed"]
    assert keys(run) == [
        "mcp:shop:tools", "think-0", "tool-send_note-0", "think-1", "tool-pause-1", "think-2",
        "tool-refund-2.approval", "tool-refund-2", "think-3", "tool-lookup-3", "think-4",
    ]  # fmt: skip
    # The tool list is recorded, and the server's tools are what the model was offered.
    listed = Step.objects.get(run=run, key="mcp:shop:tools").output
    assert [t["name"] for t in listed] == SERVER_TOOLS
    assert listed[0]["input_schema"]["required"] == ["to", "text"]
    assert offered(demo_model.bodies[0]) == [*SERVER_TOOLS, "pause"]
    assert demo_model.bodies[0]["tools"][1]["function"]["description"].startswith("Refund")
    # One call at the server per call step, each with its step's idempotency key in _meta.
    done = wf.server_calls(calls)
    assert [(c["tool"], c["key"]) for c in done] == [
        ("send_note", f"{run.id}:tool-send_note-0"), ("refund", f"{run.id}:tool-refund-2"),
    ]  # fmt: skip
    assert done[1]["args"] == {"order": "A1", "amount": 30}
    # What the tools answered went back to the model; the server's error too, sent once.
    results = told(demo_model.bodies[-1])
    assert results[0] == {"result": "note sent to ada"}
    assert results[2] == {"refunded": "A1", "amount": 30}
    assert results[3] == {"error": "Error executing tool lookup: no order missing"}
    lookup = Step.objects.get(run=run, key="tool-lookup-3")
    assert (lookup.status, lookup.attempt, lookup.error["code"]) == (
        "failed", 1, "mcp_tool_error",
    )  # fmt: skip
    assert Run.objects.get(pk=run.pk).output["answer"].startswith("Done. Tool results:")


def test_a_rejected_call_never_reaches_the_server(drive, demo_model, cast, tmp_path):
    calls = str(tmp_path / "calls.jsonl")
    run = start_run("mcp-agent", {"calls": calls, "approve_over": 20})  # refund of 30: asked
    assert drive() == ["waiting"]
    decide(ApprovalRequest.objects.get(run=run).pk, "reject", cast["ada"], "not this one")
    assert drive() == ["completed"]
    assert [c["tool"] for c in wf.server_calls(calls)] == ["send_note"]
    assert "not this one" in told(demo_model.bodies[-1])[2]["refused"]


def test_a_crash_does_not_call_a_finished_tool_again_nor_relist(
    drive, expire_lease, demo_model, tmp_path
):
    calls = str(tmp_path / "calls.jsonl")
    workflows.crash_at.add("mcp-pause")  # the process dies in turn 1, after send_note's step
    run = start_run("mcp-agent", {"calls": calls})
    with pytest.raises(workflows.Crash):
        drive()
    assert [c["tool"] for c in wf.server_calls(calls)] == ["send_note"]
    # The server changed meanwhile: it lists one tool more.
    wf.server_args.append("--extra")
    expire_lease(run.id)
    assert drive() == ["completed"]
    done = Counter(c["key"] for c in wf.server_calls(calls))
    assert done == {f"{run.id}:tool-send_note-0": 1, f"{run.id}:tool-refund-2": 1}
    steps = Counter(
        Step.objects.filter(run=run, kind="tool").exclude(key="tool-pause-1")
        .values_list("key", flat=True)
    )  # fmt: skip
    assert set(steps) == {"tool-send_note-0", "tool-refund-2", "tool-lookup-3"}
    # The resumed run offered the tools it was offered before, not the server's new list.
    assert {tuple(offered(body)) for body in demo_model.bodies} == {(*SERVER_TOOLS, "pause")}
    assert [t["name"] for t in Step.objects.get(run=run, key="mcp:shop:tools").output] == (
        SERVER_TOOLS
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server(tmp_path):
    """tests/mcp_server.py over streamable HTTP on 127.0.0.1: yields (url, calls file)."""
    calls, port = str(tmp_path / "calls.jsonl"), free_port()
    proc = subprocess.Popen(
        [sys.executable, wf.SERVER, calls, "http", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_until(listening, timeout=30)
        yield f"http://127.0.0.1:{port}/mcp", calls
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_streamable_http_server(drive, demo_model, http_server):
    url, calls = http_server
    run = start_run("mcp-agent", {"url": url, "script": "send_note, lookup", "order": "A1"})
    assert drive() == ["completed"]
    assert keys(run) == ["mcp:shop:tools", "think-0", "tool-send_note-0", "think-1",
                         "tool-lookup-1", "think-2"]  # fmt: skip
    assert [(c["tool"], c["key"]) for c in wf.server_calls(calls)] == [
        ("send_note", f"{run.id}:tool-send_note-0")
    ]
    assert told(demo_model.bodies[-1])[1] == {"result": "order A1: shipped"}


@pytest.mark.django_db(transaction=True)  # its checkpoints are written from a thread of its own
def test_an_async_workflow(drive, demo_model, tmp_path):
    calls = str(tmp_path / "calls.jsonl")
    run = start_run(
        "mcp-agent-async", {"calls": calls, "script": "send_note+lookup", "order": "A1"}
    )
    assert drive() == ["completed"]
    assert keys(run) == ["mcp:shop:tools", "think-0", "tool-send_note-0", "tool-lookup-0",
                         "think-1"]  # fmt: skip
    assert [c["tool"] for c in wf.server_calls(calls)] == ["send_note"]
    assert told(demo_model.bodies[-1]) == [
        {"result": "note sent to ada"}, {"result": "order A1: shipped"},
    ]  # fmt: skip


@pytest.mark.django_db(transaction=True)  # the adapter's checkpoints: threads of their own
def test_the_agents_sdk_adapter_offers_an_agent_s_mcp_servers_durably(
    drive, expire_lease, demo_model, cast, tmp_path
):
    calls = str(tmp_path / "calls.jsonl")
    workflows.crash_at.add("mcp-pause")  # the process dies in turn 1, after send_note's step
    run = start_run("mcp-oa-agent", {"calls": calls, "order": "A1"})
    with pytest.raises(workflows.Crash):
        drive()
    assert [c["tool"] for c in wf.server_calls(calls)] == ["send_note"]
    wf.server_args.append("--extra")  # the server lists one tool more from now on
    expire_lease(run.id)
    assert drive() == ["waiting"]  # refund: the server's require_approval, in the inbox
    request = ApprovalRequest.objects.get(run=run)
    assert request.payload == {"tool": "refund", "args": {"order": "A1", "amount": 30}}
    assert [c["tool"] for c in wf.server_calls(calls)] == ["send_note"]
    decide(request.pk, "approve", cast["ada"], "ok")
    assert drive() == ["completed"]
    assert keys(run) == [
        "mcp:shop:tools", "model:support", "tool:send_note", "model:support#2", "tool:pause",
        "model:support#3", "approve:refund", "tool:refund", "model:support#4", "tool:lookup",
        "model:support#5",
    ]  # fmt: skip
    done = wf.server_calls(calls)
    assert [(c["tool"], c["key"]) for c in done] == [
        ("send_note", f"{run.id}:tool:send_note"), ("refund", f"{run.id}:tool:refund"),
    ]  # fmt: skip
    listed = Step.objects.get(run=run, key="mcp:shop:tools").output
    assert [t["name"] for t in listed] == SERVER_TOOLS
    for body in demo_model.bodies:  # the recorded list, never the newer server's
        assert sorted(offered(body)) == sorted([*SERVER_TOOLS, "pause"])
    assert "Done. Tool results:" in Run.objects.get(pk=run.pk).output


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_sigkilled_workers_call_no_finished_tool_again(spawn_worker, demo_model, tmp_path):
    """Real worker processes: one killed just after send_note's step is recorded, the next as
    soon as the server has done the refund (its step possibly not recorded yet)."""
    calls = str(tmp_path / "calls.jsonl")

    def worker():
        return spawn_worker("--import", "tests.adapter_mcp_workflows", lease=1.0)

    running = worker()
    script = {"calls": calls, "script": "send_note, refund, lookup", "order": "A1"}
    run = start_run("mcp-agent", script)
    wait_until(
        lambda: Step.objects.filter(run=run, key="tool-send_note-0", status="completed").exists(),
        timeout=120, what="send_note's step",
    )  # fmt: skip
    running.kill()
    running = worker()
    wait_until(
        lambda: any(c["tool"] == "refund" for c in wf.server_calls(calls)),
        timeout=120, what="the refund at the server",
    )  # fmt: skip
    running.kill()
    worker()
    done = wait_until(
        lambda: (r := Run.objects.get(pk=run.pk)).is_terminal and r, timeout=120, what="the run"
    )
    assert done.status == "completed"
    at_server = Counter(c["key"] for c in wf.server_calls(calls))
    for step in Step.objects.filter(run=run, key__in=["tool-send_note-0", "tool-refund-1"]):
        if step.recovered == "resent":  # in flight at the kill: sent again with the same key
            assert at_server[step.idempotency_key] >= 1
        else:
            assert at_server[step.idempotency_key] == 1, step.key
    assert set(at_server) == {f"{run.id}:tool-send_note-0", f"{run.id}:tool-refund-1"}
    assert at_server[f"{run.id}:tool-send_note-0"] == 1  # finished before its kill
