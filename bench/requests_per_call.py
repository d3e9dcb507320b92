"""Requests at the provider per recorded model call, with the clients and frameworks people bring.

    .venv/bin/python bench/requests_per_call.py [--runs 6] [--kills 20]

Each shape below starts `--runs` runs at once on one real worker process (`runworker
--concurrency 6`) against the demo model on 127.0.0.1, which counts every request it answers
and the Idempotency-Key each came with. A recorded call is a completed `llm` step. Then the
same again while the worker is SIGKILLed `--kills` times at random moments (0.2-0.8 s apart)
and replaced each time (lease 1 s).

- without kills, the target is 1.00 request per recorded call, no request without a key, and
  no run failed (issue 30 measured 1.9x for a module-level AsyncOpenAI and up to 1.43x for the
  adapters, with runs failed);
- with kills, the only extra requests are re-sends of calls cut off in flight (their step is
  marked `resent` and its first attempt booked as possibly spent), so the provider's bill is
  at most what was recorded plus what is booked as possibly spent.

The shapes are the test suite's workflows (tests/*workflows.py), written as docs/agents.md
shows. Uses bench/steps.py's database (DATABASE_URL, default stepguard_bench); runs twice in a
row. Progress goes to stderr, the report to stdout.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["STEPGUARD_BENCH_SETTINGS"] = "tests.settings"  # the workflows' test app

from django.utils import timezone  # noqa: E402

from bench import steps as bench_steps  # noqa: E402  (sets up Django on the bench database)
from bench.steps import prepare_database, progress, table  # noqa: E402
from examples.model_server import serve  # noqa: E402
from runs.models import (  # noqa: E402
    TERMINAL_STATUSES,
    Event,
    EventType,
    Run,
    RunStatus,
    Step,
    StepStatus,
    Worker,
)
from runs.sdk import start_run  # noqa: E402

MODULES = [
    "tests.workflows",
    "tests.adapter_openai_agents_workflows",
    "tests.adapter_pydantic_ai_workflows",
    "tests.adapter_langgraph_workflows",
]


def shapes(effects: str) -> list[tuple[str, str, dict]]:
    from tests import adapter_pydantic_ai_workflows as pa

    dinner = pa.script(
        "get_weather+get_time", "book_table",
        args={"get_weather": {"city": "Paris"}, "get_time": {"city": "Paris"},
              "book_table": {"city": "Paris", "guests": 2}},
        final={"city": "Paris", "temp": 21, "summary": "clear"},
    )  # fmt: skip
    return [
        ("ctx.llm, module-level AsyncOpenAI, sync workflow", "shared-client", {"turns": 5}),
        ("ctx.llm, module-level AsyncOpenAI, async workflow", "shared-client-async", {"turns": 5}),
        ("ctx.llm, module-level AsyncOpenAI, stream=True", "shared-client-streamed-async",
         {"turns": 5}),
        ("OpenAI Agents SDK, Runner.run", "oa-agent",
         {"script": "lookup, weather", "effects": effects}),
        ("OpenAI Agents SDK, Runner.run_streamed", "oa-agent-streamed",
         {"script": "lookup, weather", "effects": effects}),
        ("Pydantic AI, agent.run", "pa-planner", {"instructions": dinner, "effects": effects}),
        ("Pydantic AI, agent.run_stream", "pa-stream",
         {"instructions": dinner, "effects": effects}),
        ("Pydantic AI, agent.run_sync", "pa-planner-sync",
         {"instructions": dinner, "effects": effects}),
        ("LangGraph, module-level ChatOpenAI.invoke", "lg-chatbot", {"provider": "openai"}),
        ("LangGraph, module-level ChatOpenAI.ainvoke", "lg-chatbot-async",
         {"provider": "openai"}),
        ("LangGraph, ChatOpenAI.invoke, stream_mode=messages", "lg-chatbot-streamed",
         {"provider": "openai", "turns": 3}),
        ("LangGraph, ChatOpenAI.ainvoke, astream_events", "lg-chatbot-streamed-async",
         {"provider": "openai", "turns": 3, "how": "events"}),
    ]  # fmt: skip


class Spawned:
    """One `runworker` process on the bench database, its output in a file."""

    def __init__(self, log: Path):
        self._log = log.open("a")
        argv = [sys.executable, "manage.py", "runworker", "--concurrency", "6"]
        argv += ["--lease-seconds", "1", "--poll-interval", "0.05"]
        for module in MODULES:
            argv += ["--import", module]
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=os.environ.copy(), stdout=self._log, stderr=subprocess.STDOUT
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def one_shape(workflow: str, input: dict, runs: int, kills: int, model, log: Path) -> dict:
    """Start `runs` runs of `workflow`, let one worker finish them (SIGKILLed `kills` times,
    replaced each time), and count what the provider saw against what was recorded."""
    before = model.total
    seen_keys = dict(model.calls)
    ids = [start_run(workflow, input).pk for _ in range(runs)]
    worker = Spawned(log)
    rng = random.Random(len(ids) * 31 + kills)
    done = Run.objects.filter(pk__in=ids, status__in=TERMINAL_STATUSES)
    made = 0
    while made < kills and done.count() < runs:
        # Kill a worker that holds runs of ours (not one still importing its frameworks),
        # a random moment after it took them.
        held = Run.objects.filter(pk__in=ids, worker__pid=worker.proc.pid)
        wait_for(lambda h=held: h.exists() or done.count() == runs, 120, "a claim")
        time.sleep(rng.uniform(0.02, 0.6))
        if done.count() == runs:
            break
        worker.kill()
        made += 1
        worker = Spawned(log)
    wait_for(lambda: done.count() == runs, 600, f"{runs} runs of {workflow}")
    worker.stop()
    steps = Step.objects.filter(run_id__in=ids, kind="llm", status=StepStatus.COMPLETED)
    recorded = steps.count()
    resent = steps.filter(recovered="resent").count()
    requests = model.total - before
    new_keys = {k: n - seen_keys.get(k, 0) for k, n in model.calls.items()}
    unkeyed = new_keys.get("-", 0)
    # A LangGraph node's chat-model calls are keyed `<the step's key>:<n>`.
    by_step: dict[str, int] = {}
    for key, n in new_keys.items():
        by_step[key] = by_step.get(key, 0) + n
        owner = key.rsplit(":", 1)[0]
        if owner != key:
            by_step[owner] = by_step.get(owner, 0) + n
    billed = recorded_micros = possibly = 0
    for key, micros, maybe in steps.values_list(
        "idempotency_key", "cost_micros", "possibly_spent_micros"
    ):
        billed += by_step.get(key, 0) * micros  # the demo model answers a re-send alike
        recorded_micros += micros
        possibly += maybe
    failed = Run.objects.filter(pk__in=ids).exclude(status=RunStatus.COMPLETED).count()
    windows = record_windows(ids, steps, model.answered_at)
    return {
        "runs": runs,
        "kills": made,
        "recorded": recorded,
        "requests": requests,
        "unkeyed": unkeyed,
        "resent": resent,
        "failed": failed,
        "billed": billed,
        "covered": recorded_micros + possibly,
        "windows": windows,
    }


def record_windows(ids: list, steps, answered_at: dict[str, float]) -> list[float]:
    """Seconds from the provider's last byte of each recorded call's answer (its latest, for a
    call re-sent) to its `step.completed` event: a kill in between pays the answer again. A
    LangGraph node's calls are keyed `<the step's key>:<n>`: from the last of them."""
    last: dict[str, float] = {}
    for key, at in list(answered_at.items()):
        owner = key.rsplit(":", 1)[0] if key.count(":") > 1 else key
        for k in {key, owner}:
            last[k] = max(last.get(k, 0.0), at)
    completed = {
        (run_id, key): at.timestamp()
        for run_id, key, at in Event.objects.filter(
            run_id__in=ids, type=EventType.STEP_COMPLETED
        ).values_list("run_id", "step_key", "created_at")
    }
    windows = []
    for run_id, key, idem in steps.values_list("run_id", "key", "idempotency_key"):
        if idem in last and (run_id, key) in completed:
            windows.append(max(completed[run_id, key] - last[idem], 0.0))
    return windows


def window_cells(windows: list[float]) -> list[str]:
    if not windows:
        return ["-", "-"]
    return [f"{statistics.median(windows) * 1000:.0f} ms", f"{max(windows) * 1000:.0f} ms"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="runs of each shape at once")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per shape, second pass")
    parser.add_argument("--only", default="", help="only the shapes whose name has this text")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both passes")
    args = parser.parse_args()
    error = prepare_database()
    if error:
        print(f"cannot benchmark: {error}", file=sys.stderr)
        return 2
    server, model = serve()
    os.environ["STEPGUARD_MODEL_BASE_URL"] = f"http://127.0.0.1:{server.server_port}/v1"
    for module in MODULES:
        __import__(module)
    effects = tempfile.mkdtemp(prefix="stepguard-bench-agents-")
    log = Path(effects) / "workers.log"
    bench_steps.BENCH_WORKFLOWS += tuple(w for _, w, _ in shapes(effects))
    ok = True
    chosen = [shape for shape in shapes(effects) if args.only.lower() in shape[0].lower()]
    for round_ in range(1, args.rounds + 1):
        bench_steps.delete_bench_rows()
        # Workers SIGKILLed by an earlier pass never said they stopped.
        Worker.objects.filter(stopped_at__isnull=True).update(stopped_at=timezone.now())
        for kills in dict.fromkeys((0, args.kills)):
            rows = []
            for what, workflow, input in chosen:
                progress(f"round {round_}: {what}, {kills} kills")
                r = one_shape(workflow, input, args.runs, kills, model, log)
                ratio = r["requests"] / r["recorded"] if r["recorded"] else float("nan")
                holds = r["billed"] <= r["covered"]
                clean = r["unkeyed"] == 0 and r["failed"] == 0
                ok &= clean and holds and (kills > 0 or r["requests"] == r["recorded"])
                rows.append([
                    what, r["kills"], r["recorded"], r["requests"], f"{ratio:.2f}", r["resent"],
                    r["unkeyed"], r["failed"], f"{r['billed']}/{r['covered']}",
                    *window_cells(r["windows"]),
                ])  # fmt: skip
            print(f"\nround {round_}, {'no kills' if not kills else f'{kills} SIGKILLs a shape'}")
            print(table(
                ["shape", "kills", "recorded calls", "requests", "per call", "re-sent",
                 "without key", "runs failed", "billed/recorded+possibly (micro-USD)",
                 "record window median", "max"],
                rows, right={1, 2, 3, 4, 5, 6, 7, 9, 10},
            ))  # fmt: skip
    server.shutdown()
    print(f"\nlogs: {log}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
