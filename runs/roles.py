"""The three roles, as Django groups: viewer (read), operator (act on runs), approver (decide).

Operators and approvers may annotate (mark a run or a step good, bad, or with a note): the
people who act on runs and who review them; a viewer reads annotations.

Created by a migration; `ensure_groups` is also what tests call after a table flush.
"""

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions

VIEW = [
    ("runs", "view_run"),
    ("runs", "view_step"),
    ("runs", "view_event"),
    ("runs", "view_worker"),
    ("runs", "view_signal"),
    ("runs", "view_policy"),
    ("runs", "view_budgetledger"),
    ("runs", "view_notificationchannel"),
    ("runs", "view_notificationdelivery"),
    ("runs", "view_schedule"),
    ("runs", "view_ratelimit"),
    ("approvals", "view_approvalrequest"),
    ("runs", "view_annotation"),
]
ROLES = {
    "viewer": VIEW,
    "operator": [
        *VIEW,
        ("runs", "halt_run"),
        ("runs", "unhalt_run"),
        ("runs", "cancel_run"),
        ("runs", "retry_run"),
        ("runs", "fork_run"),
        ("runs", "set_budget"),
        ("runs", "add_run"),
        ("runs", "add_signal"),
        ("runs", "add_notificationchannel"),
        ("runs", "delete_notificationchannel"),
        ("runs", "set_flow"),
        ("runs", "annotate_run"),
    ],
    "approver": [*VIEW, ("approvals", "decide_approvalrequest"), ("runs", "annotate_run")],
}


def ensure_groups(apps) -> None:
    """Create the groups with their permissions (`apps`: a migration's or django.apps.apps)."""
    # Permissions are normally created after all migrations; the groups need them now.
    for config in apps.get_app_configs():
        had = getattr(config, "models_module", None)
        config.models_module = had or True
        create_permissions(config, verbosity=0, apps=apps)
        config.models_module = had
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    for name, perms in ROLES.items():
        group, _ = Group.objects.get_or_create(name=name)
        group.permissions.set(
            [
                Permission.objects.get(content_type__app_label=app, codename=codename)
                for app, codename in perms
                if _exists(apps, app, codename)
            ]
        )


def _exists(apps, app: str, codename: str) -> bool:
    """Whether the model a default permission (`view_step`) is of exists in `apps`: an early
    migration's state lacks the models added later, whose own migration calls this again."""
    action, model = codename.split("_", 1)
    if action not in ("add", "change", "delete", "view"):  # a custom one (halt_run, set_flow)
        declared = (
            name for m in apps.get_app_config(app).get_models() for name, _ in m._meta.permissions
        )
        if codename in declared:
            return True
        if apps is global_apps:
            raise LookupError(f"no model of {app!r} declares the permission {codename!r}")
        return False
    try:
        apps.get_model(app, model)
    except LookupError:
        if apps is global_apps:
            raise  # the project's own models: a permission of none is a typo
        return False
    return True
