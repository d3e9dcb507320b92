from django.contrib import admin, messages

from runs.apikeys import create_key
from runs.models import ApiKey, BudgetLedger, Event, Policy, Run, Signal, Step, Worker


class StepInline(admin.TabularInline):
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


class ChildInline(admin.TabularInline):
    model = Run
    fk_name = "parent"
    verbose_name_plural = "child runs"
    extra = 0
    can_delete = False
    fields = ("id", "workflow", "version", "status", "created_at")
    readonly_fields = fields
    show_change_link = True


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "workflow", "version", "status", "attempt", "key", "parent", "created_at")
    list_filter = ("status", "workflow")
    search_fields = ("=id", "key")
    inlines = [StepInline, ChildInline]

    def has_add_permission(self, request):
        return False

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Run._meta.fields]


@admin.register(Step)
class StepAdmin(admin.ModelAdmin):
    list_display = ("run", "seq", "key", "kind", "status", "attempt", "recovered")
    list_filter = ("status", "kind", "recovered")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Step._meta.fields]


@admin.register(Event)
class EventAdmin(admin.ModelAdmin):
    """Read-only: the history is append-only."""

    list_display = ("run", "seq", "type", "step_key", "actor", "created_at")
    list_filter = ("type",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ("id", "host", "pid", "concurrency", "started_at", "heartbeat_at", "stopped_at")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Worker._meta.fields]


@admin.register(Signal)
class SignalAdmin(admin.ModelAdmin):
    list_display = ("id", "run", "name", "sent_by", "created_at", "consumed_by")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Signal._meta.fields]


@admin.register(Policy)
class PolicyAdmin(admin.ModelAdmin):
    """Read-only: halts and budgets change through runs.operations (permission + audit)."""

    list_display = ("scope", "halted_at", "halted_by", "daily_budget_micros", "run_budget_micros")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in Policy._meta.fields]

    def has_add_permission(self, request):
        return False


@admin.register(BudgetLedger)
class BudgetLedgerAdmin(admin.ModelAdmin):
    list_display = ("scope", "day", "spent_micros", "reserved_micros", "spent_tokens", "warned")

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in BudgetLedger._meta.fields]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Create a key here (it is shown once, in the confirmation), revoke it with the action."""

    list_display = ("prefix", "name", "user", "created_at", "last_used_at", "revoked_at")
    fields = ("user", "name")
    actions = ["revoke"]

    def has_change_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        key, text = create_key(obj.user, obj.name)
        obj.pk = key.pk
        messages.warning(request, f"New API key for {key.user} (shown only now): {text}")

    @admin.action(description="Revoke the selected API keys")
    def revoke(self, request, queryset):
        from django.utils import timezone

        queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
