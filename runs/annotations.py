"""Annotations: a person marks a run or one of its steps good, bad, or with a note, and runs
are filtered and exported by it (the feedback LangSmith and Langfuse users rely on).

One function per action, called alike by the dashboard, the API and the CLI: the same
permission (`runs.annotate_run`: operators and approvers, runs/roles.py), the same checks, and
the same audit event (`run.annotated` in the run's history, by the person).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping
from datetime import datetime

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from runs.engine.store import run_event
from runs.errors import NotFound, OperationError
from runs.models import Annotation, EventType, Run, Step, Verdict
from runs.operations.common import find_run, in_utc, require

MAX_NOTE = 2000
#: What the runs list's and the API's `annotation` filter takes: a verdict, or any at all.
ANY = "any"
FILTER_VALUES = (*Verdict.values, ANY)
EXPORT_FIELDS = (
    "id", "run_id", "workflow", "run_status", "labels", "step_seq", "step_key", "verdict",
    "note", "by", "created_at",
)  # fmt: skip


class BadAnnotation(OperationError):
    """An annotation that cannot be stored; the message says why."""


def _verdict(verdict: str) -> str:
    if verdict not in Verdict.values:
        raise BadAnnotation(
            f"verdict {verdict!r} is not one of {', '.join(Verdict.values)} "
            "(note: a note without a verdict)"
        )
    return verdict


def _note(note: str | None, verdict: str) -> str:
    note = (note or "").strip()
    if len(note) > MAX_NOTE:
        raise BadAnnotation(f"a note has at most {MAX_NOTE} characters, not {len(note)}")
    if "\x00" in note:
        raise BadAnnotation("a note cannot hold a NUL character")
    if verdict == Verdict.NOTE and not note:
        raise BadAnnotation("a note-only annotation needs the note's text")
    return note


def _step(run: Run, step: str | int | None) -> tuple[int | None, str]:
    """The step annotated, by its position or key (None: the whole run)."""
    if step is None or step == "":
        return None, ""
    if isinstance(step, int) or (isinstance(step, str) and step.isdigit()):
        found = Step.objects.filter(run=run, seq=int(step))
    else:
        found = Step.objects.filter(run=run, key=step)
    row = found.values_list("seq", "key").first()
    if row is None:
        raise NotFound(f"run {run.pk} has no step {step!r}")
    return row


def annotate(
    run_id, user, *, verdict: str, note: str | None = "", step: str | int | None = None
) -> Annotation:
    """Mark a run, or one of its steps (`step`: its key or position), `good`, `bad` or with a
    `note` only; appends a `run.annotated` event by the person in the same transaction."""
    user = require(user, "runs.annotate_run", "annotate runs")
    verdict = _verdict(verdict)
    note = _note(note, verdict)
    with transaction.atomic():
        run = find_run(run_id)
        seq, key = _step(run, step)
        made = Annotation.objects.create(
            run=run,
            step_seq=seq,
            step_key=key,
            verdict=verdict,
            note=note,
            by=user,
            by_name=user.get_username(),
        )
        run_event(
            run.pk,
            EventType.RUN_ANNOTATED,
            actor=user.get_username(),
            step_key=key,
            annotation=made.pk,
            verdict=verdict,
            note=note,
        )
    return made


def of_run(run_id) -> list[Annotation]:
    """A run's annotations, newest first (one query)."""
    return list(Annotation.objects.filter(run_id=run_id).order_by("-created_at", "-id"))


def runs_annotated(runs: QuerySet, value: str) -> QuerySet:
    """The runs with an annotation of this verdict (`any`: with any annotation), as an EXISTS
    per run, so a run marked twice is listed once."""
    if value not in FILTER_VALUES:
        raise BadAnnotation(f"annotation {value!r} is not one of {', '.join(FILTER_VALUES)}")
    marks = Annotation.objects.filter(run=OuterRef("pk"))
    if value != ANY:
        marks = marks.filter(verdict=value)
    return runs.filter(Exists(marks))


def matching(filters: Mapping[str, object]) -> QuerySet:
    """Annotations for an export, newest first: `verdict`, `workflow`, `run`, `by`, and
    `since`/`until` (when they were made; ISO date and time)."""
    f = {k: v for k, v in filters.items() if v not in (None, "")}
    rows = Annotation.objects.select_related("run").order_by("-created_at", "-id")
    if "verdict" in f:
        rows = rows.filter(verdict=_verdict(str(f["verdict"])))
    if "workflow" in f:
        rows = rows.filter(run__workflow=f["workflow"])
    if "run" in f:
        rows = rows.filter(run_id=f["run"])
    if "by" in f:
        rows = rows.filter(by_name=f["by"])
    for name, lookup in (("since", "created_at__gte"), ("until", "created_at__lt")):
        if name in f:
            rows = rows.filter(Q(**{lookup: _when(f[name], name)}))
    return rows


def _when(value, name: str) -> datetime:
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else value
    except ValueError:
        raise BadAnnotation(f"{name} {value!r} is not a date and time") from None
    return in_utc(when, name)


def as_row(a: Annotation) -> dict:
    """One annotation as the API and the exports give it."""
    return {
        "id": a.pk,
        "run_id": a.run_id,
        "workflow": a.run.workflow,
        "run_status": a.run.status,
        "labels": a.run.labels,
        "step_seq": a.step_seq,
        "step_key": a.step_key or None,
        "verdict": a.verdict,
        "note": a.note,
        "by": a.by_name,
        "created_at": a.created_at,
    }


def to_csv(rows: Iterable[Annotation]) -> str:
    """The export as CSV: one annotation a line, labels as `name=value, ...`."""
    from runs import labels

    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(EXPORT_FIELDS)
    for a in rows:
        row = as_row(a)
        row["labels"] = labels.text(row["labels"])
        row["created_at"] = row["created_at"].isoformat()
        writer.writerow(["" if row[f] is None else row[f] for f in EXPORT_FIELDS])
    return out.getvalue()
