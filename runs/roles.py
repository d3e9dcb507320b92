"""The three roles, as Django groups: viewer (read), operator (act on runs), approver (decide).

Created by a migration; `ensure_groups` is also what tests call after a table flush.
"""

from django.contrib.auth.management import create_permissions

VIEW = [
    ("runs", "view_run"),
    ("runs", "view_step"),
    ("runs", "view_event"),
    ("runs", "view_worker"),
    ("runs", "view_signal"),
    ("runs", "view_policy"),
    ("runs", "view_budgetledger"),
    ("approvals", "view_approvalrequest"),
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
    ],
    "approver": [*VIEW, ("approvals", "decide_approvalrequest")],
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
            ]
        )
