"""The development settings a second terminal needs: `make run` writes them to
`var/stepguard.env`, and `manage.py` and the `stepguard` command read them, so that a command the
demo prints works when pasted into a new terminal in the same directory.

Read only when DJANGO_SETTINGS_MODULE is not set already: workers and tests, which always set
it, never pick up a developer's demo settings. Nothing outside `make run` writes the file.
"""

from __future__ import annotations

import os
from pathlib import Path

NAME = "stepguard.env"


def path() -> Path:
    return Path(os.environ.get("STEPGUARD_VAR_DIR") or Path.cwd() / "var") / NAME


def load() -> None:
    """KEY=VALUE lines of the file into the environment, under what is set there already."""
    if os.environ.get("DJANGO_SETTINGS_MODULE"):
        return
    try:
        lines = path().read_text().splitlines()
    except OSError:
        return
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            os.environ.setdefault(key.strip(), value.strip())


def write(values: dict[str, str]) -> Path:
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Written by `make run`: development settings for a second terminal (manage.py,"]
    lines.append("# stepguard). Delete it to stop using them; never copy it to a server.")
    lines += [f"{key}={value}" for key, value in values.items()]
    target.write_text("\n".join(lines) + "\n")
    return target
