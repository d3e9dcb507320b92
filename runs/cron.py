"""Schedule declarations' checks: a schedule name, a cron expression (parsed by cronsim: 5
fields, or 6 with seconds first) and a time zone, wherever a schedule is declared: in code
(`runs.sdk.workflow(schedule=...)`) or by an operator (`runs.schedules.save`).
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from runs.errors import InvalidInput

__all__ = ["NAME", "ScheduleError", "check_cron", "check_name", "zone"]


class ScheduleError(InvalidInput):
    """A schedule that cannot be stored as given (its message names what is wrong)."""

    code = "invalid_schedule"


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleError(
            f"unknown time zone {name!r} (an IANA name like 'Europe/Lisbon')"
        ) from None


# A slug (dots too, as in workflow names): it is part of the dashboard's URLs and of run keys
# (`schedule:<name>:<tick>`), so no '/', ':', space or '..'-like name that a URL would bend.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def check_name(name: str) -> str:
    """`name` if it is a schedule name (1 to 200 letters, digits, '.', '_' or '-', starting
    with a letter or digit), else ScheduleError saying so."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ScheduleError(
            f"a schedule name is 1 to 200 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit: not {name!r}"
        )
    return name


def check_cron(cron: str) -> str:
    """The expression, normalised, or ScheduleError saying why cronsim refused it."""
    cron = " ".join(cron.split())
    try:
        CronSim(cron, datetime(2000, 1, 1, tzinfo=UTC))
    except CronSimError as exc:
        raise ScheduleError(f"bad cron expression {cron!r}: {exc}") from None
    return cron
