from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.utils import timezone

from runs.apikeys import OTHERS, create_key, revoke_key
from runs.errors import StepguardError
from runs.models import ApiKey, ApiKeyScope, BudgetLedger, Event, Policy, Run, Signal, Step, Worker


class HistoryAdmin:
    """Read-only for everyone, superusers included: these rows record what happened, and change
    only through the engine and runs.operations (permission checks, audit events, wake-ups).

    No add, no change (the pages show every field read-only, with no Save button), no delete (so
    no bulk delete action either); whoever may view the model still sees it. Mixed into a
    ModelAdmin or an inline, whose `has_add_permission` also takes `obj`.
    """

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class StepInline(HistoryAdmin, admin.TabularInline):
    model = Step
    extra = 0
    can_delete = False
    fields = (
        "seq",
        "key",
        "kind",
        "status",
        "attempt",
        "recovered",
        "idempotency_key",
        "finished_at",
    )
    readonly_fields = fields
    show_change_link = True


class ChildInline(HistoryAdmin, admin.TabularInline):
    model = Run
    fk_name = "parent"
    verbose_name_plural = "child runs"
    extra = 0
    can_delete = False
    fields = ("id", "workflow", "version", "status", "created_at")
    readonly_fields = fields
    show_change_link = True


@admin.register(Run)
class RunAdmin(HistoryAdmin, admin.ModelAdmin):
    """Read-only: runs are cancelled, halted, retried and pruned through runs.operations."""

    list_display = ("id", "workflow", "version", "status", "attempt", "key", "parent", "created_at")
    list_filter = ("status", "workflow")
    search_fields = ("=id", "key")
    inlines = [StepInline, ChildInline]


@admin.register(Step)
class StepAdmin(HistoryAdmin, admin.ModelAdmin):
    list_display = ("run", "seq", "key", "kind", "status", "attempt", "recovered")
    list_filter = ("status", "kind", "recovered")


@admin.register(Event)
class EventAdmin(HistoryAdmin, admin.ModelAdmin):
    """Read-only: the history is append-only."""

    list_display = ("run", "seq", "type", "step_key", "actor", "created_at")
    list_filter = ("type",)


@admin.register(Worker)
class WorkerAdmin(HistoryAdmin, admin.ModelAdmin):
    list_display = ("id", "host", "pid", "concurrency", "started_at", "heartbeat_at", "stopped_at")


@admin.register(Signal)
class SignalAdmin(HistoryAdmin, admin.ModelAdmin):
    list_display = ("id", "run", "name", "sent_by", "created_at", "consumed_by")


@admin.register(Policy)
class PolicyAdmin(HistoryAdmin, admin.ModelAdmin):
    """Read-only: halts, budgets and limits change through runs.operations (permission + audit);
    deleting a row here would lift a halt with no event."""

    list_display = ("scope", "halted_at", "halted_by", "daily_budget_micros", "run_budget_micros")


@admin.register(BudgetLedger)
class BudgetLedgerAdmin(HistoryAdmin, admin.ModelAdmin):
    list_display = ("scope", "day", "spent_micros", "reserved_micros", "spent_tokens", "warned")


class ApiKeyForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ("user", "name", "scope", "expires_at")
        help_texts = {"expires_at": "blank: never; after it the key is refused (401)"}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["scope"].required = False  # left out: full, as before scopes

    def clean_scope(self):
        return self.cleaned_data.get("scope") or ApiKeyScope.FULL

    def clean_expires_at(self):
        expires_at = self.cleaned_data.get("expires_at")
        if expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("The expiry is in the past: pick a later date.")
        return expires_at


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Create a key here (it is shown once, in the confirmation), revoke it with the action.
    Each person sees and revokes their own keys; other people's take
    runs.revoke_others_apikey (runs.apikeys.revoke_key, which audits each revocation).
    Creating one is audited too (runs.apikeys.create_key)."""

    form = ApiKeyForm
    list_display = (
        "prefix", "name", "user", "scope", "expires_at", "created_at", "last_used_at",
        "revoked_at",
    )  # fmt: skip
    list_filter = ("scope",)
    fields = ("user", "name", "scope", "expires_at")
    actions = ["revoke"]

    def get_queryset(self, request):
        keys = super().get_queryset(request).select_related("user")
        return keys if request.user.has_perm(OTHERS) else keys.filter(user=request.user)

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # a key is revoked (audited, its use still on record), never deleted

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        # Only a superuser mints keys for someone else: a key acts with its user's permissions.
        if db_field.name == "user" and not request.user.is_superuser:
            kwargs["queryset"] = get_user_model().objects.filter(pk=request.user.pk)
            kwargs["initial"] = request.user.pk
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        if obj.user_id != request.user.pk and not request.user.is_superuser:
            raise PermissionDenied("only a superuser may create API keys for another user")
        key, text = create_key(
            obj.user, obj.name, scope=obj.scope, expires_at=obj.expires_at,
            actor=request.user.get_username(),
        )  # fmt: skip
        obj.pk = key.pk
        request._new_api_key = (key, text)

    def response_add(self, request, obj, post_url_continue=None):
        """The secret is shown once, on this page, never stored (not in a messages cookie)."""
        key, text = request._new_api_key
        response = TemplateResponse(
            request,
            "admin/runs/apikey/created.html",
            {**self.admin_site.each_context(request), "key": key, "text": text,
             "opts": self.model._meta, "title": "API key created"},
        )  # fmt: skip
        return response  # the admin already sends it with Cache-Control: no-store

    @admin.action(description="Revoke the selected API keys")
    def revoke(self, request, queryset):
        revoked = 0
        for key in queryset.filter(revoked_at__isnull=True):
            try:
                revoke_key(key.prefix, request.user)
            except StepguardError as exc:
                self.message_user(request, str(exc), messages.ERROR)
            else:
                revoked += 1
        self.message_user(request, f"{revoked} API key(s) revoked")
