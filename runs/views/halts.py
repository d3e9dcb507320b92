"""The halts page and the kill switch: halts of a workflow or of everything, and the nav's
live parts that show them."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from runs import labels as run_labels
from runs import operations, queries
from runs.models import GLOBAL, Policy
from runs.views.common import do_action, viewer_required


def scope_rows(*, labels: bool = False) -> list[dict]:
    """Everything and each workflow, with its policy (halt, budgets); with `labels`, then
    each label value that has a budget (`label:tenant=acme`: budgets only, never halted)."""
    policies = {p.scope: p for p in Policy.objects.all()}
    by_label = sorted(s for s in policies if s.startswith(run_labels.SCOPE_PREFIX))
    workflows = sorted(set(queries.workflow_names()) | (policies.keys() - {GLOBAL, *by_label}))
    rows = [
        {"scope": name, "label": "everything" if name == GLOBAL else name,
         "policy": policies.get(name)}
        for name in [GLOBAL, *workflows]
    ]  # fmt: skip
    for scope in by_label if labels else ():
        value = scope.removeprefix(run_labels.SCOPE_PREFIX)
        rows.append(
            {"scope": scope, "label": f"label {value}", "label_value": value,
             "policy": policies[scope]}
        )  # fmt: skip
    return rows


@viewer_required
def halts_page(request):
    """The kill switch and the workflow-wide halts."""
    scopes = scope_rows()
    return render(
        request,
        "runs/halts.html",
        {
            "scopes": scopes[1:],
            "global_halt": (g := scopes[0]["policy"]) and g.halted_at and g,
            "can_operate": request.user.has_perm("runs.halt_run"),
            "can_unhalt": request.user.has_perm("runs.unhalt_run"),
        },
    )


@viewer_required
def nav_part(request):
    """The nav (approvals badge, kill switch) or the kill-switch banner, for the live feed."""
    part = "killswitch-banner" if request.GET.get("part") == "banner" else "nav-live"
    return render(request, f"stepguard/base.html#{part}")


@login_required
@require_POST
def halt_scope(request, action: str):
    """Halt or unhalt a workflow (`workflow` field) or everything (no field)."""
    target = f"workflow:{request.POST['workflow']}" if request.POST.get("workflow") else "all"
    reason = request.POST.get("reason", "")
    act = {"halt": operations.halt, "unhalt": operations.unhalt}.get(action)
    if act is None:
        raise Http404(f"no action {action!r}")
    typed = request.POST.get("confirm", "").strip().lower()
    if target == "all" and action == "halt" and typed != KILL_SWITCH_CONFIRM:
        messages.error(
            request, f"the kill switch halts every run: type “{KILL_SWITCH_CONFIRM}” to confirm"
        )
        return HttpResponseRedirect(reverse("stepguard:halts"))
    back = request.POST.get("next") or reverse("stepguard:halts")
    if not url_has_allowed_host_and_scheme(back, {request.get_host()}, request.is_secure()):
        back = reverse("stepguard:halts")
    label = "Everything" if target == "all" else f"Workflow {request.POST['workflow']}"
    done = f"{label} {'halted' if action == 'halt' else 'unhalted'}."
    return do_action(request, lambda: act(target, request.user, reason), back, done)


#: What an operator types to turn the kill switch on from the dashboard.
KILL_SWITCH_CONFIRM = "halt everything"
