"""The approvals app moved into the runs package: it is `runs.approvals` (label, tables,
migrations and permissions unchanged). This module only tells a project that still lists
"approvals" in INSTALLED_APPS what to write instead."""

from django.core.exceptions import ImproperlyConfigured

raise ImproperlyConfigured(
    'Stepguard\'s approvals app is now "runs.approvals": in INSTALLED_APPS, replace '
    '"approvals" with "runs.approvals" (its tables, migrations and permissions are unchanged)'
)
