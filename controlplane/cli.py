"""The `stepguard` command: `manage.py` for an installed Stepguard (`stepguard migrate`,
`stepguard runworker --import myapp.agents`, `stepguard serve`, `stepguard showrun ID`...)."""

from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    from controlplane import devenv

    devenv.load()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    # `python manage.py` has its directory on the path; `stepguard` has the one it runs in, so
    # `--import myapp.agents` finds the code next to you. Last, so a file there named like an
    # installed module never shadows it.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    argv = sys.argv if argv is None else argv
    name = os.path.basename(argv[0]) or "stepguard"
    try:
        execute_from_command_line([name, *argv[1:]])
    except ImproperlyConfigured as exc:  # a setting from the environment: say which, no trace
        sys.exit(f"{name}: {exc} (settings come from the environment: docs/deploy.md)")


if __name__ == "__main__":
    main()
