"""Which run, workflow, step, worker and event a log line is about, and JSON log lines.

The worker executes each run inside a `contextvars.Context` that names the run
(`run_context`), so every line logged while it runs (by the engine, by agent code, by a
library) carries the run without any call passing it. `ContextFilter` copies the fields onto
each record (an `extra={"step": ...}` given to one call wins); `JsonFormatter` writes one JSON
object per line (`LOG_FORMAT=json`). With `LOG_EVENTS=1` each event appended to the history
is a log line too (logger `stepguard.events`).
"""

from __future__ import annotations

import contextvars
import json
import logging
from datetime import UTC, datetime
from typing import Any

FIELDS = ("run_id", "workflow", "step", "worker", "event")

_current: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "stepguard_log_context", default=None
)
#: The worker of this process, for lines logged outside any run (the claim loop, heartbeats).
process_worker: str | None = None

events_log = logging.getLogger("stepguard.events")


def run_context(run: Any, worker: Any) -> contextvars.Context:
    """A copy of the current context naming `run` and `worker`; `.run(fn, ...)` in it."""
    context = contextvars.copy_context()
    fields = {"run_id": str(run.id), "workflow": f"{run.workflow}@{run.version}"}
    context.run(_current.set, {**fields, "worker": str(worker)})
    return context


class ContextFilter(logging.Filter):
    """Puts the fields of the current run (and the process's worker) on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = _current.get() or {}
        for name in FIELDS:
            if getattr(record, name, None) is None:
                value = current.get(name) or (process_worker if name == "worker" else None)
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, the fields
    that are known, and the traceback as one string."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def log_event(sender, instance, created: bool, **kwargs) -> None:
    """post_save of Event: one log line per event appended (when `stepguard.events` is on)."""
    if created:
        event_written(instance.run_id, instance.type, instance.step_key, instance.actor)


def event_written(run_id, type: str, step_key: str = "", actor: str = "system") -> None:
    """Log one appended event. The engine's one-statement writes (raw SQL, no post_save) call
    this themselves. Type, run, step and actor only: payloads may hold what agents were given."""
    if not events_log.isEnabledFor(logging.INFO):
        return
    current = _current.get() or {}
    events_log.info(
        "%s by %s", type, actor,
        extra={
            "run_id": str(run_id) if run_id else None,
            "workflow": current.get("workflow") if current.get("run_id") == str(run_id) else None,
            "step": step_key or None,
            "event": type,
        },
    )  # fmt: skip
