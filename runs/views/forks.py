"""Forking a run from the run page: the preview of what a fork re-executes and the form that
edits an input or a step's output before forking."""

from __future__ import annotations

import json
from uuid import UUID

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_POST

from runs import operations
from runs.errors import OperationError, StepguardError
from runs.models import Run, Step, StepKind
from runs.views.common import do_action, viewer_required
from runs.views.run_page import fork_asks_again

# Kinds that act on the world (or spend) when they run again; waits only wait.
SIDE_EFFECTS = {StepKind.CALL, StepKind.LLM, StepKind.TOOL, StepKind.TRANSACTION, StepKind.CHILD}


@viewer_required
def fork_preview_view(request, run_id: UUID):
    """What forking from `step` would run again, shown before the operator confirms."""
    chosen = request.GET.get("step", "")
    context = {"chosen": chosen, "side_effects": SIDE_EFFECTS, "again": [], "reused": 0}
    try:
        listed = operations.fork_preview(str(run_id), chosen)
        context["again"] = [s for s in listed if s["asked_again"] is None]
        seq = context["again"][0]["seq"]
        kept = Step.objects.filter(run_id=run_id, seq__lt=seq)
        context["reused"] = kept.count()
        effects = [s for s in context["again"] if s["kind"] in SIDE_EFFECTS]
        context["effects"], context["more_effects"] = effects[:100], max(len(effects) - 100, 0)
        context["approvals"] = fork_approvals(kept, listed)
        run = Run.objects.only("input").get(pk=run_id)
        context["edit_input"] = _editable(run.input)
        editable = kept.exclude(kind=StepKind.APPROVAL)  # a recorded decision is not edited
        latest = list(editable.order_by("-seq")[:FORK_EDITABLE])[::-1]
        context["edit_steps"] = [_edit_row(s) for s in latest]
        context["edit_hidden"] = editable.count() - len(latest)
    except StepguardError as exc:
        context["problem"] = str(exc)
    return render(request, "runs/detail.html#fork-preview", context)


def fork_approvals(kept, listed: list[dict]) -> list[dict]:
    """The approvals a fork copies, as the preview says them: asked again (and why), or
    standing unless an edit of the input or of a step before it asks them again."""
    asked = {s["key"]: s["asked_again"] for s in listed if s["asked_again"]}
    # The latest, nearest the fork point, as the editable steps are.
    approvals = list(kept.filter(kind=StepKind.APPROVAL).order_by("-seq")[:FORK_EDITABLE])[::-1]
    rows = []
    for step in approvals:
        earlier = kept.filter(seq__lt=step.seq)
        before = list(earlier.order_by("-seq").values_list("key", flat=True)[:5])[::-1]
        decision = step.output if isinstance(step.output, dict) else {}
        rows.append({
            "key": step.key, "seq": step.seq, "why": asked.get(step.key),
            "approval_id": decision.get("approval_id"), "by": decision.get("decided_by"),
            "before": before, "more": earlier.count() - len(before) if len(before) == 5 else 0,
        })  # fmt: skip
    return rows


#: The copied steps whose outputs the fork form offers to edit: the latest before the fork
#: point (a run is forked near where it went wrong); the API edits any.
FORK_EDITABLE = 20


#: A value longer than this (as indented JSON) is not offered for editing in the browser.
EDITABLE_CHARS = 20_000


def _editable(value) -> str | None:
    text = json.dumps(value, indent=2, ensure_ascii=False, default=str)
    return text if len(text) <= EDITABLE_CHARS else None


def _edit_row(step: Step) -> dict:
    """A copied step as the fork form offers it: a model call's answer as its text, any
    other output as JSON."""
    text = answer_text(step.output) if step.kind == StepKind.LLM else None
    return {"key": step.key, "kind": step.kind, "seq": step.seq, "text": text,
            "json": None if text is not None else _editable(step.output)}  # fmt: skip


TEXTS = ("output_text",)


def _answer_blocks(output) -> list[dict] | None:
    """The one text block holding what the model said, in whichever protocol's response the
    step recorded (chat completions, Anthropic messages, OpenAI responses), as a one-item
    list of (container, field); None when there is not exactly one."""
    if not isinstance(output, dict):
        return None
    choices = output.get("choices")
    if isinstance(choices, list):
        message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            return [message]
        return None
    blocks: list = []
    if output.get("type") == "message" and isinstance(output.get("content"), list):
        blocks = [b for b in output["content"] if isinstance(b, dict) and b.get("type") == "text"]
    elif isinstance(output.get("output"), list):
        for item in output["output"]:
            if isinstance(item, dict) and item.get("type") == "message":
                said = item.get("content") or []
                blocks += [b for b in said if isinstance(b, dict) and b.get("type") in TEXTS]
    return blocks if len(blocks) == 1 and isinstance(blocks[0].get("text"), str) else None


def answer_text(output) -> str | None:
    """What a model call said, as the text an operator edits (None: edit its JSON)."""
    found = _answer_blocks(output)
    if found is None:
        return None
    return found[0]["content"] if "content" in found[0] else found[0]["text"]


def with_answer(output, text: str):
    """`output` (a model call's recorded response) saying `text` instead."""
    copy = json.loads(json.dumps(output))
    (block,) = _answer_blocks(copy) or [None]
    if block is None:
        raise OperationError("this model call's answer cannot be edited as text: edit its JSON")
    block["content" if "content" in block else "text"] = text
    return copy


def _json_field(text: str, what: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise OperationError(f"{what} is not JSON: {exc}") from None


def fork_form_edits(post, run_id) -> dict:
    """The fork form's edits as fork_run's `input` and `outputs`: each field as typed (a
    field left as shown is no edit; fork_run records only what changed)."""
    edits: dict = {}
    if "input" in post:
        edits["input"] = _json_field(post["input"], "The input")
    outputs = {}
    for name, value in post.items():
        kind, _, key = name.partition(":")
        if kind == "output" and key:
            outputs[key] = _json_field(value, f"The output of step {key}")
        elif kind == "text" and key:
            step = Step.objects.filter(run_id=run_id, key=key).only("output").first()
            if step is None:
                raise OperationError(f"run {run_id} has no step {key!r}")
            said = value.replace("\r\n", "\n")  # a textarea sends CRLF line ends
            if said != answer_text(step.output):
                outputs[key] = with_answer(step.output, said)
    if outputs:
        edits["outputs"] = outputs
    return edits


@login_required
@require_POST
def fork_view(request, run_id: UUID):
    """Fork from the chosen step (after the page listed what will run again)."""
    step = request.POST.get("step", "")
    reason = request.POST.get("reason", "")
    created = {}

    def fork():
        edits = fork_form_edits(request.POST, run_id)
        created["run"] = operations.fork_run(str(run_id), step, request.user, reason, **edits)

    response = do_action(request, fork, reverse("stepguard:run", args=[run_id]))
    if "run" in created:
        messages.success(request, f"Forked run {str(run_id)[:8]} from step {step}.")
        for key, why in fork_asks_again(created["run"]).items():
            messages.warning(request, f"The fork asks approval {key} again: {why}.")
    if "run" in created:
        return HttpResponseRedirect(reverse("stepguard:run", args=[created["run"].pk]))
    return response
