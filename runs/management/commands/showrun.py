import json
import time

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError

from runs.management.base import StepguardCommand
from runs.management.targets import run_arg
from runs.models import Event, EventType, Run
from runs.operations import unserved_reason


def run_as_dict(run: Run) -> dict:
    return {
        "id": str(run.id),
        "workflow": run.workflow,
        "version": run.version,
        "status": run.status,
        "key": run.key,
        "attempt": run.attempt,
        "max_attempts": run.max_attempts,
        "input": run.input,
        "output": run.output,
        "error": run.error,
        "waiting_reason": unserved_reason(run),
        "created_at": run.created_at.isoformat(),
        "finished_at": run.finished_at.isoformat() if run.finished_at else None,
        "steps": [
            {
                "seq": s.seq,
                "key": s.key,
                "kind": s.kind,
                "status": s.status,
                "attempt": s.attempt,
                "recovered": s.recovered or None,
                "idempotency_key": s.idempotency_key,
                "output": s.output,
                "error": s.error,
            }
            for s in run.steps.order_by("seq")
        ],
    }


def describe(event: Event) -> str:
    p = event.payload
    text = f"#{event.seq:<4} {event.created_at:%H:%M:%S.%f}"[:-3] + f"  {event.type:<16}"
    if event.step_key:
        text += f" {event.step_key}"
    if p.get("attempt", 1) != 1 or event.type == EventType.STEP_RETRYING:
        text += f" (attempt {p.get('attempt')})"
    if p.get("recovered"):
        text += f" [recovered from an ambiguous outcome: {p['recovered']}]"
    if p.get("error"):
        text += f" error: {p['error'].get('type')}: {p['error'].get('message')}"
    if p.get("reason"):
        text += f" ({p['reason']})"
    return text


class Command(StepguardCommand):
    help = "Show a run and its steps; --json for machines, --follow to watch it until it ends."

    def add_arguments(self, parser):
        parser.add_argument("run_id", type=run_arg, help="a run id, or its first characters")
        group = parser.add_mutually_exclusive_group()
        group.add_argument("--json", action="store_true")
        group.add_argument("--follow", action="store_true")
        parser.add_argument("--timeout", type=float, default=None, help="stop following after N s")

    def handle(self, *args, run_id, json: bool, follow: bool, timeout, **options):
        try:
            run = Run.objects.get(pk=run_id)
        except (Run.DoesNotExist, ValidationError):
            raise CommandError(f"no run with id {run_id!r}") from None
        if json:
            self.stdout.write(_json.dumps(run_as_dict(run), indent=2, default=str))
            return
        self.stdout.write(f"run {run.id}  {run.workflow}@{run.version}  {run.status}")
        reason = unserved_reason(run)
        if reason:
            self.stdout.write(f"waiting: {reason}")
        after = -1
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # The status first, then the events: a run seen ended has every event committed,
            # and they are read before stopping (read the other way round, the events that
            # came between the two reads were never printed: 2 of 3 steps shown, once).
            run.refresh_from_db(fields=["status", "output", "error"])
            for event in Event.objects.of(run).filter(seq__gt=after).order_by("seq"):
                self.stdout.write(describe(event))
                self.stdout.flush()
                after = event.seq
            if not follow or run.is_terminal or (deadline and time.monotonic() > deadline):
                break
            time.sleep(0.2)
        if run.is_terminal:
            result = run.output if run.status == "completed" else run.error
            self.stdout.write(f"{run.status}: {_json.dumps(result, default=str)[:2000]}")


_json = json
